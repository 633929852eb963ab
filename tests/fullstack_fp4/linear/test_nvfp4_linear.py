"""NVFP4 linear: forward == the dequantized-operand product; gradients unbiased and close.

Oracles: FP64 products of dequantized operands (forward; expected gradients), FP64 products
of the unquantized operands (the "BF16 gradient", computed in higher precision).
"""

import pytest
import torch
import torch.nn.functional as F

from fullstack_fp4.linear import nvfp4_linear, quantize_wgrad_operand
from fullstack_fp4.nvfp4 import hadamard16, inverse_hadamard16, quantize


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _data(t, fin, fout, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, fin, generator=g)
    w = torch.randn(fout, fin, generator=g) / fin ** 0.5
    dy = torch.randn(t, fout, generator=g)
    return x, w, dy


def test_forward_equals_dequantized_product_and_megatron_shape():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, 64, generator=g)        # [s, b, h]
    w = torch.randn(48, 64, generator=g)
    b = torch.randn(48, generator=g)
    y = nvfp4_linear(x, w, b)
    assert y.shape == (6, 4, 48) and y.dtype == torch.float32
    xq = quantize(x.reshape(24, 64)).dequantize(torch.float64)
    wq = quantize(w, tile=(16, 16)).dequantize(torch.float64)
    ref = (xq @ wq.T + b.double()).reshape(6, 4, 48)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4)
    # BF16 activations give BF16 output.
    assert nvfp4_linear(x.bfloat16(), w.bfloat16()).dtype == torch.bfloat16


def _grads(x, w, dy, gen):
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = nvfp4_linear(xx, ww, generator=gen)
    return torch.autograd.grad(y, (xx, ww), dy)


def test_gradients_unbiased_over_stochastic_rounding_draws():
    # T = 40 is not a multiple of 16: exercises the zero-padding of the wgrad token blocks.
    x, w, dy = _data(40, 32, 48, 1)
    gen = torch.Generator().manual_seed(2)
    n = 300
    dxs, dws = zip(*(_grads(x, w, dy, gen) for _ in range(n)))
    dxs, dws = torch.stack(dxs).double(), torch.stack(dws).double()

    # Exact expectation of SR: E[x̂] = clamp(y, ±6) · s · dec with the (rounding-independent)
    # scales, i.e. the input itself except for block maxima clamped when the E4M3 scale
    # rounds down (the format's only bias).
    def sr_mean(m):
        q = quantize(m)  # nearest: same scales as SR
        s = q.block_scale.double().repeat_interleave(16, dim=-1) * q.tensor_scale.double()
        return torch.clamp(m.double() / s, -6, 6) * s

    # dgrad: E[dX] = E[dY^] @ W^ (W^ the 16x16-quantized weight of the forward).
    wq = quantize(w, tile=(16, 16)).dequantize(torch.float64)
    e_dx = sr_mean(dy) @ wq
    # wgrad: E[dW] = E[RHT(dYᵀ)^] @ RHT(xᵀ)^ᵀ (RHT along tokens, zero-padded to 48).
    pad = lambda m: F.pad(m, (0, 0, 0, 8))  # noqa: E731
    a = hadamard16(pad(dy).t())
    xt = quantize(hadamard16(pad(x).t())).dequantize(torch.float64)
    e_dw = sr_mean(a) @ xt.T

    for d, e in ((dxs, e_dx), (dws, e_dw)):
        mean, sem = d.mean(0), d.std(0) / n ** 0.5
        # Per element: within 5 standard errors (+ FP32 accumulation slack).
        assert ((mean - e).abs() <= 5 * sem + 1e-5 * e.abs().max()).all()
        # In aggregate the averaged error shrinks like 1/sqrt(n): single draw vs mean.
        assert rel(mean, e) < 0.25 * rel(d[0], e)
    # The expectations themselves are close to the unquantized gradients (nearest-rounded
    # forward operands: ~10% relative per operand).
    assert rel(e_dx, dy.double() @ w.double()) < 0.15
    assert rel(e_dw, dy.double().T @ x.double()) < 0.15


def test_single_draw_gradients_close_to_high_precision():
    x, w, dy = _data(256, 128, 96, 3)
    dx, dw = _grads(x.bfloat16(), w.bfloat16(), dy.bfloat16(), torch.Generator().manual_seed(4))
    assert dx.dtype == dw.dtype == torch.bfloat16
    rx, rw = rel(dx, dy.double() @ w.double()), rel(dw, dy.double().T @ x.double())
    # Two NVFP4 operands, one with SR (~13%) and one nearest (~10%): about 15-20% relative.
    assert 0.05 < rx < 0.25 and 0.05 < rw < 0.25, (rx, rw)


def test_wgrad_rht_cancels():
    # Without quantization error the RHT would be invisible: RHT(dYᵀ) RHT(xᵀ)ᵀ = dYᵀ x.
    x, _, dy = _data(40, 32, 48, 5)
    a = inverse_hadamard16(hadamard16(F.pad(dy, (0, 0, 0, 8)).t().double()))
    assert torch.allclose(hadamard16(F.pad(dy, (0, 0, 0, 8)).t().double())
                          @ hadamard16(F.pad(x, (0, 0, 0, 8)).t().double()).T,
                          dy.double().T @ x.double(), atol=1e-10)
    assert torch.allclose(a[:, :40].T, dy.double(), atol=1e-12)
    q = quantize_wgrad_operand(x, rounding="nearest")
    assert q.shape == (32, 48)


