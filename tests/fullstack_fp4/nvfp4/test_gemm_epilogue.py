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
    from fullstack_fp4.nvfp4.kernels.gemm_epilogue import scale_cast_triton
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
    from fullstack_fp4.nvfp4.kernels.gemm_epilogue import scale_cast_triton
    acc = _acc()
    acc[0, 0] = float("nan")
    got = scale_cast_triton(acc.to(DEV), torch.tensor(1.0, device=DEV), torch.tensor(2.0, device=DEV),
                            torch.bfloat16).cpu()
    assert torch.isnan(got[0, 0]) and int(torch.isnan(got).sum()) == 1
    got = scale_cast_triton(acc.to(DEV), torch.tensor(float("nan"), device=DEV),
                            torch.tensor(2.0, device=DEV), torch.bfloat16).cpu()
    assert torch.isnan(got).all()


def test_scale_cast_rejects_bad_input():
    from fullstack_fp4.nvfp4.kernels.gemm_epilogue import scale_cast_triton
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


# ------------------------------------------------------------ accumulate variant: dst += acc·α
def _accumulate_oracle(dst, acc, a, b):
    """The torch arithmetic the kernel must reproduce: two FP32 RNE ops, one final rounding."""
    return (dst.float() + acc * (a * b)).to(dst.dtype)


def _dst(dtype, acc):
    """A destination that hits BF16 ties after the add, sums that overflow, ±Inf, NaN, signed
    zeros, cancellation against acc, and ordinary values."""
    g = torch.Generator().manual_seed(2)
    d = (torch.randn(acc.numel(), generator=g) * torch.logspace(-20, 20, acc.numel())).reshape(acc.shape)
    flat = d.view(-1)
    flat[:4] = torch.tensor([1.0, 1.0, -1.0, 3.0])   # + acc's ties' offsets: exact BF16 ties
    flat[4:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    flat[8:12] = torch.tensor([3.3e38, -3.3e38, 0.0, -1e-38])
    flat[12:16] = -acc.view(-1)[12:16]               # exact cancellation -> +0
    return d.to(dtype)


def _bits_equal(got, ref):
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan)
    bits = torch.int32 if ref.dtype == torch.float32 else torch.int16
    assert torch.equal(got[~nan].view(bits), ref[~nan].view(bits))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.75, 3.0e-3), (2.0**60, 2.0**40), (1e-30, 1e-10)])
def test_scale_accumulate_matches_torch(dtype, scales):
    from fullstack_fp4.nvfp4.kernels.gemm_epilogue import scale_accumulate_triton
    acc = _acc()
    acc.view(-1)[:4] = torch.tensor([2**-8, 3 * 2**-8, -(2**-8), 2**-7 + 2**-8])  # ties on 1, 1, -1, 3
    a, b = torch.tensor(scales[0]), torch.tensor(scales[1])
    dst = _dst(dtype, acc)
    ref = _accumulate_oracle(dst, acc, a, b)
    got = dst.clone().to(DEV)
    assert scale_accumulate_triton(acc.to(DEV), a.to(DEV), b.to(DEV), got) is None
    _bits_equal(got.cpu(), ref)


def test_scale_accumulate_bf16_ties_round_to_even():
    """dst + v lands exactly half-way between two BF16 neighbours: both parities, both signs,
    checked against hand-computed BF16 values (not only against torch)."""
    from fullstack_fp4.nvfp4.kernels.gemm_epilogue import scale_accumulate_triton
    one = torch.tensor(1.0)
    dst = torch.tensor([1.0, 1.0 + 2**-7, -1.0, 2.0], dtype=torch.bfloat16).to(DEV)
    acc = torch.tensor([2**-8, 2**-8, -(2**-8), 2**-7]).to(DEV)     # the half ulp of each dst
    scale_accumulate_triton(acc, one.to(DEV), one.to(DEV), dst)
    want = torch.tensor([1.0, 1.0 + 2**-6, -1.0, 2.0], dtype=torch.bfloat16)
    assert torch.equal(dst.cpu().view(torch.int16), want.view(torch.int16))


def test_scale_accumulate_is_one_rounding_not_two():
    """The fused sum rounds once, the unfused path twice: v = 2^-8 + 2^-17 rounds alone to 2^-8
    in BF16, and 1 + 2^-8 is a tie that goes to 1; unrounded, 1 + v is past the tie -> 1 + 2^-7."""
    from fullstack_fp4.nvfp4.kernels.gemm_epilogue import scale_accumulate_triton
    one = torch.tensor(1.0)
    v = torch.tensor([2**-8 + 2**-17])
    dst = torch.tensor([1.0], dtype=torch.bfloat16)
    twice = (dst.float() + v.to(torch.bfloat16).float()).to(torch.bfloat16)
    assert twice.item() == 1.0
    got = dst.clone().to(DEV)
    scale_accumulate_triton(v.to(DEV), one.to(DEV), one.to(DEV), got)
    assert got.cpu().item() == 1.0 + 2**-7


