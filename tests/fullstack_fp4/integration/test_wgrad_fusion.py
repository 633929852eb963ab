"""Gradient-accumulation fusion (`parallel.gradient_accumulation_fusion`) inside megatron-core's
DDP, in process on CPU (tiny GPTModel, gloo, one process): the NVFP4 / LoRA-SVD wgrad is added
into `weight.main_grad` by the backward, and DDP's hook does not add it again.

Oracles, independent of the fused path:
  main_grad   main_grad before the backward + the FP32 wgrad of the unfused function path
              (`nvfp4_linear_forward` / `nvfp4_linear_backward` with `w_dtype=float32`: acc·alpha,
              before any rounding to W's dtype), same stochastic-rounding draws (the global RNG
              seeded alike), rounded once to main_grad's dtype: bit for bit.
  unfused     main_grad before + the unfused dW in W's dtype (DDP's `main_grad.add_(grad)`).
  training    the same run with the fusion off: identical losses in FP32 (dW in FP32 *is*
              acc·alpha), within BF16 rounding in BF16 (the only difference is dW's rounding).
"""
from __future__ import annotations

import functools

import pytest
import torch

from fullstack_fp4.linear.nvfp4_linear import nvfp4_linear_backward, nvfp4_linear_forward
from megatron.training.config import ConfigError, load_config
from tests.megatron.training import helpers

TINY = ["model.preset=tiny", "model.seq_length=32", "model.vocab_size=256", "data.mock=true",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_iters=1",
        "logging.tensorboard=false", "checkpoint.load=none", "train.iters=8",
        "optimizer.lr=3e-3", "optimizer.warmup_iters=0"]
NVFP4 = ["fp4.linear=nvfp4"]
LORA = ["fp4.linear=lora_svd", "fp4.lora_svd.rank=4", "fp4.lora_svd.realign_interval=1000"]
# (train.precision, parallel.grad_reduce_in_fp32): FP32 params; BF16 params with an FP32 or a
# BF16 grad buffer
LAYOUTS = {"fp32": ("fp32", True), "bf16": ("bf16", True), "bf16_buffer": ("bf16", False)}
LAYERS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
          "mlp.linear_fc2")

_dist = pytest.fixture(scope="module", autouse=True)(helpers.in_process_megatron)
# The fused result against the two-pass sum (acc·alpha rounded, then added), bit for bit: what
# the CPU path computes. On CUDA cuBLASLt adds the wgrad itself (beta = 1) and may round
# acc·alpha + main_grad once (fullstack_fp4/nvfp4/gemm.py), so these are CPU statements.
_TWO_PASS = helpers.cpu_path_oracle(
    "main_grad against the two-pass sum bit for bit; on CUDA cuBLASLt adds the wgrad itself "
    "(beta = 1) and may round acc·alpha + main_grad once (fullstack_fp4/nvfp4/gemm.py)")


def _cfg(*overrides):
    cfg = load_config(None, TINY + list(overrides))
    cfg.logging.dir = None
    return cfg


@functools.lru_cache(maxsize=None)
def _trainer(*overrides):
    """One Trainer per configuration for the whole module (each test resets its grad buffers)."""
    from megatron.training.trainer import Trainer

    return Trainer(_cfg(*overrides), verbose=False)


def _layout(name):
    precision, fp32_buffer = LAYOUTS[name]
    return [f"train.precision={precision}", f"parallel.grad_reduce_in_fp32={str(fp32_buffer).lower()}"]


def _layer(trainer, suffix, index=1):
    return next(m for n, m in trainer.model.named_modules()
                if n.endswith(f"decoder.layers.{index}.{suffix}"))


def _input(layer, seed, tokens=(8, 2)):
    """x [s, b, in] and dy [s, b, out] in the weight's dtype (what Float16Module feeds it)."""
    g = torch.Generator().manual_seed(seed)
    out_f, in_f = layer.weight.shape
    w = layer.weight
    return (torch.randn(*tokens, in_f, generator=g).to(w),
            torch.randn(*tokens, out_f, generator=g).to(w))


def _fresh_main_grad(trainer, layer, seed):
    """Zero the buffers as a step does (flags reset), then give this layer's main_grad nonzero
    contents so that the sum is tested, not a copy. Returns them."""
    trainer.model.zero_grad_buffer()
    mg = layer.weight.main_grad
    mg.copy_(torch.randn(mg.shape, generator=torch.Generator().manual_seed(seed)) * 1e-2)
    return mg.clone()


def _layer_backward(layer, x, dy, seed):
    torch.manual_seed(seed)          # the SR draws of the backward come from the global RNG
    y, _ = layer(x.clone().requires_grad_())
    y.backward(dy)


