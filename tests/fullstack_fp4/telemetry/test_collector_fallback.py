"""Collector hooks (names, values, zero hooks when off) and the BF16 fallback on real NVFP4 layers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fullstack_fp4.nvfp4 import dequantize, quantize
from fullstack_fp4.telemetry import (FallbackPolicy, TelemetryCollector, fallback_state, rel_err,
                                     restore_fallback_state)


class FakeNVFP4(torch.nn.Linear):
    def _nvfp4_forward_impl(self):  # marker only: the collector finds modules by duck typing
        pass


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.plain = FakeNVFP4(32, 48), FakeNVFP4(48, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.plain(self.fc2(self.fc1(x)))


def _hooks(net):
    return sum(len(m._forward_hooks) for m in net.modules())


def test_collector_names_values_and_zero_cost_when_off():
    torch.manual_seed(0)
    net = torch.nn.Module()
    net.module = Net()                     # a wrapper prefix, stripped from the names
    tel = TelemetryCollector(interval=10, blocks=10**6)
    assert not tel.begin_step(net, 5) and _hooks(net) == 0 and tel.end_step() == {}
    x = torch.randn(4, 8, 32, requires_grad=True)
    assert tel.begin_step(net, 20) and _hooks(net) == 2
    ys = {}
    net.module.fc1.register_forward_hook(lambda m, a, o: ys.setdefault("h1", o))
    net.module(x).sum().backward()
    out = tel.end_step()
    assert _hooks(net) == 1                # only the test's own hook remains
    assert set(out) == {f"quant/{p}/{t}/rel_err" for p in ("fc1", "fc2")
                        for t in ("x", "w", "dy", "wgrad_x", "wgrad_dy")}
    # blocks >= N: exact full-tensor values for x and w (nearest rounding)
    want_x = rel_err(x, dequantize(quantize(x.detach())))
    want_w = rel_err(net.module.fc1.weight, dequantize(quantize(net.module.fc1.weight.detach(), tile=(16, 16))))
    assert out["quant/fc1/x/rel_err"] == pytest.approx(float(want_x), rel=1e-5)
    assert out["quant/fc1/w/rel_err"] == pytest.approx(float(want_w), rel=1e-5)
    assert 0.02 < out["quant/fc1/dy/rel_err"] < 0.5   # stochastic rounding: a noisy, bounded error
    # two micro-batches accumulate sums (ratio of sums) and weights are sampled once per step
    tel.begin_step(net, 30)
    a, b = torch.randn(2, 32), 100 * torch.randn(2, 32)
    net.module(a)
    net.module(b)
    o = tel.end_step()
    ab = torch.cat([a, b])
    e2 = sum((t - dequantize(quantize(t))).pow(2).sum() for t in (a, b))
    assert o["quant/fc1/x/rel_err"] == pytest.approx(float((e2 / ab.pow(2).sum()).sqrt()), rel=1e-5)
    tel.record("qadamw/v/rel_err", 0.5)
    assert tel.end_step() == {"qadamw/v/rel_err": 0.5}


# ------------------------------------------------------------------------ scale rules
class FakeLoRA(torch.nn.Linear):
    def __init__(self, i, o, r=4):
        super().__init__(i, o)
        self.lora_l1 = torch.nn.Parameter(torch.randn(r, i))
        self.lora_l2 = torch.nn.Parameter(torch.randn(o, r), requires_grad=False)
        self.lora_beta = 0.5

    def _lora_forward_impl(self):  # marker only, as FakeNVFP4
        pass


def _ref_rel_err(t, rule, *, tile=(1, 16), rounding="nearest", rand=None):
    """‖t − Q(t)‖/‖t‖ with the reference quantizer at t's own amax under ``rule``."""
    from fullstack_fp4.nvfp4.reference import quantize_reference

    q = quantize_reference(t, tile=tile, rounding=rounding, rand=rand, scale_rule=rule)
    return float(rel_err(t, dequantize(q)))