def test_scale_accumulate_nan_and_inf():
    from fullstack_fp4.nvfp4.kernels.gemm_epilogue import scale_accumulate_triton
    for dtype in (torch.bfloat16, torch.float32):
        acc = torch.tensor([float("nan"), float("inf"), float("inf"), 1.0, 3e38, 1.0])
        dst = torch.tensor([1.0, -float("inf"), 1.0, float("nan"), 3e38, 2.0], dtype=dtype)
        ref = _accumulate_oracle(dst, acc, torch.tensor(1.0), torch.tensor(1.0))
        got = dst.clone().to(DEV)
        scale_accumulate_triton(acc.to(DEV), torch.tensor(1.0, device=DEV),
                                torch.tensor(1.0, device=DEV), got)
        got = got.cpu()
        # nan+x, inf-inf, x+nan -> NaN; inf+1 -> inf; 3e38+3e38 overflows to inf in FP32
        assert torch.isnan(got[[0, 1, 3]]).all() and got[2] == float("inf") and got[4] == float("inf")
        assert got[5] == 3.0
        _bits_equal(got, ref)
        # a NaN tensor scale poisons every element (as the cast epilogue does)
        got = dst.clone().to(DEV)
        scale_accumulate_triton(acc.to(DEV), torch.tensor(float("nan"), device=DEV),
                                torch.tensor(1.0, device=DEV), got)
        assert torch.isnan(got).all()


@pytest.mark.parametrize("n", [1, 15, 1023, 1025, 3001])
def test_scale_accumulate_odd_sizes_touch_only_their_elements(n):
    """Masking: sizes around the block (1024 under the interpreter); the elements past n in
    the same storage are left untouched."""
    from fullstack_fp4.nvfp4.kernels.gemm_epilogue import scale_accumulate_triton
    g = torch.Generator().manual_seed(n)
    acc = torch.randn(n, generator=g)
    for dtype in (torch.bfloat16, torch.float32):
        storage = torch.randn(n + 37, generator=g).to(dtype)
        ref = storage.clone()
        ref[:n] = _accumulate_oracle(storage[:n], acc, torch.tensor(0.5), torch.tensor(3.0))
        got = storage.clone().to(DEV)
        scale_accumulate_triton(acc.to(DEV), torch.tensor(0.5, device=DEV),
                                torch.tensor(3.0, device=DEV), got[:n])
        _bits_equal(got.cpu(), ref)


def test_scale_accumulate_rejects_bad_input():
    from fullstack_fp4.nvfp4.kernels.gemm_epilogue import scale_accumulate_triton
    one = torch.tensor(1.0)
    with pytest.raises(ValueError, match="FP32 accumulator"):
        scale_accumulate_triton(torch.zeros(4, 4, dtype=torch.bfloat16), one, one, torch.zeros(4, 4))
    with pytest.raises(ValueError, match="fp32 or bf16"):
        scale_accumulate_triton(torch.zeros(4, 4), one, one, torch.zeros(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        scale_accumulate_triton(torch.zeros(4, 4), one, one, torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="shape"):
        scale_accumulate_triton(torch.zeros(4, 4), one, one, torch.zeros(16))
    scale_accumulate_triton(torch.zeros(0, 4), one, one, torch.zeros(0, 4))   # empty: no launch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decoded_matmul_accumulate_into(dtype):
    """decoded_matmul(..., accumulate_into=dst) returns None and leaves dst = dst + FP32 product
    · alpha, rounded once: the cast path with out_dtype=float32 gives that product exactly."""
    from fullstack_fp4.nvfp4 import quantize
    from fullstack_fp4.nvfp4.gemm import decode_to_bf16, decoded_matmul, nvfp4_matmul
    g = torch.Generator().manual_seed(3)
    a = quantize(torch.randn(24, 64, generator=g))
    b = quantize(torch.randn(40, 64, generator=g))
    dw32 = nvfp4_matmul(a, b, out_dtype=torch.float32)
    dst = torch.randn(24, 40, generator=g).to(dtype)
    ref = (dst.float() + dw32).to(dtype)
    got = dst.clone()
    assert decoded_matmul(decode_to_bf16(a), decode_to_bf16(b).t(), a.tensor_scale, b.tensor_scale,
                          accumulate_into=got) is None
    _bits_equal(got, ref)
    got = dst.clone()
    assert nvfp4_matmul(a, b, accumulate_into=got) is None
    _bits_equal(got, ref)
