"""`parallel.grad_reduce_in_fp32=false` with q_adamw: QAdamW reads megatron's BF16 grad buffer in
place (fullstack_fp4/integration/bf16_grads.py), in process on CPU (tiny GPTModel, bf16 params).

Oracles:
  identity   the FP32-grad-buffer run (`true`) of the same config. One micro-batch per step,
             DP = 1, no clipping: the buffer holds the autograd BF16 grads unsummed, which FP32
             holds exactly, so losses, grad norms, params and 4-bit states must be equal bit
             for bit (the tiny preset has untied embeddings; a tied one would also be summed in
             autograd, in BF16, before the buffer in both runs).
  in place   the grad buffer's storage (`untyped_storage().data_ptr()` and the element address).
  clipping   megatron's FP32 clip of the same values (the `true` run), rounded to BF16.
  resume     the uninterrupted run of the same config.
  DP = 2     QAdamW built directly over copies of each rank's main shards, stepped on FP32
             copies of the BF16 grads it was handed.
"""
from __future__ import annotations

import os

import pytest
import torch

from fullstack_fp4.optim.q_adamw import QAdamW
from fullstack_fp4.optim.q_adamw.optimizer import GRAD_ATTR, PLACE_ATTR
from megatron.training.config import load_config
from megatron.training.optimizer import apply_schedule
from tests.megatron.training import helpers

TINY = ["model.preset=tiny", "model.seq_length=32", "model.vocab_size=256", "data.mock=true",
        # one micro-batch per step: nothing is summed in the grad buffer
        "train.global_batch_size=2", "train.micro_batch_size=2", "train.eval_iters=1",
        "logging.tensorboard=false", "train.grad_clip=0", "checkpoint.load=none",
        "optimizer.name=q_adamw", "optimizer.q_adamw.min_numel=1024", "train.precision=bf16"]
LR, WD, STEPS = 2e-3, 0.1, 3
DISTOPT = {"plain": [], "distopt": ["parallel.use_distributed_optimizer=true"]}


def _trainer(fp32_grads: bool, extra=()):
    from megatron.training.trainer import Trainer

    cfg = load_config(None, TINY + [f"parallel.grad_reduce_in_fp32={str(fp32_grads).lower()}",
                                    *extra])
    cfg.logging.dir = None
    return Trainer(cfg, verbose=False)


def _wrapper(tr):
    return tr.optimizer.chained_optimizers[0] if hasattr(tr.optimizer, "chained_optimizers") \
        else tr.optimizer


def _inner(tr):
    return _wrapper(tr).optimizer


def _steps(tr, n=STEPS):
    out = []
    for _ in range(n):
        apply_schedule(tr.optimizer, LR, WD)
        out.append(tr.train_step())
    return out


_dist = pytest.fixture(scope="module", autouse=True)(helpers.in_process_megatron)


@helpers.cpu_path_oracle(
    "on CUDA the grad norm of the BF16 buffer (vector_norm with FP32 accumulation) sums in "
    "another order than the FP32 buffer's (e.g. 8.0587519 against 8.0587509 at step 3)")
@pytest.mark.parametrize("layout", list(DISTOPT))
def test_steps_bit_identical_to_fp32_grad_buffer(layout):
    ref, bf = _trainer(True, DISTOPT[layout]), _trainer(False, DISTOPT[layout])
    assert all(p.main_grad.dtype == torch.float32 for p in ref.model.parameters())
    assert all(p.main_grad.dtype == torch.bfloat16 for p in bf.model.parameters())
    losses_ref, losses_bf = _steps(ref), _steps(bf)
    assert losses_bf == losses_ref   # (loss, grad norm) per step, exactly
    for (n, a), b in zip(ref.model.named_parameters(), bf.model.parameters()):
        assert torch.equal(a, b), n
    for a, b in zip([p for g in _inner(ref).param_groups for p in g["params"]],
                    [p for g in _inner(bf).param_groups for p in g["params"]]):
        assert torch.equal(a, b)
        sa, sb = _inner(ref).state[a], _inner(bf).state[b]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


def _expected_view(w, mp):
    """The grad-buffer piece the optimizer must read for model param ``mp``."""
    if hasattr(w, "_get_model_param_range_map"):
        rng = w._get_model_param_range_map(mp)["param"]
        return mp.main_grad.view(-1)[rng.start:rng.end]
    return mp.main_grad


def _check_in_place(tr) -> int:
    """Pre-step hook on the inner QAdamW: every main param's grad is the BF16 buffer itself.
    Returns the number of params checked."""
    from fullstack_fp4.integration.wrappers import model_main_pairs

    w = _wrapper(tr)
    buffers = {b.grad_data.untyped_storage().data_ptr() for b in w.buffers} \
        if hasattr(w, "buffers") else {b.grad_data.untyped_storage().data_ptr()
                                       for b in tr.model.buffers}
    pairs = list(model_main_pairs(w))
    seen = []

    def hook(opt, args, kwargs):
        for mp, main in pairs:
            assert main.grad is None, "an FP32 .grad was materialised"
            g = getattr(main, GRAD_ATTR)
            assert g.dtype == torch.bfloat16 and g.numel() == main.numel()
            assert g.untyped_storage().data_ptr() in buffers
            assert g.data_ptr() == _expected_view(w, mp).data_ptr()
            seen.append(mp)

    handle = _inner(tr).register_step_pre_hook(hook)
    _steps(tr, 1)
    handle.remove()
    tr.optimizer.zero_grad()
    assert all(getattr(main, GRAD_ATTR, None) is None for _, main in pairs)
    return len(seen)


@pytest.mark.parametrize("layout", list(DISTOPT))
def test_optimizer_reads_the_bf16_buffer_in_place(layout):
    tr = _trainer(False, DISTOPT[layout])
    n = _check_in_place(tr)
    assert n == sum(1 for _ in tr.model.parameters())   # DP = 1: every param, whole


