"""The NVFP4 linear with chosen operands unquantized (`partial_nvfp4_linear`, the diagnostic
behind `fp4.unquantized_operands`).

Oracles: the NVFP4 linear itself (nothing kept: same codes, so equal up to its FP32
accumulation); FP64 products of `quantize(...).dequantize()` and of the raw operands, with the
stochastic-rounding draws reproduced from a generator seeded alike (one operand kept); FP64
`x Wᵀ`, `dY W`, `dYᵀ x` (all kept: the RHT must cancel, also over a padded last token block).
"""
import pytest
import torch

from fullstack_fp4.linear import nvfp4_linear, quantize_wgrad_operand
from fullstack_fp4.linear.partial_nvfp4 import check_kept, partial_nvfp4_linear
from fullstack_fp4.nvfp4 import DEFAULT_SIGNS, hadamard16, quantize


def _data(t=40, fin=64, fout=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, fin, generator=g)
    x[3, 5] = 30.0                                   # an outlier: the RHT has something to spread
    w = torch.randn(fout, fin, generator=g) / fin ** 0.5
    dy = torch.randn(t, fout, generator=g)
    return x, w, dy


def _run(fn, x, w, dy, seed=7, **kw):
    """y, dX, dW of ``fn`` with its stochastic rounding drawn from a generator seeded ``seed``."""
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(xr, wr, generator=torch.Generator().manual_seed(seed), **kw)
    y.backward(dy)
    return y.detach(), xr.grad, wr.grad


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_nothing_kept_is_the_nvfp4_linear():
    x, w, dy = _data()
    got = _run(partial_nvfp4_linear, x, w, dy)
    ref = _run(nvfp4_linear, x, w, dy)
    for a, b in zip(got, ref):
        assert _rel(a, b) < 1e-6                   # FP32 accumulation against FP64, same codes


def test_weight_kept_quantizes_x_and_dy_as_the_recipe():
    x, w, dy = _data(seed=1)
    y, dx, dw = _run(partial_nvfp4_linear, x, w, dy, keep=["w"])
    g = torch.Generator().manual_seed(7)             # the same draws: dY's way, then RHT(dYᵀ)'s
    xq = quantize(x).dequantize(torch.float64)
    dyq = quantize(dy, rounding="stochastic", generator=g).dequantize(torch.float64)
    dyt = quantize_wgrad_operand(dy, rounding="stochastic", generator=g).dequantize(torch.float64)
    xt = quantize_wgrad_operand(x, rounding="nearest").dequantize(torch.float64)
    assert torch.allclose(y.double(), xq @ w.double().T, rtol=1e-5, atol=1e-5)
    assert torch.allclose(dx.double(), dyq @ w.double(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(dw.double(), dyt @ xt.T, rtol=1e-5, atol=1e-5)
    # W really is unquantized: the forward is not the NVFP4 linear's
    assert _rel(y, _run(nvfp4_linear, x, w, dy)[0]) > 1e-2


def test_everything_kept_is_the_exact_linear_and_the_rht_cancels():
    x, w, dy = _data(t=37, seed=2)                   # 37 tokens: the wgrad pads to 48
    y, dx, dw = _run(partial_nvfp4_linear, x, w, dy, keep=["x", "w", "dy"])
    xd, wd, dyd = x.double(), w.double(), dy.double()
    assert torch.allclose(y.double(), xd @ wd.T, rtol=1e-6, atol=1e-6)
    assert torch.allclose(dx.double(), dyd @ wd, rtol=1e-6, atol=1e-6)
    assert torch.allclose(dw.double(), dyd.T @ xd, rtol=1e-6, atol=1e-6)


def test_dy_kept_rotates_it_as_its_wgrad_partner():
    x, w, dy = _data(t=37, seed=3)
    _, dx, dw = _run(partial_nvfp4_linear, x, w, dy, keep=["dy"])
    wq = quantize(w, tile=(16, 16)).dequantize(torch.float64)
    xt = quantize_wgrad_operand(x, rounding="nearest").dequantize(torch.float64)   # [in, 48]
    pad = torch.zeros(48, dy.shape[1], dtype=torch.float64)
    pad[:37] = dy.double()
    dyt = hadamard16(pad.T.contiguous(), DEFAULT_SIGNS)                            # [out, 48]
    assert torch.allclose(dx.double(), dy.double() @ wq, rtol=1e-5, atol=1e-5)
    assert torch.allclose(dw.double(), dyt @ xt.T, rtol=1e-5, atol=1e-5)
    # and close to the exact dW (only RHT(xᵀ) is quantized)
    assert _rel(dw, dy.double().T @ x.double()) < 0.2


def test_bias_and_bf16_dtypes():
    x, w, dy = _data(seed=4)
    b = torch.randn(w.shape[0])
    xr, wr, br = (t.bfloat16().requires_grad_() for t in (x, w, b))
    y = partial_nvfp4_linear(xr, wr, br, keep=["w"])
    y.backward(dy.bfloat16())
    assert y.dtype == xr.grad.dtype == wr.grad.dtype == br.grad.dtype == torch.bfloat16
    assert torch.allclose(br.grad.float(), dy.bfloat16().float().sum(0), rtol=1e-2, atol=1e-2)


def test_unknown_operand_is_refused():
    assert check_kept(["w", "dy"]) == {"w", "dy"}
    with pytest.raises(ValueError, match="unknown NVFP4 linear operand"):
        check_kept(["weight"])
