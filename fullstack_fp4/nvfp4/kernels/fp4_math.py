"""The ``@triton.jit`` arithmetic every NVFP4 kernel of the recipes is made of (no kernels, no
host code): the quantize kernels (``quantize.py``, ``quantize_two_ways.py``), the amax passes
(``amax.py``), the decode (``decode.py``), and, across packages, the NVFP4 Newton–Schulz
(``fullstack_fp4/optim/triton_ns.py``) and Q-Attn (``fullstack_fp4/attention``). Every function
is bit-exact with the pure-PyTorch reference (``nvfp4/reference.py``: the FP32 contract of
docs/nvfp4-format.md); ``quantize.py``'s docstring derives each rounding step.

* **E4M3 block scales**: :func:`e4m3_rne` (normal range by integer rounding of the FP32 bits,
  subnormals by a ``2^14`` add), :func:`e4m3_rne1` (one rounding add for every range),
  :func:`candidate_fast` / :func:`candidate_nb` (scale, its bits and the element factor
  ``1/(s·dec)``, by ``div_rn`` or branch-free), :func:`tensor_scales` (enc/dec from the amax).
* **E2M1 codes**: :func:`e2m1_code` (select ladder; nearest or stochastic), :func:`nib_rne` /
  :func:`nib_sr` (the nibble without compare ladders or float->int converts),
  :func:`e2m1_rne_t` / :func:`e2m1_rne_val` (nearest code / value by ``2^23`` additions),
  :func:`neg_where` (a true negation, so ``-0`` survives).
* **Decode of codes**: :func:`e2m1_value`, :func:`e4m3_value` (code / scale byte to FP32),
  :func:`dec_nib_bits` (``e2m1 · s`` as FP32 bits), :func:`bf16_word` (two exact values as one
  word of two BF16).
* **RHT-16 butterflies**: :func:`wht_stage`, :func:`rht16_eo` (a block in eo form),
  :func:`rht16_tokens` (16 tokens held as a tuple).
* **Stochastic rounding draws** (the stream of ``nvfp4/sr_stream.py``): :func:`philox10`
  (Philox4x32-10 written out), :func:`philox_eo`, :func:`philox_halves`, :func:`sr_u8`.
* **Layout**: the "eo" form — a 16-block as four ``[BM, NB, 4]`` FP32 tensors (even / odd
  elements of each 8-element half), BF16 read as int32 words (:func:`bf16w_to_f32`,
  :func:`load_eo`), codes packed into words (:func:`pack_word`, :func:`store_codes`), tile
  coordinates and reductions.

The sm_90 compile gate (tests/test_triton_compile_sm90.py) compiles them through the kernels
that call them.
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
def neg_where(neg, m):
    """``-m`` where ``neg``, else ``m``, as a true negation, so ``+0`` becomes ``-0``.
    A select between ``-m`` and ``m`` does not do that: the GPU image's triton 3.6 lowers a
    float's unary minus to ``0 - m``, which is ``+0`` for ``m = +0`` (triton 3.9's compiler and
    its interpreter negate), and a negative value that rounds to 0 must decode to ``-0`` like its
    code. ``m * -1.0`` is exact in IEEE arithmetic, and LLVM turns it into ``fneg`` (PTX
    ``neg.f32``), the cost of ``0 - m`` (tests/fullstack_fp4/test_triton_signed_zero.py reads
    the IR)."""
    return tl.where(neg, m * -1.0, m)


@triton.jit
def e4m3_rne(v):
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
def e2m1_code(y, u, STOCHASTIC: tl.constexpr):
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
def wht_stage(t, BM: tl.constexpr, NB: tl.constexpr, N: tl.constexpr, H: tl.constexpr):
    """One Walsh–Hadamard stage with stride H (< N) along the last axis of ``t [BM, NB, N]``:
    elements i and i + H become their sum and difference."""
    t = tl.reshape(t, (BM, NB, N // (2 * H), 2, H))
    t = tl.permute(t, (0, 1, 2, 4, 3))
    a, b = tl.split(t)                                   # a: element i, b: element i + H
    t = tl.join(a + b, a - b)
    t = tl.permute(t, (0, 1, 2, 4, 3))
    return tl.reshape(t, (BM, NB, N))


@triton.jit
def tile_coords(pid, M, NBLK, BM: tl.constexpr, NB: tl.constexpr):
    nbk = tl.cdiv(NBLK, NB)
    pid_m = pid // nbk
    pid_b = pid % nbk
    rows = pid_m * BM + tl.arange(0, BM)
    blks = pid_b * NB + tl.arange(0, NB)
    mask2 = (rows < M)[:, None] & (blks < NBLK)[None, :]
    return rows, blks, mask2


@triton.jit
def sr_u8(word, S: tl.constexpr):
    """The uniform of byte ``S`` of a Philox word, ``(byte + ½)/256`` (sr_stream.py), exact:
    the FP32 ``1 + (byte + ½)/256`` is built from bits, then 1 is subtracted (Sterbenz)."""
    b = ((word >> (8 * S)) & 0xFF).to(tl.int32)
    return ((b << 15) | 0x3F804000).to(tl.float32, bitcast=True) - 1.0


@triton.jit
def sr_row_split(rows):
    """(g(r), p(r)) of sr_stream.py: the row quad a Philox call covers, and the row's word."""
    return (rows >> 4) * 4 + ((rows & 7) >> 1), ((rows >> 3) & 1) * 2 + (rows & 1)


