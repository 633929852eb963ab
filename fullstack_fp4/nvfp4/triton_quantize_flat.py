"""Flat NVFP4 quantize kernels for the commonest call: a contiguous BF16 tensor, 1×16 blocks,
round-to-nearest, the 6 rule, no RHT (the NVFP4 linear's forward activation, weights' row
operands, any `quantize(x)` with defaults).

Why a third kernel form. The tiled kernels of triton_quantize_kernels.py own a [BM rows × NB
blocks] tile and give each thread whole 16-blocks; each of their loads is a 16-byte vector per
thread at a 32-byte stride across the warp (half of every sector per instruction). On the H200
they reached 37–54% of copy bandwidth (BENCHMARKS.md §A.4). For a contiguous tensor with K % 16
== 0 no 16-block straddles a row, and the scale tensor ``[..., K // 16]`` in row-major order *is*
the flat block index. So the problem is one-dimensional: block ``b`` is words ``8b .. 8b+7`` of
the tensor viewed as int32 (two BF16 a word), its scale is byte ``b``, its codes are bytes
``8b .. 8b+7``. A program takes ``NBP`` consecutive blocks as a ``[NBP, 2, 4]`` word tensor:
each thread loads one 16-byte half-block, consecutive threads consecutive halves, so a warp
instruction reads 512 contiguous bytes (full sectors), and stores one 4-byte code word, again
contiguous across the warp. The block max pairs two threads (one shuffle).

Arithmetic: exactly the eo helpers of triton_quantize_jit.py (``_bf16w_to_f32``,
``_tensor_scales``, ``_candidate_fast``, ``_nib_rne``), so the same values, bit for bit, as
:func:`fullstack_fp4.nvfp4.reference.quantize_reference` (tests/fullstack_fp4/nvfp4/
test_quantize_flat.py checks it against the reference and against the tiled kernels).

Amax pass: one flat read of the int32 words, ``max`` of the |BF16| bit patterns as integers (for
non-negative floats integer order is float order; NaN patterns order above +Inf, so a NaN is
never lost and the host's ``bits >= +Inf's`` test catches NaN and Inf), one ``atomic_max`` per
program. The quantize pass then walks the blocks in reverse, so its first reads are the tail the
amax pass left in L2.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_quantize_jit import (NAN_BITS, _bf16w_to_f32, _candidate_fast, _max_nan, _nib_rne,
                                  _tensor_scales)


@triton.jit
def _amax_flat_kernel(xw_ptr, amax_ptr, NW, BLOCK: tl.constexpr, I64: tl.constexpr):
    """atomic_max of max |x| as int32 FP32 bits over ``BLOCK`` words (2·BLOCK BF16 elements)."""
    if I64:
        off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        off = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(xw_ptr + off, mask=off < NW, other=0, eviction_policy="evict_last")
    # |low element| and |high element| as FP32 bits: the BF16 bits moved to the top half, sign off
    m = tl.maximum((w << 16) & 0x7FFF0000, w & 0x7FFF0000)
    tl.atomic_max(amax_ptr, tl.max(m, 0))


@triton.jit(do_not_specialize=["amax_imm"])
def _quantize_flat_kernel(xw_ptr, amax_ptr, obs_ptr, data_ptr, scale_ptr, dec_ptr, amax_imm,
                          NBLK_ALL, TRACK_AMAX: tl.constexpr, REVERSE: tl.constexpr,
                          AMAX_IMM: tl.constexpr, NBP: tl.constexpr, I64: tl.constexpr):
    """``NBP`` consecutive 16-blocks of the flat tensor (layout: module docstring).

    data_ptr: the codes viewed as int32 (2 words a block). TRACK_AMAX (global amax given): the
    observed amax bits go to ``obs_ptr`` (NaN-propagating block maxima), for NaN/Inf detection."""
    pid = tl.program_id(0)
    if REVERSE:
        pid = tl.num_programs(0) - 1 - pid
    if I64:
        blk = pid.to(tl.int64) * NBP + tl.arange(0, NBP)
    else:
        blk = pid * NBP + tl.arange(0, NBP)
    h = tl.arange(0, 2)
    q = tl.arange(0, 4)
    bmask = blk < NBLK_ALL
    off = blk[:, None, None] * 8 + h[None, :, None] * 4 + q[None, None, :]
    w = tl.load(xw_ptr + off, mask=bmask[:, None, None], other=0, eviction_policy="evict_first")
    e, o = _bf16w_to_f32(w)                                     # [NBP, 2, 4] elements 2j, 2j+1
    if TRACK_AMAX:
        a = _max_nan(tl.abs(e), tl.abs(o))
        bamax = tl.reduce(tl.reduce(a, 2, _max_nan), 1, _max_nan)
        tl.atomic_max(obs_ptr, tl.reduce(bamax, 0, _max_nan).to(tl.int32, bitcast=True))
    else:
        bamax = tl.max(tl.max(tl.maximum(tl.abs(e), tl.abs(o)), 2), 1)     # [NBP]

    if AMAX_IMM:
        gbits = amax_imm                       # host number: its FP32 bits, no device read
    else:
        gbits = tl.load(amax_ptr)
    enc, dec = _tensor_scales(gbits, 448.0)
    if pid == 0:
        # a non-finite (or negative) amax poisons the tensor scale (as the tiled kernels do)
        bad = ((gbits & 0x7FFFFFFF) >= 0x7F800000) | (gbits.to(tl.float32, bitcast=True) < 0.0)
        nan = tl.full(dec.shape, NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
        tl.store(dec_ptr, tl.where(bad, nan, dec))

    s_val, s_bits, f = _candidate_fast(bamax, enc, dec, 0.1666666716337204)
    f3 = f[:, None, None]
    b = _nib_rne(e, f3) | (_nib_rne(o, f3) << 4)               # byte 4h + q of the block
    b02, b13 = tl.split(tl.reshape(b, (NBP, 2, 2, 2)))          # bytes q = 0, 2 and q = 1, 3
    hw = b02 | (b13 << 8)
    h0, h1 = tl.split(hw)
    word = h0 | (h1 << 16)                                      # [NBP, 2]: bytes 4h .. 4h+3
    tl.store(data_ptr + blk[:, None] * 2 + h[None, :], word, mask=bmask[:, None])
    tl.store(scale_ptr + blk, s_bits.to(tl.uint8), mask=bmask)
