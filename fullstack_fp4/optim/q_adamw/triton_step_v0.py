"""SUPERSEDED (kept only so scripts/bench_q_adamw.py can time the old kernel): the first fused
kernel, 29.5 ms/step for 1e9 params on an H200. Its 4/6 error sums (FP64) and tile-sum tree
differ from today's reference, so it is NOT bit-exact with it any more; see PERF.md.

Fused Q-AdamW step in Triton: decode m and v, AdamW update, re-encode both, write p — one pass.

One program owns one CHUNK (1024 entries) of a flat parameter: it reads p, g, the 4-bit codes,
E4M3 block scales, the chunk's two FP32 scales and 32 BF16 tile means, and writes p and the new
state. Bytes moved per parameter (FP32 grad): p 4+4, g 4, m 0.566+0.566, v 0.629+0.629 →
~14.4 B, against 28 B for FP32-state fused AdamW (p 8, g 4, m 8, v 8): the bytes allow ~0.5×.

It computes exactly what ``optimizer.q_adamw_step_reference`` computes, operation for operation
in FP32 (IEEE ``div_rn``/``sqrt_rn``, launched with ``enable_fp_fusion=False`` so no FMA
contraction), so given the same uniforms (``rand``) the two agree bit for bit; without ``rand``
the stochastic-rounding uniforms come from Philox (``tl.rand``) seeded per (step, parameter).

Rounding to E4M3 and BF16 is done on the FP32 bits (RNE by adding ``0x7FFFF + lsb``), not with
Triton's FP8/BF16 casts, so the interpreter and the GPU round the same way; tests check the
result against ``torch``'s casts.

Layouts: element ``i`` of the chunk is ``[i // 16, i % 16]`` of the ``[64, 16]`` block view and
``[i // 32, i % 32]`` of the ``[32, 32]`` tile view (both row-major, so a reshape converts).
The Hadamard is fullstack_fp4.nvfp4's butterfly (stages 1, 2, 4, 8; pairs (a+b, a-b)).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .codecs import BLOCK, CHUNK, REL_FLOOR, TILE

FP32_MAX = 3.4028234663852886e38
# Transformer Engine's sign vector as a bitmask of the negative positions (bit j = sign j < 0).
_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
NEG_MASK = sum(1 << j for j, s in enumerate(_SIGNS) if s < 0)
NUM_WARPS = 4   # 128 threads × 8 entries per live tensor: everything stays in registers


@triton.jit
def _signs16():
    j = tl.arange(0, 16)
    neg = (tl.full((16,), NEG_MASK_C, tl.int32) >> j) & 1
    return 1.0 - 2.0 * neg.to(tl.float32)


NEG_MASK_C = tl.constexpr(NEG_MASK)


@triton.jit
def _stage(x, R: tl.constexpr, H: tl.constexpr):
    """One butterfly stage on [R, 16]: pairs (i, i + H) inside each group of 2H -> (a+b, a-b)."""
    G: tl.constexpr = 16 // (2 * H)
    y = tl.reshape(x, (R * G, 2, H))
    y = tl.permute(y, (0, 2, 1))          # [R*G, H, 2]
    a, b = tl.split(y)
    y = tl.join(a + b, a - b)             # [R*G, H, 2]
    y = tl.permute(y, (0, 2, 1))          # [R*G, 2, H]
    return tl.reshape(y, (R, 16))


@triton.jit
def _fwht16(x, R: tl.constexpr):
    x = _stage(x, R, 1)
    x = _stage(x, R, 2)
    x = _stage(x, R, 4)
    x = _stage(x, R, 8)
    return x


@triton.jit
def _rht16(x, R: tl.constexpr):
    return _fwht16(x * _signs16()[None, :], R) * 0.25


@triton.jit
def _irht16(y, R: tl.constexpr):
    return (_fwht16(y, R) * 0.25) * _signs16()[None, :]


@triton.jit
def _e4m3_rne(x):
    """FP32 x in [0, 448] -> (value of the nearest-even E4M3 as FP32, its 8-bit code)."""
    # Subnormal range (x < 2^-6): multiples of 2^-9, round half to even by hand.
    t = x * 512.0
    r = tl.floor(t)
    d = t - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)
    sub_val = r * 0.001953125
    sub_code = r.to(tl.int32)
    # Normal range: keep 3 mantissa bits, RNE on the bit pattern.
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFFF + ((b >> 20) & 1)) & -1048576      # & ~0xFFFFF
    nrm_val = b.to(tl.float32, bitcast=True)
    nrm_code = (((b >> 23) - 120) << 3) | ((b >> 20) & 7)
    is_sub = x < 0.015625
    return tl.where(is_sub, sub_val, nrm_val), tl.where(is_sub, sub_code, nrm_code)


@triton.jit
def _e4m3_decode(c):
    c = c.to(tl.int32)
    e = c >> 3
    mm = c & 7
    nrm = (((e + 120) << 23) | (mm << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, mm.to(tl.float32) * 0.001953125, nrm)


@triton.jit
def _e2m1_value(c):
    """Magnitude of code c & 7: 0, .5, 1, 1.5, 2, 3, 4, 6."""
    k = (c & 7).to(tl.float32)
    return tl.where(k < 4.0, k * 0.5, tl.where(k < 6.0, k - 2.0, (k - 4.0) * 2.0))


@triton.jit
def _rtn_code(a):
    return ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))


@triton.jit
def _sr_code(a, u):
    lo = ((a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
          + (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
          + (a >= 6.0).to(tl.int32))
    vlo = _e2m1_value(lo)
    step = _e2m1_value(tl.minimum(lo + 1, 7)) - vlo
    frac = tl.where(step > 0.0, tl.div_rn(a - vlo, tl.where(step > 0.0, step, 1.0)), 0.0)
    return lo + (u < frac).to(tl.int32)


@triton.jit
def _candidate(bamax, enc, dec, inv_target):
    s, code = _e4m3_rne(tl.minimum(bamax * (enc * inv_target), 448.0))
    f = tl.minimum(tl.div_rn(1.0, s * dec), FP32_MAX_C)
    return s, code, f


FP32_MAX_C = tl.constexpr(FP32_MAX)


@triton.jit
def _encode_chunk(y, u, NB: tl.constexpr, FOUR_OVER_SIX: tl.constexpr, STOCH: tl.constexpr):
    """NVFP4 of y [NB, 16] with one chunk scale: (codes int32 [NB,16], scale codes [NB], dec)."""
    ay = tl.abs(y)
    amax = tl.max(tl.max(ay, axis=1), axis=0)
    M6: tl.constexpr = 1536.0 if FOUR_OVER_SIX else 2688.0     # 256·6 or 448·6
    enc = tl.minimum(tl.div_rn(M6, amax), FP32_MAX_C)
    enc = tl.where(enc == 0.0, 1.0, enc)
    dec = tl.div_rn(1.0, enc)
    bamax = tl.max(ay, axis=1)
    s, sc, f = _candidate(bamax, enc, dec, 0.1666666716337204)   # fp32(1/6)
    if FOUR_OVER_SIX:
        s4, sc4, f4 = _candidate(bamax, enc, dec, 0.25)
        a6 = tl.minimum(tl.abs(y * f[:, None]), 6.0)
        a4 = tl.minimum(tl.abs(y * f4[:, None]), 6.0)
        sgn = tl.where(y < 0.0, -1.0, 1.0)
        x6 = ((sgn * _e2m1_value(_rtn_code(a6))) * s[:, None]) * dec
        x4 = ((sgn * _e2m1_value(_rtn_code(a4))) * s4[:, None]) * dec
        e6 = tl.sum(tl.abs(y - x6).to(tl.float64), axis=1)
        e4 = tl.sum(tl.abs(y - x4).to(tl.float64), axis=1)
        use4 = e4 < e6
        s = tl.where(use4, s4, s)
        sc = tl.where(use4, sc4, sc)
        f = tl.where(use4, f4, f)
    a = tl.minimum(tl.abs(y * f[:, None]), 6.0)
    if STOCH:
        c = _sr_code(a, u)
    else:
        c = _rtn_code(a)
    c = c | tl.where(y < 0.0, 8, 0)
    return c, sc, dec


@triton.jit
def _decode_chunk(codes_ptr, scale_ptr, cs_ptr, pid, npad, NB: tl.constexpr):
    half = pid * (NB * 8) + tl.arange(0, NB * 8)
    byte = tl.load(codes_ptr + half, mask=half < npad // 2, other=0).to(tl.int32)
    c = tl.reshape(tl.join(byte & 15, byte >> 4), (NB, 16))
    blk = pid * NB + tl.arange(0, NB)
    s = _e4m3_decode(tl.load(scale_ptr + blk, mask=blk < npad // 16, other=0))
    dec = tl.load(cs_ptr + pid)
    q = tl.where((c & 8) != 0, -_e2m1_value(c), _e2m1_value(c))
    return (q * s[:, None]) * dec


@triton.jit
def _store_chunk(codes_ptr, scale_ptr, cs_ptr, pid, npad, c, sc, dec, NB: tl.constexpr):
    lo, hi = tl.split(tl.reshape(c, (NB * 8, 2)))
    half = pid * (NB * 8) + tl.arange(0, NB * 8)
    tl.store(codes_ptr + half, (lo | (hi << 4)).to(tl.uint8), mask=half < npad // 2)
    blk = pid * NB + tl.arange(0, NB)
    tl.store(scale_ptr + blk, sc.to(tl.uint8), mask=blk < npad // 16)
    tl.store(cs_ptr + pid, dec)


@triton.jit
def _tile_sum32(x, NT: tl.constexpr):
    """Row sums of [NT, 32] by halving (x[:, :h] + x[:, h:]), the reference's fixed tree."""
    y = tl.reshape(x, (NT, 2, 16))
    a, b = tl.split(tl.permute(y, (0, 2, 1)))
    y = tl.reshape(a + b, (NT, 2, 8))
    a, b = tl.split(tl.permute(y, (0, 2, 1)))
    y = tl.reshape(a + b, (NT, 2, 4))
    a, b = tl.split(tl.permute(y, (0, 2, 1)))
    y = tl.reshape(a + b, (NT, 2, 2))
    a, b = tl.split(tl.permute(y, (0, 2, 1)))
    y = a + b                                           # [NT, 2]
    a, b = tl.split(y)
    return a + b


