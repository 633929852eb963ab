"""`fp4.linear=lora_svd` inside megatron-core: layers, initial split, realignment with the
optimizer state, exact resume across a realignment, merged export loaded by a BF16 model.

In-process parts build a `Trainer` (tiny model, seq 32, mock data, one process); the resume
and export parts run `pretrain_gpt.py` / `scripts/export_merged_checkpoint.py` as
subprocesses (the helpers of tests/megatron/training).
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from megatron.training import recipes
from megatron.training.config import load_config
from tests.megatron.training import helpers

RANK, INTERVAL = 4, 3
BETA_CFG = 0.25  # the default fp4.lora_svd.beta
# the paper's projected route: the realignment's moment transfer below is its; the dense route
# (the default) has its own tests
LORA = ["fp4.linear=lora_svd", f"fp4.lora_svd.rank={RANK}", f"fp4.lora_svd.realign_interval={INTERVAL}",
        "fp4.lora_svd.route=projected"]


def _cfg(*overrides):
    cfg = load_config(None, helpers.TINY + ["checkpoint.load=none", "train.iters=8", *overrides])
    cfg.logging.dir = None
    return cfg


def _trainer(cfg):
    from megatron.core import parallel_state as ps
    from megatron.training.trainer import Trainer

    if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() != 1:
        pytest.skip("another test initialised tensor parallelism in this process")
    torch.set_num_threads(1)
    return Trainer(cfg, verbose=False)


def _mods(trainer):
    from fullstack_fp4.integration.lora_svd_layers import lora_svd_modules

    return lora_svd_modules([trainer.model])


def _fixed_batch_loss(trainer, exact):
    from fullstack_fp4.integration.lora_svd_layers import exact_matmuls

    with exact_matmuls([trainer.model], exact):
        return trainer.evaluate()


# ----------------------------------------------------------------------- layers and init
@helpers.cpu_path_oracle("the dense reference model is initialised and compared on the CPU "
                         "(on a GPU machine the Trainer puts the model on cuda:0)")
def test_layers_factors_and_initial_split():
    from fullstack_fp4.integration.lora_svd_layers import (LoRASVDColumnParallelLinear,
                                                           LoRASVDRowParallelLinear)
    from megatron.training.model import build_model
    from megatron.training.initialize import set_seed

    t = _trainer(_cfg(*LORA))
    mods = _mods(t)
    assert len(mods) == 4 * 4  # qkv, proj, fc1, fc2 per layer
    kinds = {n.rsplit(".", 1)[-1]: type(m) for n, m in mods}
    assert kinds == {"linear_qkv": LoRASVDColumnParallelLinear, "linear_fc1": LoRASVDColumnParallelLinear,
                     "linear_proj": LoRASVDRowParallelLinear, "linear_fc2": LoRASVDRowParallelLinear}
    for _, m in mods:
        out_f, in_f = m.weight.shape
        assert m.lora_l2.shape == (out_f, RANK) and m.lora_l1.shape == (RANK, in_f)
        assert not m.lora_l2.requires_grad and m.lora_l1.requires_grad
        assert m.lora_l1.tensor_model_parallel and m.lora_l1.partition_dim == m._lora_axis
    # every other weight initialised as in a plain BF16-spec model with the same seed, and the
    # split reproduces the dense init exactly (fp32 run)
    cfg = _cfg()
    set_seed(cfg.train.seed)
    dense = build_model(cfg, 256)
    dense_sd = dense.state_dict()
    for k, v in t.gpt.state_dict().items():
        if k.endswith(("lora_l1", "lora_l2")) or k.endswith("_extra_state"):
            continue
        owner = k.rsplit(".", 1)[0]
        m = dict((n.split(".", 1)[1].replace("module.", "", 2), mm) for n, mm in mods).get(owner)
        if m is not None and k.endswith(".weight"):
            torch.testing.assert_close(m.merge(), dense_sd[k], rtol=0, atol=1e-6)
        else:
            assert torch.equal(v, dense_sd[k]), k
    # checkpoints: factors are TP-sharded tensors along the layer's axis
    sd = t.gpt.sharded_state_dict()
    keys = [k for k in sd if k.endswith(("lora_l1", "lora_l2"))]
    assert len(keys) == 2 * len(mods)
    proj = sd["decoder.layers.0.self_attention.linear_proj.lora_l2"]  # layers stacked on axis 0
    assert proj.global_shape == (4, 128, RANK) and proj.local_shape == (128, RANK)


def test_unquantized_switch_runs_the_exact_path():
    """`fp4.lora_svd.unquantized=true` (the diagnostic arm) builds layers whose W_res GEMMs are
    unquantized: its loss equals the default model's under `exact_matmuls` (same seed, same
    weights), which is not the default model's NVFP4 loss."""
    quantized = _trainer(_cfg(*LORA))
    assert not any(m.lora_exact for _, m in _mods(quantized))
    nvfp4_loss = quantized.evaluate()
    exact_loss = _fixed_batch_loss(quantized, True)
    unquantized = _trainer(_cfg(*LORA, "fp4.lora_svd.unquantized=true"))
    assert all(m.lora_exact for _, m in _mods(unquantized))
    assert unquantized.evaluate() == exact_loss
    assert exact_loss != nvfp4_loss


