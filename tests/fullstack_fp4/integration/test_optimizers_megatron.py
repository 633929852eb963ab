"""The FP4 optimizers inside megatron-core's wrappers, in process on CPU (tiny GPTModel).

Oracles, applied to copies of the same FP32 main params and the same gradients the wrapper
used (grad clipping off, so the wrapper hands the inner optimizer the raw grads):
  q_adamw             -> QAdamW (fullstack_fp4.optim) built directly over the copies
  muon/root matrices  -> the other engineer's plain Muon / Root, with the fused QKV weight cut
                         into separate Q, K, V parameters by megatron's head layout (written here
                         from attention.py, independently of the integration's permutation) and
                         linear_fc1 into separate gate and up parameters
  everything else     -> torch.optim.AdamW (q_root: QAdamW)
and the QKV permutation is checked against megatron's own `get_query_key_value_tensors`.
"""
from __future__ import annotations

import copy

import pytest
import torch

from fullstack_fp4.integration.optimizers import (SplitOptimizer, is_orthogonal_matrix,
                                                  qkv_row_permutation)
from fullstack_fp4.optim.muon import Muon
from fullstack_fp4.optim.q_adamw import QAdamW
from fullstack_fp4.optim.root import Root
from megatron.training.config import load_config
from megatron.training.optimizer import apply_schedule
from tests.megatron.training import helpers

TINY = ["model.preset=tiny", "model.seq_length=32", "model.vocab_size=256", "data.mock=true",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_iters=1",
        "logging.tensorboard=false", "train.grad_clip=0", "checkpoint.load=none",
        "optimizer.q_adamw.min_numel=1024"]
LR, WD = 2e-3, 0.1


def _trainer(name: str, precision: str = "fp32", extra=()):
    from megatron.training.trainer import Trainer

    cfg = load_config(None, TINY + [f"optimizer.name={name}", f"train.precision={precision}",
                                    *extra])
    cfg.logging.dir = None
    return Trainer(cfg, verbose=False)


def _inner_params(opt):
    return [p for g in opt.optimizer.param_groups for p in g["params"]]


def _step(tr):
    """One train step at lr LR / wd WD; returns (params before, grads) of the inner optimizer."""
    apply_schedule(tr.optimizer, LR, WD)
    before = [p.detach().clone() for p in _inner_params(tr.optimizer)]
    tr.train_step()
    grads = [p.grad.detach().clone() for p in _inner_params(tr.optimizer)]
    return before, grads


def _names(tr):
    """inner param -> model param name (FP32Optimizer: identity; Float16: via its groups)."""
    w = tr.optimizer.chained_optimizers[0] if hasattr(tr.optimizer, "chained_optimizers") \
        else tr.optimizer
    name_of = {id(p): n for n, p in tr.model.named_parameters()}
    out = {}
    if hasattr(w, "float16_groups"):
        for g16, g32 in zip(w.float16_groups, w.fp32_from_float16_groups):
            out.update({id(m): name_of[id(p)] for p, m in zip(g16, g32)})
        for g in w.fp32_from_fp32_groups:
            out.update({id(p): name_of[id(p)] for p in g})
    else:
        out = {id(p): name_of[id(p)] for p in _inner_params(tr.optimizer)}
    return out


_dist = pytest.fixture(scope="module", autouse=True)(helpers.in_process_megatron)


