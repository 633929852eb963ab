"""Per-row register arithmetic of the fused Q-AdamW step (``triton_step.py``).

A *row* is one NVFP4 block of 16 entries, owned by one thread and held in 16 scalar registers
(x0 … x15), so every function here takes and returns its 16 values one by one: loads and
stores of rows, the 16-point Hadamard butterflies with Transformer Engine's signs, E4M3 and
E2M1 rounding without comparison ladders (exact in IEEE FP32, so the interpreter and the GPU
agree), nibble packing and decoding, the m / v row encoders, the AdamW update of one entry and
the Philox uniforms. ``triton_step.py`` holds the kernel that strings them together and its
launch; its docstring gives the design and the byte budget.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .codecs import REL_FLOOR

FP32_MAX = 3.4028234663852886e38
FP32_MAX_C = tl.constexpr(FP32_MAX)
REL_FLOOR_C = tl.constexpr(REL_FLOOR)
# Transformer Engine's sign vector (fullstack_fp4.nvfp4.hadamard); negative at 3, 5-10, 12, 14, 15
# — written out in _rht16/_irht16 below, checked against this tuple by the tests.
_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


# ----------------------------------------------------------------------------- rows of 16
@triton.jit
def _ld4(ptr, rows, Q: tl.constexpr, lim, other, MASK: tl.constexpr = True):
    """Entries 4Q..4Q+3 of each row (one 16-byte load per thread), as 4 row vectors.
    ``MASK`` False: every entry is known to be in [0, lim) (a full program), no predicate."""
    idx = rows[:, None] * 16 + (Q * 4 + tl.arange(0, 4))[None, :]
    if MASK:
        x = tl.load(ptr + idx, mask=(idx < lim) & (idx >= 0), other=other)
    else:
        x = tl.load(ptr + idx)
    x = x.to(tl.float32)   # bf16 grads too
    a, b = tl.split(tl.reshape(x, (rows.shape[0], 2, 2)))
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    return x0, x1, x2, x3


@triton.jit
def _ld16(ptr, rows, lim, other, MASK: tl.constexpr = True):
    x0, x1, x2, x3 = _ld4(ptr, rows, 0, lim, other, MASK)
    x4, x5, x6, x7 = _ld4(ptr, rows, 1, lim, other, MASK)
    x8, x9, x10, x11 = _ld4(ptr, rows, 2, lim, other, MASK)
    x12, x13, x14, x15 = _ld4(ptr, rows, 3, lim, other, MASK)
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def _st4(ptr, rows, Q: tl.constexpr, lim, x0, x1, x2, x3, MASK: tl.constexpr = True):
    idx = rows[:, None] * 16 + (Q * 4 + tl.arange(0, 4))[None, :]
    x = tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)), (rows.shape[0], 4))
    if MASK:
        tl.store(ptr + idx, x, mask=(idx < lim) & (idx >= 0))
    else:
        tl.store(ptr + idx, x)


@triton.jit
def _st16(ptr, rows, lim, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
          MASK: tl.constexpr = True):
    _st4(ptr, rows, 0, lim, x0, x1, x2, x3, MASK)
    _st4(ptr, rows, 1, lim, x4, x5, x6, x7, MASK)
    _st4(ptr, rows, 2, lim, x8, x9, x10, x11, MASK)
    _st4(ptr, rows, 3, lim, x12, x13, x14, x15, MASK)


@triton.jit
def _bf16_bits(x, HW: tl.constexpr):
    """BF16 bits (int16) of FP32 ``x`` rounded to nearest even, as torch's ``x.to(bfloat16)``.

    HW (compiled): Triton's cast, ``cvt.rn.bf16x2.f32`` — the instruction torch's CUDA cast
    uses, one F2FP per two entries. Not HW (the interpreter, whose FP32→BF16 cast does not round
    to even; nvfp4/kernels/gemm_epilogue.py): ``(bits + 0x7FFF + lsb) >> 16`` on the FP32 bits, exact
    RNE for every finite value (ties to the even BF16, a carry into the exponent included,
    overflow to ±Inf as the cast does), a NaN stays a NaN (0x7FC0; the bits alone would carry a
    NaN into ±Inf or −0). Only a NaN's payload may differ from a cast's (torch's CPU cast gives
    0xFFFF or 0x7FC0 by code path, the hardware 0x7FFF), never a value. The integer form costs
    ~6 instructions per entry in this instruction-bound kernel (docs/perf/q-adamw.md), the cast ~0.5."""
    if HW:
        return x.to(tl.bfloat16).to(tl.int16, bitcast=True)
    else:
        b = x.to(tl.int32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return tl.where(x != x, 0x7FC0, r).to(tl.int16)


@triton.jit
def _st16_bf16(ptr, rows, lim, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14,
               x15, HW: tl.constexpr, MASK: tl.constexpr = True):
    """``_st16`` of the rows rounded to BF16 (``ptr``: the BF16 destination viewed as int16)."""
    _st16(ptr, rows, lim, _bf16_bits(x0, HW), _bf16_bits(x1, HW), _bf16_bits(x2, HW),
          _bf16_bits(x3, HW), _bf16_bits(x4, HW), _bf16_bits(x5, HW), _bf16_bits(x6, HW),
          _bf16_bits(x7, HW), _bf16_bits(x8, HW), _bf16_bits(x9, HW), _bf16_bits(x10, HW),
          _bf16_bits(x11, HW), _bf16_bits(x12, HW), _bf16_bits(x13, HW), _bf16_bits(x14, HW),
          _bf16_bits(x15, HW), MASK)


@triton.jit
def _bf(a, b):
    return a + b, a - b


@triton.jit
def _fwht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    """Unnormalized Walsh-Hadamard butterfly, stages H = 1, 2, 4, 8 (nvfp4's order)."""
    x0, x1 = _bf(x0, x1)
    x2, x3 = _bf(x2, x3)
    x4, x5 = _bf(x4, x5)
    x6, x7 = _bf(x6, x7)
    x8, x9 = _bf(x8, x9)
    x10, x11 = _bf(x10, x11)
    x12, x13 = _bf(x12, x13)
    x14, x15 = _bf(x14, x15)
    x0, x2 = _bf(x0, x2)
    x1, x3 = _bf(x1, x3)
    x4, x6 = _bf(x4, x6)
    x5, x7 = _bf(x5, x7)
    x8, x10 = _bf(x8, x10)
    x9, x11 = _bf(x9, x11)
    x12, x14 = _bf(x12, x14)
    x13, x15 = _bf(x13, x15)
    x0, x4 = _bf(x0, x4)
    x1, x5 = _bf(x1, x5)
    x2, x6 = _bf(x2, x6)
    x3, x7 = _bf(x3, x7)
    x8, x12 = _bf(x8, x12)
    x9, x13 = _bf(x9, x13)
    x10, x14 = _bf(x10, x14)
    x11, x15 = _bf(x11, x15)
    x0, x8 = _bf(x0, x8)
    x1, x9 = _bf(x1, x9)
    x2, x10 = _bf(x2, x10)
    x3, x11 = _bf(x3, x11)
    x4, x12 = _bf(x4, x12)
    x5, x13 = _bf(x5, x13)
    x6, x14 = _bf(x6, x14)
    x7, x15 = _bf(x7, x15)
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def _rht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    """fwht(x · signs), unscaled: the RHT's × 1/4 is folded into the encoders' per-row block
    amax and element factor (codecs._quantize_chunked). x · −1 is −x exactly, so the signs
    fold into the adds."""
    return _fwht16(x0, x1, x2, -x3, x4, -x5, -x6, -x7, -x8, -x9, -x10, x11, -x12, x13, -x14, -x15)


@triton.jit
def _irht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    """fwht(y) · signs, unscaled: the × 1/4 is in the decoded values (_decode_rows: the block
    scale is taken × 1/4). The negations fold into the consumers' FADD/FMUL operands."""
    y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _fwht16(
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
    return (y0, y1, y2, -y3, y4, -y5, -y6, -y7, -y8, -y9, -y10, y11, -y12, y13, -y14, -y15)


@triton.jit
def _hsum16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    """codecs._halving_sum on 16 entries: (x[:8] + x[8:]), then 4, 2, 1."""
    a0 = x0 + x8
    a1 = x1 + x9
    a2 = x2 + x10
    a3 = x3 + x11
    a4 = x4 + x12
    a5 = x5 + x13
    a6 = x6 + x14
    a7 = x7 + x15
    b0 = a0 + a4
    b1 = a1 + a5
    b2 = a2 + a6
    b3 = a3 + a7
    c0 = b0 + b2
    c1 = b1 + b3
    return c0 + c1


@triton.jit
def _max16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    a = tl.maximum(tl.maximum(tl.maximum(x0, x1), tl.maximum(x2, x3)),
                   tl.maximum(tl.maximum(x4, x5), tl.maximum(x6, x7)))
    b = tl.maximum(tl.maximum(tl.maximum(x8, x9), tl.maximum(x10, x11)),
                   tl.maximum(tl.maximum(x12, x13), tl.maximum(x14, x15)))
    return tl.maximum(a, b)


# ----------------------------------------------------------------------------- E4M3 / E2M1
@triton.jit
def _e4m3_rne(x):
    """FP32 x in [0, 448] -> (value of the nearest-even E4M3 as FP32, its 8-bit code).

    One rounding add: M = 2^(E+20) for x in [2^E, 2^(E+1)) (E >= -6; the subnormals share
    E = -6) has ulp 2^(E-3) = E4M3's spacing there, so fl(x + M) - M is x rounded to nearest
    even on E4M3's grid (a carry into the next binade included), and the code is the number of
    ulps k plus 8·(E + 6)."""
    mb = tl.maximum(x.to(tl.int32, bitcast=True) & 0x7F800000, 0x3C800000) + (20 << 23)
    mf = mb.to(tl.float32, bitcast=True)
    t = x + mf
    k = t.to(tl.int32, bitcast=True) - mb
    return t - mf, k + 8 * (mb >> 23) - 1128


@triton.jit
def _e4m3_decode(c):
    c = c.to(tl.int32)
    e = c >> 3
    mm = c & 7
    nrm = (((e + 120) << 23) | (mm << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, mm.to(tl.float32) * 0.001953125, nrm)


@triton.jit
def _candidate(bamax, enc, dec, inv_target, rtab_ptr):
    """(E4M3 scale s, its code, element factor f = min(fl(0.25 / s) · enc, FP32_MAX / 4) for
    the unscaled RHT output, sd = s · dec). ``bamax``: the row's amax of the scaled RHT (× 1/4);
    ``enc``, ``dec``: the chunk's scales (_chunk_scales); fl(0.25 / s) is read from
    ``rtab_ptr`` (recip_table: one cached load where the division 0.25 / (s · dec) took ~11
    instructions; codecs.chunk_scales)."""
    s, code = _e4m3_rne(tl.minimum(bamax * (enc * inv_target), 448.0))
    sd = s * dec
    f = tl.minimum(tl.load(rtab_ptr + code) * enc, FP32_MAX_C * 0.25)
    return s, code, f, sd


@triton.jit
def _rtn_magic(a):
    """a in [0, 6] -> (t, M): fl(a + M) with M = 2^22, 2^23, 2^24 for a < 2, < 4, < 8, whose ulp
    (0.5, 1, 2) is E2M1's spacing there: t - M is a rounded to nearest even on the E2M1 grid —
    the thresholds 0.25 (down), 0.75 (up), 1.25, 1.75, 2.5, 3.5, 5 of nvfp4.e2m1 exactly."""
    mb = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000) + (22 << 23)
    mf = mb.to(tl.float32, bitcast=True)
    return a + mf, mf, mb


@triton.jit
def _rtn_val(a):
    """Value of the nearest-even E2M1 to a in [0, 6]."""
    t, mf, mb = _rtn_magic(a)
    return t - mf


@triton.jit
def _rtn_code(a):
    """Magnitude code (0..7) of the nearest-even E2M1 to a in [0, 6]: ulps of M + 2·region."""
    t, mf, mb = _rtn_magic(a)
    return (t.to(tl.int32, bitcast=True) - mb) + 2 * (mb >> 23) - 298


@triton.jit
def _sr_code(a, d):
    """Stochastic E2M1 code of a in [0, 6] with dither d = 0x3FFFFF − K (K = floor(u · 2^22)):
    codecs.sr_codes' rule (nvfp4.e2m1's ``u < frac`` on a pre-rounded to 2^-23 below 1).

    x = max(a, a/2 + 1/2) (one FFMA, one FMNMX): a >= 1 is kept; a < 1 maps to [0.5, 1), whose
    FP32 grid of 1 mantissa bit (0.5, 0.75, 1) is E2M1's (0, 0.5, 1) halved and shifted, so in
    both ranges the E2M1 lower grid point is x truncated to 1 mantissa bit and the fraction
    (a − lo) / step is the low 22 bits L of x over 2^22 (a < 1: after x's one rounding, i.e. a
    rounded to nearest-even on 2^-23). Adding d carries into bit 22 iff L + 0x3FFFFF − K >= 2^22
    iff K < L iff u < L / 2^22 = frac, and the code is then the carried word's bits 22+ minus
    bits(0.5) >> 22: one IADD3 and one shift."""
    x = tl.maximum(a, tl.fma(a, 0.5, 0.5))
    return (x.to(tl.int32, bitcast=True) + d - 1056964608) >> 22    # 0x3F000000 = 252 << 22


@triton.jit
def _dither(u):
    """SR dither of an FP32 uniform u in [0, 1): 0x3FFFFF − floor(u · 2^22) (exact)."""
    return 4194303 - (u * 4194304.0).to(tl.int32)


@triton.jit
def _nib(w, J: tl.constexpr, s, FAST: tl.constexpr):
    """Decode nibble J of word w to the exact q · s / 4 (q = ±E2M1 value; code 8 is −0), times
    2^-8 with FAST; the chunk's decode scale comes after the inverse RHT (_decode_rows).

    FAST: the 3 magnitude bits k placed at bits 22-24 of an FP32 word are exactly
    E2M1(k) · 2^-126 (k = 0, 1: subnormals 0, 2^-127; k >= 2: exponent field k >> 1 with the
    top mantissa bit k & 1) (sm_90 FMUL keeps subnormals: Triton emits mul.f32 without .ftz),
    and s · 2^116 (_decode_rows) turns them into q · s · 2^-10 = (q · s / 4) · 2^-8, exact: q · s
    is a multiple of 2^-10 below 2^12 (<= 22 significant bits), and 2^-20 <= |·| < 2^2 is
    normal. Two shifts, one LOP3 and one FMUL per nibble instead of the select chain."""
    if FAST:
        if 4 * J <= 22:
            mag = (w << (22 - 4 * J)) & 0x01C00000
        else:
            mag = (w >> (4 * J - 22)) & 0x01C00000
        bits = mag | ((w << (28 - 4 * J)) & -2147483648)
        return bits.to(tl.float32, bitcast=True) * s           # s: · 2^116
    else:
        k = (w >> (4 * J)) & 7
        bits = tl.where(k >= 2, (k + 252) << 22, k * 0x3F000000)
        bits = bits | ((w << (28 - 4 * J)) & -2147483648)
        return bits.to(tl.float32, bitcast=True) * s


@triton.jit
def _err46(y, f6, f4):
    """Code-domain rounding errors |t − rtn(min(t, 6))|, t = |y| · f, of the two 4/6
    candidates (codecs._code_error32: the block sums times s · dec are the 4/6 criterion)."""
    ay = tl.abs(y)
    t6 = ay * f6
    t4 = ay * f4
    return tl.abs(t6 - _rtn_val(tl.minimum(t6, 6.0))), tl.abs(t4 - _rtn_val(tl.minimum(t4, 6.0)))


@triton.jit
def _q(y, f, u, STOCH: tl.constexpr):
    """Signed 4-bit code of y · f (sign from y · f, as nvfp4.e2m1's _with_sign)."""
    t = y * f
    a = tl.minimum(tl.abs(t), 6.0)
    if STOCH:
        c = _sr_code(a, u)
    else:
        c = _rtn_code(a)
    return c | tl.where(t < 0.0, 8, 0)


@triton.jit
def _pack8(c0, c1, c2, c3, c4, c5, c6, c7):
    return (c0 | (c1 << 4) | (c2 << 8) | (c3 << 12) | (c4 << 16) | (c5 << 20) | (c6 << 24)
            | (c7 << 28))


@triton.jit
def _codes16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
             u0, u1, u2, u3, u4, u5, u6, u7, u8, u9, u10, u11, u12, u13, u14, u15,
             f, STOCH: tl.constexpr):
    """A row's 16 codes of y · f packed into two words (_q; ``u`` the dithers with STOCH,
    unused without)."""
    w0 = _pack8(_q(y0, f, u0, STOCH), _q(y1, f, u1, STOCH), _q(y2, f, u2, STOCH),
                _q(y3, f, u3, STOCH), _q(y4, f, u4, STOCH), _q(y5, f, u5, STOCH),
                _q(y6, f, u6, STOCH), _q(y7, f, u7, STOCH))
    w1 = _pack8(_q(y8, f, u8, STOCH), _q(y9, f, u9, STOCH), _q(y10, f, u10, STOCH),
                _q(y11, f, u11, STOCH), _q(y12, f, u12, STOCH), _q(y13, f, u13, STOCH),
                _q(y14, f, u14, STOCH), _q(y15, f, u15, STOCH))
    return w0, w1


# ----------------------------------------------------------------------------- chunk codec
@triton.jit
def _decode_rows(codes_ptr, scale_ptr, cs_ptr, rows, vrows, nrows, FAST: tl.constexpr,
                 MASK: tl.constexpr = True):
    """Each row's 16 exact Hadamard-domain products x = q · s / 4 (· 2^-8 with FAST) and the
    chunk's decode scale ``dec`` that x · dec decodes them with (codecs._decode_chunked; with
    FAST the consumer takes dec · 2^8: _dec_factor).

    The chunk scale is applied *after* the inverse RHT, inside the consumer's FFMA (_adam:
    fma(x, dec · β1, g · (1 − β1)); _vhat: fma(x, dec, μ)): the butterfly of x is exact —
    every partial sum is (a partial Hadamard sum of the q's: a multiple of 1/2, magnitude
    <= 96, <= 8 bits) times the row's one E4M3 s (<= 4 significant bits) / 4: <= 12 bits,
    2^-20 <= |·| < 2^6 (FAST) — so each decoded value is one rounding of the exact
    H(q) · s · dec / 4 (not one per value and one per butterfly stage), with no separate FMUL
    by dec. FAST and the select chain give the same products (x · 2^-8 times
    dec · 2^8, both exact: dec · 2^8 <= 2^125.4 as dec <= FP32_MAX / 1536).
    ``rows``: the local 16-block index (< 0 before the tensor: phase); ``vrows``: the row on
    the chunk grid (``rows + phase / 16``). ``MASK`` False: all rows are in [0, nrows)."""
    wp = codes_ptr.to(tl.pointer_type(tl.int32))
    widx = rows[:, None] * 2 + tl.arange(0, 2)[None, :]
    if MASK:
        w0, w1 = tl.split(tl.load(wp + widx, mask=(widx < nrows * 2) & (widx >= 0), other=0))
        live = (rows < nrows) & (rows >= 0)
        s = _e4m3_decode(tl.load(scale_ptr + rows, mask=live, other=0))
        dec = tl.load(cs_ptr + vrows // 64, mask=live, other=0.0)
    else:
        w0, w1 = tl.split(tl.load(wp + widx))
        s = _e4m3_decode(tl.load(scale_ptr + rows))
        dec = tl.load(cs_ptr + vrows // 64)
    # the inverse RHT's 1/4 goes into s (q · s / 4 stays exact: a multiple of 2^-11 below 2^10)
    if FAST:        # and the nibble trick's 2^126: s · 2^-2 · 2^118 = s · 2^116, dec · 2^8 (_nib)
        s = s * 8.307674973655724e+34          # 2^116
    else:
        s = s * 0.25
    return (_nib(w0, 0, s, FAST), _nib(w0, 1, s, FAST), _nib(w0, 2, s, FAST),
            _nib(w0, 3, s, FAST), _nib(w0, 4, s, FAST), _nib(w0, 5, s, FAST),
            _nib(w0, 6, s, FAST), _nib(w0, 7, s, FAST), _nib(w1, 0, s, FAST),
            _nib(w1, 1, s, FAST), _nib(w1, 2, s, FAST), _nib(w1, 3, s, FAST),
            _nib(w1, 4, s, FAST), _nib(w1, 5, s, FAST), _nib(w1, 6, s, FAST),
            _nib(w1, 7, s, FAST), dec)


@triton.jit
def _dec_factor(d, FAST: tl.constexpr):
    """A chunk decode scale (or a product of it, rounded unscaled first, so that FAST and the
    select chain agree) as _decode_rows' products need it: · 2^8 with FAST (exact: d <= 2^125.4)."""
    if FAST:
        return d * 256.0
    else:
        return d


@triton.jit
def _chunk_scales(bamax, INV_M: tl.constexpr, R: tl.constexpr):
    """Per-chunk (enc, dec) from the rows' block amax (codecs.chunk_scales): dec = fl(amax ·
    fl(1/M)) clamped to [2^-126, 2^126], enc = fl(1 / dec) — one multiply and one division
    where NVFP4's M / amax and 1 / enc took two divisions. ``INV_M``: fl(1/M), exactly as an
    FP32 constant. Returns (enc_rows, dec_rows, dec_chunks)."""
    NCH: tl.constexpr = R // 64
    amax = tl.max(tl.reshape(bamax, (NCH, 64)), axis=1)
    dec = tl.minimum(tl.maximum(amax * INV_M, 1.1754943508222875e-38), 8.507059173023462e37)
    enc = tl.div_rn(1.0, dec)
    enc_r = tl.reshape(tl.broadcast_to(enc[:, None], (NCH, 64)), (R,))
    dec_r = tl.reshape(tl.broadcast_to(dec[:, None], (NCH, 64)), (R,))
    return enc_r, dec_r, dec


@triton.jit
def _store_rows(codes_ptr, scale_ptr, cs_ptr, rows, nrows, pid, nch, w0, w1, sc, dec_c,
                R: tl.constexpr, MASK: tl.constexpr = True):
    wp = codes_ptr.to(tl.pointer_type(tl.int32))
    widx = rows[:, None] * 2 + tl.arange(0, 2)[None, :]
    if MASK:
        tl.store(wp + widx, tl.join(w0, w1), mask=(widx < nrows * 2) & (widx >= 0))
        tl.store(scale_ptr + rows, sc.to(tl.uint8), mask=(rows < nrows) & (rows >= 0))
    else:
        tl.store(wp + widx, tl.join(w0, w1))
        tl.store(scale_ptr + rows, sc.to(tl.uint8))
    ch = pid * (R // 64) + tl.arange(0, R // 64)
    tl.store(cs_ptr + ch, dec_c, mask=ch < nch)


@triton.jit
def encode46(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
             u0, u1, u2, u3, u4, u5, u6, u7, u8, u9, u10, u11, u12, u13, u14, u15,
             rtab_ptr, R: tl.constexpr, STOCH: tl.constexpr):
    """NVFP4, 4/6 scale rule: (word0, word1, scale code, dec per chunk). m's encoder with
    ``STOCH`` (stochastic rounding with the dithers ``u``; codecs.encode_exp_avg); without it,
    nearest rounding (``u`` unused): what v's encoder would be with the 4/6 rule, which
    benchmarks/sass_q_adamw.py --v-rule 4over6 counts (docs/perf/q-adamw.md)."""
    bamax = _max16(tl.abs(y0), tl.abs(y1), tl.abs(y2), tl.abs(y3), tl.abs(y4), tl.abs(y5),
                   tl.abs(y6), tl.abs(y7), tl.abs(y8), tl.abs(y9), tl.abs(y10), tl.abs(y11),
                   tl.abs(y12), tl.abs(y13), tl.abs(y14), tl.abs(y15))
    bamax = bamax * 0.25                # = the amax of the × 1/4 RHT (rounding is monotone)
    enc, dec, dec_c = _chunk_scales(bamax, 0.0006510416860692203, R)   # fl(1/1536), 1536 = 256·6
    s6, sc6, f6, sd6 = _candidate(bamax, enc, dec, 0.1666666716337204, rtab_ptr)   # fp32(1/6)
    s4, sc4, f4, sd4 = _candidate(bamax, enc, dec, 0.25, rtab_ptr)
    a0, b0 = _err46(y0, f6, f4)
    a1, b1 = _err46(y1, f6, f4)
    a2, b2 = _err46(y2, f6, f4)
    a3, b3 = _err46(y3, f6, f4)
    a4, b4 = _err46(y4, f6, f4)
    a5, b5 = _err46(y5, f6, f4)
    a6, b6 = _err46(y6, f6, f4)
    a7, b7 = _err46(y7, f6, f4)
    a8, b8 = _err46(y8, f6, f4)
    a9, b9 = _err46(y9, f6, f4)
    a10, b10 = _err46(y10, f6, f4)
    a11, b11 = _err46(y11, f6, f4)
    a12, b12 = _err46(y12, f6, f4)
    a13, b13 = _err46(y13, f6, f4)
    a14, b14 = _err46(y14, f6, f4)
    a15, b15 = _err46(y15, f6, f4)
    e6 = _hsum16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15)
    e4 = _hsum16(b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15)
    # 4 wins if its block error, in the element domain, is smaller — or if the 6-candidate
    # reconstructs nothing (s6 · dec == 0: its code-domain error times 0 says nothing)
    use4 = (e4 * sd4 < e6 * sd6) | (sd6 == 0.0)
    sc = tl.where(use4, sc4, sc6)
    f = tl.where(use4, f4, f6)
    w0, w1 = _codes16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
                      u0, u1, u2, u3, u4, u5, u6, u7, u8, u9, u10, u11, u12, u13, u14, u15,
                      f, STOCH)
    return w0, w1, sc, dec_c


@triton.jit
def _encode_v(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
              rtab_ptr, R: tl.constexpr):
    """NVFP4, "4" scale rule (block max → 4), nearest rounding: (word0, word1, scale code, dec
    per chunk) — codecs.encode_exp_avg_sq (CODEC_VERSION 1 had the 6-rule)."""
    bamax = _max16(tl.abs(y0), tl.abs(y1), tl.abs(y2), tl.abs(y3), tl.abs(y4), tl.abs(y5),
                   tl.abs(y6), tl.abs(y7), tl.abs(y8), tl.abs(y9), tl.abs(y10), tl.abs(y11),
                   tl.abs(y12), tl.abs(y13), tl.abs(y14), tl.abs(y15))
    bamax = bamax * 0.25                # = the amax of the × 1/4 RHT (rounding is monotone)
    enc, dec, dec_c = _chunk_scales(bamax, 0.0006510416860692203, R)   # fl(1/1536), 1536 = 256·6
    s4, sc, f, sd = _candidate(bamax, enc, dec, 0.25, rtab_ptr)
    w0, w1 = _codes16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
                      y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
                      f, False)
    return w0, w1, sc, dec_c


# ----------------------------------------------------------------------------- per element
@triton.jit
def _vhat(x, dec, mean, floor):
    """v̂ = min(max(x · dec + μ, μ/4)², FP32_MAX) with x · dec + μ one FFMA (codecs.
    decode_exp_avg_sq): the decoded residual is not rounded on its own."""
    sh = tl.maximum(tl.fma(x, dec, mean), floor)
    return tl.minimum(sh * sh, FP32_MAX_C)


@triton.jit
def _adam(p, g, xm, fm, v, live, decay, beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps,
          step_size, FAST_DIV: tl.constexpr):
    """AdamW on one entry, the reference's FP32 order: (p', m', v', sqrt(v')).

    m' = fma(xm, fm, g·(1−β1)) with the decoded first moment as its exact inverse RHT xm and
    the row's factor fm = dec·β1 (_decode_rows), v' = fma(v, β2, g²·(1−β2)),
    d = fma(sqrt(v'), 1/sqrt(bc2), eps), p' = fma(−step, m'/d, p·decay): each sum one FFMA,
    rounded once (the reference's codecs._fma_rn); an FMUL + FADD pair rounds twice and is one
    instruction more.

    FAST_DIV (compiled kernels only): m'/d as m' · rcp.approx(d) — MUFU.RCP (≤ 1 ulp) and one
    FMUL instead of IEEE div_rn's ~10 executed instructions and slow-path branch. Only p'
    changes (relative error of the update ≤ 2^-22 against div_rn's 2^-24); m', v' and
    sqrt(v') — everything the states are encoded from — stay the reference's bits.
    docs/perf/q-adamw.md."""
    p = p * decay
    m = tl.fma(xm, fm, g * omb1)
    v = tl.fma(v, beta2, (g * g) * omb2)
    m = tl.where(live, m, 0.0)
    v = tl.where(live, v, 0.0)
    s = tl.sqrt_rn(v)
    d = tl.fma(s, inv_sqrt_bc2, eps)
    if FAST_DIV:
        upd = m * _rcp_approx(d)
    else:
        upd = tl.div_rn(m, d)
    return tl.fma(-step_size, upd, p), m, v, s


@triton.jit
def _rcp_approx(d):
    """1/d by the SFU (``rcp.approx.ftz.f32``: max error 1 ulp; a subnormal d or result flushes
    to zero — d = sqrt(v')/sqrt(bc2) + eps >= eps is normal for any eps >= 2^-126, and 1/d is
    subnormal only for d > 2^126, which a finite v' cannot reach). No interpreter form: the
    launch runs div_rn under TRITON_INTERPRET."""
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [d],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _u16(r):
    """Dithers (``_sr_code``) of the two uniforms k / 2^16, k = the halves of a uint32:
    0x3FFFFF − (k << 6) = ((0xFFFF − k) << 6) | 0x3F, one shift and one LOP3 each."""
    nr = ~r
    lo = ((nr << 6) & 0x3FFFC0) | 0x3F
    hi = ((nr >> 10) & 0x3FFFC0) | 0x3F
    return lo.to(tl.int32, bitcast=True), hi.to(tl.int32, bitcast=True)


@triton.jit
def _u8(r):
    """Dithers (``_sr_code``) of the four centred uniforms (k + ½) / 2^8, k = the bytes of a
    uint32 (byte 0 first): 0x3FFFFF − (k << 14 | 0x2000) = ((0xFF − k) << 14) | 0x1FFF, one
    shift and one LOP3 each — the NVFP4 linear's stream definition (nvfp4.sr_stream: 8 bits an
    element, as Blackwell's ``cvt.rs`` spends; the ½ makes the bias two-sided, ≤ 2^-9 step)."""
    nr = ~r
    a = ((nr << 14) & 0x3FC000) | 0x1FFF
    b = ((nr << 6) & 0x3FC000) | 0x1FFF
    c = ((nr >> 2) & 0x3FC000) | 0x1FFF
    d = ((nr >> 10) & 0x3FC000) | 0x1FFF
    return (a.to(tl.int32, bitcast=True), b.to(tl.int32, bitcast=True),
            c.to(tl.int32, bitcast=True), d.to(tl.int32, bitcast=True))
