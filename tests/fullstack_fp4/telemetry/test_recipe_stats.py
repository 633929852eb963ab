"""Per-recipe telemetry statistics (fullstack_fp4/telemetry/recipe_stats.py) against direct
computations on small tensors, and the sampled sums against the full ones (unbiasedness)."""
from __future__ import annotations

import math

import pytest
import torch

from fullstack_fp4.nvfp4 import DEFAULT_SIGNS, dequantize, inverse_hadamard16, quantize
from fullstack_fp4.telemetry import TelemetryCollector
from fullstack_fp4.telemetry import recipe_stats as rs

ALL = 10**9  # a sample size above every unit count: the statistic over every unit once


def _ratio(pair):
    return float((pair[0] / pair[1]).sqrt())


def _unbiased(draw, full: float, reps: int, scale: float):
    """mean over ``reps`` of ``scale · draw()`` within 4 standard errors of ``full``."""
    vals = torch.tensor([float(draw()) * scale for _ in range(reps)], dtype=torch.float64)
    se = float(vals.std()) / math.sqrt(reps)
    assert abs(float(vals.mean()) - full) < 4 * se + 1e-9 * abs(full), (float(vals.mean()), full, se)


# ----------------------------------------------------------------------------- NVFP4 wgrad
@pytest.mark.parametrize("rule", ["6", "4over6"])
def test_wgrad_operand_matches_the_recipes_quantizer(rule):
    from fullstack_fp4.linear.nvfp4_linear import quantize_wgrad_operand

    torch.manual_seed(0)
    x = torch.randn(40, 32) * torch.linspace(0.1, 3, 32)   # 40 tokens: padded to 48
    e2, x2 = rs.wgrad_operand_sums(x, rounding="nearest", blocks=ALL, scale_rule=rule)
    xt = torch.nn.functional.pad(x, (0, 0, 0, 8)).t()

    def linear_err(r):   # what fprop saves for wgrad under rule r, in the original basis
        back = inverse_hadamard16(dequantize(quantize_wgrad_operand(x, rounding="nearest",
                                                                    scale_rule=r)).float(), DEFAULT_SIGNS)
        return float((xt - back).norm() / xt.norm())

    assert _ratio((e2, x2)) == pytest.approx(linear_err(rule), rel=1e-5)
    if rule == "4over6":
        assert linear_err("6") != pytest.approx(linear_err(rule), rel=1e-3)   # the rule matters
    g = torch.Generator().manual_seed(1)
    r = _ratio(rs.wgrad_operand_sums(x, rounding="stochastic", blocks=ALL, generator=g, scale_rule=rule))
    assert 0.9 * _ratio((e2, x2)) < r < 2.0 * _ratio((e2, x2))   # SR: noisier, same order


# ----------------------------------------------------------------------------- LoRA-SVD
def test_lora_svd_energy_and_residual_error_exact_and_unbiased():
    torch.manual_seed(0)
    w_res, l1, l2, beta = torch.randn(64, 48) * 0.1, torch.randn(4, 48), torch.randn(64, 4), 0.5
    out = rs.lora_svd_sums(w_res, l1, l2, beta, tiles=ALL)
    branch = beta * l2 @ l1
    assert _ratio(out["energy"]) ** 2 == pytest.approx(float(branch.norm() ** 2 / (w_res + branch).norm() ** 2),
                                                       rel=1e-5)
    wq = dequantize(quantize(w_res, tile=(16, 16))).float()
    assert _ratio(out["w_res"]) == pytest.approx(float((w_res - wq).norm() / w_res.norm()), rel=1e-5)
    # sampled numerators scaled by N/n are unbiased for the full sums
    n_tiles, n = (64 // 16) * (48 // 16), 3
    g = torch.Generator().manual_seed(2)
    draws = [rs.lora_svd_sums(w_res, l1, l2, beta, tiles=n, generator=g) for _ in range(150)]
    for key in ("energy", "w_res"):
        it = iter(draws)
        _unbiased(lambda: next(it)[key][0], float(out[key][0]), reps=150, scale=n_tiles / n)


def test_lora_svd_residual_error_under_4over6():
    """``scale_rule="4over6"``: W_res's error is that of its 4over6 16×16 quantization."""
    torch.manual_seed(3)
    w_res, l1, l2 = torch.randn(64, 48) * 0.1, torch.randn(4, 48), torch.randn(64, 4)
    out = rs.lora_svd_sums(w_res, l1, l2, 0.5, tiles=ALL, scale_rule="4over6")

    def err(rule):
        wq = dequantize(quantize(w_res, tile=(16, 16), scale_rule=rule)).float()
        return float((w_res - wq).norm() / w_res.norm())

    assert _ratio(out["w_res"]) == pytest.approx(err("4over6"), rel=1e-5)
    assert err("6") != pytest.approx(err("4over6"), rel=1e-3)


# ----------------------------------------------------------------------------- Q-AdamW
def _qadamw_state(n=5000, steps=3, seed=0):
    from fullstack_fp4.optim.q_adamw import QAdamW

    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(n))
    opt = QAdamW([p], lr=1e-3, betas=(0.9, 0.99), eps=1e-8, min_numel=16)
    for _ in range(steps):
        p.grad = torch.randn(n) * torch.rand(n)
        opt.step()
    p.grad = torch.randn(n) * torch.rand(n)
    return opt, p