# ----------------------------------------------------------------------------- q_adamw
@pytest.mark.parametrize("name", ["q_adamw", "q_root"])
def test_approx_division_key_reaches_qadamw(name):
    """optimizer.q_adamw.approx_division reaches the QAdamW the trainer builds (q_adamw's inner
    optimizer; q_root's QAdamW for the non-matrix params), off by default."""
    def qadamws(tr):
        inner = tr.optimizer.optimizer
        return [o for o in (inner.subs if isinstance(inner, SplitOptimizer) else [inner])
                if isinstance(o, QAdamW)]

    for value in (None, "true", "false"):
        extra = [] if value is None else [f"optimizer.q_adamw.approx_division={value}"]
        found = qadamws(_trainer(name, extra=extra))
        assert found, "no QAdamW in the trainer's optimizer"
        assert all(o.approx_division is (value == "true") for o in found), value


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_q_adamw_step_equals_direct_q_adamw(precision):
    tr = _trainer("q_adamw", precision)
    inner = tr.optimizer.optimizer
    assert isinstance(inner, QAdamW)
    before, grads = _step(tr)
    # the oracle: QAdamW over copies, same groups (lr·lr_mult, wd·wd_mult), same order
    copies = [b.clone() for b in before]
    it = iter(copies)
    groups = [{"params": [next(it) for _ in g["params"]], "lr": g["lr"],
               "weight_decay": g["weight_decay"]} for g in inner.param_groups]
    assert any(g["weight_decay"] == 0 for g in groups) and any(g["weight_decay"] > 0 for g in groups)
    ref = QAdamW(groups, lr=LR, betas=inner.defaults["betas"], eps=inner.defaults["eps"],
                 min_numel=1024, seed=tr.cfg.train.seed)
    for c, g in zip(copies, grads):
        c.grad = g
    ref.step()
    after = _inner_params(tr.optimizer)
    n_quant = 0
    for a, c, b in zip(after, copies, before):
        assert torch.equal(a.detach(), c), "integrated step != direct QAdamW"
        assert not torch.equal(a.detach(), b)
    for p, c in zip(after, copies):
        st = inner.state[p]
        if p.numel() >= 1024:
            n_quant += 1
            assert st["exp_avg_codes"].dtype == torch.uint8
            assert torch.equal(st["exp_avg_codes"], ref.state[c]["exp_avg_codes"])
    assert n_quant > 0
    # 4-bit states in the (non-sharded) state dict too
    sd = tr.optimizer.state_dict()
    assert any(v.dtype == torch.uint8 for s in sd["fp4_state"]["inner"]["state"].values()
               for v in s.values() if torch.is_tensor(v))


# ------------------------------------------------------------------------ orthogonal
def _qkv_blocks_oracle(w, ng, hpg, hd):
    """[Q; K; V] rows of megatron's fused weight, from its documented view
    [ng, (hpg + 2) * hd, in] -> q = [:, :hpg*hd], k = next hd, v = last hd."""
    v3 = w.view(ng, (hpg + 2) * hd, -1)
    q = v3[:, :hpg * hd].reshape(-1, w.shape[1])
    k = v3[:, hpg * hd:(hpg + 1) * hd].reshape(-1, w.shape[1])
    v = v3[:, (hpg + 1) * hd:].reshape(-1, w.shape[1])
    return q, k, v


def test_qkv_permutation_matches_megatron_attention():
    tr = _trainer("adamw")
    attn = tr.gpt.decoder.layers[0].self_attention
    c = tr.gpt.config
    ng, hpg, hd = c.num_query_groups, c.num_attention_heads // c.num_query_groups, c.kv_channels
    assert ng > 1 and hpg > 1  # the tiny preset is GQA: the interleaving matters
    w = attn.linear_qkv.weight.detach()
    perm, sizes = qkv_row_permutation(ng, hpg, hd)
    wq, wk, wv = torch.split(w[perm], sizes)
    x = torch.randn(5, 2, c.hidden_size, device=w.device)  # the trainer's device (CUDA on a GPU)
    with torch.no_grad():
        q, k, v = attn.get_query_key_value_tensors(x)
    torch.testing.assert_close(q.reshape(5, 2, -1), x @ wq.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.reshape(5, 2, -1), x @ wk.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v.reshape(5, 2, -1), x @ wv.T, rtol=1e-5, atol=1e-5)
    for a, b in zip((wq, wk, wv), _qkv_blocks_oracle(w, ng, hpg, hd)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name,precision", [("muon", "fp32"), ("root", "fp32"),
                                            ("q_root", "fp32"), ("muon", "bf16")])
