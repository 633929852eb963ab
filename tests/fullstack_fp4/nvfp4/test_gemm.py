"""Emulated NVFP4 GEMM vs an FP64 product of the dequantized operands."""

import pytest
import torch

from fullstack_fp4.nvfp4 import E2M1_VALUES, quantize
from fullstack_fp4.nvfp4.gemm import decode_to_bf16, nvfp4_matmul


def test_e2m1_times_every_e4m3_is_exact_in_bf16():
    # Exhaustive proof of the docstring's claim: all 8 magnitudes × all 126 finite non-negative
    # E4M3 values (incl. subnormals) survive a round trip through BF16 unchanged.
    # Bit patterns 0x00..0x7E: zero and the 126 positive finite values (0x7F is NaN).
    e4m3 = torch.arange(127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.isfinite(e4m3).all() and e4m3.max() == 448 and e4m3[1] == 2.0 ** -9
    prod = torch.tensor(E2M1_VALUES).unsqueeze(1) * e4m3.unsqueeze(0)
    assert torch.equal(prod.to(torch.bfloat16).float(), prod)


def _pair(m, n, k, seed, **kw):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * 3
    b = torch.randn(n, k, generator=g) * 0.02
    return quantize(a, **kw), quantize(b, tile=(16, 16))


def test_matches_fp64_product_of_dequantized_operands():
    qa, qb = _pair(40, 48, 128, 0)
    ref = qa.dequantize(torch.float64) @ qb.dequantize(torch.float64).T
    out = nvfp4_matmul(qa, qb, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and out.shape == (40, 48)
    # Only FP32 accumulation (K = 128) and the final scale product round: bound ~K · 2^-24.
    scale = qa.dequantize(torch.float64).abs() @ qb.dequantize(torch.float64).abs().T
    assert ((out.double() - ref).abs() <= scale * 128 * 2 ** -23).all()
    bf = nvfp4_matmul(qa, qb)
    assert bf.dtype == torch.bfloat16
    assert torch.allclose(bf.double(), ref, rtol=2 ** -8, atol=1e-6)


def test_decode_to_bf16_times_tensor_scale_is_dequantize():
    qa, _ = _pair(16, 16, 64, 1)
    d = decode_to_bf16(qa)
    assert d.dtype == torch.bfloat16
    assert torch.equal(d.float() * qa.tensor_scale, qa.dequantize())


def test_leading_dims_and_errors():
    g = torch.Generator().manual_seed(2)
    qa = quantize(torch.randn(2, 3, 32, generator=g))
    qb = quantize(torch.randn(16, 32, generator=g), tile=(16, 16))
    out = nvfp4_matmul(qa, qb, out_dtype=torch.float32)
    assert out.shape == (2, 3, 16)
    ref = qa.dequantize(torch.float64).reshape(6, 32) @ qb.dequantize(torch.float64).T
    assert torch.allclose(out.reshape(6, 16).double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        nvfp4_matmul(qa, quantize(torch.randn(16, 48)))
    with pytest.raises(ValueError):
        nvfp4_matmul(qa, quantize(torch.randn(2, 16, 32)))