def _fp32_wgrad(weight, x, dy, seed):
    """The unfused function path's wgrad in FP32 (acc·alpha, never rounded to W's dtype)."""
    torch.manual_seed(seed)
    w = weight.detach()
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    _, qw, qxt = nvfp4_linear_forward(x2, w, True, True)
    _, dw = nvfp4_linear_backward(dy2, qw, qxt, x.dtype, torch.float32)
    return dw


# ------------------------------------------------------------------------------ config
def test_config_key_defaults_to_true_and_reaches_the_layers():
    assert load_config(None, TINY).parallel.gradient_accumulation_fusion is True
    assert load_config(None, TINY + ["parallel.gradient_accumulation_fusion=false"]) \
        .parallel.gradient_accumulation_fusion is False
    with pytest.raises(ConfigError, match="gradient_accumulation_fusion"):
        load_config(None, TINY + ["parallel.gradient_accumulation_fusion=sometimes"])
    for recipe in (NVFP4, LORA):
        for on, key in ((True, ()), (False, ("parallel.gradient_accumulation_fusion=false",))):
            tr = _trainer(*recipe, *_layout("bf16"), *key)     # on: the default, no key given
            mods = [_layer(tr, s, i) for s in LAYERS for i in range(4)]
            assert all(m.fuse_wgrad_accumulation is on for m in mods)
            # megatron's own fusion (apex) stays off everywhere, also in our layers' fallback path
            assert all(m.gradient_accumulation_fusion is False for m in tr.model.modules()
                       if hasattr(m, "gradient_accumulation_fusion"))


# ------------------------------------------------------------------- NVFP4 layers, fused
@_TWO_PASS
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("suffix", ["mlp.linear_fc1", "self_attention.linear_proj"])
def test_fused_main_grad_is_the_fp32_wgrad_added_once(layout, suffix, monkeypatch):
    """Column- and row-parallel: after one backward main_grad = before + FP32 wgrad, rounded once
    to main_grad's dtype, bit for bit; the flag is set, autograd's placeholder is dropped by the
    hook and not added: it is filled with a sentinel here (torch.empty may hand out zeros,
    whose addition would not show)."""
    from fullstack_fp4.integration.nvfp4_linear_layers import MainGradAccumulator

    real = MainGradAccumulator.accumulated
    monkeypatch.setattr(MainGradAccumulator, "accumulated", lambda self: real(self).fill_(1e3))
    tr = _trainer(*NVFP4, *_layout(layout))
    layer = _layer(tr, suffix)
    w = layer.weight
    assert w.main_grad.dtype == (torch.float32 if LAYOUTS[layout][1] else torch.bfloat16)
    before = _fresh_main_grad(tr, layer, 1)
    assert w.grad_added_to_main_grad is False
    x, dy = _input(layer, 2)
    _layer_backward(layer, x, dy, 3)
    want = (before.float() + _fp32_wgrad(w, x, dy, 3)).to(w.main_grad.dtype)
    assert torch.equal(w.main_grad, want)
    assert w.grad_added_to_main_grad is True
    assert w.grad is None             # the hook ran and dropped the placeholder
    tr.model.zero_grad_buffer()       # what the next step does: flag reset, buffer zeroed
    assert w.grad_added_to_main_grad is False and not w.main_grad.any()


@_TWO_PASS
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_micro_batches_accumulate_twice(layout):
    """The flag stays set across micro-batches (DDP resets it once per step): the second
    backward adds again, onto the rounded first sum."""
    tr = _trainer(*NVFP4, *_layout(layout))
    layer = _layer(tr, "mlp.linear_fc2")
    w = layer.weight
    before = _fresh_main_grad(tr, layer, 4)
    (x1, dy1), (x2, dy2) = _input(layer, 5), _input(layer, 6)
    _layer_backward(layer, x1, dy1, 7)
    _layer_backward(layer, x2, dy2, 8)
    dtype = w.main_grad.dtype
    once = (before.float() + _fp32_wgrad(w, x1, dy1, 7)).to(dtype)
    assert torch.equal(w.main_grad, (once.float() + _fp32_wgrad(w, x2, dy2, 8)).to(dtype))
    assert w.grad_added_to_main_grad is True and w.grad is None


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_unfused_is_the_old_behaviour(layout):
    """Fusion off: the backward returns dW in W's dtype and DDP's hook adds it (flag unset)."""
    tr = _trainer(*NVFP4, *_layout(layout), "parallel.gradient_accumulation_fusion=false")
    layer = _layer(tr, "mlp.linear_fc1")
    w = layer.weight
    before = _fresh_main_grad(tr, layer, 9)
    x, dy = _input(layer, 10)
    _layer_backward(layer, x, dy, 11)
    dw = _fp32_wgrad(w, x, dy, 11).to(w.dtype)      # the unfused path's dW, as returned
    # the hook's main_grad.add_(dW): one rounding of the sum to main_grad's dtype
    assert torch.equal(w.main_grad, (before.float() + dw.float()).to(w.main_grad.dtype))
    assert w.grad_added_to_main_grad is False and w.grad is None