def test_orthogonal_step_equals_reference(name, precision):
    scale = 3.0
    tr = _trainer(name, precision, extra=[f"optimizer.orthogonal.lr_scale={scale}"])
    inner = tr.optimizer.optimizer
    assert isinstance(inner, SplitOptimizer)
    orth, rest = inner.subs
    assert isinstance(orth, Muon if "muon" in name else Root)
    assert isinstance(rest, QAdamW if name == "q_root" else torch.optim.AdamW)
    assert orth.ns_cuda_graph is True       # optimizer.orthogonal.cuda_graph's default
    names = _names(tr)
    params = _inner_params(tr.optimizer)
    mats = {id(p) for g in orth.param_groups for p in g["params"]}
    # which params are matrices: exactly the 2-D linear weights of the transformer layers
    for p in params:
        n = names[id(p)]
        want = p.ndim == 2 and any(s in n for s in ("linear_qkv.", "linear_proj.", "linear_fc1.",
                                                    "linear_fc2.")) and n.endswith("weight")
        assert (id(p) in mats) == want, n
        assert is_orthogonal_matrix(n, p) == want
    # weight decay per group as megatron decided (norms: 0), lr scaled for matrices
    g_m = orth.param_groups[0]
    before, grads = _step(tr)
    c = tr.gpt.config
    ng, hpg, hd = c.num_query_groups, c.num_attention_heads // c.num_query_groups, c.kv_channels
    q = name.startswith("q_")
    kw = dict(momentum=0.95, ns_precision="nvfp4" if q else "bf16",
              ns_coefficients="fp4" if q else ("muon" if name == "muon" else "root"))
    Ref = Muon if "muon" in name else Root
    expected = {}
    by_id = {id(p): i for i, p in enumerate(params)}
    for g in orth.param_groups:
        assert g["lr"] == pytest.approx(LR * scale)
        for p in g["params"]:
            i = by_id[id(p)]
            w, gr = before[i].clone(), grads[i]
            n = names[id(p)]
            if n.endswith("linear_qkv.weight"):
                wb, gb = _qkv_blocks_oracle(w, ng, hpg, hd), _qkv_blocks_oracle(gr, ng, hpg, hd)
            elif n.endswith("linear_fc1.weight"):
                wb, gb = w.chunk(2), gr.chunk(2)
            else:
                wb, gb = (w,), (gr,)
            outs = []
            for wi, gi in zip(wb, gb):
                t = wi.clone()
                t.grad = gi.clone()
                Ref([t], lr=g["lr"], weight_decay=g["weight_decay"], **kw).step()
                outs.append(t)
            if n.endswith("linear_qkv.weight"):
                out = torch.empty_like(w)
                qo, ko, vo = outs
                v3 = out.view(ng, (hpg + 2) * hd, -1)
                v3[:, :hpg * hd] = qo.view(ng, hpg * hd, -1)
                v3[:, hpg * hd:(hpg + 1) * hd] = ko.view(ng, hd, -1)
                v3[:, (hpg + 1) * hd:] = vo.view(ng, hd, -1)
            else:
                out = torch.cat(outs)
            expected[i] = out
    copies, groups = [], []
    for g in rest.param_groups:
        ps_ = []
        for p in g["params"]:
            t = before[by_id[id(p)]].clone()
            t.grad = grads[by_id[id(p)]]
            ps_.append(t)
            copies.append((by_id[id(p)], t))
        groups.append({"params": ps_, "lr": g["lr"], "weight_decay": g["weight_decay"]})
    if name == "q_root":
        # QAdamW's seeds follow the param index inside its own optimizer: same order here
        QAdamW(groups, lr=LR, betas=rest.defaults["betas"], eps=rest.defaults["eps"],
               min_numel=1024, seed=tr.cfg.train.seed).step()
    else:
        torch.optim.AdamW(groups, lr=LR, betas=rest.defaults["betas"],
                          eps=rest.defaults["eps"]).step()
    for i, t in copies:
        expected[i] = t
    assert len(expected) == len(params)
    for i, p in enumerate(params):
        torch.testing.assert_close(p.detach(), expected[i], rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"{names[id(p)]}: {m}")
        assert not torch.equal(p.detach(), before[i]), names[id(p)]
    assert g_m["weight_decay"] == pytest.approx(WD)


def test_cuda_graph_switch_reaches_the_optimizer():
    orth = _trainer("root", extra=["optimizer.orthogonal.cuda_graph=false"]).optimizer.optimizer.subs[0]
    assert isinstance(orth, Root) and orth.ns_cuda_graph is False