def _qadamw_direct(opt, p):
    """Full-tensor oracle: the optimizer state's decoded moments, the public codecs on the whole
    tensor, the update formula of q_adamw_step_reference."""
    from fullstack_fp4.optim.q_adamw import (MomentState, decode_exp_avg, decode_exp_avg_sq,
                                             encode_exp_avg, encode_exp_avg_sq)

    st, n = opt.state[p], p.numel()
    ms = MomentState(st["exp_avg_codes"], st["exp_avg_scales"].view(torch.float8_e4m3fn),
                     st["exp_avg_chunk_scales"].view(torch.float32), n)
    vs = MomentState(st["exp_avg_sq_codes"], st["exp_avg_sq_scales"].view(torch.float8_e4m3fn),
                     st["exp_avg_sq_chunk_scales"].view(torch.float32), n,
                     tile_mean=st["exp_avg_sq_means"].view(torch.bfloat16))
    t = int(st["step"]) + 1
    g = p.grad.float()
    m = 0.9 * decode_exp_avg(ms) + 0.1 * g
    v = 0.99 * decode_exp_avg_sq(vs) + 0.01 * g * g
    mq = decode_exp_avg(encode_exp_avg(m))
    venc = encode_exp_avg_sq(v)
    vq = decode_exp_avg_sq(venc)
    c = 1 / math.sqrt(1 - 0.99 ** t)
    u, uq = m / (v.sqrt() * c + 1e-8), mq / (vq.sqrt() * c + 1e-8)
    rel = lambda a, b: float((a - b).norm() / a.norm())     # noqa: E731
    below = decode_exp_avg_sq(venc, guard="none") < vq       # raised by the μ/4 floor
    return {"m": rel(m, mq), "v": rel(v, vq), "update": rel(u, uq), "v_clamped": float(below.float().mean())}


def test_q_adamw_stats_against_full_tensor_and_through_the_step_hook():
    opt, p = _qadamw_state()
    want = _qadamw_direct(opt, p)
    got = rs.q_adamw_sample_sums(opt.state[p], p.grad, beta1=0.9, beta2=0.99, eps=1e-8, chunks=ALL)
    assert _ratio(got["v"]) == pytest.approx(want["v"], rel=1e-5)          # v: nearest, exact
    assert float(got["v_clamped"][0] / got["v_clamped"][1]) == pytest.approx(want["v_clamped"], abs=1e-7)
    # m (stochastic rounding) and the update that uses it: another draw, same distribution
    assert _ratio(got["m"]) == pytest.approx(want["m"], rel=0.1)
    assert _ratio(got["update"]) == pytest.approx(want["update"], rel=0.25)
    assert 0.05 < want["m"] < 0.3 and 0 < want["v_clamped"] < 0.5

    # the collector's step pre-hook sees the state *before* the update and names the param
    holder = torch.nn.Module()
    holder.w = p
    tel = TelemetryCollector(interval=1, blocks=4, opt_chunks=ALL)
    assert tel.begin_step(holder, 1, optimizer=opt)
    opt.step()
    out = tel.end_step()
    assert out["quant/optimizer/w/v/rel_err"] == pytest.approx(want["v"], rel=1e-5)
    assert out["quant/optimizer/w/v_clamped/frac"] == pytest.approx(want["v_clamped"], abs=1e-7)
    assert set(out) == {f"quant/optimizer/w/{t}" for t in ("m/rel_err", "v/rel_err", "update/rel_err",
                                                            "v_clamped/frac")}
    assert not opt._optimizer_step_pre_hooks            # removed by end_step


def test_q_adamw_sampled_chunks_are_unbiased():
    opt, p = _qadamw_state(n=2048, steps=2, seed=1)   # 2 chunks
    full = rs.q_adamw_sample_sums(opt.state[p], p.grad, beta1=0.9, beta2=0.99, eps=1e-8, chunks=ALL)
    g = torch.Generator().manual_seed(3)
    draw = lambda: rs.q_adamw_sample_sums(opt.state[p], p.grad, beta1=0.9, beta2=0.99, eps=1e-8,  # noqa: E731
                                          chunks=1, generator=g)
    samples = [draw() for _ in range(40)]
    for key in ("v", "v_clamped"):                       # deterministic per chunk: exact CI test
        vals = torch.tensor([2.0 * float(s[key][0]) for s in samples], dtype=torch.float64)  # N/n = 2
        se = float(vals.std()) / math.sqrt(len(vals))
        assert abs(float(vals.mean()) - float(full[key][0])) < 4 * se + 1e-12, key


