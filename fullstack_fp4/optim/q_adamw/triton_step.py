"""Fused Q-AdamW step in Triton: decode m and v, AdamW update, re-encode both, write p — one pass.

One program owns ``CPP`` chunks (CHUNK = 1024 entries each = 64 NVFP4 blocks of 16) of a flat
parameter and runs ``2 · CPP`` warps: **one thread owns one 16-block** (row). Every per-block
operation — the 16-point Hadamard butterflies, the block amax, the 4/6 block errors, the nibble
packing, the in-block part of the tile sum — is register arithmetic inside one thread: no
shuffles, no shared-memory layout conversions. Only the chunk amax (one value per row) and the
tile mean (two rows) cross threads. A thread reads its row as four 16-byte vectors (LDG.128)
and the row's 8 code bytes as two int32 words. See PERF.md for the instruction budget.

Bytes moved per parameter (FP32 grad): p 4+4, g 4, m 0.566+0.566, v 0.629+0.629 → ~14.4 B,
against 28 B for FP32-state fused AdamW (p 8, g 4, m 8, v 8): the bytes allow ~0.5×.

It computes exactly what ``optimizer.q_adamw_step_reference`` computes, operation for operation
in FP32 (IEEE ``div_rn``/``sqrt_rn``, launched with ``enable_fp_fusion=False`` so no FMA
contraction; every sum is the reference's fixed halving tree), so given the same uniforms
(``rand``) the two agree bit for bit. Without ``rand`` the stochastic-rounding uniforms come from
Philox (``tl.randint4x``) seeded per (step, parameter): one Philox call gives 8 uniforms of 16
bits (u = k / 2^16; the rounding's bias is then at most 2^-16 of one E2M1 step).

Rounding without comparison ladders, exact in IEEE FP32 (so the interpreter and the GPU agree):
E2M1 and E4M3 round-to-nearest-even is one add of a power of two M picked from the exponent
(fl(a + M) − M lands on the format's grid, ties to even); stochastic E2M1 truncates to 1
mantissa bit. The results equal fullstack_fp4.nvfp4.e2m1's threshold definitions and torch's
E4M3 cast exactly (tests/.../test_q_adamw_kernel.py checks every grid point and tie). BF16
tile means are rounded on the bits (adding 0x7FFF + lsb).

The Hadamard is fullstack_fp4.nvfp4's butterfly (stages 1, 2, 4, 8; pairs (a+b, a-b)) with TE's
signs, written out on the 16 registers of a row.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .codecs import BLOCK, CHUNK, REL_FLOOR, TILE

FP32_MAX = 3.4028234663852886e38
FP32_MAX_C = tl.constexpr(FP32_MAX)
REL_FLOOR_C = tl.constexpr(REL_FLOOR)
# Transformer Engine's sign vector (fullstack_fp4.nvfp4.hadamard); negative at 3, 5-10, 12, 14, 15
# — written out in _rht16/_irht16 below, checked against this tuple by the tests.
_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
CPP = 1          # chunks per program (one warp = 32 blocks; 2·CPP warps per program)
FAST_DEC = True  # nibble decode through the subnormal trick (_nib); False: the select chain
assert BLOCK == 16 and TILE == 32 and CHUNK == 1024


# ----------------------------------------------------------------------------- rows of 16
@triton.jit
def _ld4(ptr, rows, Q: tl.constexpr, lim, other):
    """Entries 4Q..4Q+3 of each row (one 16-byte load per thread), as 4 row vectors."""
    idx = rows[:, None] * 16 + (Q * 4 + tl.arange(0, 4))[None, :]
    x = tl.load(ptr + idx, mask=(idx < lim) & (idx >= 0),
                other=other).to(tl.float32)   # bf16 grads too
    a, b = tl.split(tl.reshape(x, (rows.shape[0], 2, 2)))
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    return x0, x1, x2, x3


@triton.jit
def _ld16(ptr, rows, lim, other):
    x0, x1, x2, x3 = _ld4(ptr, rows, 0, lim, other)
    x4, x5, x6, x7 = _ld4(ptr, rows, 1, lim, other)
    x8, x9, x10, x11 = _ld4(ptr, rows, 2, lim, other)
    x12, x13, x14, x15 = _ld4(ptr, rows, 3, lim, other)
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def _st4(ptr, rows, Q: tl.constexpr, lim, x0, x1, x2, x3):
    idx = rows[:, None] * 16 + (Q * 4 + tl.arange(0, 4))[None, :]
    x = tl.join(tl.join(x0, x2), tl.join(x1, x3))
    tl.store(ptr + idx, tl.reshape(x, (rows.shape[0], 4)), mask=(idx < lim) & (idx >= 0))


@triton.jit
def _st16(ptr, rows, lim, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    _st4(ptr, rows, 0, lim, x0, x1, x2, x3)
    _st4(ptr, rows, 1, lim, x4, x5, x6, x7)
    _st4(ptr, rows, 2, lim, x8, x9, x10, x11)
    _st4(ptr, rows, 3, lim, x12, x13, x14, x15)


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
    """fwht(x · signs) · 0.25 (x · −1 is −x exactly, so the signs fold into the adds)."""
    y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _fwht16(
        x0, x1, x2, -x3, x4, -x5, -x6, -x7, -x8, -x9, -x10, x11, -x12, x13, -x14, -x15)
    return (y0 * 0.25, y1 * 0.25, y2 * 0.25, y3 * 0.25, y4 * 0.25, y5 * 0.25, y6 * 0.25,
            y7 * 0.25, y8 * 0.25, y9 * 0.25, y10 * 0.25, y11 * 0.25, y12 * 0.25, y13 * 0.25,
            y14 * 0.25, y15 * 0.25)


@triton.jit
def _irht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    """(fwht(y) · 0.25) · signs; (z · 0.25) · −1 == z · −0.25 exactly."""
    y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _fwht16(
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
    return (y0 * 0.25, y1 * 0.25, y2 * 0.25, y3 * -0.25, y4 * 0.25, y5 * -0.25, y6 * -0.25,
            y7 * -0.25, y8 * -0.25, y9 * -0.25, y10 * -0.25, y11 * 0.25, y12 * -0.25,
            y13 * 0.25, y14 * -0.25, y15 * -0.25)


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
def _candidate(bamax, enc, dec, inv_target):
    s, code = _e4m3_rne(tl.minimum(bamax * (enc * inv_target), 448.0))
    f = tl.minimum(tl.div_rn(1.0, s * dec), FP32_MAX_C)
    return s, code, f


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
def _sr_code(a, u):
    """Stochastic E2M1 code of a in [0, 6]: lo + (u < (a - lo) / step), nvfp4.e2m1's rule.

    lo = a truncated to 1 mantissa bit (a >= 1) or 0 / 0.5; step is a power of two, so
    (a - lo) · (1 / step) equals the reference's correctly rounded division bit for bit."""
    b = a.to(tl.int32, bitcast=True)
    bl = b & -4194304
    inv_n = ((255 << 23) - (b & 0x7F800000)).to(tl.float32, bitcast=True)   # 1 / 2^(e-1)
    half = a >= 0.5
    is_n = a >= 1.0
    vlo = tl.where(is_n, bl.to(tl.float32, bitcast=True), tl.where(half, 0.5, 0.0))
    frac = (a - vlo) * tl.where(is_n, inv_n, 2.0)
    code = tl.where(is_n, (bl >> 22) - 252, tl.where(half, 1, 0))
    return code + tl.where(u < frac, 1, 0)


