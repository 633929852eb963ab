"""Triton NVFP4 dequantize: ``x̂ = (e2m1(code) · fp32(block_scale)) · tensor_scale`` in FP32.

Bit-identical to :meth:`fullstack_fp4.nvfp4.tensor.NVFP4Tensor.dequantize` (same two FP32
products, left to right; the first is exact since E2M1 × E4M3 needs at most 5 significant bits,
the second rounds once), then one cast to the requested dtype (RNE, as ``Tensor.to``).
1×16 and 16×16 tensors decode the same way because the 2D tile scale is stored on each row.

Decoding without tables (``fp4_math.e2m1_value``, ``e4m3_value``, ``dec_nib_bits``):
* E2M1 magnitude of code ``m`` (0..7): ``m · 0.5`` for ``m < 4``, else ``m − 2`` except ``7 → 6``;
  bit 3 is the sign (code 8 decodes to ``-0.0`` like the reference).
* E4M3 byte ``b`` (never NaN here): ``e = b >> 3``, ``m = b & 7``; ``e == 0``: ``m · 2⁻⁹``
  (subnormal); else FP32 bits ``((e + 120) << 23) | (m << 20)`` (exponent bias 7 → 127).

Layout of the work (``_dequantize_flat_kernel``). The codes ``[rows, K/2]`` and
the block scales ``[rows, K/16]`` of a row-major tensor with K % 16 == 0 are, read flat, the
blocks in order: block ``b`` is code bytes ``8b .. 8b+7`` and scale byte ``b`` (no block straddles
a row; 16×16 tiles store their scale on each row, so the same holds). A program takes ``NBP``
consecutive blocks as ``2·NBP`` half-blocks, a lane each: ``[2·NBP, 4]`` code bytes (4-byte
loads, consecutive lanes consecutive) and ``[2·NBP, 8]`` BF16 outputs (16-byte stores), the
block's scale byte read by both its lanes. Bytes moved: 0.5625 B/element read, 2 (BF16) or
4 (FP32) written; timings against copy bandwidth: ``docs/perf/nvfp4.md``.
``knobs.DEQUANT_NBP`` (blocks per program) and ``knobs.DEQUANT_WARPS`` override the defaults
(``benchmarks/bench_decode.py --sweep`` sweeps them).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fullstack_fp4 import knobs

from ..tensor import NVFP4Tensor
from .fp4_math import bf16_word, dec_nib_bits, e2m1_value, e4m3_value
from .launch import cdiv, launch

__all__ = ["dequantize_triton", "decode_bf16_triton", "decode_bf16_pair"]

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _decode_half(byte, s, dec, OUT_BF16: tl.constexpr, APPLY_DEC: tl.constexpr,
                 out_ty: tl.constexpr):
    """``[R, 4]`` code bytes (a half-block a row) and their ``[R]`` scales -> ``[R, 8]`` outputs
    (element 2i from byte i's low nibble, 2i+1 from its high nibble)."""
    v_even = e2m1_value(byte & 15) * s[:, None]
    v_odd = e2m1_value(byte >> 4) * s[:, None]
    if APPLY_DEC:
        v_even = v_even * dec
        v_odd = v_odd * dec
    v = tl.reshape(tl.join(v_even, v_odd), (byte.shape[0], 8))
    if OUT_BF16:
        # FP32 -> BF16 RNE in integer arithmetic (finite values only): the Triton
        # interpreter's FP32 -> BF16 cast truncates, the GPU's rounds; exact on both.
        bits = v.to(tl.int32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)
    return v.to(out_ty)


@triton.jit
def _decode_half_words(byte, s):
    """``[R, 4]`` code bytes and their ``[R]`` scales -> ``[R, 4]`` int32 words of two BF16
    (byte i's low nibble in the low half): the GEMM operand ``e2m1 · s`` without the tensor
    scale. The product is exact in FP32 and in BF16 (at most 5 significant bits), so its BF16
    is the top half of its FP32 bits, built from the code's bits (``dec_nib_bits``: no
    int -> float conversions, which issue at a quarter of the FP32 rate, and no rounding)."""
    s2 = s[:, None]
    return bf16_word(dec_nib_bits(byte & 15, s2), dec_nib_bits(byte >> 4, s2))


@triton.jit
def _dequantize_flat_kernel(data_ptr, scale_ptr, dec_ptr, out_ptr, NBLK_ALL,
                            OUT_BF16: tl.constexpr, NBP: tl.constexpr, APPLY_DEC: tl.constexpr,
                            I64: tl.constexpr):
    """``NBP`` consecutive 16-blocks of the flat tensor (module docstring), a lane a
    half-block, consecutive lanes consecutive halves: ``[2·NBP, 4]`` bytes in, ``[2·NBP, 8]``
    values out, so each load and store instruction of a warp covers whole 32-byte sectors (a
    lane a block, its two halves in turn, would write half of every sector per instruction:
    twice the L2 write requests)."""
    if OUT_BF16 and not APPLY_DEC:
        _decode_words_blocks(data_ptr, scale_ptr, out_ptr, tl.program_id(0), NBLK_ALL, NBP, I64)
    else:
        q = tl.arange(0, 4)
        j = tl.arange(0, 8)
        dec = 1.0
        if APPLY_DEC:
            dec = tl.load(dec_ptr)
        if I64:
            hb = tl.program_id(0).to(tl.int64) * (2 * NBP) + tl.arange(0, 2 * NBP)
        else:
            hb = tl.program_id(0) * (2 * NBP) + tl.arange(0, 2 * NBP)
        hmask = hb < 2 * NBLK_ALL
        s = e4m3_value(tl.load(scale_ptr + (hb >> 1), mask=hmask, other=0).to(tl.int32))
        byte = tl.load(data_ptr + hb[:, None] * 4 + q[None, :], mask=hmask[:, None], other=0,
                       eviction_policy="evict_first").to(tl.int32)
        v = _decode_half(byte, s, dec, OUT_BF16, APPLY_DEC, out_ptr.dtype.element_ty)
        tl.store(out_ptr + hb[:, None] * 8 + j[None, :], v, mask=hmask[:, None])


@triton.jit
def _decode_words_blocks(data_ptr, scale_ptr, out_ptr, pid, NBLK_ALL, NBP: tl.constexpr,
                         I64: tl.constexpr):
    """Program ``pid`` of the GEMM-operand decode (:func:`_dequantize_flat_kernel`'s BF16 form
    without the tensor scale): ``NBP`` blocks as ``[2·NBP, 4]`` words of two BF16."""
    q = tl.arange(0, 4)
    if I64:
        hb = pid.to(tl.int64) * (2 * NBP) + tl.arange(0, 2 * NBP)
    else:
        hb = pid * (2 * NBP) + tl.arange(0, 2 * NBP)
    hmask = hb < 2 * NBLK_ALL
    s = e4m3_value(tl.load(scale_ptr + (hb >> 1), mask=hmask, other=0).to(tl.int32))
    byte = tl.load(data_ptr + hb[:, None] * 4 + q[None, :], mask=hmask[:, None], other=0,
                   eviction_policy="evict_first").to(tl.int32)
    tl.store(out_ptr + hb[:, None] * 4 + q[None, :], _decode_half_words(byte, s),
             mask=hmask[:, None])


@triton.jit
def _decode_pair_kernel(data_ptr, scale_ptr, out_ptr, NBLK_ALL, data2_ptr, scale2_ptr, out2_ptr,
                        NBLK_ALL2, NPROG_1, NBP: tl.constexpr, I64: tl.constexpr,
                        I64_2: tl.constexpr):
    """Two GEMM-operand decodes in one launch (the linear's backward: the saved W and
    RHT(xᵀ)): the first ``NPROG_1`` programs decode the first tensor, the others the second.
    One launch fewer, and the smaller tensor's programs fill the other's last wave."""
    pid = tl.program_id(0)
    if pid < NPROG_1:
        _decode_words_blocks(data_ptr, scale_ptr, out_ptr, pid, NBLK_ALL, NBP, I64)
    else:
        _decode_words_blocks(data2_ptr, scale2_ptr, out2_ptr, pid - NPROG_1, NBLK_ALL2, NBP,
                             I64_2)


def _flat_config():
    """(NBP blocks per program, num_warps): 256 blocks on 8 warps, the fastest of the H200 sweep
    (``benchmarks/bench_decode.py --sweep``); ``knobs.DEQUANT_NBP`` / ``DEQUANT_WARPS`` override
    them for the sweep."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return 8, 1
    nbp = 256 if knobs.DEQUANT_NBP is None else knobs.DEQUANT_NBP
    warps = 8 if knobs.DEQUANT_WARPS is None else knobs.DEQUANT_WARPS
    knobs.check_dequant(nbp, warps)
    return nbp, warps


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
    data, scale, rows, nblk_all = _flat_views(t)
    dec = t.tensor_scale.to(torch.float32).reshape(1)
    nbp, warps = _flat_config()
    if dtype == torch.bfloat16:       # words of two BF16 for the GEMM operand, else halves
        out_k = out.view(torch.int16 if _apply_dec else torch.int32)
    else:
        out_k = out
    launch(_dequantize_flat_kernel, (cdiv(nblk_all, nbp),),
        data, scale, dec, out_k, nblk_all, OUT_BF16=dtype == torch.bfloat16, NBP=nbp,
        APPLY_DEC=_apply_dec, I64=nblk_all * 16 >= 2**31 - 16 * nbp, num_warps=warps,
        enable_fp_fusion=False)
    return out.reshape(shape)


def _flat_views(t: NVFP4Tensor):
    """(codes [rows, K/2], scales [rows, K/16] as bytes, rows, blocks) of ``t``, contiguous."""
    k = t.shape[-1]
    rows = t.data.numel() * 2 // k if k else 0
    data = t.data.reshape(rows, k // 2).contiguous()
    scale = t.block_scale.reshape(rows, k // 16).contiguous().view(torch.uint8)
    return data, scale, rows, rows * (k // 16)


def decode_bf16_pair(t1: NVFP4Tensor, t2: NVFP4Tensor):
    """:func:`decode_bf16_triton` of two tensors in one launch: ``(decoded t1, decoded t2)``,
    the same bits as two calls."""
    (d1, s1, r1, n1), (d2, s2, r2, n2) = _flat_views(t1), _flat_views(t2)
    if n1 == 0 or n2 == 0:
        return decode_bf16_triton(t1), decode_bf16_triton(t2)
    o1 = torch.empty((r1, t1.shape[-1]), dtype=torch.bfloat16, device=t1.data.device)
    o2 = torch.empty((r2, t2.shape[-1]), dtype=torch.bfloat16, device=t2.data.device)
    nbp, warps = _flat_config()
    p1 = cdiv(n1, nbp)
    launch(_decode_pair_kernel, (p1 + cdiv(n2, nbp),),
        d1, s1, o1.view(torch.int32), n1, d2, s2, o2.view(torch.int32), n2, p1, NBP=nbp,
        I64=n1 * 16 >= 2**31 - 16 * nbp, I64_2=n2 * 16 >= 2**31 - 16 * nbp, num_warps=warps,
        enable_fp_fusion=False)
    return o1, o2