# ----------------------------------------------------------------------------- Newton–Schulz
def test_ns_stats_against_direct_iteration():
    from fullstack_fp4.optim import newton_schulz, resolve_schedule

    torch.manual_seed(0)
    g = torch.randn(32, 48)
    out = rs.ns_stats(g, steps=3, coefficients="muon", precision="nvfp4")
    sched = list(resolve_schedule("muon", (32, 48), 3))
    x = (g / (g.norm() + 1e-7)).double()
    errs = []
    for k in range(1, 4):
        xk = newton_schulz(g, steps=k, coefficients=sched[:k], precision="nvfp4").double()
        a, b, c = sched[k - 1]
        A = x @ x.T
        ref = a * x + (b * A + c * A @ A) @ x                # the exact quintic step, FP64
        errs.append(float((xk - ref).norm() / ref.norm()))
        x = xk
    assert float(out["ns_step"]) == pytest.approx(max(errs), rel=1e-4)
    orth = float((x @ x.T - torch.eye(32, dtype=torch.float64)).norm() / math.sqrt(32))
    assert float(out["ns_orth"]) == pytest.approx(orth, rel=1e-4)
    assert 1e-3 < float(out["ns_step"]) < 0.3
    # FP32 "quantization" of the FP32 iteration: the one-step error vanishes (oracle sanity)
    exact = rs.ns_stats(g, steps=3, coefficients="muon", precision="fp32")
    assert float(exact["ns_step"]) < 1e-5
    assert float(exact["ns_orth"]) == pytest.approx(float(out["ns_orth_fp32"]), rel=1e-5)


# ----------------------------------------------------------------------------- Q-Attn
def _attn_head(sq=80, d=32, seed=0):
    torch.manual_seed(seed)
    q, k, v = torch.randn(sq, d), torch.randn(sq, d) + 0.5, torch.randn(sq, d)
    do = torch.randn(sq, d)
    return q, k, v, do


def test_attn_s_against_q_attn_views_and_unbiased():
    from fullstack_fp4.attention.quant import per_head_view

    q, k, _, _ = _attn_head()
    e2, x2 = rs.attn_s_sums(q, k, torch.arange(q.shape[0]), causal=True)
    ks = k - k.mean(0, keepdim=True)                     # Q-Attn's K-smoothing
    qv, qd = per_head_view(q[None, None], "head_dim")
    kv, kd = per_head_view(ks[None, None], "head_dim")
    s = q @ ks.T
    sq = (qv[0, 0] * qd[0, 0]) @ (kv[0, 0] * kd[0, 0]).T
    keep = torch.ones_like(s).tril().bool()
    want = float((s - sq)[keep].norm() / s[keep].norm())
    assert _ratio((e2, x2)) == pytest.approx(want, rel=1e-5)
    assert 0.05 < want < 0.3
    g = torch.Generator().manual_seed(4)
    rows = 4
    _unbiased(lambda: rs.attn_s_sums(q, k, torch.randint(q.shape[0], (rows,), generator=g))[0],
              float(e2), reps=300, scale=q.shape[0] / rows)


def test_attn_ds_tile_rows_add_up_to_the_full_ds():
    from fullstack_fp4.attention.quant import per_head_view, tile_dequant

    q, k, v, do = _attn_head(sq=80)
    scale = 1 / math.sqrt(q.shape[1])
    ks = k - k.mean(0, keepdim=True)
    qv, qd = per_head_view(q[None, None], "head_dim")
    kv, kd = per_head_view(ks[None, None], "head_dim")
    logits = ((qv[0, 0] * qd[0, 0]) @ (kv[0, 0] * kd[0, 0]).T) * scale
    logits = logits.masked_fill(torch.ones_like(logits).triu(1).bool(), float("-inf"))
    p = torch.softmax(logits, -1)
    o = (p @ v).to(torch.bfloat16).float()
    bf = lambda t: t.to(torch.bfloat16).float()         # noqa: E731
    ds = p * (bf(do) @ bf(v).T - (do * o).sum(-1, keepdim=True))
    dsq = tile_dequant(ds[None, None], "keys")[0, 0]
    want = float((ds - dsq).norm() / ds.norm())
    parts = [rs.attn_ds_sums(q, k, v, o, do, t, scale=scale) for t in range(2)]   # 80 rows: 2 tile rows
    got = float((sum(a for a, _ in parts) / sum(b for _, b in parts)).sqrt())
    assert got == pytest.approx(want, rel=1e-5)
    assert 0.02 < want < 0.4


