"""In-register NVFP4 quantization for the Q-Attn kernels (Triton ``@jit`` helpers).

Bit-compatible with ``fullstack_fp4.nvfp4.reference.quantize_reference`` (docs/nvfp4-format.md):

    s = e4m3_rne(min(bamax · (enc · (1/6)), 448));  f = min(1 / (s · dec), FP32_MAX)
    value = e2m1_round(clamp(x · f, −6, 6)) · s       (returned: code·scale, exact in BF16)

Choices that keep it exact on GPU and in the interpreter alike:
  * ``e4m3_rne`` without a float8 cast (the interpreter and Triton 3.6 differ there): the
    exponent comes from the FP32 bits, the value is scaled by an exact power of two so the
    E4M3 step becomes 1, rounded to nearest-even with the ``(r + 2²³) − 2²³`` FP32 trick
    (exact for 0 ≤ r < 2²², here r ≤ 16), and scaled back. Subnormals: exponent floor −6.
  * Divisions use ``tl.div_rn`` (IEEE), because ``/`` on FP32 may lower to an approximate
    ``div.full.f32`` on NVIDIA GPUs.
  * E2M1 nearest by the FP32 magic add (:func:`e2m1_nearest`, equal to the format's threshold
    chain with ties to even); stochastic by ``lo = floor(a / step) · step``, up iff
    ``u < (a − lo) / step`` (step a power of two).
  * :func:`qdq_codes` also returns the 4-bit code (the saved views, ``packed.py``);
    :func:`e4m3_bits` the scale byte.
"""

import triton
import triton.language as tl

from fullstack_fp4.nvfp4.kernels.fp4_math import neg_where  # -0 where the code's sign says so

FP32_MAX = tl.constexpr(3.4028234663852886e38)  # a plain global is invisible to compiled kernels


@triton.jit
def e4m3_rne(v):
    """Round FP32 ``0 <= v <= 448`` to the nearest-even E4M3 value (returned as FP32)."""
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)                       # subnormal range shares the 2^-9 step
    inv_step = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)   # 2^(3 - e), exact
    step = ((127 + (e - 3)) << 23).to(tl.float32, bitcast=True)       # 2^(e - 3), exact
    r = v * inv_step
    r = (r + 8388608.0) - 8388608.0             # RNE to an integer (r <= 16)
    return r * step


@triton.jit
def e2m1_nearest(a):
    """Magnitude ``0 <= a <= 6`` to the E2M1 grid, ties to even.

    The grid step is 0.5 below 2, 1 on [2, 4), 2 on [4, 6]; ``(a + C) − C`` with ``C`` = 2²²,
    2²³, 2²⁴ (whose FP32 ulp is that step) is FP32 round-to-nearest-even onto the grid, exact
    (a < 2²²). 2 compares + 2 selects + 2 adds instead of the 7-level threshold chain
    (``t <= 0.25 → 0, < 0.75 → 0.5, <= 1.25 → 1, < 1.75 → 1.5, <= 2.5 → 2, < 3.5 → 3,
    <= 5 → 4, else 6``); checked equal to that chain on every FP32 in [0, 6] (docs/perf/q-attn.md)."""
    c = tl.where(a < 2.0, 4194304.0, tl.where(a < 4.0, 8388608.0, 16777216.0))
    return (a + c) - c


@triton.jit
def e2m1_stochastic(a, u):
    """Magnitude ``0 <= a <= 6`` rounded up to the next grid value iff ``u < frac``."""
    step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    lo = (a / step).to(tl.int32).to(tl.float32) * step      # a/step exact (power of two)
    frac = (a - lo) / step
    up = (u < frac) & (lo < 6.0)
    return tl.where(up, lo + step, lo)


@triton.jit
def encode_scales(amax):
    """``(enc·(1/6), dec)`` FP32 for a tensor amax (TE order; amax 0 -> enc = FP32_MAX)."""
    enc = tl.minimum(tl.div_rn(tl.full(amax.shape, 2688.0, tl.float32), amax), FP32_MAX)
    dec = tl.div_rn(tl.full(enc.shape, 1.0, tl.float32), enc)
    return enc * 0.16666667163372040, dec


