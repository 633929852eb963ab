"""The ``@triton.jit`` arithmetic the NVFP4 quantize kernels are made of (no kernels, no host code).

Two forms of the same operations, bit-identical (fullstack_fp4/nvfp4/triton_quantize.py says which
kernel uses which, and why both are kept):

* the block-per-thread helpers of the first kernels ("legacy"): E4M3 / E2M1 rounding by select
  ladders, the RHT-16 butterflies on [BM, NB, 8] halves, Philox uniforms per half, packing;
* the "eo" helpers: a 16-block as four [BM, NB, 4] FP32 tensors (even / odd elements of each
  half), BF16 read as int32 words, E2M1 round-to-nearest-even by 2^23 additions, exact stochastic
  rounding without float->int converts, Philox4x32-10 written out.

Also imported by fullstack_fp4/nvfp4/triton_quantize_decode.py (the NVFP4 linear's fused
operands) and fullstack_fp4/optim/triton_ns.py; the sm_90 compile gate compiles them through
the kernels that call them.
"""
from __future__ import annotations

import triton
import triton.language as tl
# `to_tensor` lives in triton.language.core; triton >= 3.7 also exports it as tl.to_tensor, the
# 3.6 of the GPU image does not (tl.philox itself calls it through core)
from triton.language import core as tlc

FP32_MAX = tl.constexpr(3.4028234663852886e38)  # a plain global is invisible to compiled kernels
# NaN as its bit pattern: a NaN constexpr never compares equal to itself, so Triton would
# think the global changed and refuse every launch after the first.
NAN_BITS = tl.constexpr(0x7FC00000)
INV6 = tl.constexpr(0.1666666716337204)  # fp32(1/6) = torch.reciprocal(6.0), exact; constexpr: used in kernels

# ----------------------------------------------------------------------------- jit helpers
@triton.jit
def _neg_where(neg, m):
    """``-m`` where ``neg``, else ``m``, as a true negation, so ``+0`` becomes ``-0``.
    A select between ``-m`` and ``m`` does not do that: the GPU image's triton 3.6 lowers a
    float's unary minus to ``0 - m``, which is ``+0`` for ``m = +0`` (triton 3.9's compiler and
    its interpreter negate), and a negative value that rounds to 0 must decode to ``-0`` like its
    code. ``m * -1.0`` is exact in IEEE arithmetic, and LLVM turns it into ``fneg`` (PTX
    ``neg.f32``), which costs what ``0 - m`` did: the same SASS count for the two-way kernels
    (tests/fullstack_fp4/test_triton_signed_zero.py reads the IR)."""
    return tl.where(neg, m * -1.0, m)


@triton.jit
def _e4m3_rne(v):
    """RNE of FP32 ``v`` in [0, 448] to E4M3: returns (value as FP32, E4M3 bit pattern int32)."""
    bits = v.to(tl.int32, bitcast=True)
    # Normal E4M3 (v >= 2^-6): round the 23-bit mantissa to 3 bits, ties to even.
    rn_bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 == 0xFFF00000
    # Subnormal E4M3 (v < 2^-6): multiples of 2^-9; 2^14 + v has ulp 2^-9, so the RNE add rounds.
    sub = (v + 16384.0) - 16384.0
    is_sub = v < 0.015625
    val = tl.where(is_sub, sub, rn_bits.to(tl.float32, bitcast=True))
    # E4M3 bits: normal -> ((e32 - 127 + 7) << 3) | top-3 mantissa = (bits >> 20) - (120 << 3);
    # subnormal -> value / 2^-9 (0..8; 8 is 2^-6 = 0x08, the smallest normal, also correct).
    code = tl.where(is_sub, (sub * 512.0).to(tl.int32), (rn_bits >> 20) - 960)
    return val, code