def _ref_wgrad_rel_err(m, rule, rand=None):
    """The same for the wgrad operand RHT16(mᵀ) (T a multiple of 16), in the original basis."""
    from fullstack_fp4.nvfp4 import DEFAULT_SIGNS, hadamard16, inverse_hadamard16
    from fullstack_fp4.nvfp4.reference import quantize_reference

    mt = m.t().contiguous()
    q = quantize_reference(hadamard16(mt, DEFAULT_SIGNS), rand=rand, scale_rule=rule,
                           rounding="nearest" if rand is None else "stochastic")
    return float(rel_err(mt, inverse_hadamard16(dequantize(q).float(), DEFAULT_SIGNS)))


def test_collector_measures_each_operand_with_its_scale_rule(monkeypatch):
    """A linear with ``scale_rule`` 4over6 on x only: x and wgrad_x are measured with 4over6, w,
    dy and wgrad_dy with the 6 rule (every block sampled: exact full-tensor values; the
    stochastic-rounding uniforms are the ones the collector drew). A LoRA-SVD linear with
    ``lora_scale_rule`` 4over6 on w: w_res with 4over6, x with 6."""
    import fullstack_fp4.telemetry.collector as col
    from fullstack_fp4.linear.nvfp4_linear import ScaleRules

    calls = []
    real = col.qdq_rows

    def spy(x, gam, **kw):
        calls.append((x, kw))
        return real(x, gam, **kw)

    monkeypatch.setattr(col, "qdq_rows", spy)
    torch.manual_seed(1)
    fc = FakeNVFP4(32, 48)
    fc.scale_rule = ScaleRules(x="4over6")
    x = torch.randn(64, 32) * torch.exp(torch.randn(64, 1))
    net = torch.nn.Module()
    net.fc = fc
    tel = TelemetryCollector(interval=1, blocks=10**6)
    assert tel.begin_step(net, 1)
    y = fc(x)
    grads = {}
    y.register_hook(lambda g: grads.setdefault("dy", g.detach().clone()))
    (y * torch.randn_like(y) * 3).sum().backward()
    out = tel.end_step()
    g = grads["dy"]

    # the uniforms of dY and RHT(dYᵀ): each kind is one sample here (one module)
    sr = {kw["rht_signs"] is not None: (xs, kw["rand"]) for xs, kw in calls if kw["rounding"] == "stochastic"}
    xs, u_dy = sr[False]
    assert torch.equal(xs, g.reshape(-1, 16))                      # every block, in order
    xs, u_wdy = sr[True]
    assert torch.equal(xs.reshape(g.shape[1], -1), g.t())          # blocks of dYᵀ before the RHT
    u_dy, u_wdy = u_dy.reshape(g.shape), u_wdy.reshape(g.t().shape)

    want = {"x": (_ref_rel_err(x, "4over6"), _ref_rel_err(x, "6")),
            "wgrad_x": (_ref_wgrad_rel_err(x, "4over6"), _ref_wgrad_rel_err(x, "6")),
            "w": (_ref_rel_err(fc.weight.detach(), "6", tile=(16, 16)),
                  _ref_rel_err(fc.weight.detach(), "4over6", tile=(16, 16))),
            "dy": (_ref_rel_err(g, "6", rounding="stochastic", rand=u_dy),
                   _ref_rel_err(g, "4over6", rounding="stochastic", rand=u_dy)),
            "wgrad_dy": (_ref_wgrad_rel_err(g, "6", rand=u_wdy), _ref_wgrad_rel_err(g, "4over6", rand=u_wdy))}
    for t, (right, other) in want.items():
        assert out[f"quant/fc/{t}/rel_err"] == pytest.approx(right, rel=1e-5), t
        assert other != pytest.approx(right, rel=1e-3), t          # the other rule is told apart

    lora = FakeLoRA(32, 48)
    lora.lora_scale_rule = ScaleRules(w="4over6")
    net.lora = lora
    assert tel.begin_step(net, 2)
    with torch.no_grad():
        lora(x)
    out = tel.end_step()
    w = lora.weight.detach()
    got = out["quant/lora/w_res/rel_err"]
    assert got == pytest.approx(_ref_rel_err(w, "4over6", tile=(16, 16)), rel=1e-5)
    assert _ref_rel_err(w, "6", tile=(16, 16)) != pytest.approx(got, rel=1e-3)
    assert out["quant/lora/x/rel_err"] == pytest.approx(_ref_rel_err(x, "6"), rel=1e-5)


