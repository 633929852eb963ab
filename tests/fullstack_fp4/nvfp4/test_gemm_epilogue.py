"""The one-pass GEMM epilogue ``(acc · (ts_a · ts_b)).to(dtype)`` against PyTorch's two passes.

Oracle: ``(acc * (ts_a * ts_b)).to(dtype)`` in PyTorch on the CPU (FP32 products, RNE casts).
Inputs are built to hit BF16 rounding ties (both parities), FP32 overflow after the scale,
BF16 overflow to ±Inf, subnormal products, signed zeros, ±Inf and NaN.
"""

from __future__ import annotations

import os

import pytest
import torch

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
pytestmark = pytest.mark.skipif(not (_INTERPRET or torch.cuda.is_available()),
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if (torch.cuda.is_available() and not _INTERPRET) else "cpu"


def _acc():
    g = torch.Generator().manual_seed(0)
    ties = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.0 + 2**-7 + 2**-8])
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.3e38, -3.3e38, 1e-38,
                            -2e-39, 65504.0, 70000.0])
    body = torch.randn(2086, generator=g) * torch.logspace(-30, 30, 2086)
    return torch.cat([ties, special, body]).reshape(-1, 50)  # 2100 elements: 2 programs + a tail


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.75, 3.0e-3), (2.0**60, 2.0**40), (1e-30, 1e-10)])
def test_scale_cast_matches_torch(dtype, scales):
    from fullstack_fp4.nvfp4.triton_gemm_epilogue import scale_cast_triton
    acc = _acc()
    a, b = torch.tensor(scales[0]), torch.tensor(scales[1])
    ref = (acc * (a * b)).to(dtype)
    got = scale_cast_triton(acc.to(DEV), a.to(DEV), b.to(DEV), dtype).cpu()
    assert got.dtype == dtype and got.shape == acc.shape
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got[~nan].view(bits), ref[~nan].view(bits))


def test_scale_cast_nan_input_and_nan_scale():
    from fullstack_fp4.nvfp4.triton_gemm_epilogue import scale_cast_triton
    acc = _acc()
    acc[0, 0] = float("nan")
    got = scale_cast_triton(acc.to(DEV), torch.tensor(1.0, device=DEV), torch.tensor(2.0, device=DEV),
                            torch.bfloat16).cpu()
    assert torch.isnan(got[0, 0]) and int(torch.isnan(got).sum()) == 1
    got = scale_cast_triton(acc.to(DEV), torch.tensor(float("nan"), device=DEV),
                            torch.tensor(2.0, device=DEV), torch.bfloat16).cpu()
    assert torch.isnan(got).all()


def test_scale_cast_rejects_bad_input():
    from fullstack_fp4.nvfp4.triton_gemm_epilogue import scale_cast_triton
    one = torch.tensor(1.0)
    with pytest.raises(ValueError):
        scale_cast_triton(torch.zeros(4, 4, dtype=torch.float16), one, one, torch.bfloat16)
    with pytest.raises(ValueError):
        scale_cast_triton(torch.zeros(4, 4).t(), one, one, torch.bfloat16)
    with pytest.raises(ValueError):
        scale_cast_triton(torch.zeros(4, 4), one, one, torch.int32)


def test_decoded_matmul_equals_nvfp4_matmul():
    """gemm.decoded_matmul on decoded operands == nvfp4_matmul on their NVFP4 tensors."""
    from fullstack_fp4.nvfp4 import quantize
    from fullstack_fp4.nvfp4.gemm import decode_to_bf16, decoded_matmul, nvfp4_matmul
    g = torch.Generator().manual_seed(1)
    a = quantize(torch.randn(24, 64, generator=g))
    b = quantize(torch.randn(40, 64, generator=g))
    ref = nvfp4_matmul(a, b, out_dtype=torch.bfloat16)
    got = decoded_matmul(decode_to_bf16(a), decode_to_bf16(b).t(), a.tensor_scale, b.tensor_scale,
                         torch.bfloat16)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
