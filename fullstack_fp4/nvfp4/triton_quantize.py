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
  the contract's ``(a − lo) / (hi − lo)`` exactly (both exact in FP32).
* **4/6.** Both candidates are rounded to nearest; ``err = Σ |x − (q · s) · dec|`` with each term
  in FP32 and the sum in FP64 (``(q · s)`` is exact; ``| |x| − r·s·dec |`` equals
  ``|x − q·s·dec|`` bit for bit since ``q`` has ``x``'s sign); keep 4 iff ``err4 < err6``.
* **FMA contraction is disabled** (``enable_fp_fusion=False`` at every launch): a fused
  ``x·f − lo`` or ``x − q·s·dec`` would skip a rounding the reference performs.

**Fused amax.** When ``global_amax`` is not given, a first kernel (:func:`_amax_kernel`) reads
``x`` once, each program reduces ``|x|`` over its tile and does **one** ``atomic_max`` on the
FP32 bit pattern viewed as int32 (for non-negative floats integer order is float order; NaN
bit patterns are above +Inf, so a NaN cannot be lost the way ``max`` on floats may drop it).
The quantize kernel then reads ``x`` a second time and takes the amax from device memory: no
host round trip between the two kernels; the host checks finiteness once, after both are
queued (``.item()``), and raises ``ValueError`` (the codes computed from a non-finite amax are
thrown away). To recover part of the second read from L2, the quantize kernel walks its tiles
in reverse order after an amax pass (the amax pass finished on the tensor's tail, which is
what is still in L2). With ``global_amax`` given, ``x`` is read once; the quantize kernel then
tracks the observed amax the same way (one atomic per program) only to detect NaN/Inf.

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
``tl.random.uint_to_uniform_float`` (so one Philox evaluation serves 4 elements).
:func:`philox_uniforms` dumps exactly those uniforms, so a test can hand them to the reference.

**Layout.** A program owns ``BLOCK_M`` rows × ``BLOCK_B`` 16-blocks. Each block is loaded as two
8-element halves (columns ``16·blk + 0..7`` and ``16·blk + 8..15``), so each thread holds whole
halves in registers as 16-byte vectors (BF16) and every per-block reduction, RHT butterfly and
nibble packing stays inside a thread; the two loads together cover every byte of the tile.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .hadamard import DEFAULT_SIGNS
from .tensor import NVFP4Tensor

__all__ = ["quantize_triton", "amax_triton", "philox_uniforms", "e4m3_rne_triton",
           "e2m1_round_triton"]

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


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _amax_kernel(x_ptr, signs_ptr, amax_ptr, M, NBLK, stride_xm,
                 RHT: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr):
    """Global amax (of the RHT-transformed values if RHT): one atomic_max on int32 bits per program."""
    rows, blks, mask2 = _tile_coords(tl.program_id(0), M, NBLK, BM, NB)
    lo, hi = _load_halves(x_ptr, rows, blks, mask2, stride_xm, False)
    if RHT:
        lo, hi = _rht16(lo, hi, signs_ptr, BM, NB)
    m = tl.maximum(_abs_bits_max(lo), _abs_bits_max(hi))
    tl.atomic_max(amax_ptr, m)


@triton.jit(do_not_specialize=["seed", "amax_imm"])
def _quantize_kernel(x_ptr, rand_ptr, signs_ptr, amax_ptr, obs_ptr,
                     data_ptr, scale_ptr, dec_ptr, seed, amax_imm,
                     M, NBLK, stride_xm, stride_rm,
                     M_BOUND: tl.constexpr, TILE2D: tl.constexpr, STOCHASTIC: tl.constexpr,
                     PHILOX: tl.constexpr, FOUR_OVER_SIX: tl.constexpr, RHT: tl.constexpr,
                     TRACK_AMAX: tl.constexpr, REVERSE: tl.constexpr, AMAX_IMM: tl.constexpr,
                     BM: tl.constexpr, NB: tl.constexpr):
    pid = tl.program_id(0)
    if REVERSE:
        pid = tl.num_programs(0) - 1 - pid
    rows, blks, mask2 = _tile_coords(pid, M, NBLK, BM, NB)
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
        # A non-finite (or negative) amax poisons the tensor scale: every product with this
        # tensor is NaN, so a caller that skips the host check still cannot train on garbage.
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


@triton.jit
def _philox_uniforms_kernel(u_ptr, seed, M, NBLK, BM: tl.constexpr, NB: tl.constexpr):
    rows, blks, mask2 = _tile_coords(tl.program_id(0), M, NBLK, BM, NB)
    u_lo, u_hi = _philox_halves(seed, rows, blks, NBLK, BM, NB)
    j = tl.arange(0, 8)
    off = (rows.to(tl.int64) * NBLK * 16)[:, None, None] + (blks * 16)[None, :, None] + j[None, None, :]
    tl.store(u_ptr + off, u_lo, mask=mask2[:, :, None])
    tl.store(u_ptr + off + 8, u_hi, mask=mask2[:, :, None])


@triton.jit
def _elementwise_probe_kernel(v_ptr, s_out, s_bits_out, c_out, n, BLOCK: tl.constexpr):
    """Test hook: the E4M3 and E2M1 (nearest) helpers applied elementwise."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    v = tl.load(v_ptr + i, mask=m, other=0.0)
    sv, sb = _e4m3_rne(tl.minimum(tl.abs(v), 448.0))
    c, _ = _e2m1_code(tl.minimum(tl.maximum(v, -6.0), 6.0), v, False)
    tl.store(s_out + i, sv, mask=m)
    tl.store(s_bits_out + i, sb, mask=m)
    tl.store(c_out + i, c, mask=m)


# ----------------------------------------------------------------------------- host side
def _is_interpreter() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _default_config(nblk: int):
    """(BLOCK_M rows, BLOCK_B 16-blocks, num_warps): 2048 elements a program."""
    if _is_interpreter():
        return 16, 4, 4     # small tiles: the interpreter's cost grows with padding
    nb = 8 if nblk >= 8 else triton.next_power_of_2(nblk)
    # 16 rows x 8 blocks, 4 warps: the fastest of the sweep on the H200 for 1x16 nearest
    # (154 vs 210 us with the amax pass, 122 vs 171 us with the amax given, 8192^2 BF16;
    # BENCHMARKS.md section 4); the modes with more live registers used 16 rows already.
    return 16, nb, 4


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
    """
    tile, rows, k = _check_input(x, tile, rounding, scale_rule)
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

    bm, nb, nw = config if config is not None else _default_config(nblk)
    if tile2d and bm % 16:
        raise ValueError("BLOCK_M must be a multiple of 16 for 16x16 tiles")
    grid = (triton.cdiv(rows, bm) * triton.cdiv(nblk, nb),)

    obs = torch.zeros((1,), dtype=torch.int32, device=dev)
    given = global_amax is not None
    imm = 0
    g = None
    if given and not isinstance(global_amax, torch.Tensor):
        # A host number: checked on the host and passed by value (its FP32 bits, rounded as
        # torch.as_tensor(..., float32) rounds it). torch.as_tensor(float, device=cuda) would be
        # a pageable H2D copy, i.e. a stream sync per call.
        gh = torch.tensor(float(global_amax), dtype=torch.float32)
        if not (bool(torch.isfinite(gh)) and float(gh) >= 0):
            raise ValueError(f"global_amax must be finite and >= 0, got {float(global_amax)}")
        imm = int(gh.view(torch.int32))
        amax_bits = obs                  # never read (AMAX_IMM)
    elif given:
        g = global_amax.to(device=dev, dtype=torch.float32).reshape(1)
        amax_bits = g.view(torch.int32)
    else:
        amax_bits = obs
        _amax_kernel[grid](x2, signs, amax_bits, rows, nblk, x2.stride(0),
                           RHT=rht, BM=bm, NB=nb, num_warps=nw, enable_fp_fusion=False)
    _quantize_kernel[grid](
        x2, rand2, signs, amax_bits, obs, data, scale, dec, seed_v, imm,
        rows, nblk, x2.stride(0), stride_r,
        M_BOUND=_SCALE_RULES[scale_rule], TILE2D=tile2d, STOCHASTIC=stochastic, PHILOX=philox,
        FOUR_OVER_SIX=four6, RHT=rht, TRACK_AMAX=given, REVERSE=not given,
        AMAX_IMM=given and g is None, BM=bm, NB=nb, num_warps=nw, enable_fp_fusion=False)

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


def amax_triton(x: torch.Tensor, rht_signs=None) -> torch.Tensor:
    """``|x|.amax()`` (of ``hadamard16(x, rht_signs)`` if signs are given) as an FP32 0-dim
    device tensor, by the quantize's own amax kernel (NaN propagates: its bits order above
    +Inf). For callers that reduce the amax across ranks before quantizing with RHT."""
    if x.shape[-1] % 16:
        raise ValueError(f"last dimension must be a multiple of 16, got shape {tuple(x.shape)}")
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    obs = torch.zeros((1,), dtype=torch.int32, device=x.device)
    if rows and k:
        x2 = _as_2d(x, rows, k)
        bm, nb, nw = _default_config(k // 16)
        grid = (triton.cdiv(rows, bm) * triton.cdiv(k // 16, nb),)
        _amax_kernel[grid](x2, _device_signs(rht_signs, x.device), obs, rows, k // 16,
                           x2.stride(0), RHT=rht_signs is not None, BM=bm, NB=nb, num_warps=nw,
                           enable_fp_fusion=False)
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
    grid = (triton.cdiv(rows, bm) * triton.cdiv(k // 16, nb),)
    if rows and k:
        _philox_uniforms_kernel[grid](u, int(seed), rows, k // 16, BM=bm, NB=nb, num_warps=4)
    return u.reshape(shape)


def e4m3_rne_triton(v: torch.Tensor):
    """Test hook: (E4M3 value as FP32, E4M3 bits) of ``min(|v|, 448)``, and E2M1 nearest codes
    of ``clamp(v, -6, 6)``, through the kernels' own helpers."""
    v = v.to(torch.float32).contiguous().reshape(-1)
    n = v.numel()
    sv = torch.empty_like(v)
    sb = torch.empty(n, dtype=torch.int32, device=v.device)
    c = torch.empty(n, dtype=torch.int32, device=v.device)
    block = 1024
    _elementwise_probe_kernel[(triton.cdiv(n, block),)](v, sv, sb, c, n, BLOCK=block,
                                                         enable_fp_fusion=False)
    return sv, sb, c


e2m1_round_triton = e4m3_rne_triton