# ------------------------------------------------------------------------ real NVFP4 layers
@pytest.fixture(scope="module")
def gpt():
    from megatron.training.config import load_config
    from megatron.training.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = load_config(None, ["model.preset=tiny", "model.seq_length=32", "model.vocab_size=256",
                             "data.mock=true", "train.global_batch_size=4", "train.micro_batch_size=2",
                             "train.eval_iters=1", "logging.tensorboard=false", "checkpoint.load=none",
                             "fp4.linear=nvfp4", "train.precision=fp32"])
    cfg.logging.dir = None
    yield Trainer(cfg, verbose=False)
    torch.set_num_threads(threads)
    from megatron.training.initialize import shutdown
    shutdown()


def test_telemetry_on_tiny_gpt_and_forced_fallback(gpt):
    from fullstack_fp4.integration.nvfp4_linear_layers import (NVFP4ColumnParallelLinear,
                                                               NVFP4RowParallelLinear,
                                                               switch_module_to_bf16)

    tel = TelemetryCollector(interval=1, blocks=16)
    tel.begin_step(gpt.model, 1)
    gpt.model.zero_grad_buffer()
    loss = gpt._run_schedule(gpt.train_ds, 0, forward_only=False)
    stats = tel.end_step()
    assert loss is not None
    qkv = "decoder.layers.0.self_attention.linear_qkv"
    for t in ("x", "w", "dy"):
        assert 0 < stats[f"quant/{qkv}/{t}/rel_err"] < 0.5
    n_fp4 = sum(hasattr(m, "_nvfp4_forward_impl") for m in gpt.model.modules())
    assert n_fp4 >= 4 and len(stats) == 5 * n_fp4

    # forced error spike on one module for k intervals -> that module, and only it, switches
    policy = FallbackPolicy("bf16", threshold=0.3, k_intervals=2, switch_fn=switch_module_to_bf16)
    spiked = dict(stats)
    spiked[f"quant/{qkv}/x/rel_err"] = 0.9
    assert policy.observe(gpt.model, spiked) == []
    ev = policy.observe(gpt.model, spiked)
    assert ev == [{"module": qkv, "rel_err": 0.9, "action": "bf16", "recipe": "linear", "tensor": "x",
                   "threshold": 0.3}]
    assert policy.observe(gpt.model, spiked) == []          # logged once
    mods = dict(gpt.model.named_modules())
    layer = next(m for n, m in mods.items() if n.endswith(qkv))
    assert isinstance(layer, NVFP4ColumnParallelLinear) and layer.fp4_fallback_bf16
    x = torch.randn(8, 2, layer.weight.shape[1]).to(layer.weight)    # the model's device
    y, _ = layer(x)
    ref = F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)  # plain high-precision GEMM
    # a module not switched still runs NVFP4 (differs from F.linear)
    proj = next(m for n, m in mods.items() if n.endswith("layers.0.self_attention.linear_proj"))
    assert isinstance(proj, NVFP4RowParallelLinear)
    xp = torch.randn(8, 2, proj.weight.shape[1]).to(proj.weight)
    assert not torch.allclose(proj(xp)[0], F.linear(xp, proj.weight))
    # telemetry skips modules in fallback
    tel.begin_step(gpt.model, 2)
    gpt._run_schedule(gpt.train_ds, 0, forward_only=True)
    assert not any(qkv in k for k in tel.end_step())

    # checkpoint round trip: state -> (torch.save in checkpoint extra) -> fresh flags restored
    state = {"fallback": fallback_state(gpt.model), "policy": policy.state_dict()}
    assert state["fallback"] == {"bf16_modules": [qkv]}
    import io
    buf = io.BytesIO()
    torch.save(state, buf)
    layer.fp4_fallback_bf16 = False                         # a "fresh" model on resume
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert restore_fallback_state(gpt.model, loaded["fallback"], switch_module_to_bf16) == [qkv]
    assert layer.fp4_fallback_bf16 and not getattr(proj, "fp4_fallback_bf16", False)
    p2 = FallbackPolicy("bf16", threshold=0.3, k_intervals=2, switch_fn=switch_module_to_bf16)
    p2.load_state_dict(loaded["policy"])
    assert p2.observe(gpt.model, spiked) == []              # already triggered: not again
    with pytest.raises(KeyError):
        restore_fallback_state(gpt.model, {"bf16_modules": ["no.such.module"]}, switch_module_to_bf16)
    with pytest.raises(TypeError):
        switch_module_to_bf16(torch.nn.Linear(2, 2))
    layer.fp4_fallback_bf16 = False