@triton.jit
def pick_word(p, w0, w1, w2, w3):
    """Word ``p`` (a runtime 0..3 per row, broadcast) of a Philox call's four."""
    return tl.where(p == 0, w0, tl.where(p == 1, w1, tl.where(p == 2, w2, w3)))


@triton.jit
def philox_halves(seed, rows, blks, NBLK, BM: tl.constexpr, NB: tl.constexpr):
    """Uniforms for the two halves of each block: the stream of sr_stream.py (one call per
    (row quad, block, element quad); a row keeps its word, element ``2q + b`` of the low half
    byte ``b``, of the high half byte ``2 + b``)."""
    g, p = sr_row_split(rows.to(tl.int64))
    q = tl.arange(0, 4)
    ctr = ((g * NBLK)[:, None, None] + blks[None, :, None]) * 4 + q[None, None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, ctr)
    w = pick_word(p[:, None, None], r0, r1, r2, r3)
    u_lo = tl.reshape(tl.join(sr_u8(w, 0), sr_u8(w, 1)), (BM, NB, 8))
    u_hi = tl.reshape(tl.join(sr_u8(w, 2), sr_u8(w, 3)), (BM, NB, 8))
    return u_lo, u_hi


@triton.jit
def tile_reduce_max(v, BM: tl.constexpr, NB: tl.constexpr):
    """[BM, NB] -> max over each 16-row group, broadcast back onto the 16 rows."""
    t = tl.max(tl.reshape(v, (BM // 16, 16, NB)), 1)
    return tl.reshape(tl.broadcast_to(t[:, None, :], (BM // 16, 16, NB)), (BM, NB))


@triton.jit
def tile_reduce_sum(v, BM: tl.constexpr, NB: tl.constexpr):
    t = tl.sum(tl.reshape(v, (BM // 16, 16, NB)), 1)
    return tl.reshape(tl.broadcast_to(t[:, None, :], (BM // 16, 16, NB)), (BM, NB))


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
def bf16w_to_f32(w):
    """int32 words of two BF16 -> (element in the low 16 bits, element in the high 16 bits)."""
    return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)


@triton.jit
def ld(ptrs, mask, EVICT: tl.constexpr):
    """Masked load (0 outside). EVICT: True / "evict_first": streamed once (L1 and L2
    evict-first); "evict_last": kept in L2 for a second read; False / "": default policy."""
    if EVICT == "evict_last":
        return tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_last")
    elif EVICT:
        return tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")
    else:
        return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def eo_of_quarters(qa, qb, BM: tl.constexpr, NB: tl.constexpr):
    """Elements 0..3 (qa) and 4..7 (qb) of a half -> (evens 0, 2, 4, 6; odds 1, 3, 5, 7), FP32."""
    ea, oa = tl.split(tl.reshape(qa.to(tl.float32), (BM, NB, 2, 2)))
    eb, ob = tl.split(tl.reshape(qb.to(tl.float32), (BM, NB, 2, 2)))
    e = tl.reshape(tl.permute(tl.join(ea, eb), (0, 1, 3, 2)), (BM, NB, 4))
    o = tl.reshape(tl.permute(tl.join(oa, ob), (0, 1, 3, 2)), (BM, NB, 4))
    return e, o


@triton.jit
def load_eo(ptr, rows, blks, mask2, stride, XW: tl.constexpr, I64: tl.constexpr,
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
        e0, o0 = bf16w_to_f32(ld(ptr + off, m3, EVICT))
        e1, o1 = bf16w_to_f32(ld(ptr + off + 4, m3, EVICT))
    elif ptr.dtype.element_ty == tl.float32:
        # 16-byte vectors are quarters of a block: split each into (even, odd) pairs in-thread
        # and concatenate two quarters per half (a [BM, NB, 8] FP32 load would put a half on
        # two threads and cost a shared-memory transpose).
        q = tl.arange(0, 4)
        off = roff[:, None, None] + (blks * 16)[None, :, None] + q[None, None, :]
        e0, o0 = eo_of_quarters(ld(ptr + off, m3, EVICT), ld(ptr + off + 4, m3, EVICT), BM, NB)
        e1, o1 = eo_of_quarters(ld(ptr + off + 8, m3, EVICT), ld(ptr + off + 12, m3, EVICT),
                                 BM, NB)
    else:
        j = tl.arange(0, 8)
        off = roff[:, None, None] + (blks * 16)[None, :, None] + j[None, None, :]
        h0 = ld(ptr + off, m3, EVICT)
        h1 = ld(ptr + off + 8, m3, EVICT)
        e0, o0 = tl.split(tl.reshape(h0.to(tl.float32), (BM, NB, 4, 2)))
        e1, o1 = tl.split(tl.reshape(h1.to(tl.float32), (BM, NB, 4, 2)))
    return e0, o0, e1, o1


@triton.jit
def sign4(SIGN_MASK: tl.constexpr, FIRST: tl.constexpr):
    """±1.0 for elements FIRST + 2q (q = 0..3) of the 16 signs (bit i of SIGN_MASK: s_i = -1)."""
    i = FIRST + 2 * tl.arange(0, 4)
    return 1.0 - 2.0 * ((SIGN_MASK >> i) & 1).to(tl.float32)


@triton.jit
def rht16_eo(e0, o0, e1, o1, SIGN_MASK: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr):
    """``hadamard16`` on a block in eo form with compile-time signs: × signs, strides 1, 2, 4, 8, × ¼.

    Same operations on the same operands as ``hadamard16``: stride 1 pairs (2q, 2q+1) = (e, o);
    strides 2 and 4 pair q with q+1, q+2 inside each 4-vector; stride 8 pairs the halves. The
    signs are constants per register, so ``x · (±1)`` folds into the first adds (exact)."""
    e0 = e0 * sign4(SIGN_MASK, 0)[None, None, :]
    o0 = o0 * sign4(SIGN_MASK, 1)[None, None, :]
    e1 = e1 * sign4(SIGN_MASK, 8)[None, None, :]
    o1 = o1 * sign4(SIGN_MASK, 9)[None, None, :]
    e0, o0 = e0 + o0, e0 - o0                            # stride 1
    e1, o1 = e1 + o1, e1 - o1
    e0 = wht_stage(e0, BM, NB, 4, 1)                # stride 2
    o0 = wht_stage(o0, BM, NB, 4, 1)
    e1 = wht_stage(e1, BM, NB, 4, 1)
    o1 = wht_stage(o1, BM, NB, 4, 1)
    e0 = wht_stage(e0, BM, NB, 4, 2)                # stride 4
    o0 = wht_stage(o0, BM, NB, 4, 2)
    e1 = wht_stage(e1, BM, NB, 4, 2)
    o1 = wht_stage(o1, BM, NB, 4, 2)
    e0, e1 = e0 + e1, e0 - e1                            # stride 8
    o0, o1 = o0 + o1, o0 - o1
    return e0 * 0.25, o0 * 0.25, e1 * 0.25, o1 * 0.25


@triton.jit
def max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def block_amax_eo(e0, o0, e1, o1, NAN: tl.constexpr):
    """[BM, NB] max |x| of each block; NAN: a NaN element makes its block's max NaN."""
    if NAN:
        m = max_nan(max_nan(tl.abs(e0), tl.abs(o0)), max_nan(tl.abs(e1), tl.abs(o1)))
        return tl.reduce(m, 2, max_nan)
    else:
        m = tl.maximum(tl.maximum(tl.abs(e0), tl.abs(o0)), tl.maximum(tl.abs(e1), tl.abs(o1)))
        return tl.max(m, 2)


@triton.jit
def e4m3_rne1(v):
    """:func:`e4m3_rne` with one rounding add: ``M = 2^(E+20)`` for ``v`` in ``[2^E, 2^(E+1))``
    (``E >= -6``; E4M3 subnormals share ``E = -6``) has ulp ``2^(E-3)``, E4M3's spacing there,
    so ``fl(v + M) - M`` is ``v`` rounded to nearest even on E4M3's grid (a carry into the next
    binade included) and the code is the ulp count plus ``8·(E + 6)``."""
    mb = tl.maximum(v.to(tl.int32, bitcast=True) & 0x7F800000, 0x3C800000) + (20 << 23)
    mf = mb.to(tl.float32, bitcast=True)
    t = v + mf
    return t - mf, t.to(tl.int32, bitcast=True) - mb + 8 * (mb >> 23) - 1128


@triton.jit
def candidate_fast(bamax, enc, dec, INV: tl.constexpr):
    """The E4M3 block scale ``e4m3(min(bamax · (enc · INV), 448))`` (:func:`e4m3_rne1`), its
    bits and the element factor ``f = min(div_rn(1, s · dec), FP32_MAX)``."""
    s = tl.minimum(bamax * (enc * INV), 448.0)
    s_val, s_bits = e4m3_rne1(s)
    f = tl.minimum(tl.math.div_rn(tl.full(s_val.shape, 1.0, tl.float32), s_val * dec), FP32_MAX)
    return s_val, s_bits, f


@triton.jit
def rcp_kd(dec):
    """The power of two that :func:`candidate_nb` scales ``s·dec`` by: ``2^64`` for a tensor
    whose decode scale is below ``2^-40`` (an amax below ~1e-9), else 1 (once a tensor)."""
    return tl.where(dec < 9.094947017729282e-13, 1.8446744073709552e19, 1.0)


@triton.jit
def candidate_nb(bamax, enc, dec, kd, INV: tl.constexpr):
    """:func:`candidate_fast` (same values) with ``f = min(RN(1/d), FP32_MAX)``, ``d = s·dec``,
    computed without the branch of an IEEE division (``div_rn`` checks its operands and calls
    a slow path for some: on sm_90 a branch and a convergence barrier a block scale, which
    split the row way's 16 per-token scale chains into separate basic blocks).

    ``dd = max(d·kd, 2^-100)`` (``kd`` from :func:`rcp_kd`, exact: a power of two) lies in
    ``[2^-100, 2^126]`` (``d <= 448 · dec`` and ``dec <= 1/fl(2688/FP32_MAX) < 2^117``), where
    ``1/dd`` is a normal number. ``r`` = the approximate ``1/dd`` (``div.full``), refined by two
    steps ``e = fma(-dd, r, 1)`` (exact), ``r = fma(r, e, r)``: ``RN(1/dd)``, checked against
    ``div_rn`` on every FP32 value of that range on the H200 (benchmarks/profile/rcp_exhaustive.py).
    ``r·kd`` is then ``RN(1/d)`` (a power-of-two scaling; where it overflows to inf so does
    ``RN(1/d)``, and the min gives FP32_MAX; so does ``d < 2^-128``). A zero scale
    (an all-zero block, or one whose scale underflows E4M3: its elements are not all 0, so the
    factor matters for their codes) gives FP32_MAX, as ``1/0 = inf`` would; the floor ``2^-100``
    only keeps that lane's discarded arithmetic finite."""
    s = tl.minimum(bamax * (enc * INV), 448.0)
    s_val, s_bits = e4m3_rne1(s)
    dd = tl.maximum((s_val * dec) * kd, 7.888609052210118e-31)
    r = 1.0 / dd
    e = tl.fma(-dd, r, 1.0)
    r = tl.fma(r, e, r)
    e = tl.fma(-dd, r, 1.0)
    r = tl.fma(r, e, r)
    return s_val, s_bits, tl.where(s_val == 0.0, FP32_MAX, tl.minimum(r * kd, FP32_MAX))


@triton.jit
def e2m1_rne_t(a):
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
def e2m1_rne_val(a):
    """Nearest-even E2M1 *value* of ``a`` in [0, 6]: ``fl(a + M) - M`` with ``M = 2^(e+22)``,
    ``2^e = max(a, 1)`` truncated to its binade (ulp of M = E2M1's step 2^(e-1), ½ below 1).
    ``P·2^22`` is exact, so each fma rounds once: the same value as ``a + M`` then ``- M``."""
    p = (tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    t = tl.fma(p, 4194304.0, a)
    return tl.fma(p, -4194304.0, t)


@triton.jit
def nib_rne(x, f):
    """E2M1 nibble (bit 3 = sign of ``y``) of ``y = x · f`` rounded to nearest even."""
    y = x * f
    c = e2m1_rne_t(tl.abs(y)).to(tl.int32, bitcast=True) - MAGIC_BITS
    return tl.where(y < 0.0, c | 8, c)


@triton.jit
def nib_sr(x, f, u):
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
def err_terms(x, f, s_val, dec):
    """FP64 terms ``|x - q·s·dec|`` of the nearest-rounded candidate."""
    a = tl.minimum(tl.abs(x * f), 6.0)
    xhat = (e2m1_rne_val(a) * s_val) * dec
    return tl.abs(tl.abs(x) - xhat).to(tl.float64)


@triton.jit
def err_eo(e0, o0, e1, o1, f, s_val, dec, BM: tl.constexpr, NB: tl.constexpr):
    """[BM, NB] Σ|x - q·s·dec| over each block: FP64 sums over each half in element order, then
    low + high (the reference's order)."""
    f3 = f[:, :, None]
    s3 = s_val[:, :, None]
    lo = tl.reshape(tl.join(err_terms(e0, f3, s3, dec), err_terms(o0, f3, s3, dec)), (BM, NB, 8))
    hi = tl.reshape(tl.join(err_terms(e1, f3, s3, dec), err_terms(o1, f3, s3, dec)), (BM, NB, 8))
    return tl.sum(lo, 2) + tl.sum(hi, 2)


@triton.jit
def pack_word(ne, no, BM: tl.constexpr, NB: tl.constexpr):
    """Nibbles of elements 2q (``ne``) and 2q+1 (``no``), q = 0..3 -> the 4 packed bytes as a
    little-endian int32 word (byte q = ne[q] | no[q] << 4)."""
    b = ne | (no << 4)
    b02, b13 = tl.split(tl.reshape(b, (BM, NB, 2, 2)))
    h = b02 | (b13 << 8)
    h0, h1 = tl.split(h)
    return h0 | (h1 << 16)


@triton.jit
def join4(a0, a1, a2, a3, BM: tl.constexpr, NB: tl.constexpr):
    """Four [BM, NB] tensors -> [BM, NB, 4] with ``a_q`` at index q (in-thread, no data moves)."""
    return tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (BM, NB, 4))


@triton.jit
def philox10(c0, k0, k1):
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
def philox_eo(seed, rows, blks, NBLK, I64: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr):
    """Uniforms of e0, o0, e1, o1 (bytes 0..3 of the row's word of the call for (row quad,
    block, q)) — the stream of :func:`philox_halves` / sr_stream.py. One Philox evaluation per
    (row, block, q) on [BM, NB] tensors, joined along q: the counters then live in the blocks'
    own layout (a [BM, NB, 4] arange-built counter gets a layout of its own and a shared-memory
    transpose). I64: ``tl.randint4x`` on int64 counters; else :func:`philox10` on uint32 ones (a
    counter below 2^31 is the same value either way: ``randint4x`` takes its high word as 0)."""
    if I64:
        g, p = sr_row_split(rows.to(tl.int64))
        base = ((g * NBLK)[:, None] + blks[None, :]) * 4
        a0, b0, c0, d0 = tl.randint4x(seed, base)
        a1, b1, c1, d1 = tl.randint4x(seed, base + 1)
        a2, b2, c2, d2 = tl.randint4x(seed, base + 2)
        a3, b3, c3, d3 = tl.randint4x(seed, base + 3)
    else:
        g, p = sr_row_split(rows)
        base = (((g * NBLK)[:, None] + blks[None, :]) * 4).to(tl.uint32)
        s = tlc.to_tensor(seed).to(tl.uint64)       # tl.philox's key: the seed's two words
        k0 = (s & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((s >> 32) & 0xFFFFFFFF).to(tl.uint32)
        a0, b0, c0, d0 = philox10(base, k0, k1)
        a1, b1, c1, d1 = philox10(base + 1, k0, k1)
        a2, b2, c2, d2 = philox10(base + 2, k0, k1)
        a3, b3, c3, d3 = philox10(base + 3, k0, k1)
    p2 = p[:, None]
    w = join4(pick_word(p2, a0, b0, c0, d0), pick_word(p2, a1, b1, c1, d1),
               pick_word(p2, a2, b2, c2, d2), pick_word(p2, a3, b3, c3, d3), BM, NB)
    return sr_u8(w, 0), sr_u8(w, 1), sr_u8(w, 2), sr_u8(w, 3)


@triton.jit
def tensor_scales(gbits, M_BOUND: tl.constexpr):
    """(enc, dec) from the amax bits: reference.tensor_scales, TE's order."""
    gamax = gbits.to(tl.float32, bitcast=True)
    enc = tl.math.div_rn(M_BOUND * 6.0, gamax)
    enc = tl.minimum(enc, FP32_MAX)
    enc = tl.where(enc == 0.0, 1.0, enc)
    return enc, tl.math.div_rn(1.0, enc)


@triton.jit
def tile_coords_2d(M, NBLK, REVERSE: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr):
    """:func:`tile_coords` on a 2-D grid (axis 0: block tiles, axis 1: row tiles; launch order
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
def store_codes(data_ptr, w_lo, w_hi, rows, blks, mask2, NBLK, I64: tl.constexpr):
    """The two packed code words of each block (``data`` viewed as int32): one 8-byte store."""
    k = tl.arange(0, 2)
    if I64:
        roff = rows.to(tl.int64) * (NBLK * 2)
    else:
        roff = rows * (NBLK * 2)
    off = roff[:, None, None] + (blks * 2)[None, :, None] + k[None, None, :]
    tl.store(data_ptr + off, tl.join(w_lo, w_hi), mask=mask2[:, :, None])


# ----------------------------------------------------------------------------- decode of codes
@triton.jit
def e2m1_value(c):
    """E2M1 code (int32, bit 3 = sign) -> FP32 value: ``m · 0.5`` for ``m < 4``, else ``m − 2``
    except ``7 → 6``; code 8 decodes to ``-0.0`` like the reference."""
    m = c & 7
    mag = tl.where(m < 4, m.to(tl.float32) * 0.5, tl.where(m == 7, 6.0, (m - 2).to(tl.float32)))
    # the sign as a bit: `where(sign, -mag, mag)` gives +0.0 for code 8 on sm_90 (triton 3.6
    # lowers the unary minus to 0 - mag), where the reference decodes -0.0
    return (mag.to(tl.int32, bitcast=True) | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_value(b):
    """E4M3 byte (int32, never NaN here) -> FP32: ``e = b >> 3``, ``m = b & 7``; ``e == 0``:
    ``m · 2⁻⁹`` (subnormal), else the FP32 bits ``((e + 120) << 23) | (m << 20)``."""
    e = b >> 3
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
def dec_nib_bits(nib, s_val):
    """FP32 bits of ``e2m1(nib) · s`` (exact): magnitude bits from the 3-bit code (0, ½ below
    2; ``(c << 22) + bits(0.5)`` from 2 on: 1, 1.5, 2, 3, 4, 6), × s, the nibble's sign bit."""
    c = nib & 7
    mag = tl.where(c >= 2, (c << 22) + 0x3F000000, c * 0x3F000000).to(tl.float32, bitcast=True)
    return ((mag * s_val).to(tl.int32, bitcast=True)) | ((nib & 8) << 28)


@triton.jit
def bf16_word(lo_bits, hi_bits):
    """Two exact-in-BF16 FP32 bit patterns -> one int32 word (``lo`` in the low 16 bits)."""
    return (hi_bits & -65536) | ((lo_bits >> 16) & 0xFFFF)


# ----------------------------------------------------------------------------- RHT on token tuples
@triton.jit
def rht16_tokens(v, SIGNS: tl.constexpr, STAGES: tl.constexpr = 4):
    """hadamard16 along the tuple (the 16 tokens of a block): × signs, strides 1, 2, 4, 8, × ¼.
    ``SIGNS`` has bit i set where s_i = −1: ``x · (−1)`` is written ``−x`` (the same value, an
    exact negation), which the compiler folds into the first butterfly's adds. ``STAGES`` < 4:
    only the first butterflies, without the ``× ¼`` (for the amax pass, ``amax._rht16_abs_max``)."""
    s = ()
    for i in tl.static_range(16):
        if ((SIGNS >> i) & 1) != 0:
            s = s + (-v[i],)
        else:
            s = s + (v[i],)
    for k in tl.static_range(STAGES):
        o = ()
        for i in tl.static_range(16):
            if (i & (1 << k)) == 0:
                o = o + (s[i] + s[i + (1 << k)],)
            else:
                o = o + (s[i - (1 << k)] - s[i],)
        s = o
    if STAGES < 4:
        return s
    o = ()
    for i in tl.static_range(16):
        o = o + (s[i] * 0.25,)
    return o