def test_dense_route_unquantized_trains_as_the_dense_model():
    """`fp4.lora_svd.route=dense` with unquantized W_res GEMMs is dense AdamW reparametrised:
    W_res gets the whole gradient (elementwise moments of the dense W), the branch only decays.
    Oracle: the plain BF16-spec model with the same seed, trained the same steps (fp32 run);
    the losses agree to fp32 rounding, while the projected route's do not."""
    dense = _trainer(_cfg("optimizer.weight_decay=0.1"))
    lora = _trainer(_cfg(*LORA, "fp4.lora_svd.realign_interval=1000", "fp4.lora_svd.route=dense",
                         "fp4.lora_svd.unquantized=true", "optimizer.weight_decay=0.1"))
    projected = _trainer(_cfg(*LORA, "fp4.lora_svd.realign_interval=1000",
                              "fp4.lora_svd.unquantized=true", "optimizer.weight_decay=0.1"))
    assert all(m.lora_route == "dense" for _, m in _mods(lora))
    l_dense, l_lora, l_proj = [], [], []
    for _ in range(5):
        (ld, gd), (ll, gl) = dense.train_step(), lora.train_step()
        l_dense.append(ld)
        l_lora.append(ll)
        l_proj.append(projected.train_step()[0])
        assert abs(gd - gl) <= 1e-4 * gd, (gd, gl)       # L1's zero gradient adds nothing
    for a, b in zip(l_dense, l_lora):
        assert abs(a - b) <= 1e-5 * abs(a), (l_dense, l_lora)
    assert max(abs(a - b) for a, b in zip(l_dense, l_proj)) > 1e-4, (l_dense, l_proj)
    # the merged weights are the dense model's (W_res + β L2 L1 = W). Not bit for bit: the two
    # wgrads are the same product rounded in different orders, and Adam's m/√v turns a rounding
    # difference of a near-zero gradient entry into a visible step difference (a few entries)
    dsd = dense.gpt.state_dict()
    for n, m in _mods(lora):
        key = n.split(".", 1)[1].replace("module.", "", 2) + ".weight"
        w, wm = dsd[key].double(), m.merge(torch.float32).double()
        assert (wm - w).norm() <= 1e-4 * w.norm(), n


def test_dense_route_realignment_keeps_w_res_moments_and_resets_l1():
    """Under the dense route W_res's moments are the dense W's: a realignment keeps them (the
    elementwise moments of W do not depend on the split) and resets L1's; W is unchanged."""
    t = _trainer(_cfg(*LORA, "fp4.lora_svd.route=dense"))
    t.train_step()
    opt = t.optimizer

    def state(p):
        mp = getattr(p, "main_param", None)
        mp = p if mp is None else mp
        for sub in getattr(opt, "chained_optimizers", None) or [opt]:
            if mp in sub.optimizer.state:
                return sub.optimizer.state[mp]
        raise AssertionError("no optimizer state")

    mods = _mods(t)
    before = {n: (m.merge(torch.float32), state(m.weight)["exp_avg"].clone(),
                  state(m.weight)["exp_avg_sq"].clone(), m.lora_l2.detach().clone()) for n, m in mods}
    recipes.after_optimizer_step([t.model], opt, t.cfg, INTERVAL)
    for n, m in mods:
        w, m_res, v_res, l2 = before[n]
        assert not torch.equal(m.lora_l2, l2)                      # a new split happened
        assert (m.merge(torch.float32) - w).abs().max() <= 1e-6 * w.abs().max()
        assert torch.equal(state(m.weight)["exp_avg"], m_res)
        assert torch.equal(state(m.weight)["exp_avg_sq"], v_res)
        s1 = state(m.lora_l1)
        assert not s1["exp_avg"].any() and not s1["exp_avg_sq"].any()


