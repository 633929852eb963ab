"""The amax passes: the global ``max |x|`` every NVFP4 tensor scale is computed from.

Every block scale depends on the tensor scale, so a quantize reads its input twice: an amax
pass, then the quantize pass (``quantize.py``, ``quantize_two_ways.py``), with the amax left in
device memory between them (no host round trip). Each program reduces its tile in registers
and does **one** ``atomic_max`` on the FP32 bit pattern viewed as int32: for non-negative floats
integer order is float order, and NaN bit patterns order above +Inf, so a NaN cannot be lost
the way ``max`` on floats may drop it; the host (or the quantize kernel) tests
``bits >= 0x7F800000`` for NaN/Inf. Maxima inside a program are NaN-propagating (``max.NaN``).

* ``_amax_kernel``: ``[BM rows × NB blocks]`` tiles in the quantize kernel's eo form, with the
  RHT-16 applied first when the quantize fuses it (the scales are computed from the
  transformed values, so the amax must be theirs).
* ``_amax_flat_kernel``: a contiguous BF16 tensor read flat as int32 words (the flat quantize).
* ``_amax_two_ways_kernel`` / ``_amax_pair_kernel``: one read of ``m [T, C]`` gives both the row
  way's ``max |m|`` and the column way's ``max |RHT16 along tokens of pad(m)|`` (the NVFP4
  linear's operands, ``quantize_two_ways.py``); the pair kernel takes two tensors in one launch
  (the forward's x and W). A lane holds one BF16 word (two channels) of 16 tokens, so no move
  into the quantize kernel's eo form is needed to take maxima; the RHT butterflies are
  :func:`fp4_math.rht16_tokens`.

Host wrappers: ``quantize.amax_triton``, ``quantize_two_ways.amax_two_ways`` /
``amax_two_ways_pair``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .fp4_math import (bf16w_to_f32, block_amax_eo, load_eo, max_nan, rht16_eo, rht16_tokens,
                       tile_coords, tile_coords_2d)


# ----------------------------------------------------------------------------- tiled (quantize)
@triton.jit
def _amax_kernel(x_ptr, amax_ptr, M, NBLK, stride_xm, tail_row,
                 RHT: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr, XW: tl.constexpr,
                 I64: tl.constexpr, SIGN_MASK: tl.constexpr, GRID2D: tl.constexpr):
    """Global amax of a [rows, K] tensor (of the RHT-transformed values if RHT), tiled as the
    quantize kernel: one ``atomic_max`` on the int32 bits per program.

    The max is NaN-propagating (``max.NaN``; a NaN comes out as a positive NaN, whose bits order
    above +Inf's). Row tiles from ``tail_row`` on are loaded ``evict_last`` (the quantize pass,
    which walks the tiles in reverse, reads them first; see ``quantize.AMAX_L2_TAIL_BYTES``)."""
    if GRID2D:
        rows, blks, mask2, _ = tile_coords_2d(M, NBLK, False, BM, NB)
        row0 = tl.program_id(1) * BM
    else:
        rows, blks, mask2 = tile_coords(tl.program_id(0), M, NBLK, BM, NB)
        row0 = tl.program_id(0) // tl.cdiv(NBLK, NB) * BM
    if row0 >= tail_row:
        e0, o0, e1, o1 = load_eo(x_ptr, rows, blks, mask2, stride_xm, XW, I64, "evict_last",
                                 BM, NB)
    else:
        e0, o0, e1, o1 = load_eo(x_ptr, rows, blks, mask2, stride_xm, XW, I64, False, BM, NB)
    if RHT:
        e0, o0, e1, o1 = rht16_eo(e0, o0, e1, o1, SIGN_MASK, BM, NB)
    bm = block_amax_eo(e0, o0, e1, o1, True)
    m = tl.reduce(tl.reduce(bm, 1, max_nan), 0, max_nan).to(tl.int32, bitcast=True)
    tl.atomic_max(amax_ptr, m)


# ----------------------------------------------------------------------------- flat BF16
@triton.jit
def _amax_flat_kernel(xw_ptr, amax_ptr, NW, BLOCK: tl.constexpr, I64: tl.constexpr):
    """atomic_max of max |x| as int32 FP32 bits over ``BLOCK`` words (2·BLOCK BF16 elements) of
    a contiguous BF16 tensor read flat as int32 words: ``max`` of the |BF16| bit patterns as
    integers (for non-negative floats integer order is float order; NaN patterns order above
    +Inf, so a NaN is never lost and the host's ``bits >= +Inf's`` test catches NaN and Inf)."""
    if I64:
        off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        off = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(xw_ptr + off, mask=off < NW, other=0, eviction_policy="evict_last")
    # |low element| and |high element| as FP32 bits: the BF16 bits moved to the top half, sign off
    m = tl.maximum((w << 16) & 0x7FFF0000, w & 0x7FFF0000)
    tl.atomic_max(amax_ptr, tl.max(m, 0))


# ----------------------------------------------------------------------------- two ways (the linear)
@triton.jit
def _rht16_abs_max(acc, v, SIGNS: tl.constexpr):
    """``acc`` folded (NaN-propagating max) with the largest magnitude among the 16 outputs of
    ``RHT16(v)``'s last butterfly, before the ``× ¼`` (the caller takes it on its final max).
    That stage maps a pair (a, b) to (a + b, a − b), and ``max(|fl(a + b)|, |fl(a − b)|) =
    fl(|a| + |b|)`` exactly (one of the two is ``±fl(|a| + |b|)``, the other's exact magnitude
    is at most ``|a| + |b|`` and rounding is monotone), so 8 adds of magnitudes replace its 16
    adds and 8 of the 16 maxima. A NaN or Inf still gives a result >= Inf."""
    s = rht16_tokens(v, SIGNS, 3)
    for i in tl.static_range(8):
        acc = max_nan(acc, tl.abs(s[i]) + tl.abs(s[i + 8]))
    return acc


@triton.jit
def _amax_row_values(p, t, imask, T, stride_t, XW: tl.constexpr, I64: tl.constexpr,
                     EVEN: tl.constexpr):
    """Token row ``t`` at the program's pointers ``p`` (``x_ptr`` + its indices: words with XW,
    BF16 viewed as int32, a word two channels; else elements of any float dtype) as FP32:
    (even, odd) elements of each word, or (element, element). Tokens past ``T`` and indices
    past the row load as 0; EVEN: neither exists (no masks)."""
    if I64:
        roff = t.to(tl.int64) * stride_t
    else:
        roff = t * stride_t
    if EVEN:
        w = tl.load(p + roff)
    else:
        w = tl.load(p + roff, mask=imask & ((imask.to(tl.int32) * 0 + t) < T), other=0)
    if XW:
        return bf16w_to_f32(w)
    v = w.to(tl.float32)
    return v, v


@triton.jit
def _abs_max_nan_tuple(acc, v):
    """``acc`` and the 16 ``|v[i]|`` folded with a NaN-propagating max (FMNMX.NAN on sm_90)."""
    for i in tl.static_range(16):
        acc = max_nan(acc, tl.abs(v[i]))
    return acc


@triton.jit
def _amax_tiles(x_ptr, obs_ptr, pid, T, C, stride_t, SIGNS: tl.constexpr, ROW: tl.constexpr,
                COL: tl.constexpr, XW: tl.constexpr, I64: tl.constexpr, BLOCK: tl.constexpr,
                TBS: tl.constexpr, EVEN: tl.constexpr):
    """Program ``pid`` of the amax pass of ``x [T, C]``: its running maxima merged into
    ``obs[0]`` (ROW: max |m|) and ``obs[1]`` (COL: max |RHT16 along tokens of pad(m)|).

    A program owns ``BLOCK`` words (XW) or channels of ``TBS`` consecutive token blocks: a lane
    holds its word's two channels for the 16 tokens of a block (coalesced row loads, no layout
    moves; the quantize kernel's eo form is not needed to take maxima) and keeps running maxima
    in registers across its token blocks, reduced and atomically merged once at the end.
    Token blocks past the last one load as zeros, which leave a max of absolute values as it is
    (EVEN: the host saw that the program grid covers ``m`` exactly, so nothing is masked).
    The RHT's ``× ¼`` is taken once, on the program's max: ``fl(a/4)`` is monotone, so
    ``max fl(|z_i|/4) = fl(max |z_i| / 4)`` for any inputs. The maxima propagate NaN, and the
    stored bits of a non-finite input are >= 0x7F800000 as the module docstring says."""
    ntbp = tl.cdiv(tl.cdiv(T, 16), TBS)
    tb0 = (pid % ntbp) * TBS
    if XW:
        nidx = C // 2
    else:
        nidx = C
    idx = (pid // ntbp) * BLOCK + tl.arange(0, BLOCK)
    imask = idx < nidx
    p = x_ptr + idx
    acc_row = tl.zeros((BLOCK,), tl.float32)
    acc_col = tl.zeros((BLOCK,), tl.float32)
    for sub in range(TBS):
        E = ()
        O = ()
        for i in tl.static_range(16):
            e, o = _amax_row_values(p, (tb0 + sub) * 16 + i, imask, T, stride_t, XW, I64,
                                    EVEN)
            E = E + (e,)
            O = O + (o,)
        if ROW:
            acc_row = _abs_max_nan_tuple(acc_row, E)
            if XW:
                acc_row = _abs_max_nan_tuple(acc_row, O)
        if COL:
            acc_col = _rht16_abs_max(acc_col, E, SIGNS)
            if XW:
                acc_col = _rht16_abs_max(acc_col, O, SIGNS)
    if ROW:
        m = tl.reduce(acc_row, 0, max_nan)
        tl.atomic_max(obs_ptr, m.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    if COL:
        m = tl.reduce(acc_col, 0, max_nan) * 0.25
        tl.atomic_max(obs_ptr + 1, m.to(tl.int32, bitcast=True) & 0x7FFFFFFF)


@triton.jit
def _amax_two_ways_kernel(x_ptr, obs_ptr, T, C, stride_t, SIGNS: tl.constexpr,
                          ROW: tl.constexpr, COL: tl.constexpr, XW: tl.constexpr,
                          I64: tl.constexpr, BLOCK: tl.constexpr, TBS: tl.constexpr,
                          EVEN: tl.constexpr):
    """obs[0] = bits of max |m| (ROW); obs[1] = bits of max |RHT16 along tokens of pad(m)| (COL).
    One program is :func:`_amax_tiles`' ``pid``."""
    _amax_tiles(x_ptr, obs_ptr, tl.program_id(0), T, C, stride_t, SIGNS, ROW, COL, XW, I64,
                BLOCK, TBS, EVEN)


