"""Triton NVFP4 quantize kernels: fused amax, 1×16 / 16×16 tiles, nearest / stochastic, 4/6, RHT-16.

Bit-exact with :func:`fullstack_fp4.nvfp4.reference.quantize_reference` (the oracle; see its
docstring and docs/nvfp4-format.md for the contract). Every FP32 operation below is the
reference's, in the reference's order; what a kernel adds is *how* each step is computed:

* **Tensor scales.** ``enc = min(div_rn(M·6, amax), FP32_MAX)``, ``enc = 1`` if ``enc == 0``,
  ``dec = div_rn(1, enc)``. ``div_rn`` is IEEE round-to-nearest division (Triton's ``/`` on
  FP32 is ``div.full.f32``, an approximation with 2 ulp error, so it is never used for a value
  that reaches the output). Each program recomputes enc/dec from the amax (two divisions per
  program, nothing next to its 4096+ elements); program 0 stores ``dec`` as the tensor scale.
  As in the reference (TE's order), an all-zero tensor gets ``enc = FP32_MAX`` and a subnormal
  ``dec``: the kernels never flush subnormals (no ``.ftz``), so this is reproduced.
* **Block scale.** ``s = e4m3_rne(min(bamax · (enc · fp32(1/6)), 448))`` (1/4 for the map-to-4
  candidate), rounded to E4M3 in integer arithmetic (:func:`_e4m3_rne`): normal range by adding
  ``0x7FFFF + lsb`` to the FP32 bits and truncating 20 mantissa bits (RNE to 3 bits; the carry
  moves into the exponent on its own); below 2⁻⁶ (E4M3 subnormals, quantum 2⁻⁹) by
  ``(v + 2¹⁴) − 2¹⁴``, whose FP32 ulp is exactly 2⁻⁹ so the hardware's RNE addition does the
  rounding. Tested against ``torch.Tensor.to(torch.float8_e4m3fn)`` on every E4M3 midpoint.
  The same code runs under the interpreter and on the GPU (no reliance on a backend's fp8 cvt).
  The eo kernel uses :func:`_e4m3_rne1` (one rounding add ``v + 2^(E+20)`` for every range,
  subnormals included; same values).
* **Element factor.** ``f = min(div_rn(1, fp32(s) · dec), FP32_MAX)``: a zero scale gives
  ``f = FP32_MAX`` (TE), so non-zero elements of such a block saturate to ±6 and decode to 0.
* **E2M1 rounding** of ``a = |clamp(x·f, −6, 6)|`` (:func:`_e2m1_code`): with ``inv`` = 2, 1, ½
  for ``a`` in [0, 2), [2, 4), [4, 6] (the reciprocal of the grid step), ``t = a · inv`` is exact
  and the grid point index inside the binade is ``rint(t)`` (nearest) or ``floor(t) + (u <
  t − floor(t))`` (stochastic). ``rint`` is ``bits(t + 2²³) & 7``: ``t + 2²³`` has ulp 1, so the
  FP32 addition rounds ``t`` to an integer with ties to even, and ties-to-even on the index is
  ties-to-even on the E2M1 mantissa (0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4). The
  code is the index plus 2 per binade boundary crossed; the sign bit comes from ``y < 0`` (so
  ``-0`` gets code 8 like the reference / TE, and ``y == -0.0`` gets 0). ``t − floor(t)`` equals
  the contract's ``(a − lo) / (hi − lo)`` exactly (both exact in FP32). The eo kernel, without
  compare/select ladders or float->int conversions (:func:`_e2m1_rne_t`, :func:`_nib_sr`):
  nearest is ``rne(min(2a, a + 2, a/2 + 4, 7))`` in code space (three roundings at 2²³, the
  min of the rounded terms is the rounded min); stochastic takes ``inv`` from the exponent
  bits, ``r = rint(a·inv)`` and ``d = a·inv − r`` (exact), and the index
  ``r − [d < 0] + [u < (d < 0 ? d + 1 : d)]`` (= ``floor + [u < frac]``).
* **4/6.** Both candidates are rounded to nearest; ``err = Σ |x − (q · s) · dec|`` with each term
  in FP32 and the sum in FP64 (``(q · s)`` is exact; ``| |x| − r·s·dec |`` equals
  ``|x − q·s·dec|`` bit for bit since ``q`` has ``x``'s sign); keep 4 iff ``err4 < err6``.
  Both kernels sum each 8-element half in element order, then low + high.
* **FMA contraction is disabled** (``enable_fp_fusion=False`` at every launch): a fused
  ``x·f − lo`` or ``x − q·s·dec`` would skip a rounding the reference performs.

**Fused amax.** When ``global_amax`` is not given, a first kernel (:func:`_amax_kernel`) reads
``x`` once, each program reduces ``|x|`` over its tile and does **one** ``atomic_max`` on the
FP32 bit pattern viewed as int32 (for non-negative floats integer order is float order; NaN
bit patterns are above +Inf, so a NaN cannot be lost the way ``max`` on floats may drop it;
the eo kernel takes a NaN-propagating float max, ``max.NaN``, whose NaN is positive).
The quantize kernel then reads ``x`` a second time and takes the amax from device memory: no
host round trip between the two kernels; the host checks finiteness once, after both are
queued (``.item()``), and raises ``ValueError`` (the codes computed from a non-finite amax are
thrown away). To recover part of the second read from L2, the quantize kernel walks its tiles
in reverse order after an amax pass (the amax pass finished on the tensor's tail, which is
what is still in L2). With ``global_amax`` given, ``x`` is read once; the quantize kernel then
tracks the observed amax the same way (one atomic per program) only to detect NaN/Inf (the eo
kernel: from its block maxima, taken NaN-propagating in that mode).

**RHT-16 fused.** With ``rht_signs``, each 16-block is transformed in registers before
anything else, with :func:`fullstack_fp4.nvfp4.hadamard.hadamard16`'s arithmetic: × signs
(exact), butterflies with strides 1, 2, 4, 8 (``(a + b, a − b)``), × 0.25 (exact). The global
amax must then be the amax of the *transformed* tensor, because the block scales and the
tensor scale are computed from the transformed values (a block whose transformed max exceeds
the raw amax would otherwise get a scale above 448·enc/6 and saturate); so the amax pass
applies the same transform. The result equals ``quantize_reference(hadamard16(x, signs))``
bit for bit. A caller that passes ``global_amax`` together with ``rht_signs`` must pass the
amax of the transformed tensor.

**Stochastic rounding.** ``rand`` (FP32 uniforms, shape of ``x``) is read if given (tests);
otherwise uniforms come from Triton's Philox (``tl.randint4x``, 10 rounds) in the kernel:
element ``(row, 16·blk + 8·h + 2·g + b)`` (``h, b ∈ {0,1}``, ``g ∈ 0..3``) takes output
``2·h + b`` of Philox counter ``(row·(K/16) + blk)·4 + g`` under ``seed``, converted by
``tl.random.uint_to_uniform_float`` (so one Philox evaluation serves 4 elements). The eo
kernel evaluates the same Philox4x32-10 rounds itself (:func:`_philox10`: one 64-bit product
per ``umulhi``/low pair) on int32 counters; a test compares it with ``tl.randint4x``'s stream.
:func:`philox_uniforms` dumps exactly those uniforms, so a test can hand them to the reference.

**Layout.** A program owns ``BLOCK_M`` rows × ``BLOCK_B`` 16-blocks. Each block is loaded as two
8-element halves (columns ``16·blk + 0..7`` and ``16·blk + 8..15``), so each thread holds whole
halves in registers as 16-byte vectors (BF16) and every per-block reduction, RHT butterfly and
nibble packing stays inside a thread; the two loads together cover every byte of the tile.

**Two kernels.** ``quantize_triton`` runs the *eo* kernels (the fast-path helpers below): a block
held as even / odd elements of each half (BF16 read as int32 words: one integer op a value),
int32 offsets unless an offset may reach 2³¹ (``I64``, chosen on the host), a 2-D grid (no
integer division), compile-time RHT signs, two blocks a thread for nearest rounding, the 8
code bytes of a block in one 8-byte store. ``legacy=True`` runs the previous kernels, kept as
the benchmark's before/after baseline (and tested bit-exact like the eo ones). SASS counts
and predictions: PERF.md; ``scripts/bench_nvfp4_quantize.py --sass`` reproduces the counts.
"""