@triton.jit
def q_adamw_kernel(p_ptr, g_ptr,
                   mc_ptr, ms_ptr, mcs_ptr,
                   vc_ptr, vs_ptr, vcs_ptr, vmean_ptr,
                   u_ptr, n, npad, seed,
                   decay, beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size,
                   HAS_U: tl.constexpr, CHUNK_C: tl.constexpr):
    NB: tl.constexpr = CHUNK_C // 16
    NT: tl.constexpr = CHUNK_C // 32
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * CHUNK_C + tl.arange(0, CHUNK_C)
    live = idx < n
    p = tl.load(p_ptr + idx, mask=live, other=0.0)
    g = tl.load(g_ptr + idx, mask=live, other=0.0).to(tl.float32)
    g = tl.reshape(g, (NB, 16))
    live2 = tl.reshape(live, (NB, 16))

    # decode
    m = _irht16(_decode_chunk(mc_ptr, ms_ptr, mcs_ptr, pid, npad, NB), NB)
    r = tl.reshape(_irht16(_decode_chunk(vc_ptr, vs_ptr, vcs_ptr, pid, npad, NB), NB), (NT, 32))
    tix = pid * NT + tl.arange(0, NT)
    mb = tl.load(vmean_ptr + tix, mask=tix < npad // 32, other=0).to(tl.int32)
    mean = ((mb & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    sh = tl.maximum(r + mean[:, None], mean[:, None] * REL_FLOOR_C)
    v = tl.reshape(tl.minimum(sh * sh, FP32_MAX_C), (NB, 16))

    # AdamW (decoupled decay, bias correction), fixed FP32 order (see the reference)
    p = p * decay
    m = m * beta1 + g * omb1
    v = v * beta2 + (g * g) * omb2
    m = tl.where(live2, m, 0.0)
    v = tl.where(live2, v, 0.0)
    s = tl.sqrt_rn(v)
    upd = tl.div_rn(m, s * inv_sqrt_bc2 + eps)
    p = p - step_size * tl.reshape(upd, (CHUNK_C,))
    tl.store(p_ptr + idx, p, mask=live)

    # encode m: RHT16, 4/6, SR
    if HAS_U:
        u = tl.load(u_ptr + idx, mask=idx < npad, other=0.0)
    else:
        u = tl.rand(seed, idx.to(tl.int32))
    cm, scm, decm = _encode_chunk(_rht16(m, NB), tl.reshape(u, (NB, 16)), NB, True, True)
    _store_chunk(mc_ptr, ms_ptr, mcs_ptr, pid, npad, cm, scm, decm, NB)

    # encode v: sqrt, tile mean (BF16 RNE), residual, RHT16, RTN 6-rule
    s_t = tl.reshape(s, (NT, 32))
    live_t = tl.reshape(live2, (NT, 32))
    cnt = tl.maximum(tl.sum(live_t.to(tl.float32), axis=1), 1.0)
    mean = tl.div_rn(_tile_sum32(s_t, NT), cnt)
    mbits = mean.to(tl.int32, bitcast=True)
    mbits = (mbits + 0x7FFF + ((mbits >> 16) & 1)) & -65536
    mean = mbits.to(tl.float32, bitcast=True)
    tl.store(vmean_ptr + tix, (mbits >> 16).to(tl.int16), mask=tix < npad // 32)
    res = tl.where(live_t, s_t - mean[:, None], 0.0)
    cv, scv, decv = _encode_chunk(_rht16(tl.reshape(res, (NB, 16)), NB), u, NB, False, False)
    _store_chunk(vc_ptr, vs_ptr, vcs_ptr, pid, npad, cv, scv, decv, NB)


REL_FLOOR_C = tl.constexpr(REL_FLOOR)
assert BLOCK == 16 and TILE == 32 and CHUNK % 32 == 0


def launch(p_flat, g_flat, st, n, npad, *, seed, decay, beta1, omb1, beta2, omb2, inv_sqrt_bc2,
           eps,
           step_size, rand=None):
    """Run the fused step in place on the flat FP32 ``p_flat`` and the state tensors ``st``.

    ``st``: dict of the optimizer's state tensors (codes uint8, scales uint8 = E4M3 bits, chunk
    scales FP32, tile means int16 = BF16 bits). Scalars are passed as FP32 kernel arguments.
    """
    nch = -(-npad // CHUNK)
    u = rand if rand is not None else p_flat
    q_adamw_kernel[(nch,)](
        p_flat, g_flat,
        st["exp_avg_codes"], st["exp_avg_scales"], st["exp_avg_chunk_scales"],
        st["exp_avg_sq_codes"], st["exp_avg_sq_scales"], st["exp_avg_sq_chunk_scales"],
        st["exp_avg_sq_means"],
        u, n, npad, seed,
        decay, beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size,
        HAS_U=rand is not None, CHUNK_C=CHUNK, num_warps=NUM_WARPS, enable_fp_fusion=False)