@triton.jit
def head_scales(amax):
    """``(enc·(1/6), dec)`` for a per-head amax, exactly ``nvfp4.reference.tensor_scales``:
    :func:`encode_scales` plus TE's ``enc == 0 -> 1`` (amax = inf). Used where ``dec`` is
    stored (the prologue); the dS tiles keep :func:`encode_scales` (finite by construction)."""
    enc = tl.minimum(tl.div_rn(tl.full(amax.shape, 2688.0, tl.float32), amax), FP32_MAX)
    enc = tl.where(enc == 0.0, 1.0, enc)
    dec = tl.div_rn(tl.full(enc.shape, 1.0, tl.float32), enc)
    return enc * 0.16666667163372040, dec


@triton.jit
def e4m3_bits(s):
    """E4M3 bit pattern (int32 0..126) of an FP32 ``s`` that *is* an E4M3 value in [0, 448]
    (the output of :func:`e4m3_rne`): normal (s >= 2⁻⁶) ``((e32 − 120) << 3) | top-3 mantissa
    bits`` = ``(bits >> 20) − 960``; subnormal ``s / 2⁻⁹`` (0..7), exact."""
    bits = s.to(tl.int32, bitcast=True)
    return tl.where(s < 0.015625, (s * 512.0).to(tl.int32), (bits >> 20) - 960)


@triton.jit
def block_scales(bamax, enc6, dec):
    """``(s, f)`` per block: the E4M3 block scale (as FP32) and the encode factor ``1/(s·dec)``.

    Call it on the *reduced* block-amax tensor (one element per 16-block) and broadcast the
    results: the E4M3 rounding and the IEEE division then run once per block instead of once
    per element (16× fewer; identical numbers, the same ops on the same inputs)."""
    s = e4m3_rne(tl.minimum(bamax * enc6, 448.0))
    f = tl.minimum(tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s * dec), FP32_MAX)
    return s, f


@triton.jit
def qdq_apply(x, s, f, u, STOCHASTIC: tl.constexpr):
    """``e2m1(code) · s`` for FP32 ``x`` given its block's ``(s, f)`` (broadcastable to x)."""
    y = tl.minimum(tl.maximum(x * f, -6.0), 6.0)
    a = tl.abs(y)
    if STOCHASTIC:
        m = e2m1_stochastic(a, u)
    else:
        m = e2m1_nearest(a)
    return neg_where(y < 0, m) * s


@triton.jit
def qdq_codes(x, s, f):
    """Nearest rounding as :func:`qdq_apply` (same value, bit for bit) plus the 4-bit E2M1 code
    (int32; bit 3 = sign from ``y < 0``, so a negative value rounding to 0 gets code 8 as in
    ``nvfp4.e2m1``). Magnitude code of ``m`` ∈ {0, .5, 1, 1.5, 2, 3, 4, 6}: ``2m`` below 2,
    ``m + 2`` for 2, 3, 4, and 7 for 6."""
    y = tl.minimum(tl.maximum(x * f, -6.0), 6.0)
    m = e2m1_nearest(tl.abs(y))
    neg = y < 0
    mag = tl.where(m < 2.0, m * 2.0, tl.where(m < 6.0, m + 2.0, 7.0)).to(tl.int32)
    return neg_where(neg, m) * s, tl.where(neg, mag | 8, mag)


@triton.jit
def dot_bf16(a, b, INTERP: tl.constexpr):
    """``tl.dot`` of BF16 operands with FP32 accumulation.

    Under ``TRITON_INTERPRET=1`` (Triton 3.9 + numpy 2.4) a BF16 ``tl.dot`` returns garbage
    (measured: errors ~1e10), so the interpreter path upcasts first; BF16 values are exact in
    FP32, and a BF16 MMA forms exact products in FP32, so the result is the same up to
    accumulation order.
    """
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def to_bf16(x, INTERP: tl.constexpr):
    """FP32 -> BF16, round-to-nearest-even (what ``cvt.rn.bf16.f32`` does on the GPU).

    Under ``TRITON_INTERPRET=1`` (Triton 3.9) ``.to(tl.bfloat16)`` truncates (measured: every
    result rounded toward zero, twice the RNE error and biased), so the interpreter path rounds
    the FP32 bits itself (finite inputs: ``bits + 0x7FFF + lsb``, low half cleared) and the
    final cast is then exact.
    """
    if INTERP:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(tl.bfloat16)