from __future__ import annotations

import math
import struct
from typing import Optional

import torch
import triton
import triton.language as tl
# `to_tensor` lives in triton.language.core; triton >= 3.7 also exports it as tl.to_tensor, the
# 3.6 of the GPU image does not (tl.philox itself calls it through core)
from triton.language import core as tlc

from .hadamard import DEFAULT_SIGNS
from .tensor import NVFP4Tensor

__all__ = ["quantize_triton", "amax_triton", "philox_uniforms", "e4m3_rne_triton",
           "e2m1_round_triton", "rounding_probe_triton"]

FP32_MAX = tl.constexpr(3.4028234663852886e38)  # a plain global is invisible to compiled kernels
# NaN as its bit pattern: a NaN constexpr never compares equal to itself, so Triton would
# think the global changed and refuse every launch after the first.
NAN_BITS = tl.constexpr(0x7FC00000)
INV6 = tl.constexpr(0.1666666716337204)  # fp32(1/6) = torch.reciprocal(6.0), exact; constexpr: used in kernels
_SCALE_RULES = {"6": 448.0, "4over6": 256.0}
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------- jit helpers
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
def _bfly8(t, BM: tl.constexpr, NB: tl.constexpr, H: tl.constexpr):
    """One Walsh–Hadamard stage with stride H (1, 2, 4) along the last axis (size 8)."""
    t = tl.reshape(t, (BM, NB, 8 // (2 * H), 2, H))
    t = tl.permute(t, (0, 1, 2, 4, 3))
    a, b = tl.split(t)                                   # a: element i, b: element i + H
    t = tl.join(a + b, a - b)
    t = tl.permute(t, (0, 1, 2, 4, 3))
    return tl.reshape(t, (BM, NB, 8))


@triton.jit
def _rht16(lo, hi, signs_ptr, BM: tl.constexpr, NB: tl.constexpr):
    """hadamard16 on blocks held as halves (elements 0..7, 8..15): ×signs, strides 1,2,4,8, ×¼."""
    j = tl.arange(0, 8)
    lo = lo * tl.load(signs_ptr + j)[None, None, :]
    hi = hi * tl.load(signs_ptr + 8 + j)[None, None, :]
    lo = _bfly8(lo, BM, NB, 1)
    hi = _bfly8(hi, BM, NB, 1)
    lo = _bfly8(lo, BM, NB, 2)
    hi = _bfly8(hi, BM, NB, 2)
    lo = _bfly8(lo, BM, NB, 4)
    hi = _bfly8(hi, BM, NB, 4)
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
def _philox_halves(seed, rows, blks, NBLK, BM: tl.constexpr, NB: tl.constexpr):
    """Uniforms for the two halves of each block (mapping in the module docstring)."""
    g = tl.arange(0, 4)
    ctr = ((rows.to(tl.int64) * NBLK)[:, None, None] + blks[None, :, None]) * 4 + g[None, None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, ctr)
    u0 = tl.random.uint_to_uniform_float(r0)
    u1 = tl.random.uint_to_uniform_float(r1)
    u2 = tl.random.uint_to_uniform_float(r2)
    u3 = tl.random.uint_to_uniform_float(r3)
    # element 2g + b of the low half takes output b, of the high half output 2 + b
    u_lo = tl.reshape(tl.join(u0, u1), (BM, NB, 8))
    u_hi = tl.reshape(tl.join(u2, u3), (BM, NB, 8))
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
def _bfly4(t, BM: tl.constexpr, NB: tl.constexpr, H: tl.constexpr):
    """One Walsh–Hadamard stage with stride H (1, 2) along the last axis (size 4)."""
    t = tl.reshape(t, (BM, NB, 4 // (2 * H), 2, H))
    t = tl.permute(t, (0, 1, 2, 4, 3))
    a, b = tl.split(t)                                   # a: element q, b: element q + H
    t = tl.join(a + b, a - b)
    t = tl.permute(t, (0, 1, 2, 4, 3))
    return tl.reshape(t, (BM, NB, 4))


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
    e0 = _bfly4(e0, BM, NB, 1)                           # stride 2
    o0 = _bfly4(o0, BM, NB, 1)
    e1 = _bfly4(e1, BM, NB, 1)
    o1 = _bfly4(o1, BM, NB, 1)
    e0 = _bfly4(e0, BM, NB, 2)                           # stride 4
    o0 = _bfly4(o0, BM, NB, 2)
    e1 = _bfly4(e1, BM, NB, 2)
    o1 = _bfly4(o1, BM, NB, 2)
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
    """Uniforms of e0, o0, e1, o1: Philox outputs 0..3 of counter (row·NBLK + blk)·4 + q — the
    stream of :func:`_philox_halves`. One Philox evaluation per (block, q) on [BM, NB] tensors,
    joined along q: the counters then live in the blocks' own layout (a [BM, NB, 4]
    arange-built counter gets a layout of its own and a shared-memory transpose). I64:
    ``tl.randint4x`` on int64 counters; else :func:`_philox10` on uint32 ones (a counter below
    2^31 is the same value either way: ``randint4x`` takes its high word as 0)."""
    if I64:
        base = ((rows.to(tl.int64) * NBLK)[:, None] + blks[None, :]) * 4
        a0, b0, c0, d0 = tl.randint4x(seed, base)
        a1, b1, c1, d1 = tl.randint4x(seed, base + 1)
        a2, b2, c2, d2 = tl.randint4x(seed, base + 2)
        a3, b3, c3, d3 = tl.randint4x(seed, base + 3)
    else:
        base = (((rows * NBLK)[:, None] + blks[None, :]) * 4).to(tl.uint32)
        s = tlc.to_tensor(seed).to(tl.uint64)       # tl.philox's key: the seed's two words
        k0 = (s & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((s >> 32) & 0xFFFFFFFF).to(tl.uint32)
        a0, b0, c0, d0 = _philox10(base, k0, k1)
        a1, b1, c1, d1 = _philox10(base + 1, k0, k1)
        a2, b2, c2, d2 = _philox10(base + 2, k0, k1)
        a3, b3, c3, d3 = _philox10(base + 3, k0, k1)
    u0 = tl.random.uint_to_uniform_float(_join4(a0, a1, a2, a3, BM, NB))
    u1 = tl.random.uint_to_uniform_float(_join4(b0, b1, b2, b3, BM, NB))
    u2 = tl.random.uint_to_uniform_float(_join4(c0, c1, c2, c3, BM, NB))
    u3 = tl.random.uint_to_uniform_float(_join4(d0, d1, d2, d3, BM, NB))
    return u0, u1, u2, u3


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


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _amax_kernel(x_ptr, signs_ptr, amax_ptr, M, NBLK, stride_xm, tail_row,
                 RHT: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr, XW: tl.constexpr,
                 I64: tl.constexpr, SIGN_MASK: tl.constexpr, GRID2D: tl.constexpr,
                 LEGACY: tl.constexpr):
    """Global amax (of the RHT-transformed values if RHT): one atomic_max on int32 bits per program.

    The max is NaN-propagating (``max.NaN``; a NaN comes out as a positive NaN, whose bits order
    above +Inf's). Row tiles from ``tail_row`` on are loaded ``evict_last`` (the quantize pass,
    which walks the tiles in reverse, reads them first; see AMAX_L2_TAIL_BYTES). LEGACY: the
    previous kernel (integer max of the bits), kept as the benchmark baseline."""
    if GRID2D:
        rows, blks, mask2, _ = _tile_coords_2d(M, NBLK, False, BM, NB)
    else:
        rows, blks, mask2 = _tile_coords(tl.program_id(0), M, NBLK, BM, NB)
    if LEGACY:
        lo, hi = _load_halves(x_ptr, rows, blks, mask2, stride_xm, False)
        if RHT:
            lo, hi = _rht16(lo, hi, signs_ptr, BM, NB)
        m = tl.maximum(_abs_bits_max(lo), _abs_bits_max(hi))
    else:
        if GRID2D:
            row0 = tl.program_id(1) * BM
        else:
            row0 = tl.program_id(0) // tl.cdiv(NBLK, NB) * BM
        if row0 >= tail_row:
            e0, o0, e1, o1 = _load_eo(x_ptr, rows, blks, mask2, stride_xm, XW, I64, "evict_last",
                                      BM, NB)
        else:
            e0, o0, e1, o1 = _load_eo(x_ptr, rows, blks, mask2, stride_xm, XW, I64, False, BM, NB)
        if RHT:
            e0, o0, e1, o1 = _rht16_eo(e0, o0, e1, o1, SIGN_MASK, BM, NB)
        bm = _block_amax_eo(e0, o0, e1, o1, True)
        m = tl.reduce(tl.reduce(bm, 1, _max_nan), 0, _max_nan).to(tl.int32, bitcast=True)
    tl.atomic_max(amax_ptr, m)


@triton.jit
def _quantize_tile_v0(x_ptr, rand_ptr, signs_ptr, amax_ptr, obs_ptr, data_ptr, scale_ptr,
                      dec_ptr, seed, amax_imm, pid, rows, blks, mask2, NBLK, stride_xm, stride_rm,
                      M_BOUND: tl.constexpr, TILE2D: tl.constexpr, STOCHASTIC: tl.constexpr,
                      PHILOX: tl.constexpr, FOUR_OVER_SIX: tl.constexpr, RHT: tl.constexpr,
                      TRACK_AMAX: tl.constexpr, AMAX_IMM: tl.constexpr,
                      BM: tl.constexpr, NB: tl.constexpr):
    """The previous quantize kernel body (commit 59f31f4), unchanged: the benchmark baseline."""
    lo, hi = _load_halves(x_ptr, rows, blks, mask2, stride_xm, True)
    if RHT:
        lo, hi = _rht16(lo, hi, signs_ptr, BM, NB)
    if TRACK_AMAX:
        tl.atomic_max(obs_ptr, tl.maximum(_abs_bits_max(lo), _abs_bits_max(hi)))

    # Tensor scales (reference.tensor_scales, TE's order).
    if AMAX_IMM:
        gbits = amax_imm                       # host number: its FP32 bits, no device read
    else:
        gbits = tl.load(amax_ptr)
    gamax = gbits.to(tl.float32, bitcast=True)
    enc = tl.math.div_rn(M_BOUND * 6.0, gamax)
    enc = tl.minimum(enc, FP32_MAX)
    enc = tl.where(enc == 0.0, 1.0, enc)
    dec = tl.math.div_rn(1.0, enc)
    if pid == 0:
        bad = ((gbits & 0x7FFFFFFF) >= 0x7F800000) | (gamax < 0.0)
        nan = tl.full(dec.shape, NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
        tl.store(dec_ptr, tl.where(bad, nan, dec))

    bamax = tl.maximum(tl.max(tl.abs(lo), 2), tl.max(tl.abs(hi), 2))    # [BM, NB]
    if TILE2D:
        bamax = _tile_reduce_max(bamax, BM, NB)
    s_val, s_bits, f = _candidate(bamax, enc, dec, 0.1666666716337204)
    if FOUR_OVER_SIX:
        s4_val, s4_bits, f4 = _candidate(bamax, enc, dec, 0.25)
        err6 = _half_err(lo, f, s_val, dec) + _half_err(hi, f, s_val, dec)
        err4 = _half_err(lo, f4, s4_val, dec) + _half_err(hi, f4, s4_val, dec)
        if TILE2D:
            err6 = _tile_reduce_sum(err6, BM, NB)
            err4 = _tile_reduce_sum(err4, BM, NB)
        use4 = err4 < err6                                                 # ties go to 6
        s_bits = tl.where(use4, s4_bits, s_bits)
        f = tl.where(use4, f4, f)

    if STOCHASTIC:
        if PHILOX:
            u_lo, u_hi = _philox_halves(seed, rows, blks, NBLK, BM, NB)
        else:
            u_lo, u_hi = _load_halves(rand_ptr, rows, blks, mask2, stride_rm, True)
    else:
        u_lo = lo
        u_hi = hi
    y_lo = tl.minimum(tl.maximum(lo * f[:, :, None], -6.0), 6.0)
    y_hi = tl.minimum(tl.maximum(hi * f[:, :, None], -6.0), 6.0)
    c_lo, _ = _e2m1_code(y_lo, u_lo, STOCHASTIC)
    c_hi, _ = _e2m1_code(y_hi, u_hi, STOCHASTIC)
    _pack_store(data_ptr, c_lo, c_hi, rows, blks, mask2, NBLK * 8, BM, NB)
    soff = rows.to(tl.int64)[:, None] * NBLK + blks[None, :]
    tl.store(scale_ptr + soff, s_bits.to(tl.uint8), mask=mask2)


@triton.jit(do_not_specialize=["seed", "amax_imm"])
def _quantize_kernel(x_ptr, rand_ptr, signs_ptr, amax_ptr, obs_ptr,
                     data_ptr, scale_ptr, dec_ptr, seed, amax_imm,
                     M, NBLK, stride_xm, stride_rm,
                     M_BOUND: tl.constexpr, TILE2D: tl.constexpr, STOCHASTIC: tl.constexpr,
                     PHILOX: tl.constexpr, FOUR_OVER_SIX: tl.constexpr, RHT: tl.constexpr,
                     TRACK_AMAX: tl.constexpr, REVERSE: tl.constexpr, AMAX_IMM: tl.constexpr,
                     BM: tl.constexpr, NB: tl.constexpr, XW: tl.constexpr, I64: tl.constexpr,
                     SIGN_MASK: tl.constexpr, GRID2D: tl.constexpr, LEGACY: tl.constexpr):
    """One [BM rows × NB blocks] tile (GRID2D: of a 2-D grid, see :func:`_tile_coords_2d`).

    LEGACY: :func:`_quantize_tile_v0` (``data_ptr`` uint8); else the eo-form path
    (``data_ptr`` int32 words; XW, I64, SIGN_MASK as in :func:`_load_eo`, :func:`_rht16_eo`)."""
    if LEGACY:
        pid = tl.program_id(0)
        if REVERSE:
            pid = tl.num_programs(0) - 1 - pid
        rows, blks, mask2 = _tile_coords(pid, M, NBLK, BM, NB)
        _quantize_tile_v0(x_ptr, rand_ptr, signs_ptr, amax_ptr, obs_ptr, data_ptr, scale_ptr,
                          dec_ptr, seed, amax_imm, pid, rows, blks, mask2, NBLK, stride_xm,
                          stride_rm, M_BOUND, TILE2D, STOCHASTIC, PHILOX, FOUR_OVER_SIX, RHT,
                          TRACK_AMAX, AMAX_IMM, BM, NB)
    else:
        if GRID2D:
            rows, blks, mask2, first = _tile_coords_2d(M, NBLK, REVERSE, BM, NB)
        else:
            pid = tl.program_id(0)
            if REVERSE:
                pid = tl.num_programs(0) - 1 - pid
            rows, blks, mask2 = _tile_coords(pid, M, NBLK, BM, NB)
            first = pid == 0
        e0, o0, e1, o1 = _load_eo(x_ptr, rows, blks, mask2, stride_xm, XW, I64, True, BM, NB)
        if RHT:
            e0, o0, e1, o1 = _rht16_eo(e0, o0, e1, o1, SIGN_MASK, BM, NB)
        # NaN-propagating block max when the observed amax is tracked (NaN/Inf detection).
        bamax = _block_amax_eo(e0, o0, e1, o1, TRACK_AMAX)                  # [BM, NB]
        if TRACK_AMAX:
            obs = tl.reduce(tl.reduce(bamax, 1, _max_nan), 0, _max_nan)
            tl.atomic_max(obs_ptr, obs.to(tl.int32, bitcast=True))

        if AMAX_IMM:
            gbits = amax_imm                   # host number: its FP32 bits, no device read
        else:
            gbits = tl.load(amax_ptr)
        enc, dec = _tensor_scales(gbits, M_BOUND)
        if first:
            # A non-finite (or negative) amax poisons the tensor scale: every product with this
            # tensor is NaN, so a caller that skips the host check still cannot train on garbage.
            bad = ((gbits & 0x7FFFFFFF) >= 0x7F800000) | (gbits.to(tl.float32, bitcast=True) < 0.0)
            nan = tl.full(dec.shape, NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
            tl.store(dec_ptr, tl.where(bad, nan, dec))

        if TILE2D:
            bamax = _tile_reduce_max(bamax, BM, NB)
        s_val, s_bits, f = _candidate_fast(bamax, enc, dec, 0.1666666716337204)
        if FOUR_OVER_SIX:
            s4_val, s4_bits, f4 = _candidate_fast(bamax, enc, dec, 0.25)
            err6 = _err_eo(e0, o0, e1, o1, f, s_val, dec, BM, NB)
            err4 = _err_eo(e0, o0, e1, o1, f4, s4_val, dec, BM, NB)
            if TILE2D:
                err6 = _tile_reduce_sum(err6, BM, NB)
                err4 = _tile_reduce_sum(err4, BM, NB)
            use4 = err4 < err6                                             # ties go to 6
            s_bits = tl.where(use4, s4_bits, s_bits)
            f = tl.where(use4, f4, f)

        f3 = f[:, :, None]
        if STOCHASTIC:
            if PHILOX:
                u0, u1, u2, u3 = _philox_eo(seed, rows, blks, NBLK, I64, BM, NB)
            else:
                u0, u1, u2, u3 = _load_eo(rand_ptr, rows, blks, mask2, stride_rm, False, I64, True,
                                          BM, NB)
            n0 = _nib_sr(e0, f3, u0)
            n1 = _nib_sr(o0, f3, u1)
            n2 = _nib_sr(e1, f3, u2)
            n3 = _nib_sr(o1, f3, u3)
        else:
            n0 = _nib_rne(e0, f3)
            n1 = _nib_rne(o0, f3)
            n2 = _nib_rne(e1, f3)
            n3 = _nib_rne(o1, f3)
        _store_codes(data_ptr, _pack_word(n0, n1, BM, NB), _pack_word(n2, n3, BM, NB), rows, blks,
                     mask2, NBLK, I64)
        if I64:
            soff = rows.to(tl.int64)[:, None] * NBLK + blks[None, :]
        else:
            soff = rows[:, None] * NBLK + blks[None, :]
        # One byte a block, stored from the registers that computed it: without the hint Triton
        # re-lays the [BM, NB] bytes out for 2-byte vector stores (a shared-memory transpose).
        soff = tl.max_contiguous(soff, [1, 1])
        tl.store(scale_ptr + soff, s_bits.to(tl.uint8), mask=mask2)


@triton.jit
def _philox_uniforms_kernel(u_ptr, seed, M, NBLK, BM: tl.constexpr, NB: tl.constexpr):
    rows, blks, mask2 = _tile_coords(tl.program_id(0), M, NBLK, BM, NB)
    u_lo, u_hi = _philox_halves(seed, rows, blks, NBLK, BM, NB)
    j = tl.arange(0, 8)
    off = (rows.to(tl.int64) * NBLK * 16)[:, None, None] + (blks * 16)[None, :, None] + j[None, None, :]
    tl.store(u_ptr + off, u_lo, mask=mask2[:, :, None])
    tl.store(u_ptr + off + 8, u_hi, mask=mask2[:, :, None])


@triton.jit
def _elementwise_probe_kernel(v_ptr, u_ptr, s_out, s_bits_out, c_out, s1_out, s1_bits_out,
                              c_rne_out, r_val_out, c_sr_out, n, BLOCK: tl.constexpr):
    """Test hook: the E4M3 and E2M1 helpers applied elementwise (``v``; ``u`` the uniforms of
    the stochastic one): the legacy ones (:func:`_e4m3_rne`, :func:`_e2m1_code`) and the
    fast-path ones (:func:`_e4m3_rne1`, :func:`_nib_rne`, :func:`_e2m1_rne_val`,
    :func:`_nib_sr`, all with ``f = 1``)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    v = tl.load(v_ptr + i, mask=m, other=0.0)
    u = tl.load(u_ptr + i, mask=m, other=0.0)
    sv, sb = _e4m3_rne(tl.minimum(tl.abs(v), 448.0))
    c, _ = _e2m1_code(tl.minimum(tl.maximum(v, -6.0), 6.0), v, False)
    tl.store(s_out + i, sv, mask=m)
    tl.store(s_bits_out + i, sb, mask=m)
    tl.store(c_out + i, c, mask=m)
    sv1, sb1 = _e4m3_rne1(tl.minimum(tl.abs(v), 448.0))
    tl.store(s1_out + i, sv1, mask=m)
    tl.store(s1_bits_out + i, sb1, mask=m)
    tl.store(c_rne_out + i, _nib_rne(v, 1.0), mask=m)
    tl.store(r_val_out + i, _e2m1_rne_val(tl.minimum(tl.abs(v), 6.0)), mask=m)
    tl.store(c_sr_out + i, _nib_sr(v, 1.0, u), mask=m)


# ----------------------------------------------------------------------------- host side
_INTERPRET = None


def _is_interpreter() -> bool:
    """TRITON_INTERPRET as triton.jit saw it (it decides at decoration time), read once."""
    global _INTERPRET
    if _INTERPRET is None:
        import os
        _INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return _INTERPRET


def _cdiv(a: int, b: int) -> int:
    # triton.cdiv / next_power_of_2 are @jit functions: ~10 µs of Python per host call
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _interpreter_config(rows: int, nblk: int):
    """Under the interpreter the cost is per op and program: one tile over as much of the
    tensor as is not mostly padding."""
    return (min(max(_pow2(rows), 16), 64),
            min(_pow2(max(nblk, 1)), 8), 4)


def _default_config(nblk: int, legacy: bool = False, rows: int = 16, heavy: bool = False):
    """(BLOCK_M rows, BLOCK_B 16-blocks, num_warps) of the quantize kernel.

    heavy: stochastic rounding or the 4/6 rule (more live registers a block)."""
    if _is_interpreter():
        return (16, 4, 4) if legacy else _interpreter_config(rows, nblk)
    nb = 8 if nblk >= 8 else _pow2(nblk)
    if legacy or heavy:
        # one block a thread: the previous default (the fastest of the legacy kernel's sweep);
        # for SR / 4-over-6 the eo kernel with two blocks a thread needs 74-139 registers
        # (SASS counts in PERF.md) for a 7-10% cut in instructions
        return 16, nb, 4
    # 32 rows x 8 blocks, 4 warps: two blocks a thread, which halves the per-thread setup
    # (tile coordinates, tensor scales) per element at 56 registers: 18.1 vs 20.3 SASS
    # instructions an element for 1x16 nearest (PERF.md). `scripts/bench_nvfp4_quantize.py
    # --sweep` times the alternatives on a GPU.
    return 32, nb, 4


def _amax_config(nblk: int, rows: int = 16):
    """(BLOCK_M, BLOCK_B, num_warps) of the amax pass: 64 rows x 8 blocks, 4 blocks a thread
    (8 16-byte loads in flight per thread, a quarter of the programs and atomics)."""
    if _is_interpreter():
        return _interpreter_config(rows, nblk)
    nb = 8 if nblk >= 8 else _pow2(nblk)
    return 64, nb, 4


_I32_LIMIT = 2**31 - 1

#: Bytes at the end of the input that the amax pass loads ``evict_last``, so that more of what the
#: quantize pass reads first (it walks the tiles in reverse) is still in L2 (H200: 50 MB). 0: the
#: default policy everywhere (LRU already keeps the tail; evict_last may also shield it from the
#: quantize's own code writes). Not enabled blind: ``bench_nvfp4_quantize.py --sweep`` times it.
AMAX_L2_TAIL_BYTES = 0


def _needs_i64(rows: int, nblk: int, bm: int, nb: int, strides) -> bool:
    """Whether an element / word / Philox-counter offset of the padded grid may pass 2^31 - 1
    (then the kernels compute row offsets in int64; otherwise int32, fewer instructions)."""
    rows_pad = _cdiv(rows, bm) * bm
    cols_pad = _cdiv(nblk, nb) * nb * 16
    worst = max([rows_pad * max(int(s), 1) + cols_pad for s in strides]
                + [(rows_pad * nblk + cols_pad // 16) * 4 + 4])
    return worst > _I32_LIMIT


def _grid(rows: int, nblk: int, bm: int, nb: int, legacy: bool):
    """(grid, GRID2D): a 2-D grid (block tiles, row tiles) while the row tiles fit CUDA's
    65535 limit of grid axis 1 (no integer division in the kernel), else 1-D."""
    nm, nbk = _cdiv(rows, bm), _cdiv(nblk, nb)
    if not legacy and nm <= 65535:
        return (nbk, nm), True
    return (nm * nbk,), False


def _sign_mask(rht_signs) -> int:
    """Bit i set iff sign i is -1 (signs already validated by :func:`_device_signs`)."""
    if rht_signs is None:
        return 0
    if isinstance(rht_signs, torch.Tensor):
        rht_signs = rht_signs.detach().to("cpu", torch.float64).reshape(-1).tolist()
    return sum(1 << i for i, v in enumerate(rht_signs) if float(v) == -1.0)


def _x_operand(x2: torch.Tensor, legacy: bool):
    """(tensor passed as x, row stride, XW): BF16 as int32 words when its layout allows it."""
    if (not legacy and x2.dtype == torch.bfloat16 and x2.stride(0) % 2 == 0
            and x2.storage_offset() % 2 == 0):
        return x2.view(torch.int32), x2.stride(0) // 2, True
    return x2, x2.stride(0), False


def _check_input(x: torch.Tensor, tile, rounding, scale_rule):
    tile = tuple(tile)
    if tile not in ((1, 16), (16, 16)):
        raise ValueError(f"tile must be (1, 16) or (16, 16), got {tile}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if scale_rule not in _SCALE_RULES:
        raise ValueError(f"scale_rule must be '6' or '4over6', got {scale_rule!r}")
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"input dtype must be bf16, fp16 or fp32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % 16:
        raise ValueError(f"last dimension must be a multiple of 16, got shape {tuple(x.shape)}")
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if tile == (16, 16) and rows % 16:
        raise ValueError(f"16x16 tiles need the rows ({rows}) to be a multiple of 16")
    return tile, rows, k


def _as_2d(x: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError("quantize_triton needs a contiguous last dimension")
    x2 = x.reshape(rows, k)             # a view unless the leading dims are not collapsible
    return x2


def _launch_amax(x2, signs, amax_bits, rows: int, nblk: int, rht: bool, smask: int,
                 legacy: bool, config: Optional[tuple] = None):
    """Queue the amax pass (atomic max of the |x| bits into ``amax_bits``, which must be 0)."""
    if config is not None:
        bm, nb, nw = config
    else:
        bm, nb, nw = _default_config(nblk, True) if legacy else _amax_config(nblk, rows)
    xk, stride_xk, xw = _x_operand(x2, legacy)
    i64 = _needs_i64(rows, nblk, bm, nb, (x2.stride(0),))
    grid, grid2d = _grid(rows, nblk, bm, nb, legacy)
    tail_rows = AMAX_L2_TAIL_BYTES // max(nblk * 16 * x2.element_size(), 1)
    _amax_kernel[grid](
        xk, signs, amax_bits, rows, nblk, stride_xk, rows - tail_rows, RHT=rht, BM=bm, NB=nb, XW=xw, I64=i64,
        SIGN_MASK=smask, GRID2D=grid2d, LEGACY=legacy, num_warps=nw, enable_fp_fusion=False)


def _host_amax_bits(global_amax) -> int:
    """FP32 bits of a host-number amax (rounded as ``torch.tensor(v, dtype=float32)``), or a
    ValueError if it is not finite and >= 0 (checked here: no device round trip)."""
    v = float(global_amax)
    try:
        bits = struct.unpack("<i", struct.pack("<f", v))[0]   # RNE to FP32, as torch
    except OverflowError:                                   # beyond FP32: torch makes it inf
        bits = 0x7F800000
    if not math.isfinite(v) or bits & 0x7FFFFFFF >= 0x7F800000 or v < 0:
        raise ValueError(f"global_amax must be finite and >= 0, got {v}")
    return bits


def quantize_triton(
    x: torch.Tensor,
    *,
    tile=(1, 16),
    rounding: str = "nearest",
    scale_rule: str = "6",
    global_amax=None,
    rand: Optional[torch.Tensor] = None,
    seed: Optional[int] = None,
    rht_signs=None,
    generator: Optional[torch.Generator] = None,
    config: Optional[tuple] = None,
    check_finite: bool = True,
    legacy: Optional[bool] = None,
) -> NVFP4Tensor:
    """Quantize ``x`` (BF16/FP16/FP32, any leading dims, contiguous last dim K % 16 == 0) to NVFP4.

    Bit-identical to ``quantize_reference(x if rht_signs is None else hadamard16(x, rht_signs),
    tile=..., rounding=..., scale_rule=..., global_amax=..., rand=...)``.

    rand: FP32 uniforms in [0, 1), shape of ``x`` (stochastic rounding); else Philox in the
        kernel under ``seed`` (drawn from ``generator`` / torch's default generator if None;
        :func:`philox_uniforms` returns the uniforms a given seed produces).
    rht_signs: 16 values ±1 (e.g. ``DEFAULT_SIGNS``) to fuse RHT-16 into the quantize, or None.
        ``global_amax``, when given with RHT, must be the amax of the transformed tensor.
    config: (BLOCK_M, BLOCK_B, num_warps) override (benchmarks); BLOCK_M a multiple of 16 for
        16×16 tiles.
    check_finite: True (default): raise ValueError on NaN/Inf input or a bad ``global_amax``
        (one host sync, after the kernels are queued). False: no sync; a NaN/Inf input (or a
        non-finite / negative amax) instead makes the tensor scale NaN, so anything computed
        from the result (GEMM, dequantize) is NaN and a per-step check downstream (the
        training loop's grad-norm / loss check) catches it. The codes of such a tensor are
        meaningless. Finite inputs give bit-identical results either way.
    Host numbers as ``global_amax`` are passed by value (no H2D copy, no sync); a CUDA tensor
    is read on the device.
    legacy: True runs the previous kernels (one block a thread, select ladders), False the
        eo-form ones; both give bit-identical output. None (default): the one measured faster
        for the mode on the H200 (BENCHMARKS.md, 8192² BF16 with the amax pass, CUDA graph):
        legacy for nearest rounding with the 6 rule (152 vs 210 µs 1×16, 146 vs 211 16×16,
        169 vs 212 with RHT), eo for stochastic rounding (187 vs 209; 195 vs 232 with RHT)
        and for 4/6 (164 vs 271).
    """
    tile, rows, k = _check_input(x, tile, rounding, scale_rule)
    if legacy is None:
        legacy = rounding == "nearest" and scale_rule == "6"
    dev = x.device
    nblk = k // 16
    stochastic = rounding == "stochastic"
    four6 = scale_rule == "4over6"
    tile2d = tile == (16, 16)
    lead = tuple(x.shape[:-1])

    data = torch.empty((*lead, k // 2), dtype=torch.uint8, device=dev)
    scale = torch.empty((*lead, nblk), dtype=torch.uint8, device=dev)
    dec = torch.empty((1,), dtype=torch.float32, device=dev)
    if rows == 0 or k == 0:
        dec.fill_(1.0 / FP32_MAX.value)  # reference: amax 0 -> enc FP32_MAX
        return NVFP4Tensor(data, scale.view(torch.float8_e4m3fn), dec.reshape(()), x.shape,
                           x.dtype, tile)

    x2 = _as_2d(x, rows, k)
    signs = _device_signs(rht_signs, dev)
    rht = rht_signs is not None

    philox = False
    rand2 = x2          # placeholder pointer, never read unless stochastic with explicit rand
    stride_r = 0
    seed_v = 0
    if stochastic:
        if rand is not None:
            if tuple(rand.shape) != tuple(x.shape):
                raise ValueError(f"rand shape {tuple(rand.shape)} != input shape {tuple(x.shape)}")
            rand2 = rand.to(device=dev, dtype=torch.float32).reshape(rows, k).contiguous()
            stride_r = rand2.stride(0)
        else:
            philox = True
            if seed is None:
                seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator).item())
            seed_v = int(seed)

    bm, nb, nw = (config if config is not None
                  else _default_config(nblk, legacy, rows, stochastic or four6))
    if tile2d and bm % 16:
        raise ValueError("BLOCK_M must be a multiple of 16 for 16x16 tiles")
    grid, grid2d = _grid(rows, nblk, bm, nb, legacy)
    xk, stride_xk, xw = _x_operand(x2, legacy)
    i64 = _needs_i64(rows, nblk, bm, nb, (x2.stride(0), stride_r))
    smask = _sign_mask(rht_signs)

    obs = torch.zeros((1,), dtype=torch.int32, device=dev)
    given = global_amax is not None
    imm = 0
    g = None
    if given and not isinstance(global_amax, torch.Tensor):
        # A host number: checked on the host and passed by value (its FP32 bits, rounded as
        # torch.as_tensor(..., float32) rounds it). torch.as_tensor(float, device=cuda) would be
        # a pageable H2D copy, i.e. a stream sync per call.
        imm = _host_amax_bits(global_amax)
        amax_bits = obs                  # never read (AMAX_IMM)
    elif given:
        g = global_amax.to(device=dev, dtype=torch.float32).reshape(1)
        amax_bits = g.view(torch.int32)
    else:
        amax_bits = obs
        _launch_amax(x2, signs, amax_bits, rows, nblk, rht, smask, legacy)
    _quantize_kernel[grid](
        xk if not legacy else x2, rand2, signs, amax_bits, obs,
        data if legacy else data.view(torch.int32), scale, dec, seed_v, imm,
        rows, nblk, stride_xk, stride_r,
        M_BOUND=_SCALE_RULES[scale_rule], TILE2D=tile2d, STOCHASTIC=stochastic, PHILOX=philox,
        FOUR_OVER_SIX=four6, RHT=rht, TRACK_AMAX=given, REVERSE=not given,
        AMAX_IMM=given and g is None, BM=bm, NB=nb, XW=xw, I64=i64, SIGN_MASK=smask,
        GRID2D=grid2d, LEGACY=legacy, num_warps=nw, enable_fp_fusion=False)

    if given:
        # The kernel poisoned dec for a bad *given* amax; a NaN/Inf seen in the input only
        # shows in obs (the observed amax bits): poison dec for it too (no sync).
        dec = torch.where(obs >= 0x7F800000, torch.full_like(dec, float("nan")), dec)
    if check_finite:
        # One host sync: NaN/Inf in the input <=> the observed amax bits are >= +Inf's.
        bad = obs >= 0x7F800000
        if g is not None:
            bad = bad | ~torch.isfinite(g) | (g < 0)
        if bool(bad.item()):
            if g is not None and not (bool(torch.isfinite(g).all()) and bool((g >= 0).all())):
                raise ValueError(f"global_amax must be finite and >= 0, got {float(g)}")
            raise ValueError("quantize: input holds NaN or Inf")
    return NVFP4Tensor(data, scale.view(torch.float8_e4m3fn), dec.reshape(()), x.shape, x.dtype, tile)


_SIGNS_CACHE: dict = {}


def _device_signs(rht_signs, dev) -> torch.Tensor:
    """The 16 signs as an FP32 device tensor, validated on the host and cached per device: a
    device-side check (or a fresh ``torch.tensor(..., device=cuda)``) would sync every call."""
    if rht_signs is None:
        key = (None, str(dev))
        vals = (1.0,) * 16            # never read (RHT=False)
    else:
        if isinstance(rht_signs, torch.Tensor):
            rht_signs = rht_signs.detach().to("cpu", torch.float64).reshape(-1).tolist()
        vals = tuple(float(v) for v in rht_signs)
        if len(vals) != 16 or any(v not in (1.0, -1.0) for v in vals):
            raise ValueError("rht_signs must be 16 values of +-1")
        key = (vals, str(dev))
    t = _SIGNS_CACHE.get(key)
    if t is None:
        t = torch.tensor(vals, dtype=torch.float32).to(dev)
        _SIGNS_CACHE[key] = t
    return t


def amax_triton(x: torch.Tensor, rht_signs=None, config: Optional[tuple] = None) -> torch.Tensor:
    """``|x|.amax()`` (of ``hadamard16(x, rht_signs)`` if signs are given) as an FP32 0-dim
    device tensor, by the quantize's own amax kernel (NaN propagates: its bits order above
    +Inf). For callers that reduce the amax across ranks before quantizing with RHT.
    config: (BLOCK_M, BLOCK_B, num_warps) override (benchmarks)."""
    if x.shape[-1] % 16:
        raise ValueError(f"last dimension must be a multiple of 16, got shape {tuple(x.shape)}")
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    obs = torch.zeros((1,), dtype=torch.int32, device=x.device)
    if rows and k:
        x2 = _as_2d(x, rows, k)
        _launch_amax(x2, _device_signs(rht_signs, x.device), obs, rows, k // 16,
                     rht_signs is not None, _sign_mask(rht_signs), False, config)
    return obs.view(torch.float32).reshape(())


def philox_uniforms(shape, seed: int, device="cpu") -> torch.Tensor:
    """The FP32 uniforms the quantize kernel draws for a tensor of ``shape`` under ``seed``."""
    shape = tuple(shape)
    k = shape[-1]
    if k % 16:
        raise ValueError("last dimension must be a multiple of 16")
    rows = 1
    for d in shape[:-1]:
        rows *= d
    u = torch.empty((rows, k), dtype=torch.float32, device=device)
    bm, nb = 16, 4
    grid = (_cdiv(rows, bm) * _cdiv(k // 16, nb),)
    if rows and k:
        _philox_uniforms_kernel[grid](u, int(seed), rows, k // 16, BM=bm, NB=nb, num_warps=4)
    return u.reshape(shape)


def rounding_probe_triton(v: torch.Tensor, u: Optional[torch.Tensor] = None) -> dict:
    """Test hook: the kernels' E4M3 / E2M1 helpers applied elementwise to ``v`` (FP32).

    Keys: ``e4m3_val``/``e4m3_bits`` (legacy :func:`_e4m3_rne` of ``min(|v|, 448)``),
    ``e2m1_code`` (legacy nearest code of ``clamp(v, -6, 6)``), ``e4m3_val1``/``e4m3_bits1``
    (:func:`_e4m3_rne1`), ``nib_rne`` (nearest nibble of ``v``, saturating), ``rne_val``
    (nearest E2M1 value of ``min(|v|, 6)``), ``nib_sr`` (stochastic nibble of ``v`` with
    uniforms ``u``, zeros if None)."""
    v = v.to(torch.float32).contiguous().reshape(-1)
    u = torch.zeros_like(v) if u is None else u.to(torch.float32).contiguous().reshape(-1)
    if u.shape != v.shape:
        raise ValueError("u must have the shape of v")
    n = v.numel()
    out = dict(e4m3_val=torch.empty_like(v), e4m3_bits=torch.empty(n, dtype=torch.int32, device=v.device),
               e2m1_code=torch.empty(n, dtype=torch.int32, device=v.device),
               e4m3_val1=torch.empty_like(v), e4m3_bits1=torch.empty(n, dtype=torch.int32, device=v.device),
               nib_rne=torch.empty(n, dtype=torch.int32, device=v.device), rne_val=torch.empty_like(v),
               nib_sr=torch.empty(n, dtype=torch.int32, device=v.device))
    block = 1024
    if n:
        _elementwise_probe_kernel[(_cdiv(n, block),)](v, u, *out.values(), n, BLOCK=block,
                                                             enable_fp_fusion=False)
    return out


def e4m3_rne_triton(v: torch.Tensor):
    """Test hook: (E4M3 value as FP32, E4M3 bits) of ``min(|v|, 448)``, and E2M1 nearest codes
    of ``clamp(v, -6, 6)``, through the kernels' legacy helpers (see :func:`rounding_probe_triton`)."""
    o = rounding_probe_triton(v)
    return o["e4m3_val"], o["e4m3_bits"], o["e2m1_code"]


e2m1_round_triton = e4m3_rne_triton
