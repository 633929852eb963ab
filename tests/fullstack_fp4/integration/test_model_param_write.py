"""QAdamW writes the BF16 model params in its step (fullstack_fp4/integration/model_param_write.py),
through megatron-core's Float16 wrapper and DistributedOptimizer, in process on CPU (tiny
GPTModel, bf16 params) and on 2 gloo processes.

Oracle: the same trainer without the fused write (``write_model_params_in_step`` replaced by a
no-op, so megatron's own main -> model copy runs for every param). The fused run must give the
same losses and grad norms, model params, main params and 4-bit states, bit for bit. Also:
  memory     each destination is the memory megatron's copy writes (the model param; this rank's
             slice of the DDP param buffer) and that is the model param's own storage.
  skipped    the wrapper's copy leaves the params QAdamW wrote alone and copies the rest.
  loads      a load that rewrites the main params then copies them (the converted distributed
             optimizer's load_state_dict) gives model params == bf16(main), also right after an
             inner step whose copy never ran; megatron's reload_model_params (model -> main)
             then steps as the unfused run; a resume from a checkpoint is the straight run.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

from fullstack_fp4.integration import model_param_write
from fullstack_fp4.optim.q_adamw.optimizer import MODEL_OUT_ATTR, model_param_written
from megatron.training.config import load_config
from megatron.training.optimizer import apply_schedule
from tests.megatron.training import helpers

TINY = ["model.preset=tiny", "model.seq_length=32", "model.vocab_size=256", "data.mock=true",
        "train.global_batch_size=2", "train.micro_batch_size=2", "train.eval_iters=1",
        "logging.tensorboard=false", "train.grad_clip=1.0", "checkpoint.load=none",
        "optimizer.name=q_adamw", "optimizer.q_adamw.min_numel=1024", "train.precision=bf16"]
LR, WD, STEPS = 2e-3, 0.1, 3
LAYOUTS = {"plain": [], "distopt": ["parallel.use_distributed_optimizer=true"]}
GRADS = {"fp32_grads": [], "bf16_grads": ["parallel.grad_reduce_in_fp32=false"]}


@contextlib.contextmanager
def _megatron_copy_only():
    """Build trainers without the fused write: megatron's copy for every param (the oracle)."""
    real = model_param_write.write_model_params_in_step
    model_param_write.write_model_params_in_step = lambda optimizer: 0
    try:
        yield
    finally:
        model_param_write.write_model_params_in_step = real


def _trainer(extra=(), fused=True):
    from megatron.training.trainer import Trainer

    cfg = load_config(None, TINY + list(extra))
    cfg.logging.dir = None
    if fused:
        return Trainer(cfg, verbose=False)
    with _megatron_copy_only():
        return Trainer(cfg, verbose=False)


def _wrapper(tr):
    return tr.optimizer.chained_optimizers[0] if hasattr(tr.optimizer, "chained_optimizers") \
        else tr.optimizer


def _mains(tr):
    return [p for g in _wrapper(tr).optimizer.param_groups for p in g["params"]]


def _steps(tr, n=STEPS):
    out = []
    for _ in range(n):
        apply_schedule(tr.optimizer, LR, WD)
        out.append(tr.train_step())
    return out


def _assert_same_run(a, b):
    for (n, x), y in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(x, y), n
    for x, y in zip(_mains(a), _mains(b)):
        assert torch.equal(x, y)
        sa, sb = _wrapper(a).optimizer.state[x], _wrapper(b).optimizer.state[y]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


def _assert_model_is_bf16_of_main(tr):
    for main, dest in model_param_write.megatron_copy_targets(_wrapper(tr)):
        assert torch.equal(dest.view(torch.int16), main.detach().reshape(-1).view_as(dest)
                           .to(dest.dtype).view(torch.int16))


_dist = pytest.fixture(scope="module", autouse=True)(helpers.in_process_megatron)


