"""GPU-path pieces of the NVFP4 linear, bit for bit against the reference compositions.

``amax_triton`` (RHT amax for ``amax_reduce``), ``decode_bf16_triton`` (the emulated GEMM's
operand), ``nvfp4_matmul_nt`` (dgrad without repacking W), ``quantize(..., rht_signs=)`` and
the no-sync ``check_finite=False`` mode (NaN tensor scale instead of a raise).
Kernel tests run on CUDA, or on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import pytest
import torch

from fullstack_fp4.nvfp4 import DEFAULT_SIGNS, hadamard16, quantize
from fullstack_fp4.nvfp4.gemm import decode_to_bf16, nvfp4_matmul, nvfp4_matmul_nt

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_KERNELS = _INTERPRET or torch.cuda.is_available()
DEV = "cuda" if (torch.cuda.is_available() and not _INTERPRET) else "cpu"
needs_kernels = pytest.mark.skipif(not _KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")


def _x(rows, k, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-2, 1, k)
    x[1, 3] = 37.0
    return x.to(dtype)


def _same(a, b):
    assert torch.equal(a.data.cpu(), b.data.cpu())
    assert torch.equal(a.block_scale.cpu().view(torch.uint8), b.block_scale.cpu().view(torch.uint8))
    assert int(a.tensor_scale.cpu().view(torch.int32)) == int(b.tensor_scale.cpu().view(torch.int32))


def test_nt_matmul_equals_repacked_transpose():
    g = torch.Generator().manual_seed(0)
    a = quantize(torch.randn(24, 64, generator=g))
    w = quantize(torch.randn(64, 48, generator=g), tile=(16, 16))     # [K, N]
    ref = nvfp4_matmul(a, w.t(), out_dtype=torch.float32)
    out = nvfp4_matmul_nt(a, w, out_dtype=torch.float32)
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)


def test_public_quantize_rht_matches_composition():
    x = _x(32, 64, 1)
    q = quantize(x, rht_signs=DEFAULT_SIGNS, rounding="stochastic",
                 rand=torch.rand(32, 64, generator=torch.Generator().manual_seed(2)))
    r = quantize(hadamard16(x, DEFAULT_SIGNS), rounding="stochastic",
                 rand=torch.rand(32, 64, generator=torch.Generator().manual_seed(2)))
    _same(q, r)
    assert q.dtype == torch.bfloat16


@needs_kernels
@pytest.mark.parametrize("rht", [False, True])
def test_amax_triton(rht):
    from fullstack_fp4.nvfp4.kernels.quantize import amax_triton
    x = _x(48, 96, 3)
    signs = DEFAULT_SIGNS if rht else None
    ref = (hadamard16(x, signs) if rht else x.float()).abs().amax()
    got = amax_triton(x.to(DEV), signs).cpu()
    assert got.dtype == torch.float32 and got.shape == ()
    assert int(got.view(torch.int32)) == int(ref.view(torch.int32))
    x[5, 5] = float("nan")
    assert torch.isnan(amax_triton(x.to(DEV), signs).cpu())


@needs_kernels
@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])
def test_decode_bf16_triton_bit_exact(tile):
    from fullstack_fp4.nvfp4.kernels.decode import decode_bf16_triton
    x = _x(32, 128, 4)
    x[2, :16] = 0
    q = quantize(x, tile=tile, backend="reference")            # includes subnormal scales
    qd = type(q)(q.data.to(DEV), q.block_scale.to(DEV), q.tensor_scale.to(DEV), q.shape,
                 q.dtype, q.tile)
    got = decode_bf16_triton(qd).cpu()
    ref = decode_to_bf16(q)                                     # CPU: the PyTorch decode
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


@needs_kernels
def test_decode_bf16_triton_every_code_and_scale():
    """Every code byte (two nibbles, signs and -0 included) under every finite E4M3 block
    scale (0, the subnormals, the normals to 448), against the PyTorch decode."""
    from fullstack_fp4.nvfp4.tensor import NVFP4Tensor
    from fullstack_fp4.nvfp4.kernels.decode import decode_bf16_triton
    rows = 127                                   # E4M3 bytes 0..126: every finite value >= 0
    data = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(rows, 1)  # [rows, 256]
    scale = torch.arange(rows, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 32)
    q = NVFP4Tensor(data, scale.view(torch.float8_e4m3fn), torch.tensor(1.0),
                    torch.Size((rows, 512)), torch.bfloat16)
    qd = NVFP4Tensor(data.to(DEV), q.block_scale.to(DEV), q.tensor_scale.to(DEV), q.shape,
                     q.dtype)
    got = decode_bf16_triton(qd).cpu()
    assert torch.equal(got.view(torch.int16), decode_to_bf16(q).view(torch.int16))


@needs_kernels
def test_decode_bf16_pair_is_two_decodes():
    """Two tensors decoded in one launch (the linear's backward: the saved 16×16 W and the
    1×16 RHT(xᵀ) codes) against the PyTorch decode of each: different block counts, so the
    second tensor's programs start mid-grid; the second tensor's last block is planted."""
    from fullstack_fp4.nvfp4.kernels.decode import decode_bf16_pair
    a = quantize(_x(48, 64, 5), tile=(16, 16), backend="reference")
    xb = _x(24, 160, 6)
    xb[-1, -16:] = 40.0
    b = quantize(xb, backend="reference")
    dev = [type(q)(q.data.to(DEV), q.block_scale.to(DEV), q.tensor_scale.to(DEV), q.shape,
                   q.dtype, q.tile) for q in (a, b)]
    got_a, got_b = decode_bf16_pair(*dev)
    for got, q in ((got_a, a), (got_b, b)):
        assert torch.equal(got.cpu().view(torch.int16), decode_to_bf16(q).view(torch.int16))


@needs_kernels
def test_fused_rht_via_public_quantize_on_transposed_copy():
    from fullstack_fp4.nvfp4.kernels.quantize import quantize_triton
    m = _x(64, 48, 5)                                           # [T, C]
    q = quantize_triton(m.to(DEV).t().contiguous(), rht_signs=DEFAULT_SIGNS, check_finite=False)
    _same(q, quantize(hadamard16(m.t(), DEFAULT_SIGNS), backend="reference"))


@needs_kernels
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("given", [None, 1.0, "tensor"])
def test_no_sync_mode_poisons_tensor_scale(bad, given):
    from fullstack_fp4.nvfp4.kernels.quantize import quantize_triton
    x = _x(16, 32, 6)
    ga = torch.tensor(1.0, device=DEV) if given == "tensor" else given
    clean = quantize_triton(x.to(DEV), global_amax=ga, check_finite=False)
    _same(clean, quantize_triton(x.to(DEV), global_amax=ga))    # finite: identical either way
    x[7, 9] = bad
    q = quantize_triton(x.to(DEV), global_amax=ga, check_finite=False)
    assert torch.isnan(q.tensor_scale.cpu())
    assert torch.isnan(q.dequantize()).all()
    with pytest.raises(ValueError):
        quantize_triton(x.to(DEV), global_amax=ga)


@needs_kernels
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_no_sync_mode_bad_given_amax_tensor(bad):
    from fullstack_fp4.nvfp4.kernels.quantize import quantize_triton
    q = quantize_triton(_x(16, 32, 7).to(DEV), global_amax=torch.tensor(bad, device=DEV),
                        check_finite=False)
    assert torch.isnan(q.tensor_scale.cpu())