def test_no_fusion_without_megatron_main_grad_or_in_evaluation():
    """The same layer class outside DDP (no main_grad) returns dW to autograd; under no_grad the
    forward asks for nothing."""
    from fullstack_fp4.integration.nvfp4_linear_layers import main_grad_accumulator

    w = torch.nn.Parameter(torch.randn(16, 16))
    assert main_grad_accumulator(w, True) is None               # no main_grad attribute
    w.main_grad = torch.zeros(16, 16)
    assert main_grad_accumulator(w, True) is None               # no DDP flag either
    w.grad_added_to_main_grad = False
    assert main_grad_accumulator(w, True) is not None
    assert main_grad_accumulator(w, False) is None
    with torch.no_grad():
        assert main_grad_accumulator(w, True) is None
    w.requires_grad_(False)
    assert main_grad_accumulator(w, True) is None


# --------------------------------------------------------------------- LoRA-SVD W_res
@_TWO_PASS
@pytest.mark.parametrize("layout", ["fp32", "bf16"])
def test_lora_svd_dense_route_fuses_w_res(layout):
    """W_res's wgrad under the dense route is the NVFP4 wgrad of (x, W_res): fused like the
    NVFP4 layer's, bit for bit; L1's zero gradient still goes through the hook."""
    tr = _trainer(*LORA, *_layout(layout))
    layer = _layer(tr, "mlp.linear_fc1")
    w, l1 = layer.weight, layer.lora_l1
    before = _fresh_main_grad(tr, layer, 12)
    x, dy = _input(layer, 13)
    _layer_backward(layer, x, dy, 14)
    assert torch.equal(w.main_grad, (before.float() + _fp32_wgrad(w, x, dy, 14)).to(w.main_grad.dtype))
    assert w.grad_added_to_main_grad is True and w.grad is None
    assert l1.grad_added_to_main_grad is False and not l1.main_grad.any()


def test_lora_svd_projected_route_stays_unfused():
    """The projected route rewrites the wgrad (G_q − Q QᵀG_q): its W_res gradient is returned and
    added by the hook, unfused (oracle: the functional LoRA-SVD linear on copies, same draws)."""
    from fullstack_fp4.linear.lora_svd import lora_svd_linear

    tr = _trainer(*LORA, "fp4.lora_svd.route=projected", *_layout("fp32"))
    layer = _layer(tr, "mlp.linear_fc1")
    w = layer.weight
    assert layer.fuse_wgrad_accumulation is True
    before = _fresh_main_grad(tr, layer, 15)
    x, dy = _input(layer, 16)
    _layer_backward(layer, x, dy, 17)
    torch.manual_seed(17)
    wc = w.detach().clone().requires_grad_()
    # x needs its gradient too: dY's draws for dX come before RHT(dYᵀ)'s for the wgrad
    lora_svd_linear(x.clone().requires_grad_(), wc, layer.lora_l1.detach().clone().requires_grad_(),
                    layer.lora_l2, layer.lora_beta, route="projected").backward(dy)
    assert torch.equal(w.main_grad, before + wc.grad)
    assert w.grad_added_to_main_grad is False


# ------------------------------------------------------------------------ training steps
def _losses(*overrides, steps=3):
    from megatron.training.trainer import Trainer

    tr = Trainer(_cfg(*overrides), verbose=False)
    return [tr.train_step() for _ in range(steps)], [p.detach().clone() for p in tr.model.parameters()]


@_TWO_PASS
@pytest.mark.parametrize("recipe", ["nvfp4", "lora_svd"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_steps_with_and_without_fusion(recipe, precision):
    """Three optimizer steps of two micro-batches each. FP32: the fused and unfused runs are the
    same bits (losses, grad norms, parameters). BF16: they differ only by the BF16 rounding of dW
    before it was added, so the losses agree to a small tolerance."""
    extra = (NVFP4 if recipe == "nvfp4" else LORA) + [f"train.precision={precision}"]
    (fused, p_fused) = _losses(*extra, "parallel.gradient_accumulation_fusion=true")
    (unfused, p_unfused) = _losses(*extra, "parallel.gradient_accumulation_fusion=false")
    if precision == "fp32":
        assert fused == unfused
        assert all(torch.equal(a, b) for a, b in zip(p_fused, p_unfused))
    else:
        for (lf, _), (lu, _) in zip(fused, unfused):
            assert abs(lf - lu) <= 2e-3 * abs(lu), (fused, unfused)
        # first step, same parameters: the gradients differ by dW's BF16 rounding only (later
        # grad norms drift further apart with the parameters at this lr)
        assert abs(fused[0][1] - unfused[0][1]) <= 1e-3 * abs(unfused[0][1]), (fused, unfused)
        assert fused != unfused     # the fused run did take the other (once-rounded) path