@pytest.mark.parametrize("grads", list(GRADS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_write_is_bit_identical_to_megatrons_copy(layout, grads):
    extra = LAYOUTS[layout] + GRADS[grads]
    ref, fused = _trainer(extra, fused=False), _trainer(extra)
    assert not getattr(_wrapper(ref), "fp4_model_write", False)
    assert _wrapper(fused).fp4_model_write
    losses_ref, losses_fused = _steps(ref), _steps(fused)
    assert losses_fused == losses_ref          # (loss, grad norm) per step, exactly
    _assert_same_run(ref, fused)
    _assert_model_is_bf16_of_main(fused)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_destinations_are_the_memory_megatron_copies_to(layout):
    tr = _trainer(LAYOUTS[layout])
    w = _wrapper(tr)
    quantized = 0
    for main, dest in w.fp4_copy_targets:
        mp = next(p for p in tr.model.parameters() if p.main_param is main)
        assert dest.dtype == torch.bfloat16 and getattr(main, MODEL_OUT_ATTR) is dest
        if layout == "distopt":
            rng = w._get_model_param_range_map(mp)["param"]
            assert dest.data_ptr() == mp.view(-1)[rng.start:rng.end].data_ptr()
            buffers = {b.param_data.untyped_storage().data_ptr() for b in w.buffers}
            assert dest.untyped_storage().data_ptr() in buffers
        else:
            assert dest.data_ptr() == mp.data_ptr()
        assert dest.numel() == main.numel()
        quantized += main.numel() >= 1024
    assert quantized >= 1 and len(w.fp4_copy_targets) > quantized   # both kinds present


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_copy_skips_what_the_step_wrote_and_copies_the_rest(layout):
    tr = _trainer(LAYOUTS[layout])
    w = _wrapper(tr)
    marked = []

    def poison_written(opt, args, kwargs):
        # after QAdamW's step, before the wrapper's copy: a copy would overwrite these
        for main, dest in w.fp4_copy_targets:
            if model_param_written(main):
                dest.fill_(7.0)
                marked.append(main)

    h = w.optimizer.register_step_post_hook(poison_written)
    _steps(tr, 1)
    h.remove()
    small = [(m, d) for m, d in w.fp4_copy_targets if m.numel() < 1024]
    assert marked and small
    for main, dest in w.fp4_copy_targets:
        if any(main is m for m in marked):
            assert (dest == 7.0).all()                     # not copied over
        else:
            assert torch.equal(dest, main.detach().view_as(dest).to(dest.dtype))
        assert not model_param_written(main)               # the copy consumed the record


def test_distributed_load_rewrites_main_and_copies_to_model():
    """The converted DistributedOptimizer's load_state_dict (main params := saved, then main ->
    model) after a completed step and after an inner step whose copy never ran: every model
    param is the loaded main rounded."""
    extra = LAYOUTS["distopt"]
    a, b = _trainer(extra), _trainer(extra)
    _steps(a, 2)
    saved = _wrapper(a).state_dict()
    _steps(b, 3)
    apply_schedule(b.optimizer, LR, WD)
    b.model.zero_grad_buffer()
    b.optimizer.zero_grad()
    b._run_schedule(b.train_ds, 0, forward_only=False)
    wb = _wrapper(b)
    wb.prepare_grads()
    wb.optimizer.step()                        # records set, the wrapper's copy not run
    assert any(model_param_written(m) for m, _ in wb.fp4_copy_targets)
    wb.load_state_dict(saved)
    for x, y in zip(_mains(a), _mains(b)):
        assert torch.equal(x, y)
    _assert_model_is_bf16_of_main(b)
    for (n, x), y in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(x, y), n


def test_reload_model_params_then_steps_as_megatrons_copy():
    """megatron's reload_model_params (Float16 wrapper: main := model) after some steps, with
    model params set from a snapshot, then more steps: the same as without the fused write."""
    runs = []
    for fused in (False, True):
        tr = _trainer(fused=fused)
        _steps(tr, 1)
        snapshot = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        _steps(tr, 1)
        with torch.no_grad():
            for n, p in tr.model.named_parameters():
                p.copy_(snapshot[n])
        tr.optimizer.reload_model_params()
        for main, dest in model_param_write.megatron_copy_targets(_wrapper(tr)):
            assert torch.equal(main.detach().view_as(dest), dest.float())
        runs.append((tr, _steps(tr, 2)))
    (ref, losses_ref), (fused, losses_fused) = runs
    assert losses_fused == losses_ref
    _assert_same_run(ref, fused)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_is_exact(tmp_path, layout):
    save = str(tmp_path / "ckpt")
    common = ["train.iters=4", "train.eval_interval=100", "train.global_batch_size=4",
              f"checkpoint.save_dir={save}", "checkpoint.keep_last=5", *LAYOUTS[layout]]
    straight = _trainer(common + [f"checkpoint.save_dir={tmp_path}/straight"])
    straight.train()
    part = _trainer(common + ["train.exit_interval=2"])
    part.train()
    assert part.iteration == 2
    resumed = _trainer([*common, "checkpoint.load=auto"])
    assert resumed.iteration == 2
    _assert_model_is_bf16_of_main(resumed)
    resumed.train()
    _assert_same_run(straight, resumed)


# ---------------------------------------------------------------- distributed optimizer, DP = 2
def _dp2_worker(rank: int, world: int, init: str, out: str):
    helpers.join_gloo(rank, world, init)
    torch.set_num_threads(1)
    extra = ["train.global_batch_size=4", *LAYOUTS["distopt"]]
    ref = _trainer(extra, fused=False)
    losses_ref = _steps(ref)
    fused = _trainer(extra)
    w = _wrapper(fused)
    # this rank's pieces only: a param cut by the DP shard boundary has a partial destination
    assert any(d.numel() < p.numel() for p in fused.model.parameters()
               for m, d in w.fp4_copy_targets if p.main_param is m)
    losses_fused = _steps(fused)
    assert losses_fused == losses_ref
    _assert_same_run(ref, fused)               # full model params: the all-gathered pieces
    _assert_model_is_bf16_of_main(fused)
    open(os.path.join(out, f"ok{rank}"), "w").close()


def test_distributed_optimizer_dp2_bit_identical(tmp_path):
    helpers.spawn_gloo(_dp2_worker, [(2, (str(tmp_path),))], timeout=400)
    assert sorted(os.listdir(tmp_path)) == ["ok0", "ok1"]