# ----------------------------------------------------------------------- realignment
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_realignment_keeps_w_loss_and_applies_the_moment_policy(precision):
    t = _trainer(_cfg(*LORA, f"train.precision={precision}"))
    t.train_step()  # Adam state exists
    t.iteration = 1
    mods = _mods(t)
    before_w = {n: m.merge(torch.float32) for n, m in mods}
    opt = t.optimizer

    def master(p):
        return getattr(p, "main_param", None) if getattr(p, "main_param", None) is not None else p

    def state(p):
        for sub in getattr(opt, "chained_optimizers", None) or [opt]:
            if master(p) in sub.optimizer.state:
                return sub.optimizer.state[master(p)]
        raise AssertionError("no optimizer state")

    st_res = {n: {k: v.clone() for k, v in state(m.weight).items()} for n, m in mods}
    st_l1 = {n: {k: v.clone() for k, v in state(m.lora_l1).items()} for n, m in mods}
    l2_before = {n: m.lora_l2.detach().clone() for n, m in mods}
    loss_exact, loss_q = _fixed_batch_loss(t, True), _fixed_batch_loss(t, False)

    recipes.after_optimizer_step([t.model], opt, t.cfg, INTERVAL - 1)  # not a realignment step
    assert all(torch.equal(m.merge(torch.float32), before_w[n]) for n, m in mods)
    recipes.after_optimizer_step([t.model], opt, t.cfg, INTERVAL)

    tol = 1e-6 if precision == "fp32" else 2 ** -7
    for n, m in mods:
        w = before_w[n]
        assert not torch.equal(m.lora_l2, l2_before[n])  # the split did change (new subspace)
        err = (m.merge(torch.float32) - w).abs().max() / w.abs().max()
        assert err <= tol, (n, float(err))
        # masters and model params agree (bf16: the model param is the rounded master)
        for p in (m.weight, m.lora_l1):
            assert torch.equal(master(p).to(p.dtype), p.detach())
        # moments re-expressed in the new split (oracle: FP64 pseudo-inverse of the new L2)
        l2o, l2n = l2_before[n].double(), m.lora_l2.double()
        sr, s1 = state(m.weight), state(m.lora_l1)
        big_m = st_res[n]["exp_avg"].double() + BETA_CFG * l2o @ st_l1[n]["exp_avg"].double()
        pinv = torch.linalg.pinv(l2n) / BETA_CFG                       # [r, out]
        torch.testing.assert_close(s1["exp_avg"].double(), pinv @ big_m, rtol=1e-4,
                                   atol=1e-4 * float(big_m.abs().max()))
        # the first moment of the dense W is unchanged, and W_res's part is ⟂ the new subspace
        after_m = sr["exp_avg"].double() + BETA_CFG * l2n @ s1["exp_avg"].double()
        torch.testing.assert_close(after_m, big_m, rtol=0, atol=1e-5 * float(big_m.abs().max()))
        qn, _ = torch.linalg.qr(l2n)
        assert (qn.T @ sr["exp_avg"].double()).abs().max() <= 1e-4 * big_m.abs().max()
        # second moments: v_res kept, v_L1 = (A∘A)(v_res + β²(L2∘L2) v_L1)
        assert torch.equal(sr["exp_avg_sq"], st_res[n]["exp_avg_sq"])
        big_v = st_res[n]["exp_avg_sq"].double() + BETA_CFG ** 2 * (l2o * l2o) @ st_l1[n]["exp_avg_sq"].double()
        torch.testing.assert_close(s1["exp_avg_sq"].double(), (pinv * pinv) @ big_v, rtol=1e-3,
                                   atol=1e-6 * float(big_v.max()))
        assert torch.equal(s1["step"], st_l1[n]["step"]) and torch.equal(sr["step"], st_res[n]["step"])
        # the new split is orthonormal again (L2 stored in the parameter dtype)
        g2 = m.lora_l2.float().T @ m.lora_l2.float()
        torch.testing.assert_close(g2, torch.eye(g2.shape[0], device=g2.device), rtol=0,
                                   atol=2e-2)
    # loss continuity: unquantized forward identical up to rounding; the NVFP4 forward changes
    # only by the different quantization of the new W_res
    after_exact, after_q = _fixed_batch_loss(t, True), _fixed_batch_loss(t, False)
    assert abs(after_exact - loss_exact) <= (1e-5 if precision == "fp32" else 2e-3) * loss_exact
    assert abs(after_q - loss_q) <= 1e-2 * loss_q
    # and training goes on from there
    loss, grad_norm = t.train_step()
    assert torch.isfinite(torch.tensor([loss, grad_norm])).all()


