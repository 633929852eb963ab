"""The NVFP4 quantize kernels (``@triton.jit``, launched by fullstack_fp4/nvfp4/triton_quantize.py).

``_amax_kernel`` (the tensor's amax, of the RHT-transformed values with RHT), ``_quantize_tile_v0``
and ``_quantize_kernel`` (the legacy and eo quantize; the math and the layouts are in
triton_quantize.py's docstring), ``_philox_uniforms_kernel`` (the uniforms a seed gives, for
tests) and ``_elementwise_probe_kernel`` (the rounding helpers on single values, for tests).
Their arithmetic is in triton_quantize_jit.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_quantize_jit import (FP32_MAX, NAN_BITS, _e4m3_rne, _e2m1_code, _rht16, _tile_coords,
                                  _load_halves, _philox_halves, _abs_bits_max, _candidate,
                                  _half_err, _tile_reduce_max, _tile_reduce_sum, _pack_store,
                                  _load_eo, _rht16_eo, _max_nan, _block_amax_eo, _e4m3_rne1,
                                  _candidate_fast, _e2m1_rne_val, _nib_rne, _nib_sr, _err_eo,
                                  _pack_word, _philox_eo, _tensor_scales, _tile_coords_2d,
                                  _store_codes)


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


@triton.jit(do_not_specialize=["seed"])
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