def test_real_linear_scale_rule_reaches_the_telemetry(gpt):
    """The NVFP4 parallel linear's own ``scale_rule`` (a ``ScaleRules``) is what the collector
    reads: x of one layer with 4over6 is measured with 4over6 (summed over the micro-batches,
    each with its own tensor amax), its W with the 6 rule."""
    from fullstack_fp4.linear.nvfp4_linear import ScaleRules
    from fullstack_fp4.nvfp4.reference import quantize_reference
    from fullstack_fp4.telemetry import module_path

    fc1 = "decoder.layers.0.mlp.linear_fc1"
    layer = next(m for n, m in gpt.model.named_modules() if module_path(n) == fc1)
    assert layer.scale_rule == ScaleRules()                 # the config's default, 6 everywhere
    xs = []
    h = layer.register_forward_hook(lambda m, a, o: xs.append(a[0].detach().clone()))
    layer.scale_rule = ScaleRules(x="4over6")
    try:
        tel = TelemetryCollector(interval=1, blocks=10**6)
        tel.begin_step(gpt.model, 1)
        gpt._run_schedule(gpt.train_ds, 0, forward_only=True)
        out = tel.end_step()
    finally:
        layer.scale_rule = ScaleRules()
        h.remove()
    assert len(xs) >= 2                                      # micro-batches

    def err(ts, rule, tile=(1, 16)):
        e2 = sum(float((t - dequantize(quantize_reference(t, tile=tile, scale_rule=rule))).pow(2).sum())
                 for t in ts)
        return (e2 / sum(float(t.pow(2).sum()) for t in ts)) ** 0.5

    assert out[f"quant/{fc1}/x/rel_err"] == pytest.approx(err(xs, "4over6"), rel=1e-5)
    assert err(xs, "6") != pytest.approx(err(xs, "4over6"), rel=1e-3)
    w = layer.weight.detach().float()
    assert out[f"quant/{fc1}/w/rel_err"] == pytest.approx(err([w], "6", (16, 16)), rel=1e-5)
    assert err([w], "4over6", (16, 16)) != pytest.approx(err([w], "6", (16, 16)), rel=1e-3)


def test_policy_warn_mode_and_reset():
    p = FallbackPolicy("warn", threshold=0.1, k_intervals=2)
    assert p.observe(None, {"quant/a/x/rel_err": 0.2}) == []
    assert p.observe(None, {"quant/a/x/rel_err": 0.05}) == []   # not consecutive: reset
    assert p.observe(None, {"quant/a/x/rel_err": 0.2}) == []
    assert p.observe(None, {"quant/a/w/rel_err": float("nan")}) == [
        {"module": "a", "rel_err": float("inf"), "action": "warn", "recipe": None, "tensor": "w",
         "threshold": 0.1}]
    assert FallbackPolicy("off", 0.1).observe(None, {"quant/a/x/rel_err": 9.0}) == []
    with pytest.raises(ValueError):
        FallbackPolicy("bf16", 0.1)
