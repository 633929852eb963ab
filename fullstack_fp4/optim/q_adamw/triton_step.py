"""Fused Q-AdamW step in Triton: decode m and v, AdamW update, re-encode both, write p — one pass.

One program owns ``CPP`` chunks (CHUNK = 1024 entries each = 64 NVFP4 blocks of 16) of a flat
parameter and runs ``2 · CPP`` warps: **one thread owns one 16-block** (row). Every per-block
operation — the 16-point Hadamard butterflies, the block amax, the 4/6 block errors, the nibble
packing, the in-block part of the tile sum — is register arithmetic inside one thread: no
shuffles, no shared-memory layout conversions. Only the chunk amax (one value per row) and the
tile mean (four rows) cross threads. A thread reads its row as four 16-byte vectors (LDG.128)
and the row's 8 code bytes as two int32 words. A program whose rows all hold real entries runs
a second copy of the body without bounds checks or padding masks (``FULL``; all but a
tensor's first and last programs). Besides the update's division per entry, a row divides
once per moment, for its chunk's ``enc``: the chunk scales are taken decode-scale first and
the element factors' ``0.25 / s`` come from ``recip_table`` (codecs.chunk_scales). See
docs/perf/q-adamw.md for the instruction counts.

Bytes moved per parameter (FP32 grad): p 4+4, g 4, m 0.566+0.566, v 0.598+0.598 → ~14.3 B,
against 28 B for FP32-state fused AdamW (p 8, g 4, m 8, v 8): the bytes allow ~0.5×.
With ``model_out`` (HAS_MODEL_OUT) the kernel also writes the BF16 model parameter, +2 B, in
place of megatron's separate main -> model copy pass (read 4 B + write 2 B per parameter).

It computes exactly what ``optimizer.q_adamw_step_reference`` computes, operation for operation
in FP32 (IEEE ``div_rn``/``sqrt_rn``, launched with ``enable_fp_fusion=False`` so no FMA
contraction; every sum is the reference's fixed halving tree), so given the same uniforms
(``rand``) the two agree bit for bit (with ``launch(fast_div=True)``, an option off by default,
the states still do and p' agrees within a bound: docs/perf/q-adamw.md). Without ``rand`` the
stochastic-rounding uniforms come from Philox (``tl.randint4x``) seeded per (step, parameter):
one Philox call per 16-block gives its 16 uniforms of 8 bits, u = (k + ½) / 2^8 — the NVFP4
linear's definition (nvfp4/sr_stream.py: 8 random bits an element, what Blackwell's ``cvt.rs``
E2M1 conversion spends), used as the integer dither of triton_rows._sr_code; the rounding's bias
is then at most (2^-9 + 2^-23) of one E2M1 step (codecs.sr_codes). ``optimizer.kernel_uniforms``
computes the same uniforms in PyTorch, so the Philox path is checked bit for bit against the
reference too.

Rounding without comparison ladders, exact in IEEE FP32 (so the interpreter and the GPU agree):
E2M1 and E4M3 round-to-nearest-even is one add of a power of two M picked from the exponent
(fl(a + M) − M lands on the format's grid, ties to even); stochastic E2M1 truncates to 1
mantissa bit. The results equal fullstack_fp4.nvfp4.e2m1's threshold definitions and torch's
E4M3 cast exactly (tests/.../test_q_adamw_kernel.py checks every grid point and tie). BF16
tile means are rounded on the bits (adding 0x7FFF + lsb).

The Hadamard is fullstack_fp4.nvfp4's butterfly (stages 1, 2, 4, 8; pairs (a+b, a-b)) with TE's
signs, written out on the 16 registers of a row. The per-row functions are in triton_rows.py;
this file holds the kernel that strings them together and its launch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fullstack_fp4.nvfp4.kernels.launch import launch as launch_kernel

from .codecs import BLOCK, CHUNK, TILE
# The per-row register arithmetic (one thread = one 16-block) lives in triton_rows.py.
from .triton_rows import (REL_FLOOR_C, _adam, _dec_factor, _decode_rows, _dither, encode46,
                          _encode_v, _hsum16, _irht16, _ld16, _rht16, _st16, _st16_bf16,
                          _store_rows, _u16, _u8, _vhat)

CPP = 1          # chunks per program (one warp = 32 blocks; 2·CPP warps per program)
FAST_DEC = True  # nibble decode through the subnormal trick (_nib); False: the select chain
# Register cap per thread on the GPU: 128 measured 7.5% faster than Triton's own choice on the
# H200 (1.0B parameters, bit-identical; ``python benchmarks/bench_q_adamw.py --sweep``,
# docs/perf/q-adamw.md); presumably more resident warps hide more of the state loads' latency
# (not profiled). 0: Triton's choice.
MAXNREG = 128
# The BF16 model-param write (launch's model_out) rounds with the hardware cast when compiled
# (cvt.rn: RNE, torch's CUDA cast; +19 SASS per 16 entries against +104 for the integer RNE the
# interpreter needs, docs/perf/q-adamw.md); False: the integer RNE on the GPU too (same values, NaN payload
# 0x7FC0). The interpreter always runs the integer form (its cast does not round to even).
BF16_HW_CVT = True
# Adam's m'/d as m' · rcp.approx(d) (triton_rows._adam): p' within 2^-22 of the update of the
# IEEE division's, states bit for bit the same (docs/perf/q-adamw.md). Compiled kernels only.
FAST_DIV = False
# triton.jit picks interpreter or compiler at import; the register cap is a compiler option only
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
assert BLOCK == 16 and TILE == 64 and CHUNK == 1024


@triton.jit(do_not_specialize=["seed"])   # a fresh seed each step: no recompiles
def q_adamw_kernel(p_ptr, g_ptr,
                   mc_ptr, ms_ptr, mcs_ptr,
                   vc_ptr, vs_ptr, vcs_ptr, vmean_ptr,
                   u_ptr, n, npad, seed, ph_rows, row0,
                   decay, beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, mo_ptr,
                   rtab_ptr,
                   HAS_U: tl.constexpr, CPP_C: tl.constexpr, FAST_DEC: tl.constexpr,
                   U8: tl.constexpr, ROUNDS: tl.constexpr, HAS_MODEL_OUT: tl.constexpr,
                   BF16_HW: tl.constexpr, FAST_DIV: tl.constexpr):
    # mo_ptr (after the scalars, so the default variant's other arguments keep their places):
    # the BF16 model parameter (as int16), written only with HAS_MODEL_OUT; rtab_ptr:
    # recip_table.
    pid = tl.program_id(0).to(tl.int64)
    # A program whose rows all hold real entries (all but the first piece under a chunk-grid
    # phase and the tensor's last one or two) runs the body without bounds: no load/store
    # predicates, no padding masks (FULL; 8% fewer instructions than the bounded body,
    # docs/perf/q-adamw.md). The branch is uniform over the program.
    R: tl.constexpr = CPP_C * 64
    if (pid * R >= ph_rows) & (((pid + 1) * R - ph_rows) * 16 <= n):
        _step_program(pid, p_ptr, g_ptr, mc_ptr, ms_ptr, mcs_ptr,
                      vc_ptr, vs_ptr, vcs_ptr, vmean_ptr, u_ptr, n, npad, seed, ph_rows, row0,
                      decay, beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, mo_ptr,
                      rtab_ptr, HAS_U, CPP_C, FAST_DEC, U8, ROUNDS, HAS_MODEL_OUT, BF16_HW,
                      FAST_DIV, True)
    else:
        _step_program(pid, p_ptr, g_ptr, mc_ptr, ms_ptr, mcs_ptr,
                      vc_ptr, vs_ptr, vcs_ptr, vmean_ptr, u_ptr, n, npad, seed, ph_rows, row0,
                      decay, beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, mo_ptr,
                      rtab_ptr, HAS_U, CPP_C, FAST_DEC, U8, ROUNDS, HAS_MODEL_OUT, BF16_HW,
                      FAST_DIV, False)


@triton.jit
def _step_program(pid, p_ptr, g_ptr, mc_ptr, ms_ptr, mcs_ptr, vc_ptr, vs_ptr, vcs_ptr,
                  vmean_ptr, u_ptr, n, npad, seed, ph_rows, row0,
                  decay, beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, mo_ptr,
                  rtab_ptr, HAS_U: tl.constexpr, CPP_C: tl.constexpr, FAST_DEC: tl.constexpr,
                  U8: tl.constexpr, ROUNDS: tl.constexpr, HAS_MODEL_OUT: tl.constexpr,
                  BF16_HW: tl.constexpr, FAST_DIV: tl.constexpr, FULL: tl.constexpr = False):
    """One program's step: CPP_C chunks (64 · CPP_C rows) of one tensor, program ``pid`` of
    that tensor's grid (q_adamw_kernel: one tensor per launch; q_adamw_multi_kernel: many)."""
    R: tl.constexpr = CPP_C * 64          # rows (16-blocks) per program
    # Rows on the chunk grid; the tensor starts ph_rows (= phase / 16, even) rows into it, so
    # rows < 0 are outside (masked, zero); row0: this piece's first row in the whole tensor
    # (the Philox counter).
    vrows = pid * R + tl.arange(0, R)
    rows = vrows - ph_rows
    nrows = npad // 16
    nch = (ph_rows * 16 + npad + 1023) // 1024

    MASK: tl.constexpr = not FULL
    p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15 = _ld16(
        p_ptr, rows, n, 0.0, MASK)
    g0, g1, g2, g3, g4, g5, g6, g7, g8, g9, g10, g11, g12, g13, g14, g15 = _ld16(
        g_ptr, rows, n, 0.0, MASK)
    # decode m: the exact inverse RHT of q · s / 4; the chunk scale (times β1) enters in _adam
    q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15, dm = _decode_rows(
        mc_ptr, ms_ptr, mcs_ptr, rows, vrows, nrows, FAST_DEC, MASK)
    m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15 = _irht16(
        q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15)
    fm = _dec_factor(dm * beta1, FAST_DEC)
    # decode v: the residual + μ (one FFMA with the chunk scale) floored at μ/4, squared
    q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15, dv = _decode_rows(
        vc_ptr, vs_ptr, vcs_ptr, rows, vrows, nrows, FAST_DEC, MASK)
    r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13, r14, r15 = _irht16(
        q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15)
    dv = _dec_factor(dv, FAST_DEC)
    if FULL:        # a 64-entry tile mean per 4 rows
        mb = tl.load(vmean_ptr + rows // 4).to(tl.int32)
    else:
        mb = tl.load(vmean_ptr + rows // 4, mask=(rows < nrows) & (rows >= 0),
                     other=0).to(tl.int32)
    mean = ((mb & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    fl = mean * REL_FLOOR_C
    # entries of the row that are real: j < rem (a full program: all 16, and the masks below
    # fold away)
    if FULL:
        rem: tl.constexpr = 16
    else:
        rem = n - rows * 16

    p0, m0, v0, s0 = _adam(p0, g0, m0, fm, _vhat(r0, dv, mean, fl), 0 < rem, decay,
                           beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, FAST_DIV)
    p1, m1, v1, s1 = _adam(p1, g1, m1, fm, _vhat(r1, dv, mean, fl), 1 < rem, decay,
                           beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, FAST_DIV)
    p2, m2, v2, s2 = _adam(p2, g2, m2, fm, _vhat(r2, dv, mean, fl), 2 < rem, decay,
                           beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, FAST_DIV)
    p3, m3, v3, s3 = _adam(p3, g3, m3, fm, _vhat(r3, dv, mean, fl), 3 < rem, decay,
                           beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, FAST_DIV)
    p4, m4, v4, s4 = _adam(p4, g4, m4, fm, _vhat(r4, dv, mean, fl), 4 < rem, decay,
                           beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, FAST_DIV)
    p5, m5, v5, s5 = _adam(p5, g5, m5, fm, _vhat(r5, dv, mean, fl), 5 < rem, decay,
                           beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, FAST_DIV)
    p6, m6, v6, s6 = _adam(p6, g6, m6, fm, _vhat(r6, dv, mean, fl), 6 < rem, decay,
                           beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, FAST_DIV)
    p7, m7, v7, s7 = _adam(p7, g7, m7, fm, _vhat(r7, dv, mean, fl), 7 < rem, decay,
                           beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, FAST_DIV)
    p8, m8, v8, s8 = _adam(p8, g8, m8, fm, _vhat(r8, dv, mean, fl), 8 < rem, decay,
                           beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, FAST_DIV)
    p9, m9, v9, s9 = _adam(p9, g9, m9, fm, _vhat(r9, dv, mean, fl), 9 < rem, decay,
                           beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, FAST_DIV)
    p10, m10, v10, s10 = _adam(p10, g10, m10, fm, _vhat(r10, dv, mean, fl), 10 < rem, decay,
                               beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, FAST_DIV)
    p11, m11, v11, s11 = _adam(p11, g11, m11, fm, _vhat(r11, dv, mean, fl), 11 < rem, decay,
                               beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, FAST_DIV)
    p12, m12, v12, s12 = _adam(p12, g12, m12, fm, _vhat(r12, dv, mean, fl), 12 < rem, decay,
                               beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, FAST_DIV)
    p13, m13, v13, s13 = _adam(p13, g13, m13, fm, _vhat(r13, dv, mean, fl), 13 < rem, decay,
                               beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, FAST_DIV)
    p14, m14, v14, s14 = _adam(p14, g14, m14, fm, _vhat(r14, dv, mean, fl), 14 < rem, decay,
                               beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, FAST_DIV)
    p15, m15, v15, s15 = _adam(p15, g15, m15, fm, _vhat(r15, dv, mean, fl), 15 < rem, decay,
                               beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, FAST_DIV)
    _st16(p_ptr, rows, n, p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15,
          MASK)
    if HAS_MODEL_OUT:   # the model's BF16 copy, so the wrapper's main -> model copy pass is skipped
        _st16_bf16(mo_ptr, rows, n, p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13,
                   p14, p15, BF16_HW, MASK)

    # encode m: RHT16, 4/6, SR
    if HAS_U:
        u0, u1, u2, u3, u4, u5, u6, u7, u8, u9, u10, u11, u12, u13, u14, u15 = _ld16(
            u_ptr, rows, npad, 0.0, MASK)
        u0, u1, u2, u3 = _dither(u0), _dither(u1), _dither(u2), _dither(u3)
        u4, u5, u6, u7 = _dither(u4), _dither(u5), _dither(u6), _dither(u7)
        u8, u9, u10, u11 = _dither(u8), _dither(u9), _dither(u10), _dither(u11)
        u12, u13, u14, u15 = _dither(u12), _dither(u13), _dither(u14), _dither(u15)
    else:
        off = ((rows + row0) * 2).to(tl.int32)
        if U8:      # one Philox call per row: 16 uniforms of 8 bits (SR bias <= 2^-9 step)
            k0, k1, k2, k3 = tl.randint4x(seed, off, ROUNDS)
            u0, u1, u2, u3 = _u8(k0)
            u4, u5, u6, u7 = _u8(k1)
            u8, u9, u10, u11 = _u8(k2)
            u12, u13, u14, u15 = _u8(k3)
        else:       # two calls per row: 16 uniforms of 16 bits (SR bias <= 2^-16 + 2^-23 step)
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
    w0, w1, sc, dec_c = encode46(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13,
                                 y14, y15, u0, u1, u2, u3, u4, u5, u6, u7, u8, u9, u10, u11,
                                 u12, u13, u14, u15, rtab_ptr, R, True)
    _store_rows(mc_ptr, ms_ptr, mcs_ptr, rows, nrows, pid, nch, w0, w1, sc, dec_c, R, MASK)

    # encode v: sqrt (s above), tile mean (BF16 RNE), residual, RHT16, RTN "4" rule
    bsum = _hsum16(s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15)
    # a tile is 4 rows (b0 … b3); codecs._pairwise_tile_sum's halving: (b0+b2) + (b1+b3)
    ba, bb = tl.split(tl.reshape(bsum, (R // 4, 2, 2)))     # ba = (b0, b2), bb = (b1, b3)
    b0, b2 = tl.split(ba)
    b1, b3 = tl.split(bb)
    tsum = (b0 + b2) + (b1 + b3)
    tix = pid * (R // 4) + tl.arange(0, R // 4) - ph_rows // 4
    if FULL:        # every tile holds 64 real entries: · fl(1/64) = 2^-6
        tmean = tsum * 0.015625
    else:
        cnt = tl.minimum(tl.maximum(n - tix * 64, 1), 64)
        tmean = tsum * tl.load(rtab_ptr + 128 + cnt)        # · fl(1/cnt) (recip_table)
    mbits = tmean.to(tl.int32, bitcast=True)
    mbits = (mbits + 0x7FFF + ((mbits >> 16) & 1)) & -65536
    if FULL:
        tl.store(vmean_ptr + tix, (mbits >> 16).to(tl.int16))
    else:
        tl.store(vmean_ptr + tix, (mbits >> 16).to(tl.int16),
                 mask=(tix < npad // 64) & (tix >= 0))
    mbits = tl.reshape(tl.join(tl.join(mbits, mbits), tl.join(mbits, mbits)), (R,))
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
                                  y14, y15, rtab_ptr, R)
    _store_rows(vc_ptr, vs_ptr, vcs_ptr, rows, nrows, pid, nch, w0, w1, sc, dec_c, R, MASK)


def launch(p_flat, g_flat, st, n, npad, *, seed, decay, beta1, omb1, beta2, omb2, inv_sqrt_bc2,
           eps, step_size, rand=None, cpp=None, phase=0, row0=0, fast_dec=None, maxnreg=None,
           u8=True, rounds=10, model_out=None, fast_div=None):
    """Run the fused step in place on the flat FP32 ``p_flat`` and the state tensors ``st``.

    ``st``: dict of the optimizer's state tensors (codes uint8, scales uint8 = E4M3 bits, chunk
    scales FP32, tile means int16 = BF16 bits). Scalars are passed as FP32 kernel arguments.
    ``cpp``: chunks per program (default ``CPP``), 2·cpp warps. ``phase``: chunk-grid phase
    (codecs.num_chunks; a multiple of the 64-tile here); ``row0``: the piece's first 16-block
    in the whole tensor (Philox counter base). ``fast_dec``: the nibble decode variant
    (default ``FAST_DEC``; both are bit-identical); ``maxnreg``: register cap per thread (GPU
    only; None = ``MAXNREG``, 0 = Triton's choice). ``u8`` / ``rounds`` (Philox path only, i.e.
    ``rand`` None): 8-bit centred uniforms from one Philox call per 16-block (the default; SR
    bias bound 2^-9 of an E2M1 step) or, ``u8=False``, 16-bit ones from two calls (2^-16; 56
    more SASS instructions per 16 entries, docs/perf/q-adamw.md), and Philox rounds (10 = Triton's and
    cuRAND's default; 7 passes BigCrush per Salmon et al. 2011, a sweep option).
    ``optimizer.kernel_uniforms(seed, npad, row0, u8=, rounds=)`` gives the uniforms each draws.

    ``model_out``: a contiguous BF16 tensor of ``n`` entries (the model parameter, or the
    slice of it that ``p_flat`` is the main shard of), or None. Given, the kernel also stores
    ``p_new.to(bfloat16)`` there (RNE, bit for bit: triton_rows._bf16_bits, ``BF16_HW_CVT``) —
    the megatron wrapper's main -> model param copy, fused (the HAS_MODEL_OUT variant; without
    it the kernel compiles without the store).

    ``fast_div`` (default ``FAST_DIV``, off; compiled kernels only, the interpreter always
    divides with div_rn): the update's m'/d as m' · rcp.approx(d) (triton_rows._adam). The
    states stay the reference's bit for bit; p' moves by at most 2^-22 of the step's update
    plus a rounding of p' (docs/perf/q-adamw.md).
    """
    if phase % TILE or not 0 <= phase < CHUNK:
        raise ValueError(f"kernel chunk phase {phase} must be a multiple of {TILE} in [0, {CHUNK})")
    cpp = CPP if cpp is None else cpp
    fast_dec = FAST_DEC if fast_dec is None else fast_dec
    maxnreg = MAXNREG if maxnreg is None else maxnreg
    extra = {"maxnreg": maxnreg} if maxnreg and not _INTERPRET else {}
    nprog = -(-(phase + npad) // (CHUNK * cpp))
    u = rand if rand is not None else p_flat
    mo = _model_out_bits(model_out, n) if model_out is not None else p_flat
    launch_kernel(q_adamw_kernel, (nprog,),
        p_flat, g_flat,
        st["exp_avg_codes"], st["exp_avg_scales"], st["exp_avg_chunk_scales"],
        st["exp_avg_sq_codes"], st["exp_avg_sq_scales"], st["exp_avg_sq_chunk_scales"],
        st["exp_avg_sq_means"],
        u, n, npad, seed, phase // BLOCK, row0,
        decay, beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, mo,
        recip_table(p_flat.device),
        HAS_U=rand is not None, CPP_C=cpp, FAST_DEC=bool(fast_dec), U8=bool(u8), ROUNDS=rounds,
        HAS_MODEL_OUT=model_out is not None, BF16_HW=BF16_HW_CVT and not _INTERPRET,
        FAST_DIV=bool(FAST_DIV if fast_div is None else fast_div) and not _INTERPRET,
        num_warps=2 * cpp,
        enable_fp_fusion=False, **extra)


_RECIP_TABLES: dict = {}


def recip_table(device) -> torch.Tensor:
    """FP32 ``[193]``, the kernels' reciprocals, so that a row's encode divides only for its
    chunk's ``enc`` (codecs.chunk_scales):
    entry c < 128 is fl(0.25 / s) for the E4M3 code c (s its value; +inf for c = 0 and for the
    NaN code 127, which the clamped scale never takes), the element factor before the chunk's
    ``enc`` (triton_rows._candidate); entry 128 + c is fl(1 / c), c = 1 … 64, the
    v tile mean's factor for a tile of c real entries. torch's FP32 divisions, the reference's
    (codecs), so both read the same numbers."""
    dev = torch.device(device)
    tab = _RECIP_TABLES.get(dev)
    if tab is None:
        s = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        s[127] = 0.0
        c = torch.arange(TILE + 1, dtype=torch.float32)
        one = torch.tensor(1.0, dtype=torch.float32)
        tab = torch.cat([torch.div(one * 0.25, s), torch.div(one, c)]).to(dev)
        if dev.type == "cuda":   # made once; launches on any stream (launch_streams) read it
            torch.cuda.current_stream(dev).synchronize()
        _RECIP_TABLES[dev] = tab
    return tab


def _model_out_bits(model_out, n):
    """The BF16 destination as int16 (the kernel writes the rounded bits), checked: the kernel
    writes ``n`` entries at the pointer, so a wrong size or a strided view would corrupt memory."""
    if model_out.dtype != torch.bfloat16 or model_out.numel() != n \
            or not model_out.is_contiguous():
        raise ValueError(f"model_out must be a contiguous BF16 tensor of {n} entries, got "
                         f"{model_out.dtype} {tuple(model_out.shape)} "
                         f"(contiguous={model_out.is_contiguous()})")
    return model_out.view(torch.int16)