def test_clipping_is_the_fp32_clip_rounded_to_bf16():
    ref = _trainer(True, ["train.grad_clip=0.5"])
    bf = _trainer(False, ["train.grad_clip=0.5"])
    (_, norm_ref), = _steps(ref, 1)
    (_, norm_bf), = _steps(bf, 1)
    assert norm_bf == norm_ref and norm_ref > 0.5 * 2   # clipping active (coefficient < 1/2)
    grads_ref = [p.grad for g in _inner(ref).param_groups for p in g["params"]]
    grads_bf = [getattr(p, GRAD_ATTR) for g in _inner(bf).param_groups for p in g["params"]]
    assert all(g.dtype == torch.float32 for g in grads_ref)
    for a, b in zip(grads_ref, grads_bf):
        assert b.dtype == torch.bfloat16
        assert torch.equal(a.to(torch.bfloat16), b)
    # the clip changed the buffer itself (no copy was clipped)
    model_grads = [p.main_grad for p in bf.model.parameters()]
    assert sum(float(g.float().norm()) ** 2 for g in model_grads) ** 0.5 == pytest.approx(0.5, rel=1e-2)


def test_resume_is_exact(tmp_path):
    save = str(tmp_path / "ckpt")
    common = ["train.iters=4", "train.eval_interval=100", "train.global_batch_size=4",
              f"checkpoint.save_dir={save}", "checkpoint.keep_last=5"]
    straight = _trainer(False, common + [f"checkpoint.save_dir={tmp_path}/straight"])
    straight.train()
    part = _trainer(False, common + ["train.exit_interval=2"])
    part.train()
    assert part.iteration == 2
    resumed = _trainer(False, [*common, "checkpoint.load=auto"])
    assert resumed.iteration == 2
    resumed.train()
    for (n, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), n
    for a, b in zip([p for g in _inner(straight).param_groups for p in g["params"]],
                    [p for g in _inner(resumed).param_groups for p in g["params"]]):
        assert torch.equal(a, b)
        for k, v in _inner(straight).state[a].items():
            assert torch.equal(v, _inner(resumed).state[b][k]), k


# ---------------------------------------------------------------- distributed optimizer, DP = 2
def _dp2_worker(rank: int, world: int, init: str, out: str):
    helpers.join_gloo(rank, world, init)
    torch.set_num_threads(1)
    tr = _trainer(False, ["train.global_batch_size=4", *DISTOPT["distopt"]])
    inner = _inner(tr)
    params = [p for g in inner.param_groups for p in g["params"]]
    before = {}

    def keep(opt, args, kwargs):
        for p in params:
            before[p] = (p.detach().clone(), getattr(p, GRAD_ATTR).float())

    h = inner.register_step_pre_hook(keep)
    _steps(tr, 1)
    h.remove()
    # oracle: QAdamW over copies (same groups, placements, seed) on FP32 copies of the grads
    copies = {}
    groups = []
    for g in inner.param_groups:
        cs = []
        for p in g["params"]:
            c = before[p][0].clone()
            setattr(c, PLACE_ATTR, getattr(p, PLACE_ATTR))
            c.grad = before[p][1]
            copies[p] = c
            cs.append(c)
        groups.append({"params": cs, "lr": g["lr"], "weight_decay": g["weight_decay"]})
    ref = QAdamW(groups, lr=LR, betas=inner.defaults["betas"], eps=inner.defaults["eps"],
                 min_numel=1024, seed=tr.cfg.train.seed)
    ref.step()
    for p in params:
        assert torch.equal(p.detach(), copies[p]), "DP=2 step != QAdamW on the BF16 grads"
        assert not torch.equal(p.detach(), before[p][0])
    # the second step checks the in-place read on this rank's shards
    n = _check_in_place(tr)
    assert n == len(params) > 0
    open(os.path.join(out, f"ok{rank}"), "w").close()


@pytest.mark.long
def test_distributed_optimizer_dp2_reads_its_shards_in_place(tmp_path):
    helpers.spawn_gloo(_dp2_worker, [(2, (str(tmp_path),))])
    assert sorted(os.listdir(tmp_path)) == ["ok0", "ok1"]


def test_optimizer_telemetry_reads_the_bf16_grads():
    # the Q-AdamW telemetry hook samples the grads the step reads: same values, same stats
    stats = []
    for fp32 in (True, False):
        tr = _trainer(fp32, ["logging.quant_stats_interval=1"])
        _steps(tr, 1)
        stats.append({k: v for k, v in tr.quant_stats.items() if k.startswith("quant/optimizer/")})
    assert stats[0] and stats[1] == stats[0]


def test_megatron_step_equals_the_trainers_guarded_step():
    # ChainedOptimizer.step() (bound by bf16_grads: it must clip the decoupled grads too) against
    # the trainer's guarded step, with clipping active
    from megatron.training.guards import StepGuard, guarded_optimizer_step

    params, norms = [], []
    for use_guard in (True, False):
        tr = _trainer(False, ["train.grad_clip=0.5"])
        apply_schedule(tr.optimizer, LR, WD)
        tr.model.zero_grad_buffer()
        tr.optimizer.zero_grad()
        tr._run_schedule(tr.train_ds, 0, forward_only=False)
        ok, norm, _ = guarded_optimizer_step(tr.optimizer, StepGuard(), None) if use_guard \
            else tr.optimizer.step()
        assert ok and norm > 1.0
        norms.append(norm)
        params.append([p.detach().clone() for p in tr.model.parameters()])
    assert norms[0] == norms[1]
    for a, b in zip(*params):
        assert torch.equal(a, b)