@triton.jit
def _amax_pair_kernel(x_ptr, obs_ptr, T, C, stride_t, y_ptr, T2, C2, stride2, NPROG_X,
                      SIGNS: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
                      XW: tl.constexpr, I64: tl.constexpr, TBS: tl.constexpr,
                      EVEN: tl.constexpr, ROW2: tl.constexpr, COL2: tl.constexpr,
                      XW2: tl.constexpr, I64_2: tl.constexpr, TBS2: tl.constexpr,
                      EVEN2: tl.constexpr, BLOCK: tl.constexpr):
    """:func:`_amax_two_ways_kernel` of two tensors in one launch (the linear's x and W): the
    first ``NPROG_X`` programs take ``x`` into ``obs[0:2]``, the others ``y`` into
    ``obs[2:4]``. One launch and one zeroed buffer fewer in the forward, and W's few programs
    fill the SMs that x's last wave leaves idle."""
    pid = tl.program_id(0)
    if pid < NPROG_X:
        _amax_tiles(x_ptr, obs_ptr, pid, T, C, stride_t, SIGNS, ROW, COL, XW, I64, BLOCK, TBS,
                    EVEN)
    else:
        _amax_tiles(y_ptr, obs_ptr + 2, pid - NPROG_X, T2, C2, stride2, SIGNS, ROW2, COL2, XW2,
                    I64_2, BLOCK, TBS2, EVEN2)