def test_split_by_logical_matrix_differs_from_whole():
    """The per-logical-matrix QKV update is not the whole-matrix one (the test above would not
    notice a missing split if the two coincided)."""
    torch.manual_seed(0)
    ng, hpg, hd, h = 2, 2, 8, 32
    g = torch.randn((hpg + 2) * hd * ng, h)
    g[:hpg * hd * ng // 2] *= 10  # scales differ per block
    w1 = torch.zeros_like(g, requires_grad=False)
    w1.grad = g.clone()
    Muon([w1], lr=1.0, ns_precision="fp32").step()
    w2 = torch.zeros_like(g)
    w2.grad = g.clone()
    w2.ns_row_perm, w2.ns_split_sizes = qkv_row_permutation(ng, hpg, hd)
    Muon([w2], lr=1.0, ns_precision="fp32").step()
    assert (w1 - w2).abs().max() > 1e-2


def test_state_dict_round_trip_resumes_exactly():
    """state_dict -> fresh run -> load_state_dict -> same next step (in process, q_root)."""
    a = _trainer("q_root")
    _step(a)
    sd = copy.deepcopy(a.optimizer.state_dict())
    model_sd = copy.deepcopy(a.gpt.state_dict())
    b = _trainer("q_root")
    b.gpt.load_state_dict(model_sd)
    b.optimizer.load_state_dict(sd)
    b.consumed_samples = a.consumed_samples
    _step(a)
    _step(b)
    for x, y in zip(_inner_params(a.optimizer), _inner_params(b.optimizer)):
        assert torch.equal(x, y)


def test_q_adamw_distributed_optimizer_one_rank_step_equals_direct():
    """DistributedOptimizer (DP=1): the inner QAdamW gets 1-D FP32 shards (views of the
    params); its step equals QAdamW applied to copies of those flat shards."""
    tr = _trainer("q_adamw", extra=["parallel.use_distributed_optimizer=true"])
    inner = tr.optimizer.optimizer
    assert isinstance(inner, QAdamW)
    assert all(p.ndim == 1 for p in _inner_params(tr.optimizer))
    before, grads = _step(tr)
    copies = [b.clone() for b in before]
    # the shards carry their Placement (key = model param index, chunk grid on the buffer)
    from fullstack_fp4.optim.q_adamw.optimizer import PLACE_ATTR
    for c, p in zip(copies, _inner_params(tr.optimizer)):
        assert getattr(p, PLACE_ATTR).offset == 0          # DP=1: whole params
        setattr(c, PLACE_ATTR, getattr(p, PLACE_ATTR))
    it = iter(copies)
    groups = [{"params": [next(it) for _ in g["params"]], "lr": g["lr"],
               "weight_decay": g["weight_decay"]} for g in inner.param_groups]
    for c, g in zip(copies, grads):
        c.grad = g
    QAdamW(groups, lr=LR, betas=inner.defaults["betas"], eps=inner.defaults["eps"],
           min_numel=1024, seed=tr.cfg.train.seed).step()
    for a, c in zip(_inner_params(tr.optimizer), copies):
        assert torch.equal(a.detach(), c)
    # the placements are part of the saved layout: a state saved before them (or with another
    # chunk grid) is refused, not decoded with the wrong grid
    from fullstack_fp4.integration.optimizers import OptimizerLayoutError
    sd = copy.deepcopy(tr.optimizer.state_dict())
    assert len(sd["fp4_state"]["layout"]["q_adamw_places"]) == len(copies)
    tr.optimizer.load_state_dict(copy.deepcopy(sd))                  # same layout: fine
    del sd["fp4_state"]["layout"]["q_adamw_places"]
    with pytest.raises(OptimizerLayoutError, match="q_adamw_places"):
        tr.optimizer.load_state_dict(sd)


def test_changed_layout_refusal_names_both_layouts():
    """A checkpoint saved at TP=2 (2 processes) loaded by 1 process with q_adamw: one message
    naming both layouts; the same layout passes; an unconverted optimizer (adamw) is left to
    megatron's own resharding."""
    from fullstack_fp4.integration.optimizers import resume_layout_error

    tr = _trainer("q_adamw")
    par = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
               use_distributed_optimizer=False)
    meta = {"world_size": 2, "config": {"parallel": par, "optimizer": {"name": "q_adamw"}}}
    msg = resume_layout_error(meta, tr.optimizer, "/ck")
    assert "TP=2 PP=1 DP=1 (world 2), distributed optimizer off" in msg
    assert "TP=1 PP=1 DP=1 (world 1), distributed optimizer off" in msg
    assert "could not be read" in msg and "\n" not in msg
    same = {"world_size": 1, "config": {"parallel": {**par, "tensor_model_parallel_size": 1}}}
    assert resume_layout_error(same, tr.optimizer, "/ck") is None
    dist_on = {"world_size": 1, "config": {"parallel": {**par, "tensor_model_parallel_size": 1,
                                                        "use_distributed_optimizer": True}}}
    assert "distributed optimizer on, this run has" in resume_layout_error(dist_on, tr.optimizer,
                                                                          "/ck")
    assert resume_layout_error(meta, _trainer("adamw").optimizer, "/ck") is None
    # plain optimizer, same TP and PP, another DP size: the state is replicated over DP
    dp2 = {"world_size": 2, "config": {"parallel": {**par, "tensor_model_parallel_size": 1}}}
    assert resume_layout_error(dp2, tr.optimizer, "/ck") is None
    dp2_dist = {"world_size": 2, "config": {"parallel": {**par, "tensor_model_parallel_size": 1,
                                                         "use_distributed_optimizer": True}}}
    assert "DP=2 (world 2), distributed optimizer on" in resume_layout_error(dp2_dist, tr.optimizer, "/ck")