@triton.jit
def _e2m1_code(y, u, STOCHASTIC: tl.constexpr):
    """E2M1 code (int32, bit 3 = sign) and rounded magnitude of ``y`` (already clamped to ±6)."""
    a = tl.abs(y)
    ge2 = a >= 2.0
    ge4 = a >= 4.0
    inv = tl.where(ge4, 0.5, tl.where(ge2, 1.0, 2.0))   # 1 / grid step in a's binade
    t = a * inv                                          # exact (power-of-two factor)
    if STOCHASTIC:
        k = t.to(tl.int32)                               # floor (t >= 0)
        frac = t - k.to(tl.float32)                      # exact: == (a - lo) / (hi - lo)
        n = k + (u < frac).to(tl.int32)
    else:
        # t + 2^23 has ulp 1: the FP32 add rounds t to an integer, ties to even.
        n = (t + 8388608.0).to(tl.int32, bitcast=True) & 7
    mag = n + tl.where(ge2, 2, 0) + tl.where(ge4, 2, 0)
    code = tl.where(y < 0.0, mag | 8, mag)
    step = tl.where(ge4, 2.0, tl.where(ge2, 1.0, 0.5))
    r = n.to(tl.float32) * step                          # rounded magnitude (exact)
    return code, r


@triton.jit
def _wht_stage(t, BM: tl.constexpr, NB: tl.constexpr, N: tl.constexpr, H: tl.constexpr):
    """One Walsh–Hadamard stage with stride H (< N) along the last axis of ``t [BM, NB, N]``:
    elements i and i + H become their sum and difference."""
    t = tl.reshape(t, (BM, NB, N // (2 * H), 2, H))
    t = tl.permute(t, (0, 1, 2, 4, 3))
    a, b = tl.split(t)                                   # a: element i, b: element i + H
    t = tl.join(a + b, a - b)
    t = tl.permute(t, (0, 1, 2, 4, 3))
    return tl.reshape(t, (BM, NB, N))


@triton.jit
def _rht16(lo, hi, signs_ptr, BM: tl.constexpr, NB: tl.constexpr):
    """hadamard16 on blocks held as halves (elements 0..7, 8..15): ×signs, strides 1,2,4,8, ×¼."""
    j = tl.arange(0, 8)
    lo = lo * tl.load(signs_ptr + j)[None, None, :]
    hi = hi * tl.load(signs_ptr + 8 + j)[None, None, :]
    lo = _wht_stage(lo, BM, NB, 8, 1)
    hi = _wht_stage(hi, BM, NB, 8, 1)
    lo = _wht_stage(lo, BM, NB, 8, 2)
    hi = _wht_stage(hi, BM, NB, 8, 2)
    lo = _wht_stage(lo, BM, NB, 8, 4)
    hi = _wht_stage(hi, BM, NB, 8, 4)
    lo2 = lo + hi                                        # stride 8: pairs (i, i + 8)
    hi2 = lo - hi
    return lo2 * 0.25, hi2 * 0.25


@triton.jit
def _tile_coords(pid, M, NBLK, BM: tl.constexpr, NB: tl.constexpr):
    nbk = tl.cdiv(NBLK, NB)
    pid_m = pid // nbk
    pid_b = pid % nbk
    rows = pid_m * BM + tl.arange(0, BM)
    blks = pid_b * NB + tl.arange(0, NB)
    mask2 = (rows < M)[:, None] & (blks < NBLK)[None, :]
    return rows, blks, mask2


@triton.jit
def _load_halves(ptr, rows, blks, mask2, stride, EVICT: tl.constexpr):
    """Load a [BM, NB] grid of 16-blocks as two [BM, NB, 8] FP32 halves (16-byte vectors)."""
    j = tl.arange(0, 8)
    off = (rows.to(tl.int64) * stride)[:, None, None] + (blks * 16)[None, :, None] + j[None, None, :]
    m3 = mask2[:, :, None]
    if EVICT:
        lo = tl.load(ptr + off, mask=m3, other=0.0, eviction_policy="evict_first")
        hi = tl.load(ptr + off + 8, mask=m3, other=0.0, eviction_policy="evict_first")
    else:
        lo = tl.load(ptr + off, mask=m3, other=0.0)
        hi = tl.load(ptr + off + 8, mask=m3, other=0.0)
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def _sr_u8(word, S: tl.constexpr):
    """The uniform of byte ``S`` of a Philox word, ``(byte + ½)/256`` (sr_stream.py), exact:
    the FP32 ``1 + (byte + ½)/256`` is built from bits, then 1 is subtracted (Sterbenz)."""
    b = ((word >> (8 * S)) & 0xFF).to(tl.int32)
    return ((b << 15) | 0x3F804000).to(tl.float32, bitcast=True) - 1.0


@triton.jit
def _sr_row_split(rows):
    """(g(r), p(r)) of sr_stream.py: the row quad a Philox call covers, and the row's word."""
    return (rows >> 4) * 4 + ((rows & 7) >> 1), ((rows >> 3) & 1) * 2 + (rows & 1)


@triton.jit
def _pick_word(p, w0, w1, w2, w3):
    """Word ``p`` (a runtime 0..3 per row, broadcast) of a Philox call's four."""
    return tl.where(p == 0, w0, tl.where(p == 1, w1, tl.where(p == 2, w2, w3)))


@triton.jit
def _philox_halves(seed, rows, blks, NBLK, BM: tl.constexpr, NB: tl.constexpr):
    """Uniforms for the two halves of each block: the stream of sr_stream.py (one call per
    (row quad, block, element quad); a row keeps its word, element ``2q + b`` of the low half
    byte ``b``, of the high half byte ``2 + b``)."""
    g, p = _sr_row_split(rows.to(tl.int64))
    q = tl.arange(0, 4)
    ctr = ((g * NBLK)[:, None, None] + blks[None, :, None]) * 4 + q[None, None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, ctr)
    w = _pick_word(p[:, None, None], r0, r1, r2, r3)
    u_lo = tl.reshape(tl.join(_sr_u8(w, 0), _sr_u8(w, 1)), (BM, NB, 8))
    u_hi = tl.reshape(tl.join(_sr_u8(w, 2), _sr_u8(w, 3)), (BM, NB, 8))
    return u_lo, u_hi


@triton.jit
def _abs_bits_max(v):
    """max |v| over a tensor as int32 FP32 bits (NaN patterns order above +Inf)."""
    return tl.max(tl.max(tl.max(v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 2), 1), 0)


@triton.jit
def _candidate(bamax, enc, dec, INV: tl.constexpr):
    s = tl.minimum(bamax * (enc * INV), 448.0)
    s_val, s_bits = _e4m3_rne(s)
    f = tl.minimum(tl.math.div_rn(tl.full(s_val.shape, 1.0, tl.float32), s_val * dec), FP32_MAX)
    return s_val, s_bits, f


@triton.jit
def _half_err(xa, f, s_val, dec):
    """FP32 terms |x - q·s·dec| of nearest-rounded candidate, returned as FP64 [BM, NB]."""
    y = tl.minimum(tl.maximum(xa * f[:, :, None], -6.0), 6.0)
    _, r = _e2m1_code(y, y, False)
    xhat = (r * s_val[:, :, None]) * dec
    return tl.sum(tl.abs(tl.abs(xa) - xhat).to(tl.float64), 2)


@triton.jit
def _tile_reduce_max(v, BM: tl.constexpr, NB: tl.constexpr):
    """[BM, NB] -> max over each 16-row group, broadcast back onto the 16 rows."""
    t = tl.max(tl.reshape(v, (BM // 16, 16, NB)), 1)
    return tl.reshape(tl.broadcast_to(t[:, None, :], (BM // 16, 16, NB)), (BM, NB))


@triton.jit
def _tile_reduce_sum(v, BM: tl.constexpr, NB: tl.constexpr):
    t = tl.sum(tl.reshape(v, (BM // 16, 16, NB)), 1)
    return tl.reshape(tl.broadcast_to(t[:, None, :], (BM // 16, 16, NB)), (BM, NB))


@triton.jit
def _pack_store(data_ptr, code_lo, code_hi, rows, blks, mask2, KH, BM: tl.constexpr, NB: tl.constexpr):
    """Two codes per byte (element 2i low nibble): 4 bytes per half, 8 per block."""
    e, o = tl.split(tl.reshape(code_lo, (BM, NB, 4, 2)))
    b_lo = (e | (o << 4)).to(tl.uint8)
    e, o = tl.split(tl.reshape(code_hi, (BM, NB, 4, 2)))
    b_hi = (e | (o << 4)).to(tl.uint8)
    q = tl.arange(0, 4)
    off = (rows.to(tl.int64) * KH)[:, None, None] + (blks * 8)[None, :, None] + q[None, None, :]
    m3 = mask2[:, :, None]
    tl.store(data_ptr + off, b_lo, mask=m3)
    tl.store(data_ptr + off + 4, b_hi, mask=m3)


# ----------------------------------------------------------------------------- fast-path helpers
# The kernels below hold a 16-block as four [BM, NB, 4] FP32 tensors ("eo" form): e0[q], o0[q]
# are elements 2q, 2q+1 (the low half, 0..7), e1[q], o1[q] elements 8+2q, 9+2q. A BF16 block is
# then 8 int32 words read as two 16-byte vectors: word q of a half holds its elements 2q (low
# 16 bits) and 2q+1 (high 16 bits), so ``w << 16`` and ``w & 0xFFFF0000`` are those two elements
# as FP32 bit patterns (one integer op each, no PRMT + shift); the nibbles of elements 2q, 2q+1
# form byte q of the half's packed code word; Philox outputs 0..3 are exactly the uniforms of
# e0, o0, e1, o1 (module docstring's mapping). No reshape across threads is ever needed.
MAGIC = tl.constexpr(8388608.0)              # 2^23: FP32 ulp 1 on [2^23, 2^24)
MAGIC_BITS = tl.constexpr(0x4B000000)


@triton.jit
def _bf16w_to_f32(w):
    """int32 words of two BF16 -> (element in the low 16 bits, element in the high 16 bits)."""
    return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _ld(ptrs, mask, EVICT: tl.constexpr):
    """Masked load (0 outside). EVICT: True / "evict_first": streamed once (L1 and L2
    evict-first); "evict_last": kept in L2 for a second read; False / "": default policy."""
    if EVICT == "evict_last":
        return tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_last")
    elif EVICT:
        return tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")
    else:
        return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def _eo_of_quarters(qa, qb, BM: tl.constexpr, NB: tl.constexpr):
    """Elements 0..3 (qa) and 4..7 (qb) of a half -> (evens 0, 2, 4, 6; odds 1, 3, 5, 7), FP32."""
    ea, oa = tl.split(tl.reshape(qa.to(tl.float32), (BM, NB, 2, 2)))
    eb, ob = tl.split(tl.reshape(qb.to(tl.float32), (BM, NB, 2, 2)))
    e = tl.reshape(tl.permute(tl.join(ea, eb), (0, 1, 3, 2)), (BM, NB, 4))
    o = tl.reshape(tl.permute(tl.join(oa, ob), (0, 1, 3, 2)), (BM, NB, 4))
    return e, o


@triton.jit
def _load_eo(ptr, rows, blks, mask2, stride, XW: tl.constexpr, I64: tl.constexpr,
             EVICT: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr):
    """A [BM, NB] grid of 16-blocks in eo form (FP32). XW: ``ptr`` is a BF16 tensor viewed as
    int32 words and ``stride`` its row stride in words; else any float dtype (row stride in
    elements). I64: 64-bit row offsets (the host sets it when an offset may reach 2^31)."""
    if I64:
        roff = rows.to(tl.int64) * stride
    else:
        roff = rows * stride
    m3 = mask2[:, :, None]
    if XW:
        q = tl.arange(0, 4)
        off = roff[:, None, None] + (blks * 8)[None, :, None] + q[None, None, :]
        e0, o0 = _bf16w_to_f32(_ld(ptr + off, m3, EVICT))
        e1, o1 = _bf16w_to_f32(_ld(ptr + off + 4, m3, EVICT))
    elif ptr.dtype.element_ty == tl.float32:
        # 16-byte vectors are quarters of a block: split each into (even, odd) pairs in-thread
        # and concatenate two quarters per half (a [BM, NB, 8] FP32 load would put a half on
        # two threads and cost a shared-memory transpose).
        q = tl.arange(0, 4)
        off = roff[:, None, None] + (blks * 16)[None, :, None] + q[None, None, :]
        e0, o0 = _eo_of_quarters(_ld(ptr + off, m3, EVICT), _ld(ptr + off + 4, m3, EVICT), BM, NB)
        e1, o1 = _eo_of_quarters(_ld(ptr + off + 8, m3, EVICT), _ld(ptr + off + 12, m3, EVICT),
                                 BM, NB)
    else:
        j = tl.arange(0, 8)
        off = roff[:, None, None] + (blks * 16)[None, :, None] + j[None, None, :]
        h0 = _ld(ptr + off, m3, EVICT)
        h1 = _ld(ptr + off + 8, m3, EVICT)
        e0, o0 = tl.split(tl.reshape(h0.to(tl.float32), (BM, NB, 4, 2)))
        e1, o1 = tl.split(tl.reshape(h1.to(tl.float32), (BM, NB, 4, 2)))
    return e0, o0, e1, o1


@triton.jit
def _sign4(SIGN_MASK: tl.constexpr, FIRST: tl.constexpr):
    """±1.0 for elements FIRST + 2q (q = 0..3) of the 16 signs (bit i of SIGN_MASK: s_i = -1)."""
    i = FIRST + 2 * tl.arange(0, 4)
    return 1.0 - 2.0 * ((SIGN_MASK >> i) & 1).to(tl.float32)


@triton.jit
def _rht16_eo(e0, o0, e1, o1, SIGN_MASK: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr):
    """:func:`_rht16` in eo form with compile-time signs: × signs, strides 1, 2, 4, 8, × ¼.

    Same operations on the same operands as ``hadamard16``: stride 1 pairs (2q, 2q+1) = (e, o);
    strides 2 and 4 pair q with q+1, q+2 inside each 4-vector; stride 8 pairs the halves. The
    signs are constants per register, so ``x · (±1)`` folds into the first adds (exact)."""
    e0 = e0 * _sign4(SIGN_MASK, 0)[None, None, :]
    o0 = o0 * _sign4(SIGN_MASK, 1)[None, None, :]
    e1 = e1 * _sign4(SIGN_MASK, 8)[None, None, :]
    o1 = o1 * _sign4(SIGN_MASK, 9)[None, None, :]
    e0, o0 = e0 + o0, e0 - o0                            # stride 1
    e1, o1 = e1 + o1, e1 - o1
    e0 = _wht_stage(e0, BM, NB, 4, 1)                # stride 2
    o0 = _wht_stage(o0, BM, NB, 4, 1)
    e1 = _wht_stage(e1, BM, NB, 4, 1)
    o1 = _wht_stage(o1, BM, NB, 4, 1)
    e0 = _wht_stage(e0, BM, NB, 4, 2)                # stride 4
    o0 = _wht_stage(o0, BM, NB, 4, 2)
    e1 = _wht_stage(e1, BM, NB, 4, 2)
    o1 = _wht_stage(o1, BM, NB, 4, 2)
    e0, e1 = e0 + e1, e0 - e1                            # stride 8
    o0, o1 = o0 + o1, o0 - o1
    return e0 * 0.25, o0 * 0.25, e1 * 0.25, o1 * 0.25


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _block_amax_eo(e0, o0, e1, o1, NAN: tl.constexpr):
    """[BM, NB] max |x| of each block; NAN: a NaN element makes its block's max NaN."""
    if NAN:
        m = _max_nan(_max_nan(tl.abs(e0), tl.abs(o0)), _max_nan(tl.abs(e1), tl.abs(o1)))
        return tl.reduce(m, 2, _max_nan)
    else:
        m = tl.maximum(tl.maximum(tl.abs(e0), tl.abs(o0)), tl.maximum(tl.abs(e1), tl.abs(o1)))
        return tl.max(m, 2)


@triton.jit
def _e4m3_rne1(v):
    """:func:`_e4m3_rne` with one rounding add: ``M = 2^(E+20)`` for ``v`` in ``[2^E, 2^(E+1))``
    (``E >= -6``; E4M3 subnormals share ``E = -6``) has ulp ``2^(E-3)``, E4M3's spacing there,
    so ``fl(v + M) - M`` is ``v`` rounded to nearest even on E4M3's grid (a carry into the next
    binade included) and the code is the ulp count plus ``8·(E + 6)``."""
    mb = tl.maximum(v.to(tl.int32, bitcast=True) & 0x7F800000, 0x3C800000) + (20 << 23)
    mf = mb.to(tl.float32, bitcast=True)
    t = v + mf
    return t - mf, t.to(tl.int32, bitcast=True) - mb + 8 * (mb >> 23) - 1128


@triton.jit
def _candidate_fast(bamax, enc, dec, INV: tl.constexpr):
    """:func:`_candidate` (same values) with :func:`_e4m3_rne1`."""
    s = tl.minimum(bamax * (enc * INV), 448.0)
    s_val, s_bits = _e4m3_rne1(s)
    f = tl.minimum(tl.math.div_rn(tl.full(s_val.shape, 1.0, tl.float32), s_val * dec), FP32_MAX)
    return s_val, s_bits, f


@triton.jit
def _rcp_kd(dec):
    """The power of two that :func:`_candidate_nb` scales ``s·dec`` by: ``2^64`` for a tensor
    whose decode scale is below ``2^-40`` (an amax below ~1e-9), else 1 (once a tensor)."""
    return tl.where(dec < 9.094947017729282e-13, 1.8446744073709552e19, 1.0)


@triton.jit
def _candidate_nb(bamax, enc, dec, kd, INV: tl.constexpr):
    """:func:`_candidate_fast` (same values) with ``f = min(RN(1/d), FP32_MAX)``, ``d = s·dec``,
    computed without the branch of an IEEE division (``div_rn`` checks its operands and calls
    a slow path for some: on sm_90 a branch and a convergence barrier a block scale, which
    split the row way's 16 per-token scale chains into separate basic blocks).

    ``dd = max(d·kd, 2^-100)`` (``kd`` from :func:`_rcp_kd`, exact: a power of two) lies in
    ``[2^-100, 2^126]`` (``d <= 448 · dec`` and ``dec <= 1/fl(2688/FP32_MAX) < 2^117``), where
    ``1/dd`` is a normal number. ``r`` = the approximate ``1/dd`` (``div.full``), refined by two
    steps ``e = fma(-dd, r, 1)`` (exact), ``r = fma(r, e, r)``: ``RN(1/dd)``, checked against
    ``div_rn`` on every FP32 value of that range on the H200 (benchmarks/profile/rcp_exhaustive.py).
    ``r·kd`` is then ``RN(1/d)`` (a power-of-two scaling; where it overflows to inf so does
    ``RN(1/d)``, and the min gives FP32_MAX as before; so does ``d < 2^-128``). A zero scale
    (an all-zero block, or one whose scale underflows E4M3: its elements are not all 0, so the
    factor matters for their codes) gives FP32_MAX, as ``1/0 = inf`` did; the floor ``2^-100``
    only keeps that lane's discarded arithmetic finite."""
    s = tl.minimum(bamax * (enc * INV), 448.0)
    s_val, s_bits = _e4m3_rne1(s)
    dd = tl.maximum((s_val * dec) * kd, 7.888609052210118e-31)
    r = 1.0 / dd
    e = tl.fma(-dd, r, 1.0)
    r = tl.fma(r, e, r)
    e = tl.fma(-dd, r, 1.0)
    r = tl.fma(r, e, r)
    return s_val, s_bits, tl.where(s_val == 0.0, FP32_MAX, tl.minimum(r * kd, FP32_MAX))


@triton.jit
def _e2m1_rne_t(a):
    """``2^23 + code`` (as FP32) of the nearest-even E2M1 magnitude of ``a >= 0`` (saturating).

    In code space the E2M1 grid is uniform: ``code = rne(g(a))`` with the piecewise-linear
    ``g(a) = min(2a, a + 2, a/2 + 4, 7)`` (slopes 2, 1, ½ on [0, 2], [2, 4], [4, 6]; E2M1's
    ties-to-even mantissa is the even code, and g maps the midpoints 0.25, 0.75, …, 3.5, 5 to
    k + ½). ``fl(u + 2^23)`` rounds ``u`` in [0, 2^23) to an integer, ties to even; each term
    below is one such rounding of an exact value (``2a``, ``a/2`` are exact inside the fma) and
    rounding is monotone, so the min of the rounded terms is the rounded min: 3 FFMA/FADD and 3
    FMNMX, no compare/select ladder. ``a = inf`` gives 7; the clamp to 6 of the contract is the
    ``7`` term."""
    t = tl.minimum(tl.fma(a, 2.0, MAGIC), a + (MAGIC + 2.0))
    return tl.minimum(t, tl.minimum(tl.fma(a, 0.5, MAGIC + 4.0), MAGIC + 7.0))


@triton.jit
def _e2m1_rne_val(a):
    """Nearest-even E2M1 *value* of ``a`` in [0, 6]: ``fl(a + M) - M`` with ``M = 2^(e+22)``,
    ``2^e = max(a, 1)`` truncated to its binade (ulp of M = E2M1's step 2^(e-1), ½ below 1).
    ``P·2^22`` is exact, so each fma rounds once: the same value as ``a + M`` then ``- M``."""
    p = (tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    t = tl.fma(p, 4194304.0, a)
    return tl.fma(p, -4194304.0, t)


@triton.jit
def _nib_rne(x, f):
    """E2M1 nibble (bit 3 = sign of ``y``) of ``y = x · f`` rounded to nearest even."""
    y = x * f
    c = _e2m1_rne_t(tl.abs(y)).to(tl.int32, bitcast=True) - MAGIC_BITS
    return tl.where(y < 0.0, c | 8, c)


@triton.jit
def _nib_sr(x, f, u):
    """E2M1 nibble of ``y = x · f`` rounded stochastically: ``floor(v) + (u < frac(v))`` with
    ``v = a / step`` (the reference's rule, the same comparison on exact values).

    ``inv = 1/step`` (2, 1, ½) from the exponent bits of ``a = min(|y|, 6)``: ``~bits & 0x7F800000``
    is ``2^(1-e)`` for ``a`` in ``[2^e, 2^(e+1))``, capped at 2 below 2 (and for 0). ``v = a·inv``
    is exact, in [0, 4). ``r = rint(v)`` by the 2^23 add; ``d = v - r`` is exact (Sterbenz) in
    [-½, ½]: if ``d >= 0`` then ``floor = r``, ``frac = d``; if ``d < 0`` then ``floor = r - 1``,
    ``frac = d + 1`` (exact: d is a multiple of ulp(v) >= 2^-24). No float->int conversions
    (those issue at 1/8 of the FP32 rate)."""
    y = x * f
    a = tl.minimum(tl.abs(y), 6.0)
    invb = tl.minimum(~a.to(tl.int32, bitcast=True) & 0x7F800000, 0x40000000)
    v = a * invb.to(tl.float32, bitcast=True)
    t = v + MAGIC
    d = v - (t - MAGIC)
    neg = d < 0.0
    frac = tl.where(neg, d + 1.0, d)
    idx = t.to(tl.int32, bitcast=True) - MAGIC_BITS + ((0x40000000 - invb) >> 22)
    idx = idx + (u < frac).to(tl.int32) - neg.to(tl.int32)
    return tl.where(y < 0.0, idx | 8, idx)


@triton.jit
def _err_terms(x, f, s_val, dec):
    """FP64 terms ``|x - q·s·dec|`` of the nearest-rounded candidate (as :func:`_half_err`)."""
    a = tl.minimum(tl.abs(x * f), 6.0)
    xhat = (_e2m1_rne_val(a) * s_val) * dec
    return tl.abs(tl.abs(x) - xhat).to(tl.float64)


@triton.jit
def _err_eo(e0, o0, e1, o1, f, s_val, dec, BM: tl.constexpr, NB: tl.constexpr):
    """[BM, NB] Σ|x - q·s·dec| over each block: FP64 sums over each half in element order, then
    low + high (the order of :func:`_half_err`'s two calls)."""
    f3 = f[:, :, None]
    s3 = s_val[:, :, None]
    lo = tl.reshape(tl.join(_err_terms(e0, f3, s3, dec), _err_terms(o0, f3, s3, dec)), (BM, NB, 8))
    hi = tl.reshape(tl.join(_err_terms(e1, f3, s3, dec), _err_terms(o1, f3, s3, dec)), (BM, NB, 8))
    return tl.sum(lo, 2) + tl.sum(hi, 2)


@triton.jit
def _pack_word(ne, no, BM: tl.constexpr, NB: tl.constexpr):
    """Nibbles of elements 2q (``ne``) and 2q+1 (``no``), q = 0..3 -> the 4 packed bytes as a
    little-endian int32 word (byte q = ne[q] | no[q] << 4)."""
    b = ne | (no << 4)
    b02, b13 = tl.split(tl.reshape(b, (BM, NB, 2, 2)))
    h = b02 | (b13 << 8)
    h0, h1 = tl.split(h)
    return h0 | (h1 << 16)


@triton.jit
def _join4(a0, a1, a2, a3, BM: tl.constexpr, NB: tl.constexpr):
    """Four [BM, NB] tensors -> [BM, NB, 4] with ``a_q`` at index q (in-thread, no data moves)."""
    return tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (BM, NB, 4))


@triton.jit
def _philox10(c0, k0, k1):
    """``tl.randint4x``'s Philox4x32-10 for the counter (c0, 0, 0, 0) and key (k0, k1), all
    uint32 — the same rounds with each ``umulhi`` / low-product pair taken from one 64-bit
    product (one IMAD.WIDE.U32 instead of IMAD.HI + IMAD)."""
    c1 = c0 * 0
    c2 = c1
    c3 = c1
    for _ in tl.static_range(10):
        pa = c0.to(tl.uint64) * 0xD2511F53
        pb = c2.to(tl.uint64) * 0xCD9E8D57
        c0 = (pb >> 32).to(tl.uint32) ^ c1 ^ k0
        c2 = (pa >> 32).to(tl.uint32) ^ c3 ^ k1
        c1 = pb.to(tl.uint32)
        c3 = pa.to(tl.uint32)
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _philox_eo(seed, rows, blks, NBLK, I64: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr):
    """Uniforms of e0, o0, e1, o1 (bytes 0..3 of the row's word of the call for (row quad,
    block, q)) — the stream of :func:`_philox_halves` / sr_stream.py. One Philox evaluation per
    (row, block, q) on [BM, NB] tensors, joined along q: the counters then live in the blocks'
    own layout (a [BM, NB, 4] arange-built counter gets a layout of its own and a shared-memory
    transpose). I64: ``tl.randint4x`` on int64 counters; else :func:`_philox10` on uint32 ones (a
    counter below 2^31 is the same value either way: ``randint4x`` takes its high word as 0)."""
    if I64:
        g, p = _sr_row_split(rows.to(tl.int64))
        base = ((g * NBLK)[:, None] + blks[None, :]) * 4
        a0, b0, c0, d0 = tl.randint4x(seed, base)
        a1, b1, c1, d1 = tl.randint4x(seed, base + 1)
        a2, b2, c2, d2 = tl.randint4x(seed, base + 2)
        a3, b3, c3, d3 = tl.randint4x(seed, base + 3)
    else:
        g, p = _sr_row_split(rows)
        base = (((g * NBLK)[:, None] + blks[None, :]) * 4).to(tl.uint32)
        s = tlc.to_tensor(seed).to(tl.uint64)       # tl.philox's key: the seed's two words
        k0 = (s & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((s >> 32) & 0xFFFFFFFF).to(tl.uint32)
        a0, b0, c0, d0 = _philox10(base, k0, k1)
        a1, b1, c1, d1 = _philox10(base + 1, k0, k1)
        a2, b2, c2, d2 = _philox10(base + 2, k0, k1)
        a3, b3, c3, d3 = _philox10(base + 3, k0, k1)
    p2 = p[:, None]
    w = _join4(_pick_word(p2, a0, b0, c0, d0), _pick_word(p2, a1, b1, c1, d1),
               _pick_word(p2, a2, b2, c2, d2), _pick_word(p2, a3, b3, c3, d3), BM, NB)
    return _sr_u8(w, 0), _sr_u8(w, 1), _sr_u8(w, 2), _sr_u8(w, 3)


@triton.jit
def _tensor_scales(gbits, M_BOUND: tl.constexpr):
    """(enc, dec) from the amax bits: reference.tensor_scales, TE's order."""
    gamax = gbits.to(tl.float32, bitcast=True)
    enc = tl.math.div_rn(M_BOUND * 6.0, gamax)
    enc = tl.minimum(enc, FP32_MAX)
    enc = tl.where(enc == 0.0, 1.0, enc)
    return enc, tl.math.div_rn(1.0, enc)


@triton.jit
def _tile_coords_2d(M, NBLK, REVERSE: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr):
    """:func:`_tile_coords` on a 2-D grid (axis 0: block tiles, axis 1: row tiles; launch order
    is the same row-major tile order) without the integer division. Also: is this the first
    tile (it stores the tensor scale)."""
    pid_b = tl.program_id(0)
    pid_m = tl.program_id(1)
    if REVERSE:
        pid_b = tl.num_programs(0) - 1 - pid_b
        pid_m = tl.num_programs(1) - 1 - pid_m
    rows = pid_m * BM + tl.arange(0, BM)
    blks = pid_b * NB + tl.arange(0, NB)
    mask2 = (rows < M)[:, None] & (blks < NBLK)[None, :]
    return rows, blks, mask2, (pid_b == 0) & (pid_m == 0)


@triton.jit
def _store_codes(data_ptr, w_lo, w_hi, rows, blks, mask2, NBLK, I64: tl.constexpr):
    """The two packed code words of each block (``data`` viewed as int32): one 8-byte store."""
    k = tl.arange(0, 2)
    if I64:
        roff = rows.to(tl.int64) * (NBLK * 2)
    else:
        roff = rows * (NBLK * 2)
    off = roff[:, None, None] + (blks * 2)[None, :, None] + k[None, None, :]
    tl.store(data_ptr + off, tl.join(w_lo, w_hi), mask=mask2[:, :, None])