@triton.jit
def _nib(w, J: tl.constexpr, s, dec, FAST: tl.constexpr):
    """Decode nibble J of word w: (q · s) · dec (q = ±E2M1 value; code 8 is −0).

    FAST: the 3 magnitude bits k placed at bits 22-24 of an FP32 word are exactly
    E2M1(k) · 2^-126 (k = 0, 1: subnormals 0, 2^-127; k >= 2: exponent field k >> 1 with the
    top mantissa bit k & 1), so q = fl(bits · 2^126) exactly (sm_90 FMUL keeps subnormals:
    Triton emits mul.f32 without .ftz) — two shifts, one LOP3 and one FMUL instead of the
    select chain."""
    if FAST:
        if 4 * J <= 22:
            mag = (w << (22 - 4 * J)) & 0x01C00000
        else:
            mag = (w >> (4 * J - 22)) & 0x01C00000
        bits = mag | ((w << (28 - 4 * J)) & -2147483648)
        q = bits.to(tl.float32, bitcast=True) * 8.507059173023462e37          # 2^126
        return (q * s) * dec
    else:
        k = (w >> (4 * J)) & 7
        bits = tl.where(k >= 2, (k + 252) << 22, k * 0x3F000000)
        bits = bits | ((w << (28 - 4 * J)) & -2147483648)
        return (bits.to(tl.float32, bitcast=True) * s) * dec