def test_bias_grad_reproducibility_and_saved_tensors_are_quantized():
    x, w, dy = _data(32, 64, 32, 6)
    b = torch.randn(32)
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    xx, ww, bb = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = nvfp4_linear(xx, ww, bb, generator=torch.Generator().manual_seed(7))
    # Only packed codes, E4M3 scales and 0-dim FP32 tensor scales: no full-size float copies.
    assert saved and all(d in (torch.uint8, torch.float8_e4m3fn) or n == 1 for d, n in saved)
    y.backward(dy)
    assert torch.allclose(bb.grad, dy.sum(0), rtol=1e-6)
    g1 = (xx.grad.clone(), ww.grad.clone())
    xx.grad = ww.grad = None
    nvfp4_linear(xx, ww, bb, generator=torch.Generator().manual_seed(7)).backward(dy)
    assert torch.equal(g1[0], xx.grad) and torch.equal(g1[1], ww.grad)


def test_amax_reduce_hook_sets_the_tensor_scale():
    x, w, dy = _data(16, 32, 16, 8)
    seen = []

    def reduce(a):
        seen.append(a.item())
        return a * 2  # stands in for an all-reduce MAX over a TP group with a larger amax

    y = nvfp4_linear(x, w, amax_reduce=reduce)
    ref = (quantize(x, global_amax=2 * x.abs().max()).dequantize(torch.float64)
           @ quantize(w, tile=(16, 16), global_amax=2 * w.abs().max()).dequantize(torch.float64).T)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)
    assert seen[:2] == [x.abs().max().item(), w.abs().max().item()]


def test_shape_errors():
    with pytest.raises(ValueError):
        nvfp4_linear(torch.randn(4, 32), torch.randn(16, 48))
    with pytest.raises(ValueError):
        nvfp4_linear(torch.randn(4, 24), torch.randn(16, 24))


# --------------------------------------------------- gradient-accumulation fusion (CPU path)
class _Buffer:
    """A WgradAccumulator over a plain tensor: records its calls, hands autograd ``give``."""

    def __init__(self, buf, give=None):
        self.buf, self.give, self.calls = buf, give, []

    def buffer(self):
        self.calls.append("buffer")
        return self.buf

    def accumulated(self):
        self.calls.append("accumulated")
        return self.give


def _fp32_wgrad(x, w, dy, seed):
    """Oracle: the unfused backward's dW in FP32 (= acc · alpha, no rounding to W's dtype), from
    the function path without autograd, with the same stochastic-rounding draws."""
    from fullstack_fp4.linear.nvfp4_linear import nvfp4_linear_backward, nvfp4_linear_forward
    x2 = x.reshape(-1, x.shape[-1])
    _, qw, qxt = nvfp4_linear_forward(x2, w, True, True)
    dx, dw = nvfp4_linear_backward(dy.reshape(-1, dy.shape[-1]), qw, qxt, x.dtype, torch.float32,
                                   torch.Generator().manual_seed(seed))
    return dx, dw


@pytest.mark.parametrize("buf_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16])
def test_wgrad_accumulator_adds_the_fp32_wgrad_rounded_once(buf_dtype, act_dtype):
    # T = 40: the wgrad token blocks are zero-padded
    x, w, dy = (t.to(act_dtype) for t in _data(40, 64, 48, 9))
    ref_dx, dw32 = _fp32_wgrad(x, w, dy, 7)
    b0 = torch.randn(48, 64, generator=torch.Generator().manual_seed(1)).to(buf_dtype)
    sink = _Buffer(b0.clone())
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    nvfp4_linear(xx, ww, generator=torch.Generator().manual_seed(7), wgrad_accumulator=sink).backward(dy)
    assert sink.calls == ["buffer", "accumulated"]
    assert ww.grad is None                               # what accumulated() returned
    assert torch.equal(xx.grad, ref_dx)                  # dgrad untouched by the option
    assert torch.equal(sink.buf, (b0.float() + dw32).to(buf_dtype))
    # a second micro-batch adds again, onto the rounded first sum
    nvfp4_linear(xx, ww, generator=torch.Generator().manual_seed(8), wgrad_accumulator=sink).backward(dy)
    _, dw32_b = _fp32_wgrad(x, w, dy, 8)
    assert torch.equal(sink.buf, ((b0.float() + dw32).to(buf_dtype).float() + dw32_b).to(buf_dtype))


def test_wgrad_accumulator_grad_returned_and_unused_without_weight_grad():
    x, w, dy = _data(32, 32, 16, 10)
    give = torch.full_like(w, 5.0)
    sink = _Buffer(torch.zeros(16, 32), give)
    ww = w.clone().requires_grad_()
    nvfp4_linear(x, ww, wgrad_accumulator=sink).backward(dy)
    assert torch.equal(ww.grad, give)                    # autograd got accumulated()'s tensor
    # W needs no gradient: the accumulator is never asked for its buffer
    sink2 = _Buffer(torch.zeros(16, 32))
    xx = x.clone().requires_grad_()
    nvfp4_linear(xx, w, wgrad_accumulator=sink2).backward(dy)
    assert sink2.calls == [] and torch.equal(sink2.buf, torch.zeros(16, 32))
    from fullstack_fp4.linear.nvfp4_linear import nvfp4_linear_backward
    with pytest.raises(ValueError, match="qxt"):
        nvfp4_linear_backward(dy, None, None, x.dtype, w.dtype, wgrad_into=torch.zeros(16, 32))