def test_q_adamw_chunk_phase_equals_zero_prefixed_tensor():
    # A tensor stored from entry 512 of its chunk grid (QAdamW Placement phase, as for a
    # distributed-optimizer piece) encodes exactly as the same tensor after 512 zeros with
    # phase 0 (zeros never raise a chunk amax, and their tile means are 0): the phase-aware
    # chunk sampling must give the same v / clamp sums as the zero-prefixed oracle.
    from fullstack_fp4.optim.q_adamw import QAdamW
    from fullstack_fp4.optim.q_adamw.optimizer import Placement

    torch.manual_seed(5)
    n, ph = 3000, 512
    a = torch.nn.Parameter(torch.randn(n))
    a.q_adamw_place = Placement(0, 0, n, ph)
    b = torch.nn.Parameter(torch.cat([torch.zeros(ph), a.detach()]))
    opts = [QAdamW([p], lr=0.0, betas=(0.9, 0.99), weight_decay=0.0, min_numel=16) for p in (a, b)]
    for _ in range(3):
        g = torch.randn(n) * torch.rand(n)
        a.grad, b.grad = g.clone(), torch.cat([torch.zeros(ph), g])
        for o in opts:
            o.step()
    kw = dict(beta1=0.9, beta2=0.99, eps=1e-8, chunks=ALL)
    sa = rs.q_adamw_sample_sums(opts[0].state[a], a.grad, phase=a.q_adamw_place.chunk_phase(), **kw)
    sb = rs.q_adamw_sample_sums(opts[1].state[b], b.grad, **kw)
    assert float(sa["v"][0]) == pytest.approx(float(sb["v"][0]), rel=1e-6)
    assert float(sa["v"][1]) == pytest.approx(float(sb["v"][1]), rel=1e-6)
    assert float(sa["v_clamped"][0]) == float(sb["v_clamped"][0]) > 0
    assert float(sa["v_clamped"][1]) == n
    # through the collector: it reads the placement off the parameter
    holder = torch.nn.Module()
    holder.a = a
    tel = TelemetryCollector(interval=1, opt_chunks=ALL)
    tel.begin_step(holder, 1, optimizer=opts[0])
    opts[0].step()
    assert tel.end_step()["quant/optimizer/a/v/rel_err"] == pytest.approx(_ratio(sa["v"]), rel=1e-6)


def test_ns_hook_uses_the_optimizers_ns_input_and_leaves_its_state_alone(monkeypatch):
    """... and runs its per-step NS calls eagerly when the optimizer graphs its NS (each (k,
    schedule) variant would otherwise be captured and kept): only the optimizer's own NS goes
    through newton_schulz_graphed."""
    import fullstack_fp4.optim.muon as muon_mod
    from fullstack_fp4.optim import Muon

    graphed = []
    real = muon_mod.newton_schulz_graphed
    monkeypatch.setattr(muon_mod, "newton_schulz_graphed",
                        lambda d, **k: graphed.append(k["steps"]) or real(d, **k))
    torch.manual_seed(6)
    mk = lambda: torch.nn.Parameter(torch.randn(32, 48) * 0.1)   # noqa: E731
    w, w_ref = mk(), None
    w_ref = torch.nn.Parameter(w.detach().clone())
    kw = dict(lr=0.02, momentum=0.9, nesterov=True, ns_steps=2, ns_precision="nvfp4", ns_coefficients="muon")
    opt, ref = Muon([w], ns_cuda_graph=True, **kw), Muon([w_ref], **kw)
    g0, g1 = torch.randn(32, 48), torch.randn(32, 48)
    for p, o in ((w, opt), (w_ref, ref)):
        p.grad = g0.clone()
        o.step()
        p.grad = g1.clone()
    buf = g0 * (1 - 0.9)                                     # Muon's momentum after step 1
    buf = buf + (g1 - buf) * (1 - 0.9)                       # lerp(g, 1 - mu) at step 2
    d = g1 + (buf - g1) * 0.9                                # Nesterov: g.lerp(buf, mu)
    want = rs.ns_stats(d, steps=2, coefficients="muon", precision="nvfp4")
    holder = torch.nn.Module()
    holder.w = w
    tel = TelemetryCollector(interval=1)
    tel.begin_step(holder, 1, optimizer=opt)
    graphed.clear()
    opt.step()
    ref.step()
    out = tel.end_step()
    assert graphed == [2]                                    # the step's NS only, not the probe's
    for k in ("ns_step", "ns_orth", "ns_orth_fp32"):
        assert out[f"quant/optimizer/w/{k}/rel_err"] == pytest.approx(float(want[k]), rel=1e-4), k
    torch.testing.assert_close(w, w_ref, rtol=0, atol=0)    # the probe changed nothing
    torch.testing.assert_close(opt.state[w]["momentum_buffer"], ref.state[w_ref]["momentum_buffer"],
                               rtol=0, atol=0)