# ----------------------------------------------------------------------- resume + export
N_STRAIGHT, N_PART = 7, 4
COMMON = LORA + [f"train.iters={N_STRAIGHT}", f"train.eval_interval={N_STRAIGHT}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("lora_resume"))
    cfg = helpers.base_config(d)
    save = os.path.join(d, "ckpt")
    straight = helpers.start(cfg, COMMON + ["checkpoint.load=none", f"logging.dir={d}/log_straight"],
                             log=os.path.join(d, "straight.txt"))
    part = helpers.start(cfg, COMMON + [f"checkpoint.save_dir={save}", "checkpoint.save_interval=2",
                                        f"train.exit_interval={N_PART}", f"logging.dir={d}/log_part"],
                         log=os.path.join(d, "part.txt"))
    rc, out = helpers.finish(part)
    assert rc == 0, out[-3000:]
    ckpt4 = os.path.join(save, "iter_0000004")
    export = subprocess.Popen([sys.executable, os.path.join(helpers.REPO, "scripts", "export_merged_checkpoint.py"),
                               "--src", ckpt4, "--out", os.path.join(d, "merged")], cwd=helpers.REPO,
                              env=helpers.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rc, out = helpers.finish(straight)
    assert rc == 0, out[-3000:]
    resumed = helpers.start(cfg, COMMON + [f"checkpoint.save_dir={save}", "checkpoint.load=auto",
                                           f"logging.dir={d}/log_resumed"], log=os.path.join(d, "resumed.txt"))
    export_out, _ = export.communicate(timeout=300)
    assert export.returncode == 0, export_out[-3000:]
    rc, out = helpers.finish(resumed)
    assert rc == 0, out[-3000:]
    return dict(dir=d, ckpt4=ckpt4, merged=os.path.join(d, "merged", "iter_0000004"),
                straight=helpers.read_metrics(os.path.join(d, "log_straight")),
                part=helpers.read_metrics(os.path.join(d, "log_part")),
                resumed=helpers.read_metrics(os.path.join(d, "log_resumed")))


def test_resume_across_realignment_is_exact(runs):
    (straight, sval), (part, _), (resumed, rval) = runs["straight"], runs["part"], runs["resumed"]
    assert sorted(straight) == list(range(1, N_STRAIGHT + 1))
    assert sorted(part) == list(range(1, N_PART + 1))
    assert sorted(resumed) == list(range(N_PART + 1, N_STRAIGHT + 1))
    # realignments after steps 3 (before the checkpoint at 4) and 6 (in the resumed run)
    for it in range(1, N_STRAIGHT + 1):
        rec = (part if it <= N_PART else resumed)[it]
        assert rec["loss"] == straight[it]["loss"], f"iteration {it}"
        assert rec["grad_norm"] == straight[it]["grad_norm"], f"iteration {it}"
    assert rval[N_STRAIGHT] == sval[N_STRAIGHT]


def test_merged_export_loads_in_a_bf16_model_with_the_same_loss(runs):
    from fullstack_fp4.integration.lora_svd_layers import exact_matmuls

    # the saved run's length: another train.iters is a changed run (continuation.py refuses it)
    lora = _trainer(_cfg(*LORA, f"checkpoint.load={runs['ckpt4']}", f"train.iters={N_STRAIGHT}"))
    assert lora.iteration == N_PART
    loss_q = lora.evaluate()
    with exact_matmuls([lora.model]):
        loss_exact = lora.evaluate()
    dense = _trainer(_cfg(f"checkpoint.load={runs['merged']}", f"train.iters={N_STRAIGHT}"))
    assert dense.cfg.fp4.linear == "bf16" and dense.iteration == N_PART
    assert not _mods(dense)
    loss_dense = dense.evaluate()
    # "same": the dense model is the LoRA-SVD model without the NVFP4 quantization of W_res
    assert loss_dense == pytest.approx(loss_exact, rel=1e-6, abs=0)
    assert loss_q != loss_exact and loss_q == pytest.approx(loss_exact, rel=2e-2)
    # the merged weights are the merge of the factors, bit for bit
    lsd, dsd = lora.gpt.state_dict(), dense.gpt.state_dict()
    w = lsd["decoder.layers.1.mlp.linear_fc2.weight"].float() + BETA_CFG * (
        lsd["decoder.layers.1.mlp.linear_fc2.lora_l2"].float() @ lsd["decoder.layers.1.mlp.linear_fc2.lora_l1"].float())
    assert torch.equal(dsd["decoder.layers.1.mlp.linear_fc2.weight"], w)
