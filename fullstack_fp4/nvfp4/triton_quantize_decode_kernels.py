"""The quantize kernel of triton_quantize_decode.py (one read of ``m [T, C]``, both ways) and
its ``@triton.jit`` helpers: ``_quantize_two_ways_kernel`` (the row way and the column way of
one 16-token tile, decoded BF16 and/or codes). Its amax pass is triton_amax_two_ways.py. The math, the layouts and the Philox counters are
in triton_quantize_decode.py's docstring; the rounding arithmetic is triton_quantize_jit.py's.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language import core as tlc   # to_tensor: not re-exported by triton 3.6's tl

from .triton_quantize_jit import (INV6, NAN_BITS, _bf16w_to_f32, _candidate_fast,
                                  _candidate_nb, _e2m1_rne_val, _neg_where, _nib_rne, _nib_sr,
                                  _philox10, _rcp_kd, _sr_u8, _tensor_scales)

# ----------------------------------------------------------------------------- jit helpers
# A token row of a tile is held in "eo" form (triton_quantize's): four [NB, 4] FP32 tensors
# e0, o0, e1, o1 = elements 2q, 2q+1 (low half) and 8+2q, 9+2q (high half) of each block; the
# lane of (block, q) holds those four channels for all 16 tokens. A 16-tuple over the tokens of
# one of the four tensors is a "channel group" of the column way.
@triton.jit
def _row_mask(cmask, t, T, EVEN: tl.constexpr):
    """``cmask & (t < T)`` for a scalar token t, broadcast explicitly (the interpreter rejects
    a load mask made by broadcasting a scalar comparison; the compiler folds the ``0 ·``).
    EVEN: every token of the program exists (:func:`_tile_coords`), so ``cmask``."""
    if EVEN:
        return cmask
    return cmask & ((cmask.to(tl.int32) * 0 + t) < T)


@triton.jit
def _load_rows(x_ptr, tb, blk, q, cmask, T, C, stride_t, XW: tl.constexpr,
               I64: tl.constexpr, EVEN: tl.constexpr):
    """The 16 token rows of token block ``tb`` as four 16-tuples (e0, o0, e1, o1) of FP32
    ``[NB, 4]`` (tokens past ``T`` and channels past C load as 0: the column way's zero padding).
    XW: ``x_ptr`` is BF16 viewed as int32 words (``stride_t`` in words): one word = (e, o),
    read as two ``[NB, 4]`` halves. (Reading a block's 32 bytes as ``[NB, 8]`` words and moving
    them to the eo form was slower here on the H200: warp shuffles, BENCHMARKS.md §U.2.)"""
    E0 = ()
    O0 = ()
    E1 = ()
    O1 = ()
    for i in tl.static_range(16):
        t = tb * 16 + i
        m = _row_mask(cmask, t, T, EVEN)
        if I64:
            roff = t.to(tl.int64) * stride_t
        else:
            roff = t * stride_t
        if XW:
            p = x_ptr + roff + (blk * 8)[:, None] + q[None, :]
            e0, o0 = _bf16w_to_f32(tl.load(p, mask=m, other=0))
            e1, o1 = _bf16w_to_f32(tl.load(p + 4, mask=m, other=0))
        else:
            p = (x_ptr + roff + (blk * 16)[:, None, None] + 2 * q[None, :, None]
                 + tl.arange(0, 2)[None, None, :])
            m3 = m[:, :, None]
            e0, o0 = tl.split(tl.load(p, mask=m3, other=0.0).to(tl.float32))
            e1, o1 = tl.split(tl.load(p + 8, mask=m3, other=0.0).to(tl.float32))
        E0 = E0 + (e0,)
        O0 = O0 + (o0,)
        E1 = E1 + (e1,)
        O1 = O1 + (o1,)
    return E0, O0, E1, O1


@triton.jit
def _rht16_tokens(v, SIGNS: tl.constexpr, STAGES: tl.constexpr = 4):
    """hadamard16 along the tuple (the 16 tokens of a block): × signs, strides 1, 2, 4, 8, × ¼.
    ``SIGNS`` has bit i set where s_i = −1: ``x · (−1)`` is written ``−x`` (the same value, an
    exact negation), which the compiler folds into the first butterfly's adds. ``STAGES`` < 4:
    only the first butterflies, without the ``× ¼`` (for triton_amax_two_ways.
    _rht16_abs_max)."""
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


@triton.jit
def _abs_max_tuple(v):
    a = tl.abs(v[0])
    for i in tl.static_range(1, 16):
        a = tl.maximum(a, tl.abs(v[i]))
    return a


@triton.jit
def _stack8(v):
    """8-tuple of ``[NB, 4]`` (index k) -> ``[NB, 4, 8]`` with k on the last axis (in-thread)."""
    b = ()
    for k in tl.static_range(4):
        b = b + (tl.join(v[k], v[k + 4]),)          # new axis: bit 2 of k
    c = (tl.join(b[0], b[2]), tl.join(b[1], b[3]))  # bit 1
    d = tl.join(c[0], c[1])                         # bit 0
    nb: tl.constexpr = d.shape[0]
    return tl.reshape(d, (nb, 4, 8))


@triton.jit
def _tensor_scale(gamax_ptr, obs_ptr):
    """(enc, dec, dec to store) from the amax the scales use (``gamax_ptr``, FP32) and the
    amax bits the pass observed in the input (``obs_ptr``, int32): the reference's order
    (``_tensor_scales``); the stored tensor scale is NaN for a non-finite input or a
    NaN/Inf/negative amax."""
    gbits = tl.load(gamax_ptr).to(tl.int32, bitcast=True)
    enc, dec = _tensor_scales(gbits, 448.0)
    bad = (((gbits & 0x7FFFFFFF) >= 0x7F800000) | (gbits.to(tl.float32, bitcast=True) < 0.0)
           | (tl.load(obs_ptr) >= 0x7F800000))
    nan = tl.full(dec.shape, NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    return enc, dec, tl.where(bad, nan, dec)


@triton.jit
def _candidate(bamax, enc, dec, RCP_NB: tl.constexpr):
    """(E4M3 scale, its bits, element factor) of a block: :func:`_candidate_nb` (no branch)
    or :func:`_candidate_fast` (``div_rn``); the same values."""
    if RCP_NB:
        return _candidate_nb(bamax, enc, dec, _rcp_kd(dec), INV6)
    return _candidate_fast(bamax, enc, dec, INV6)


@triton.jit
def _dec_rne_bits(x, f, s_val):
    """FP32 bits of the decoded nearest-rounded value ``±rne(min(|x·f|, 6)) · s`` (exact, so its
    BF16 is the top 16 bits); ``-0`` where a negative ``x·f`` rounds to 0, as the code's decode."""
    y = x * f
    r = _e2m1_rne_val(tl.minimum(tl.abs(y), 6.0)) * s_val
    # a true negation: triton 3.6's unary minus gives +0 for -(+0) (triton_quantize_jit._neg_where)
    return _neg_where(y < 0.0, r).to(tl.int32, bitcast=True)


@triton.jit
def _dec_nib_bits(nib, s_val):
    """FP32 bits of ``e2m1(nib) · s`` (exact): magnitude bits from the 3-bit code (0, ½ below
    2; ``(c << 22) + bits(0.5)`` from 2 on: 1, 1.5, 2, 3, 4, 6), × s, the nibble's sign bit."""
    c = nib & 7
    mag = tl.where(c >= 2, (c << 22) + 0x3F000000, c * 0x3F000000).to(tl.float32, bitcast=True)
    return ((mag * s_val).to(tl.int32, bitcast=True)) | ((nib & 8) << 28)


@triton.jit
def _dec_sr_bits(x, f, u, s_val):
    """FP32 bits of the decoded stochastically rounded value: ``_dec_nib_bits(_nib_sr(x, f, u),
    s)`` without the nibble. ``_nib_sr``'s ``v = a·inv`` (exact, in [0, 4)) rounds to
    ``n = floor(v) + (u < frac(v)) = ceil(v − u)`` grid steps (one FADD and one FRND), and the E2M1 magnitude is ``n · step`` with
    ``step = 1/inv`` (½, 1 or 2: ``bits(1/inv) = 0x7F000000 − bits(inv)`` for a power of two),
    exact; × s exact; the sign is ``y < 0``'s as in the nibble (so ``-0`` for a negative ``y``
    that rounds to 0, ``+0`` for ``y = -0``). For a dY element (both ways decoded, not stored
    as codes) this skips the code arithmetic and its decode: ~10 of ~30 instructions."""
    y = x * f
    a = tl.minimum(tl.abs(y), 6.0)
    invb = tl.minimum(~a.to(tl.int32, bitcast=True) & 0x7F800000, 0x40000000)
    v = a * invb.to(tl.float32, bitcast=True)
    # n = floor(v) + (u < frac(v)) = ceil(v - u), exactly: u = (b + 1/2)/256 is a multiple of
    # 2^-9 and v < 4, so for v >= u the difference is a multiple of ulp(v) below v (exact);
    # for v < u it lies in (-1, 0) however it rounds (ceil 0 = floor(v), and u > v = frac).
    # Then v - u = floor(v) + (frac - u) with frac - u in (-1, 1): ceil adds 1 iff frac > u.
    n = tl.math.ceil(v - u)                   # -0 where v - u is in (-1, 0): cleared below
    mag = (n * (0x7F000000 - invb).to(tl.float32, bitcast=True)) * s_val
    return (mag.to(tl.int32, bitcast=True) & 0x7FFFFFFF) | tl.where(y < 0.0, -2147483648, 0)


@triton.jit
def _bf16_word(lo_bits, hi_bits):
    """Two exact-in-BF16 FP32 bit patterns -> one int32 word (``lo`` in the low 16 bits)."""
    return (hi_bits & -65536) | ((lo_bits >> 16) & 0xFFFF)


@triton.jit
def _philox_words(seed, ctr, I64: tl.constexpr):
    """Philox4x32-10 of ``ctr`` under ``seed``: ``tl.randint4x`` on int64 counters (I64), else
    the same rounds written out on uint32 ones (:func:`_philox10`)."""
    if I64:
        return tl.randint4x(seed, ctr)
    s = tlc.to_tensor(seed).to(tl.uint64)       # tl.philox's key: the seed's two words
    k0 = (s & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((s >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return _philox10(ctr.to(tl.uint32), k0, k1)


@triton.jit
def _col_sr_words(seed, blk, q, tb, NBLKT, I64: tl.constexpr):
    """The column way's Philox words for the lane's 4 channels × 16 tokens (sr_stream.py on the
    ``[C, T_pad]`` operand): the lane's channels ``16·blk + {2q, 2q+1, 8+2q, 9+2q}`` are one row
    quad ``g = 4·blk + q`` (words 0..3 = channel groups E0, O0, E1, O1), token block ``tb``;
    element quad ``k`` (tokens ``{2k, 2k+1, 8+2k, 9+2k}`` = bytes 0..3) is call ``k``.
    Returns a 16-tuple, index ``4·k + p``: 4 calls instead of 16."""
    g = blk * 4
    if I64:
        base = ((g.to(tl.int64)[:, None] + q[None, :]) * NBLKT + tb) * 4
    else:
        base = ((g[:, None] + q[None, :]) * NBLKT + tb) * 4
    w = ()
    for k in tl.static_range(4):
        w0, w1, w2, w3 = _philox_words(seed, base + k, I64)
        w = w + (w0, w1, w2, w3)
    return w


@triton.jit
def _col_group_uniforms(words, P: tl.constexpr):
    """The 16 tokens' uniforms of channel group ``P`` from :func:`_col_sr_words`' words:
    token ``j`` takes byte ``s(j)`` of call ``q(j)``'s word ``P``."""
    u = ()
    for j in tl.static_range(16):
        u = u + (_sr_u8(words[4 * ((j % 8) // 2) + P], (j // 8) * 2 + j % 2),)
    return u


@triton.jit
def _token(E0, O0, E1, O1, I: tl.constexpr):
    """Token ``I``'s four ``[NB, 4]`` values (e0, o0, e1, o1) of the 16-tuples."""
    return E0[I], O0[I], E1[I], O1[I]


@triton.jit
def _row_sr_words(seed, tb, K: tl.constexpr, blk, q, NBLK, I64: tl.constexpr):
    """The row way's Philox words for the tokens ``16·tb + {2K, 2K+1, 8+2K, 9+2K}`` (row quad
    ``g = 4·tb + K``; words 0..3 in that order) of lane ``(blk, q)``: bytes 0..3 of a word are
    the token's e0, o0, e1, o1 (sr_stream.py on ``[T, C]``)."""
    if I64:
        ctr = (((tb * 4 + K).to(tl.int64) * NBLK + blk) * 4)[:, None] + q[None, :]
    else:
        ctr = (((tb * 4 + K) * NBLK + blk) * 4)[:, None] + q[None, :]
    return _philox_words(seed, ctr, I64)


@triton.jit
def _tile_coords(T, C, NB: tl.constexpr, TBS: tl.constexpr, EVEN: tl.constexpr):
    """(pid, token blocks, the program's first token block, its blocks, q, channel mask): a
    program owns TBS consecutive token blocks (16·TBS tokens) × NB 16-channel blocks. EVEN (the
    host's: 16·TBS divides T and NB divides C / 16): every token and channel of every program
    exists, the channel mask is a constant and the compiler drops the masks (sm_90, triton 3.6:
    x's, dY's and W's calls 3256 / 4498 / 2122 -> 3171 / 4382 / 1973 SASS instructions to the
    first EXIT, W's registers 217 -> 168)."""
    pid = tl.program_id(0)
    ntb = tl.cdiv(T, 16)
    ntbp = tl.cdiv(ntb, TBS)
    tb0 = (pid % ntbp) * TBS
    blk = (pid // ntbp) * NB + tl.arange(0, NB)
    q = tl.arange(0, 4)
    if EVEN:
        cmask = tl.full((NB, 4), 1, tl.int1)
    else:
        cmask = (blk < C // 16)[:, None] & (q < 4)[None, :]
    return pid, ntb, tb0, blk, q, cmask


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _col_group(z, c, tb, tpad, ntb, enc, dec, u, cmask, col_dec_ptr, col_data_ptr,
               col_scale_ptr, acc, sc, sub, COL_DEC: tl.constexpr, COL_CODES: tl.constexpr,
               COL_SR: tl.constexpr, SR_DIRECT: tl.constexpr, I64: tl.constexpr,
               TBS: tl.constexpr, RCP_NB: tl.constexpr):
    """The column way for one channel group: ``z`` the RHT'd 16 tokens of channels ``c``; ``u``
    their 16 uniforms (:func:`_col_group_uniforms`) when ``COL_SR``. With ``TBS > 1`` the codes
    (2 words) and the scale byte of token block ``tb`` (the program's ``sub``-th) go into the
    program's ``acc`` ``[NB, 4, 2·TBS]`` words and ``sc`` (byte ``sub``), stored by the caller
    after its last token block; returns (acc, sc)."""
    s_val, s_bits, f = _candidate(_abs_max_tuple(z), enc, dec, RCP_NB)    # per channel
    if I64:
        cc = c.to(tl.int64)
    else:
        cc = c
    k8 = tl.arange(0, 8)[None, None, :]
    m3 = cmask[:, :, None]
    if COL_DEC:
        words = ()
        for k in tl.static_range(8):
            if COL_SR and SR_DIRECT:
                lo = _dec_sr_bits(z[2 * k], f, u[2 * k], s_val)
                hi = _dec_sr_bits(z[2 * k + 1], f, u[2 * k + 1], s_val)
            elif COL_SR:
                lo = _dec_nib_bits(_nib_sr(z[2 * k], f, u[2 * k]), s_val)
                hi = _dec_nib_bits(_nib_sr(z[2 * k + 1], f, u[2 * k + 1]), s_val)
            else:
                lo = _dec_rne_bits(z[2 * k], f, s_val)
                hi = _dec_rne_bits(z[2 * k + 1], f, s_val)
            words = words + (_bf16_word(lo, hi),)
        # 16 BF16 = 8 words per channel, contiguous in the [C, T_pad] operand (viewed as int32)
        tl.store(col_dec_ptr + (cc * (tpad // 2) + tb * 8)[:, :, None] + k8, _stack8(words),
                 mask=m3)
    if COL_CODES:
        w0 = tl.zeros(c.shape, tl.int32)
        w1 = tl.zeros(c.shape, tl.int32)
        for k in tl.static_range(16):
            if COL_SR:
                nib = _nib_sr(z[k], f, u[k])
            else:
                nib = _nib_rne(z[k], f)
            if k < 8:
                w0 = w0 | (nib << (4 * k))
            else:
                w1 = w1 | (nib << (4 * (k - 8)))
        if TBS == 1:
            # 16 codes = 8 bytes = 2 words per channel ([C, T_pad / 2] viewed as int32)
            k2 = tl.arange(0, 2)[None, None, :]
            tl.store(col_data_ptr + (cc * (tpad // 8) + tb * 2)[:, :, None] + k2,
                     tl.join(w0, w1), mask=cmask[:, :, None])
            tl.store(col_scale_ptr + cc * ntb + tb, s_bits.to(tl.uint8), mask=cmask)
        else:
            kk = tl.arange(0, 2 * TBS)[None, None, :]
            acc = tl.where(kk == 2 * sub, w0[:, :, None], acc)
            acc = tl.where(kk == 2 * sub + 1, w1[:, :, None], acc)
            sc = sc | ((s_bits & 0xFF) << (8 * sub))
    return acc, sc


@triton.jit
def _store_col_codes(acc, sc, c, tb0, tpad, ntb, cmask, col_data_ptr, col_scale_ptr,
                     I64: tl.constexpr, TBS: tl.constexpr):
    """A channel group's codes and scales of the program's TBS token blocks: ``2·TBS`` words
    (8·TBS bytes) and ``TBS`` scale bytes a channel, each one contiguous run, so a channel's
    codes fill whole 32-byte sectors at TBS = 4 (one 8-byte store and one 1-byte store a token
    block each wrote part of a sector). ``col_scale_ptr`` is the scales viewed as TBS-byte
    words."""
    if I64:
        cc = c.to(tl.int64)
    else:
        cc = c
    kk = tl.arange(0, 2 * TBS)[None, None, :]
    tl.store(col_data_ptr + (cc * (tpad // 8) + tb0 * 2)[:, :, None] + kk, acc,
             mask=cmask[:, :, None])
    tl.store(col_scale_ptr + (cc * ntb + tb0) // TBS, sc.to(col_scale_ptr.dtype.element_ty),
             mask=cmask)


@triton.jit
def _row_way(E0, O0, E1, O1, tb, blk, q, cmask, T, C, nblk, enc, dec, seed_row,
             row_dec_ptr, row_data_ptr, row_scale_ptr, ROW_DEC: tl.constexpr,
             ROW_CODES: tl.constexpr, ROW_SR: tl.constexpr, TILE2D: tl.constexpr,
             SR_DIRECT: tl.constexpr, I64: tl.constexpr, EVEN: tl.constexpr,
             RCP_NB: tl.constexpr):
    """The row way of token block ``tb`` (1×16 blocks along the channels, or 16×16 tiles):
    decoded BF16 words and/or codes + scales."""
    if TILE2D:
        # 16x16 tile = these 16 rows x one 16-channel block: one scale for the tile.
        bm = tl.max(tl.maximum(tl.maximum(_abs_max_tuple(E0), _abs_max_tuple(O0)),
                               tl.maximum(_abs_max_tuple(E1), _abs_max_tuple(O1))), 1)
        s_val, s_bits, f = _candidate(bm, enc, dec, RCP_NB)
    # Tokens in the order of their Philox calls (sr_stream.py): call k covers the tokens
    # 2k, 2k+1, 8+2k, 9+2k (its words 0..3), so one call serves 4 tokens of the lane.
    for k in tl.static_range(4):
        if ROW_SR:
            words = _row_sr_words(seed_row, tb, k, blk, q, nblk, I64)
        for pp in tl.static_range(4):
            # token (pp // 2)·8 + 2k + pp % 2, written inline: a name assigned inside the
            # loop is not a compile-time constant for the tuple subscripts (sm_90 compiler)
            e0, o0, e1, o1 = _token(E0, O0, E1, O1, (pp // 2) * 8 + 2 * k + pp % 2)
            t = tb * 16 + (pp // 2) * 8 + 2 * k + pp % 2
            m = _row_mask(cmask, t, T, EVEN)
            if not TILE2D:
                bm = tl.max(tl.maximum(tl.maximum(tl.abs(e0), tl.abs(o0)),
                                       tl.maximum(tl.abs(e1), tl.abs(o1))), 1)     # [NB]
                s_val, s_bits, f = _candidate(bm, enc, dec, RCP_NB)
            f2 = f[:, None]
            s2 = s_val[:, None]
            if I64:
                t_ = t.to(tl.int64)
            else:
                t_ = t
            if ROW_SR:
                w = words[pp]
                u0, u1, u2, u3 = _sr_u8(w, 0), _sr_u8(w, 1), _sr_u8(w, 2), _sr_u8(w, 3)
                if ROW_CODES or not SR_DIRECT:
                    n0 = _nib_sr(e0, f2, u0)
                    n1 = _nib_sr(o0, f2, u1)
                    n2 = _nib_sr(e1, f2, u2)
                    n3 = _nib_sr(o1, f2, u3)
            elif ROW_CODES:
                n0 = _nib_rne(e0, f2)
                n1 = _nib_rne(o0, f2)
                n2 = _nib_rne(e1, f2)
                n3 = _nib_rne(o1, f2)
            if ROW_DEC:
                if ROW_SR and (ROW_CODES or not SR_DIRECT):
                    w_lo = _bf16_word(_dec_nib_bits(n0, s2), _dec_nib_bits(n1, s2))
                    w_hi = _bf16_word(_dec_nib_bits(n2, s2), _dec_nib_bits(n3, s2))
                elif ROW_SR:
                    w_lo = _bf16_word(_dec_sr_bits(e0, f2, u0, s2), _dec_sr_bits(o0, f2, u1, s2))
                    w_hi = _bf16_word(_dec_sr_bits(e1, f2, u2, s2), _dec_sr_bits(o1, f2, u3, s2))
                else:
                    w_lo = _bf16_word(_dec_rne_bits(e0, f2, s2), _dec_rne_bits(o0, f2, s2))
                    w_hi = _bf16_word(_dec_rne_bits(e1, f2, s2), _dec_rne_bits(o1, f2, s2))
                p = row_dec_ptr + t_ * (C // 2) + (blk * 8)[:, None] + q[None, :]   # words
                tl.store(p, w_lo, mask=m)
                tl.store(p + 4, w_hi, mask=m)
            if ROW_CODES:
                p = row_data_ptr + t_ * (C // 2) + (blk * 8)[:, None] + q[None, :]  # bytes
                tl.store(p, (n0 | (n1 << 4)).to(tl.uint8), mask=m)
                tl.store(p + 4, (n2 | (n3 << 4)).to(tl.uint8), mask=m)
                if EVEN:
                    tl.store(row_scale_ptr + t_ * nblk + blk, s_bits.to(tl.uint8))
                else:
                    tl.store(row_scale_ptr + t_ * nblk + blk, s_bits.to(tl.uint8),
                             mask=(blk < nblk) & ((blk * 0 + t) < T))


@triton.jit(do_not_specialize=["seed_row", "seed_col"])
def _quantize_two_ways_kernel(
        x_ptr, gamax_row_ptr, gamax_col_ptr, obs_ptr, ts_ptr, peer_row_ptr, peer_col_ptr,
        row_dec_ptr, row_data_ptr, row_scale_ptr, col_dec_ptr, col_data_ptr, col_scale_ptr,
        seed_row, seed_col, T, C, stride_t, SIGNS: tl.constexpr,
        ROW_DEC: tl.constexpr, ROW_CODES: tl.constexpr, ROW_SR: tl.constexpr,
        TILE2D: tl.constexpr, COL_DEC: tl.constexpr, COL_CODES: tl.constexpr,
        COL_SR: tl.constexpr, SR_DIRECT: tl.constexpr, XW: tl.constexpr, I64: tl.constexpr,
        NB: tl.constexpr, TBS: tl.constexpr, EVEN: tl.constexpr, ALPHA_ROW: tl.constexpr,
        ALPHA_COL: tl.constexpr, RCP_NB: tl.constexpr):
    """TBS token blocks (a loop, not unrolled) × NB channel blocks a program; TBS > 1 only
    where the column way writes codes and the token blocks are a multiple of TBS (the host's
    choice), so every block of the program exists. Program 0 stores the tensor scales
    (``ts[0]``, ``ts[1]``) and, with ALPHA_ROW / ALPHA_COL, each way's GEMM alpha: its tensor
    scale times the other operand's (``peer_*_ptr``, FP32), ``ts[2]`` / ``ts[3]`` (the
    product the GEMM call would otherwise make in a launch of its own)."""
    pid, ntb, tb0, blk, q, cmask = _tile_coords(T, C, NB, TBS, EVEN)
    nblk = C // 16
    tpad = ntb * 16
    c0 = (blk * 16)[:, None] + 2 * q[None, :]          # channel of e0; o0 = +1, e1 = +8
    acc_e0 = tl.zeros((NB, 4, 2 * TBS), tl.int32)
    acc_o0 = tl.zeros((NB, 4, 2 * TBS), tl.int32)
    acc_e1 = tl.zeros((NB, 4, 2 * TBS), tl.int32)
    acc_o1 = tl.zeros((NB, 4, 2 * TBS), tl.int32)
    sc_e0 = tl.zeros((NB, 4), tl.int32)
    sc_o0 = tl.zeros((NB, 4), tl.int32)
    sc_e1 = tl.zeros((NB, 4), tl.int32)
    sc_o1 = tl.zeros((NB, 4), tl.int32)
    for sub in range(TBS):
        tb = tb0 + sub
        E0, O0, E1, O1 = _load_rows(x_ptr, tb, blk, q, cmask, T, C, stride_t, XW, I64, EVEN)
        # the tensor scales are loaded where each way starts (per token block: a few
        # instructions), so the row way's registers do not hold the column way's
        if ROW_DEC or ROW_CODES:
            enc_r, dec_r, dec_out = _tensor_scale(gamax_row_ptr, obs_ptr)
            if pid == 0:
                tl.store(ts_ptr, dec_out)
                if ALPHA_ROW:
                    tl.store(ts_ptr + 2, dec_out * tl.load(peer_row_ptr))
            _row_way(E0, O0, E1, O1, tb, blk, q, cmask, T, C, nblk, enc_r, dec_r, seed_row,
                     row_dec_ptr, row_data_ptr, row_scale_ptr, ROW_DEC, ROW_CODES, ROW_SR,
                     TILE2D, SR_DIRECT, I64, EVEN, RCP_NB)
        if COL_DEC or COL_CODES:
            enc_c, dec_c, dec_out = _tensor_scale(gamax_col_ptr, obs_ptr + 1)
            if pid == 0:
                tl.store(ts_ptr + 1, dec_out)
                if ALPHA_COL:
                    tl.store(ts_ptr + 3, dec_out * tl.load(peer_col_ptr))
            if COL_SR:
                cw = _col_sr_words(seed_col, blk, q, tb, ntb, I64)
                u_e0, u_o0 = _col_group_uniforms(cw, 0), _col_group_uniforms(cw, 1)
                u_e1, u_o1 = _col_group_uniforms(cw, 2), _col_group_uniforms(cw, 3)
            else:
                u_e0, u_o0, u_e1, u_o1 = seed_col, seed_col, seed_col, seed_col   # unused
            acc_e0, sc_e0 = _col_group(_rht16_tokens(E0, SIGNS), c0, tb, tpad, ntb, enc_c, dec_c,
                                       u_e0, cmask, col_dec_ptr, col_data_ptr, col_scale_ptr,
                                       acc_e0, sc_e0, sub, COL_DEC, COL_CODES, COL_SR,
                                       SR_DIRECT, I64, TBS, RCP_NB)
            acc_o0, sc_o0 = _col_group(_rht16_tokens(O0, SIGNS), c0 + 1, tb, tpad, ntb, enc_c,
                                       dec_c, u_o0, cmask, col_dec_ptr, col_data_ptr,
                                       col_scale_ptr, acc_o0, sc_o0, sub, COL_DEC, COL_CODES,
                                       COL_SR, SR_DIRECT, I64, TBS, RCP_NB)
            acc_e1, sc_e1 = _col_group(_rht16_tokens(E1, SIGNS), c0 + 8, tb, tpad, ntb, enc_c,
                                       dec_c, u_e1, cmask, col_dec_ptr, col_data_ptr,
                                       col_scale_ptr, acc_e1, sc_e1, sub, COL_DEC, COL_CODES,
                                       COL_SR, SR_DIRECT, I64, TBS, RCP_NB)
            acc_o1, sc_o1 = _col_group(_rht16_tokens(O1, SIGNS), c0 + 9, tb, tpad, ntb, enc_c,
                                       dec_c, u_o1, cmask, col_dec_ptr, col_data_ptr,
                                       col_scale_ptr, acc_o1, sc_o1, sub, COL_DEC, COL_CODES,
                                       COL_SR, SR_DIRECT, I64, TBS, RCP_NB)
    if COL_CODES and TBS > 1:
        _store_col_codes(acc_e0, sc_e0, c0, tb0, tpad, ntb, cmask, col_data_ptr, col_scale_ptr,
                         I64, TBS)
        _store_col_codes(acc_o0, sc_o0, c0 + 1, tb0, tpad, ntb, cmask, col_data_ptr,
                         col_scale_ptr, I64, TBS)
        _store_col_codes(acc_e1, sc_e1, c0 + 8, tb0, tpad, ntb, cmask, col_data_ptr,
                         col_scale_ptr, I64, TBS)
        _store_col_codes(acc_o1, sc_o1, c0 + 9, tb0, tpad, ntb, cmask, col_data_ptr,
                         col_scale_ptr, I64, TBS)
