"""Triton NVFP4 dequantize: ``x̂ = (e2m1(code) · fp32(block_scale)) · tensor_scale`` in FP32.

Bit-identical to :meth:`fullstack_fp4.nvfp4.tensor.NVFP4Tensor.dequantize` (same two FP32
products, left to right; the first is exact since E2M1 × E4M3 needs at most 5 significant bits,
the second rounds once), then one cast to the requested dtype (RNE, as ``Tensor.to``).
1×16 and 16×16 tensors decode the same way because the 2D tile scale is stored on each row.

Decoding without tables:
* E2M1 magnitude of code ``m`` (0..7): ``m · 0.5`` for ``m < 4``, else ``m − 2`` except ``7 → 6``;
  bit 3 is the sign (code 8 decodes to ``-0.0`` like the reference).
* E4M3 byte ``b`` (never NaN here): ``e = b >> 3``, ``m = b & 7``; ``e == 0``: ``m · 2⁻⁹``
  (subnormal); else FP32 bits ``((e + 120) << 23) | (m << 20)`` (exponent bias 7 → 127).

A program reads ``BLOCK_M`` rows × ``BLOCK_B`` blocks: 8 code bytes per block (loaded as two
4-byte halves, so each thread expands whole bytes in registers) plus one scale byte, and writes
16 outputs per block. Bytes moved: 0.5625 B/element read, 2 (BF16) or 4 (FP32) written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tensor import NVFP4Tensor

__all__ = ["dequantize_triton", "decode_bf16_triton"]

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _e2m1_value(c):
    m = c & 7
    mag = tl.where(m < 4, m.to(tl.float32) * 0.5, tl.where(m == 7, 6.0, (m - 2).to(tl.float32)))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _e4m3_value(b):
    e = b >> 3
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
def _dequantize_kernel(data_ptr, scale_ptr, dec_ptr, out_ptr, M, NBLK,
                       OUT_BF16: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr,
                       APPLY_DEC: tl.constexpr = True):
    nbk = tl.cdiv(NBLK, NB)
    pid = tl.program_id(0)
    rows = (pid // nbk) * BM + tl.arange(0, BM)
    blks = (pid % nbk) * NB + tl.arange(0, NB)
    mask2 = (rows < M)[:, None] & (blks < NBLK)[None, :]
    m3 = mask2[:, :, None]
    r64 = rows.to(tl.int64)
    dec = tl.load(dec_ptr)
    s = _e4m3_value(tl.load(scale_ptr + r64[:, None] * NBLK + blks[None, :], mask=mask2,
                            other=0).to(tl.int32))
    q = tl.arange(0, 4)
    boff = (r64 * (NBLK * 8))[:, None, None] + (blks * 8)[None, :, None] + q[None, None, :]
    ooff = (r64 * (NBLK * 16))[:, None, None] + (blks * 16)[None, :, None]
    j = tl.arange(0, 8)
    for h in tl.static_range(2):
        byte = tl.load(data_ptr + boff + 4 * h, mask=m3, other=0).to(tl.int32)
        v_even = _e2m1_value(byte & 15) * s[:, :, None]
        v_odd = _e2m1_value(byte >> 4) * s[:, :, None]
        if APPLY_DEC:
            v_even = v_even * dec
            v_odd = v_odd * dec
        v = tl.reshape(tl.join(v_even, v_odd), (BM, NB, 8))   # element 2i low nibble, 2i+1 high
        if OUT_BF16:
            # FP32 -> BF16 RNE in integer arithmetic (finite values only): the Triton
            # interpreter's FP32 -> BF16 cast truncates, the GPU's rounds; this is exact on both.
            bits = v.to(tl.int32, bitcast=True)
            v = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)
        else:
            v = v.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + ooff + 8 * h + j[None, None, :], v, mask=m3)


def decode_bf16_triton(t: NVFP4Tensor) -> torch.Tensor:
    """``e2m1(code) · fp32(block_scale)`` as BF16, ``[rows, K]``, without the tensor scale: the
    emulated GEMM's operand (exact, see gemm.py), bit-identical to ``gemm.decode_to_bf16``."""
    return dequantize_triton(t, torch.bfloat16, _apply_dec=False).reshape(-1, t.shape[-1])


def dequantize_triton(t: NVFP4Tensor, dtype: torch.dtype = torch.float32,
                      _apply_dec: bool = True) -> torch.Tensor:
    """Dequantize an :class:`NVFP4Tensor` (1×16 or 16×16) to ``dtype`` (FP32/BF16/FP16)."""
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dtype must be fp32, bf16 or fp16, got {dtype}")
    shape = tuple(t.shape)
    k = shape[-1]
    rows = t.data.numel() * 2 // k if k else 0
    out = torch.empty((rows, k), dtype=dtype, device=t.data.device)
    if rows == 0 or k == 0:
        return out.reshape(shape)
    data = t.data.reshape(rows, k // 2).contiguous()
    scale = t.block_scale.reshape(rows, k // 16).contiguous().view(torch.uint8)
    dec = t.tensor_scale.to(torch.float32).reshape(1)
    nblk = k // 16
    import os
    bm, nb = (16, 4) if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else (32, 8)
    grid = (triton.cdiv(rows, bm) * triton.cdiv(nblk, nb),)
    out_k = out.view(torch.int16) if dtype == torch.bfloat16 else out
    _dequantize_kernel[grid](data, scale, dec, out_k, rows, nblk, OUT_BF16=dtype == torch.bfloat16,
                             BM=bm, NB=nb, APPLY_DEC=_apply_dec, num_warps=4,
                             enable_fp_fusion=False)
    return out.reshape(shape)