@triton.jit
def _err46(y, f6, s6, f4, s4, dec):
    """|y − q6·s6·dec|, |y − q4·s4·dec| (RTN candidates; sign-symmetric, so on |y|)."""
    ay = tl.abs(y)
    e6 = tl.abs(ay - (_rtn_val(tl.minimum(ay * f6, 6.0)) * s6) * dec)
    e4 = tl.abs(ay - (_rtn_val(tl.minimum(ay * f4, 6.0)) * s4) * dec)
    return e6, e4


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


# ----------------------------------------------------------------------------- chunk codec
@triton.jit
def _decode_rows(codes_ptr, scale_ptr, cs_ptr, rows, vrows, nrows, FAST: tl.constexpr):
    """Decoded Hadamard-domain values of each row (16 vectors), before the inverse RHT.
    ``rows``: the local 16-block index (< 0 before the tensor: phase); ``vrows``: the row on the
    chunk grid (``rows + phase / 16``)."""
    wp = codes_ptr.to(tl.pointer_type(tl.int32))
    widx = rows[:, None] * 2 + tl.arange(0, 2)[None, :]
    w0, w1 = tl.split(tl.load(wp + widx, mask=(widx < nrows * 2) & (widx >= 0), other=0))
    live = (rows < nrows) & (rows >= 0)
    s = _e4m3_decode(tl.load(scale_ptr + rows, mask=live, other=0))
    dec = tl.load(cs_ptr + vrows // 64, mask=live, other=0.0)
    return (_nib(w0, 0, s, dec, FAST), _nib(w0, 1, s, dec, FAST), _nib(w0, 2, s, dec, FAST),
            _nib(w0, 3, s, dec, FAST), _nib(w0, 4, s, dec, FAST), _nib(w0, 5, s, dec, FAST),
            _nib(w0, 6, s, dec, FAST), _nib(w0, 7, s, dec, FAST), _nib(w1, 0, s, dec, FAST),
            _nib(w1, 1, s, dec, FAST), _nib(w1, 2, s, dec, FAST), _nib(w1, 3, s, dec, FAST),
            _nib(w1, 4, s, dec, FAST), _nib(w1, 5, s, dec, FAST), _nib(w1, 6, s, dec, FAST),
            _nib(w1, 7, s, dec, FAST))


@triton.jit
def _chunk_scales(bamax, M6: tl.constexpr, R: tl.constexpr):
    """Per-chunk (enc, dec) from the rows' block amax; returns (enc_rows, dec_rows, dec_chunks)."""
    NCH: tl.constexpr = R // 64
    amax = tl.max(tl.reshape(bamax, (NCH, 64)), axis=1)
    enc = tl.minimum(tl.div_rn(M6, amax), FP32_MAX_C)
    enc = tl.where(enc == 0.0, 1.0, enc)
    dec = tl.div_rn(1.0, enc)
    enc_r = tl.reshape(tl.broadcast_to(enc[:, None], (NCH, 64)), (R,))
    dec_r = tl.reshape(tl.broadcast_to(dec[:, None], (NCH, 64)), (R,))
    return enc_r, dec_r, dec


@triton.jit
def _store_rows(codes_ptr, scale_ptr, cs_ptr, rows, nrows, pid, nch, w0, w1, sc, dec_c,
                R: tl.constexpr):
    wp = codes_ptr.to(tl.pointer_type(tl.int32))
    widx = rows[:, None] * 2 + tl.arange(0, 2)[None, :]
    tl.store(wp + widx, tl.join(w0, w1), mask=(widx < nrows * 2) & (widx >= 0))
    tl.store(scale_ptr + rows, sc.to(tl.uint8), mask=(rows < nrows) & (rows >= 0))
    ch = pid * (R // 64) + tl.arange(0, R // 64)
    tl.store(cs_ptr + ch, dec_c, mask=ch < nch)


@triton.jit
def _encode_m(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
              u0, u1, u2, u3, u4, u5, u6, u7, u8, u9, u10, u11, u12, u13, u14, u15,
              R: tl.constexpr):
    """NVFP4, 4/6 scale rule, stochastic rounding: (word0, word1, scale code, dec per chunk)."""
    bamax = _max16(tl.abs(y0), tl.abs(y1), tl.abs(y2), tl.abs(y3), tl.abs(y4), tl.abs(y5),
                   tl.abs(y6), tl.abs(y7), tl.abs(y8), tl.abs(y9), tl.abs(y10), tl.abs(y11),
                   tl.abs(y12), tl.abs(y13), tl.abs(y14), tl.abs(y15))
    enc, dec, dec_c = _chunk_scales(bamax, 1536.0, R)          # 256 · 6
    s6, sc6, f6 = _candidate(bamax, enc, dec, 0.1666666716337204)   # fp32(1/6)
    s4, sc4, f4 = _candidate(bamax, enc, dec, 0.25)
    a0, b0 = _err46(y0, f6, s6, f4, s4, dec)
    a1, b1 = _err46(y1, f6, s6, f4, s4, dec)
    a2, b2 = _err46(y2, f6, s6, f4, s4, dec)
    a3, b3 = _err46(y3, f6, s6, f4, s4, dec)
    a4, b4 = _err46(y4, f6, s6, f4, s4, dec)
    a5, b5 = _err46(y5, f6, s6, f4, s4, dec)
    a6, b6 = _err46(y6, f6, s6, f4, s4, dec)
    a7, b7 = _err46(y7, f6, s6, f4, s4, dec)
    a8, b8 = _err46(y8, f6, s6, f4, s4, dec)
    a9, b9 = _err46(y9, f6, s6, f4, s4, dec)
    a10, b10 = _err46(y10, f6, s6, f4, s4, dec)
    a11, b11 = _err46(y11, f6, s6, f4, s4, dec)
    a12, b12 = _err46(y12, f6, s6, f4, s4, dec)
    a13, b13 = _err46(y13, f6, s6, f4, s4, dec)
    a14, b14 = _err46(y14, f6, s6, f4, s4, dec)
    a15, b15 = _err46(y15, f6, s6, f4, s4, dec)
    e6 = _hsum16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15)
    e4 = _hsum16(b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15)
    use4 = e4 < e6
    sc = tl.where(use4, sc4, sc6)
    f = tl.where(use4, f4, f6)
    w0 = _pack8(_q(y0, f, u0, True), _q(y1, f, u1, True), _q(y2, f, u2, True),
                _q(y3, f, u3, True), _q(y4, f, u4, True), _q(y5, f, u5, True),
                _q(y6, f, u6, True), _q(y7, f, u7, True))
    w1 = _pack8(_q(y8, f, u8, True), _q(y9, f, u9, True), _q(y10, f, u10, True),
                _q(y11, f, u11, True), _q(y12, f, u12, True), _q(y13, f, u13, True),
                _q(y14, f, u14, True), _q(y15, f, u15, True))
    return w0, w1, sc, dec_c


@triton.jit
def _encode_v(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
              R: tl.constexpr):
    """NVFP4, 6 scale rule, nearest rounding: (word0, word1, scale code, dec per chunk)."""
    bamax = _max16(tl.abs(y0), tl.abs(y1), tl.abs(y2), tl.abs(y3), tl.abs(y4), tl.abs(y5),
                   tl.abs(y6), tl.abs(y7), tl.abs(y8), tl.abs(y9), tl.abs(y10), tl.abs(y11),
                   tl.abs(y12), tl.abs(y13), tl.abs(y14), tl.abs(y15))
    enc, dec, dec_c = _chunk_scales(bamax, 2688.0, R)          # 448 · 6
    s6, sc, f = _candidate(bamax, enc, dec, 0.1666666716337204)
    w0 = _pack8(_q(y0, f, y0, False), _q(y1, f, y1, False), _q(y2, f, y2, False),
                _q(y3, f, y3, False), _q(y4, f, y4, False), _q(y5, f, y5, False),
                _q(y6, f, y6, False), _q(y7, f, y7, False))
    w1 = _pack8(_q(y8, f, y8, False), _q(y9, f, y9, False), _q(y10, f, y10, False),
                _q(y11, f, y11, False), _q(y12, f, y12, False), _q(y13, f, y13, False),
                _q(y14, f, y14, False), _q(y15, f, y15, False))
    return w0, w1, sc, dec_c


# ----------------------------------------------------------------------------- per element
@triton.jit
def _vhat(r, mean, floor):
    sh = tl.maximum(r + mean, floor)
    return tl.minimum(sh * sh, FP32_MAX_C)


@triton.jit
def _adam(p, g, m, v, live, decay, beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size):
    """AdamW on one entry, the reference's FP32 order: (p', m', v', sqrt(v'))."""
    p = p * decay
    m = m * beta1 + g * omb1
    v = v * beta2 + (g * g) * omb2
    m = tl.where(live, m, 0.0)
    v = tl.where(live, v, 0.0)
    s = tl.sqrt_rn(v)
    upd = tl.div_rn(m, s * inv_sqrt_bc2 + eps)
    return p - step_size * upd, m, v, s


@triton.jit
def _u16(r):
    """Two uniforms k / 2^16 from the halves of a uint32 (exact: 1.k - 1 on the bits)."""
    lo = (((r & 0xFFFF) << 7) | 0x3F800000).to(tl.float32, bitcast=True) - 1.0
    hi = (((r >> 9) & 0x7FFF80) | 0x3F800000).to(tl.float32, bitcast=True) - 1.0
    return lo, hi


@triton.jit
def _u8(r):
    """Four uniforms k / 2^8 from the bytes of a uint32 (exact: 1.k - 1 on the bits)."""
    a = (((r & 0xFF) << 15) | 0x3F800000).to(tl.float32, bitcast=True) - 1.0
    b = (((r << 7) & 0x7F8000) | 0x3F800000).to(tl.float32, bitcast=True) - 1.0
    c = (((r >> 1) & 0x7F8000) | 0x3F800000).to(tl.float32, bitcast=True) - 1.0
    d = (((r >> 9) & 0x7F8000) | 0x3F800000).to(tl.float32, bitcast=True) - 1.0
    return a, b, c, d


@triton.jit
def q_adamw_kernel(p_ptr, g_ptr,
                   mc_ptr, ms_ptr, mcs_ptr,
                   vc_ptr, vs_ptr, vcs_ptr, vmean_ptr,
                   u_ptr, n, npad, seed, ph_rows, row0,
                   decay, beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size,
                   HAS_U: tl.constexpr, CPP_C: tl.constexpr, FAST_DEC: tl.constexpr,
                   U8: tl.constexpr, ROUNDS: tl.constexpr):
    R: tl.constexpr = CPP_C * 64          # rows (16-blocks) per program
    pid = tl.program_id(0).to(tl.int64)
    # Rows on the chunk grid; the tensor starts ph_rows (= phase / 16, even) rows into it, so
    # rows < 0 are outside (masked, zero); row0: this piece's first row in the whole tensor
    # (the Philox counter).
    vrows = pid * R + tl.arange(0, R)
    rows = vrows - ph_rows
    nrows = npad // 16
    nch = (ph_rows * 16 + npad + 1023) // 1024

    p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15 = _ld16(
        p_ptr, rows, n, 0.0)
    g0, g1, g2, g3, g4, g5, g6, g7, g8, g9, g10, g11, g12, g13, g14, g15 = _ld16(
        g_ptr, rows, n, 0.0)
    # decode m
    q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15 = _decode_rows(
        mc_ptr, ms_ptr, mcs_ptr, rows, vrows, nrows, FAST_DEC)
    m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15 = _irht16(
        q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15)
    # decode v: r̂ + μ floored at μ/4, squared
    q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15 = _decode_rows(
        vc_ptr, vs_ptr, vcs_ptr, rows, vrows, nrows, FAST_DEC)
    r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13, r14, r15 = _irht16(
        q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15)
    mb = tl.load(vmean_ptr + rows // 2, mask=(rows < nrows) & (rows >= 0),
                 other=0).to(tl.int32)
    mean = ((mb & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    fl = mean * REL_FLOOR_C
    rem = n - rows * 16                    # entries of the row that are real: j < rem

    p0, m0, v0, s0 = _adam(p0, g0, m0, _vhat(r0, mean, fl), 0 < rem, decay, beta1, omb1,
                           beta2, omb2, inv_sqrt_bc2, eps, step_size)
    p1, m1, v1, s1 = _adam(p1, g1, m1, _vhat(r1, mean, fl), 1 < rem, decay, beta1, omb1,
                           beta2, omb2, inv_sqrt_bc2, eps, step_size)
    p2, m2, v2, s2 = _adam(p2, g2, m2, _vhat(r2, mean, fl), 2 < rem, decay, beta1, omb1,
                           beta2, omb2, inv_sqrt_bc2, eps, step_size)
    p3, m3, v3, s3 = _adam(p3, g3, m3, _vhat(r3, mean, fl), 3 < rem, decay, beta1, omb1,
                           beta2, omb2, inv_sqrt_bc2, eps, step_size)
    p4, m4, v4, s4 = _adam(p4, g4, m4, _vhat(r4, mean, fl), 4 < rem, decay, beta1, omb1,
                           beta2, omb2, inv_sqrt_bc2, eps, step_size)
    p5, m5, v5, s5 = _adam(p5, g5, m5, _vhat(r5, mean, fl), 5 < rem, decay, beta1, omb1,
                           beta2, omb2, inv_sqrt_bc2, eps, step_size)
    p6, m6, v6, s6 = _adam(p6, g6, m6, _vhat(r6, mean, fl), 6 < rem, decay, beta1, omb1,
                           beta2, omb2, inv_sqrt_bc2, eps, step_size)
    p7, m7, v7, s7 = _adam(p7, g7, m7, _vhat(r7, mean, fl), 7 < rem, decay, beta1, omb1,
                           beta2, omb2, inv_sqrt_bc2, eps, step_size)
    p8, m8, v8, s8 = _adam(p8, g8, m8, _vhat(r8, mean, fl), 8 < rem, decay, beta1, omb1,
                           beta2, omb2, inv_sqrt_bc2, eps, step_size)
    p9, m9, v9, s9 = _adam(p9, g9, m9, _vhat(r9, mean, fl), 9 < rem, decay, beta1, omb1,
                           beta2, omb2, inv_sqrt_bc2, eps, step_size)
    p10, m10, v10, s10 = _adam(p10, g10, m10, _vhat(r10, mean, fl), 10 < rem, decay, beta1,
                               omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size)
    p11, m11, v11, s11 = _adam(p11, g11, m11, _vhat(r11, mean, fl), 11 < rem, decay, beta1,
                               omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size)
    p12, m12, v12, s12 = _adam(p12, g12, m12, _vhat(r12, mean, fl), 12 < rem, decay, beta1,
                               omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size)
    p13, m13, v13, s13 = _adam(p13, g13, m13, _vhat(r13, mean, fl), 13 < rem, decay, beta1,
                               omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size)
    p14, m14, v14, s14 = _adam(p14, g14, m14, _vhat(r14, mean, fl), 14 < rem, decay, beta1,
                               omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size)
    p15, m15, v15, s15 = _adam(p15, g15, m15, _vhat(r15, mean, fl), 15 < rem, decay, beta1,
                               omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size)
    _st16(p_ptr, rows, n, p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15)

    # encode m: RHT16, 4/6, SR
    if HAS_U:
        u0, u1, u2, u3, u4, u5, u6, u7, u8, u9, u10, u11, u12, u13, u14, u15 = _ld16(
            u_ptr, rows, npad, 0.0)
    else:
        off = ((rows + row0) * 2).to(tl.int32)
        if U8:      # one Philox call per row: 16 uniforms of 8 bits (SR bias <= 2^-8 step)
            k0, k1, k2, k3 = tl.randint4x(seed, off, ROUNDS)
            u0, u1, u2, u3 = _u8(k0)
            u4, u5, u6, u7 = _u8(k1)
            u8, u9, u10, u11 = _u8(k2)
            u12, u13, u14, u15 = _u8(k3)
        else:       # two calls per row: 16 uniforms of 16 bits (SR bias <= 2^-16 step)
            k0, k1, k2, k3 = tl.randint4x(seed, off, ROUNDS)
            k4, k5, k6, k7 = tl.randint4x(seed, off + 1, ROUNDS)
            u0, u1 = _u16(k0)
            u2, u3 = _u16(k1)
            u4, u5 = _u16(k2)
            u6, u7 = _u16(k3)
            u8, u9 = _u16(k4)
            u10, u11 = _u16(k5)
            u12, u13 = _u16(k6)
            u14, u15 = _u16(k7)
    y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _rht16(
        m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15)
    w0, w1, sc, dec_c = _encode_m(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13,
                                  y14, y15, u0, u1, u2, u3, u4, u5, u6, u7, u8, u9, u10, u11,
                                  u12, u13, u14, u15, R)
    _store_rows(mc_ptr, ms_ptr, mcs_ptr, rows, nrows, pid, nch, w0, w1, sc, dec_c, R)

    # encode v: sqrt (s above), tile mean (BF16 RNE), residual, RHT16, RTN 6-rule
    bsum = _hsum16(s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15)
    ba, bb = tl.split(tl.reshape(bsum, (R // 2, 2)))
    tix = pid * (R // 2) + tl.arange(0, R // 2) - ph_rows // 2
    cnt = tl.minimum(tl.maximum(n - tix * 32, 1), 32).to(tl.float32)
    tmean = tl.div_rn(ba + bb, cnt)
    mbits = tmean.to(tl.int32, bitcast=True)
    mbits = (mbits + 0x7FFF + ((mbits >> 16) & 1)) & -65536
    tl.store(vmean_ptr + tix, (mbits >> 16).to(tl.int16), mask=(tix < npad // 32) & (tix >= 0))
    mbits = tl.reshape(tl.join(mbits, mbits), (R,))
    mean = mbits.to(tl.float32, bitcast=True)
    y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _rht16(
        tl.where(0 < rem, s0 - mean, 0.0), tl.where(1 < rem, s1 - mean, 0.0),
        tl.where(2 < rem, s2 - mean, 0.0), tl.where(3 < rem, s3 - mean, 0.0),
        tl.where(4 < rem, s4 - mean, 0.0), tl.where(5 < rem, s5 - mean, 0.0),
        tl.where(6 < rem, s6 - mean, 0.0), tl.where(7 < rem, s7 - mean, 0.0),
        tl.where(8 < rem, s8 - mean, 0.0), tl.where(9 < rem, s9 - mean, 0.0),
        tl.where(10 < rem, s10 - mean, 0.0), tl.where(11 < rem, s11 - mean, 0.0),
        tl.where(12 < rem, s12 - mean, 0.0), tl.where(13 < rem, s13 - mean, 0.0),
        tl.where(14 < rem, s14 - mean, 0.0), tl.where(15 < rem, s15 - mean, 0.0))
    w0, w1, sc, dec_c = _encode_v(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13,
                                  y14, y15, R)
    _store_rows(vc_ptr, vs_ptr, vcs_ptr, rows, nrows, pid, nch, w0, w1, sc, dec_c, R)


def launch(p_flat, g_flat, st, n, npad, *, seed, decay, beta1, omb1, beta2, omb2, inv_sqrt_bc2,
           eps, step_size, rand=None, cpp=None, phase=0, row0=0, fast_dec=None, maxnreg=None,
           u8=False, rounds=10):
    """Run the fused step in place on the flat FP32 ``p_flat`` and the state tensors ``st``.

    ``st``: dict of the optimizer's state tensors (codes uint8, scales uint8 = E4M3 bits, chunk
    scales FP32, tile means int16 = BF16 bits). Scalars are passed as FP32 kernel arguments.
    ``cpp``: chunks per program (default ``CPP``), 2·cpp warps. ``phase``: chunk-grid phase
    (codecs.num_chunks; a multiple of the 32-tile here); ``row0``: the piece's first 16-block
    in the whole tensor (Philox counter base). ``fast_dec``: the nibble decode variant
    (default ``FAST_DEC``; both are bit-identical); ``maxnreg``: register cap per thread (GPU
    only; None = Triton's choice). ``u8`` / ``rounds`` (Philox path only, i.e. ``rand`` None):
    8-bit uniforms from one Philox call per 16-block instead of 16-bit ones from two (SR bias
    bound 2^-8 instead of 2^-16 of an E2M1 step), and Philox rounds (10 = Triton's default;
    7 passes BigCrush per Salmon et al. 2011) — speed options for the sweep, not defaults.
    ``scripts/bench_q_adamw.py --sweep`` times the combinations.
    """
    if phase % TILE or not 0 <= phase < CHUNK:
        raise ValueError(f"kernel chunk phase {phase} must be a multiple of {TILE} in [0, {CHUNK})")
    cpp = CPP if cpp is None else cpp
    fast_dec = FAST_DEC if fast_dec is None else fast_dec
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    nprog = -(-(phase + npad) // (CHUNK * cpp))
    u = rand if rand is not None else p_flat
    q_adamw_kernel[(nprog,)](
        p_flat, g_flat,
        st["exp_avg_codes"], st["exp_avg_scales"], st["exp_avg_chunk_scales"],
        st["exp_avg_sq_codes"], st["exp_avg_sq_scales"], st["exp_avg_sq_chunk_scales"],
        st["exp_avg_sq_means"],
        u, n, npad, seed, phase // BLOCK, row0,
        decay, beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size,
        HAS_U=rand is not None, CPP_C=cpp, FAST_DEC=bool(fast_dec), U8=bool(u8), ROUNDS=rounds,
        num_warps=2 * cpp,
        enable_fp_fusion=False, **extra)
