"""dS stored once: the dkdv kernel's second quantization of its dS tiles, and the dq kernel on them.

**Off by default: measured slower.** On the H200 (2026-12-01, BENCHMARKS.md §F.3, run32) at
1×24×4096×128 causal the dq kernel drops from 0.697 to 0.331 ms but the dkdv kernel with the
store grows from 0.921 to 1.597 ms (255 registers with ~230 B of spills in its loop, and every
lane recomputing the key-direction block scales of the 8 lanes that share a 16-key block): the
backward kernels together take 1.93 ms against 1.62 ms. ``FP4_QATTN_DS_STORE=1`` (or
``attention_backward(ds_store=True)``) turns it on; PERF.md lists what would have to change.

The dkdv kernel (``triton_bwd._dkdv_kernel``) already holds every dS tile (64 keys × 64 queries
per 64-row group, FP32, in registers) to quantize it along *queries* for ``dK = dS₄ᵀ Q₄ˢ``. With
``STORE_DS`` it also quantizes the tile along **keys** — 1×16 blocks along the key axis, the
tile's own tensor scale from the same 64×64 amax — exactly what ``_dq_kernel`` computes when it
recomputes the tile, and writes it to a transient scratch buffer (:func:`store_ds_tile`):

* codes ``uint8 [n_tiles, 64, 32]``: query row r, byte ``8b + j`` (16-key block b, j < 8) holds
  the E2M1 codes (sign in bit 3) of keys ``16b + j`` (low nibble) and ``16b + j + 8`` (high) —
  not ``nvfp4``'s adjacent pairs: keys j and j + 8 are in one thread of the dkdv kernel's MMA
  layout, adjacent keys are not (a 32 KB shared-memory layout conversion at 128 keys);
* block scales ``uint8 [n_tiles, 64, 4]``: the E4M3 bit pattern of keys ``16j … 16j + 15``;
* decode scale ``fp32 [n_tiles]`` (the tile's ``1/enc``).

The tile's ``(enc, dec)`` (from its amax, which does not depend on the block direction) are
returned and reused by the dK quantization (``triton_bwd._quantize_tile_given``): one tile-amax
reduction per tile instead of two. The codes come from the E2M1 magic add's bits and the scale
bytes from the E4M3 rounding's integer (:func:`_e2m1_codes`, :func:`_block_scales_bits`), the
decode in the dq loop is integer bit assembly (:func:`_e2m1_bits`): no float↔int conversions.

Tile index of (b·h, query tile ``tm``, key tile ``tn``) (:func:`ds_tile_index`): causal
(``Sq == Sk``) stores only the tiles at or below the diagonal, triangular,
``bh · T(T+1)/2 + tm(tm+1)/2 + tn``; non-causal ``(bh · NQT + tm) · NKT + tn``. Triangular
halves the causal buffer against a rectangle (the above-diagonal tiles are all zero and never
read). Bytes: ``n_tiles · 2308`` (2048 codes + 256 scales + 4 dec), independent of head_dim —
``B·H·T(T+1)/2 · 2308`` causal, T = ⌈S/64⌉: **115,215,360 B (109.9 MiB) at 1×24×4096×128,
116,987,904 B (111.6 MiB) at 4×24×2048×128**. Every slot is written (no zero fill).

``_dq_ds_kernel`` (one program per (b, head, 64·RM queries), causal programs longest first)
then loops over the stored tiles of its rows: load codes + scales, decode to the exact BF16
values (``e2m1 · e4m3`` is exact in BF16), one BF16 GEMM with the seq-quantized K view, scaled
by ``dec_tile · dec_k`` per row — the product ``_ds_product`` forms after its quantization, in
the same key order. No S, P, dP, exp2 or quantization in the dq loop. dQ is stored through
its (batch, head, seq) strides, like the recompute kernel's (``layout.py``).

Numbers: the stored codes are those ``_dq_kernel`` would compute from the dkdv kernel's S and
dP (same tile amax, same ``block_scales``/E2M1 rounding; stochastic rounding draws
``tl.rand(seed_dq, (bh·Sq + query)·Sk + key)``, the dq kernel's stream). Under the interpreter
the dQ is bit-identical to the recompute path (tested); on a GPU the two kernels' S/dP MMAs
(``K Qᵀ`` vs ``Q Kᵀ``, different wgmma shapes) may accumulate in a different FP32 order, which
can flip a few dS codes — the same class of difference that already separates the kernels
from ``reference.backward``.
"""

import os

import torch
import triton
import triton.language as tl

from fullstack_fp4.nvfp4.triton_dequantize import _e4m3_value
from fullstack_fp4.nvfp4.triton_launch import cdiv

from .triton_nvfp4 import FP32_MAX, dot_bf16, e2m1_stochastic, encode_scales, to_bf16

TILE = 64
CODE_BYTES = TILE * TILE // 2      # 2048
SCALE_BYTES = TILE * TILE // 16    # 256
TILE_BYTES = CODE_BYTES + SCALE_BYTES + 4
DEFAULT_MAX_BYTES = 256 << 20      # 1×24×4096×128 and 4×24×2048×128 causal: ≈ 110 MiB


@triton.jit
def ds_tile_index(bh, tm, tn, NKT, TPH, CAUSAL: tl.constexpr):
    """Scratch slot of dS tile (bh, query tile tm, key tile tn); ``TPH`` tiles per head."""
    if CAUSAL:
        return bh * TPH + (tm * (tm + 1)) // 2 + tn
    else:
        return bh * TPH + tm * NKT + tn


@triton.jit
def _e2m1_codes(x, f, u, STOCH: tl.constexpr):
    """4-bit E2M1 codes (int32, sign in bit 3) of FP32 ``x`` given its block's encode factor
    ``f``: ``e2m1(code) · s`` is the value :func:`triton_nvfp4.qdq_apply` returns, bit for bit
    (same clamp, same rounding, nearest or stochastic with ``u``; a negative x rounding to 0
    gets code 8, as ``qdq_codes``).

    Nearest: :func:`triton_nvfp4.e2m1_nearest`'s magic add ``t = a + C`` (C = 2²², 2²³, 2²⁴,
    whose ulp is the grid step 0.5, 1, 2) leaves ``a / step`` in the low mantissa bits of t
    (0…4) and the range in its exponent (149, 150, 151), so the magnitude code is
    ``(t & 7) + 2·(exp(t) − 149)`` = ``(t & 7) + (t >> 22) − 298`` (bit 22 of t is 0): integer
    ops instead of the value's compare/select chain and a float→int conversion."""
    y = x * f
    a = tl.minimum(tl.abs(y), 6.0)       # = |clamp(y, -6, 6)|
    if STOCH:
        m = e2m1_stochastic(a, u)
        mag = tl.where(m < 2.0, m * 2.0, tl.where(m < 6.0, m + 2.0, 7.0)).to(tl.int32)
    else:
        c = tl.where(a < 2.0, 4194304.0, tl.where(a < 4.0, 8388608.0, 16777216.0))
        t = (a + c).to(tl.int32, bitcast=True)
        mag = (t & 7) + (t >> 22) - 298
    return tl.where(y < 0, mag | 8, mag)


@triton.jit
def _block_scales_bits(bamax, enc6, dec):
    """:func:`triton_nvfp4.block_scales` (``s``, ``f``, the same FP32 ops) plus the E4M3 bit
    pattern of ``s`` read off the rounding: with ``e = max(exp(v), −6)`` and the integer
    ``r = rne(v · 2^(3−e))`` ∈ [0, 16], ``bits = ((e + 7) << 3) + r − 8`` covers normals, the
    carry into the next binade (r = 16), subnormals (e = −6, r < 8) and zero."""
    v = tl.minimum(bamax * enc6, 448.0)
    vb = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((vb >> 23) & 0xFF) - 127, -6)
    inv_step = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)
    step = ((127 + (e - 3)) << 23).to(tl.float32, bitcast=True)
    rr = v * inv_step + 8388608.0
    r = rr - 8388608.0
    s = r * step
    bits = (e << 3) + (rr.to(tl.int32, bitcast=True) - 0x4B000000) + 48
    f = tl.minimum(tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s * dec), FP32_MAX)
    return s, f, bits


@triton.jit
def store_ds_tile(dsT, u, codes_ptr, scales_ptr, dec_ptr, bh, start_m, start_n, NKT, TPH,
                  BN: tl.constexpr, BM: tl.constexpr, CAUSAL: tl.constexpr,
                  STOCH: tl.constexpr):
    """Quantize ``dsT [BN keys, BM = 64 queries]`` along keys (one tensor scale per 64-key
    group, i.e. per 64×64 tile) and store codes, scale bytes and decode scales (module
    docstring). ``u``: uniforms of the dq stream in the same orientation (STOCH only).
    Tiles past the keys (``tn ≥ NKT``) or above the causal diagonal are not stored."""
    x3 = tl.reshape(dsT, [BN // 16, 16, BM])
    bam = tl.max(tl.abs(x3), axis=1)                                        # [BN/16, BM]
    gam = tl.max(tl.max(tl.reshape(bam, [BN // 64, 4, BM]), 2), 1)          # [BN/64] tiles
    enc6, dec = encode_scales(gam)
    enc6b = tl.reshape(tl.broadcast_to(enc6[:, None], [BN // 64, 4]), [BN // 16])
    decb = tl.reshape(tl.broadcast_to(dec[:, None], [BN // 64, 4]), [BN // 16])
    s, f, sbits = _block_scales_bits(bam, enc6b[:, None], decb[:, None])   # [BN/16, BM]
    if STOCH:
        u3 = tl.reshape(u, [BN // 16, 16, BM])
    else:
        u3 = x3
    c = _e2m1_codes(x3, f[:, None, :], u3, STOCH)                          # [BN/16, 16, BM]
    # byte j of a 16-key block: keys j (low nibble) and j + 8 (high) — rows r and r + 8 of the
    # MMA accumulator layout are in the same thread, so the split needs no layout conversion
    # (pairing keys 2j, 2j + 1 cost a 32 KB shared-memory round trip at BN = 128)
    lo, hi = tl.split(tl.permute(tl.reshape(c, [BN // 16, 2, 8, BM]), (0, 2, 3, 1)))
    byte = (lo | (hi << 4)).to(tl.uint8)                                    # [BN/16, 8, BM]

    tm = start_m // 64
    rows = tl.arange(0, BM)
    kb = tl.arange(0, BN // 16)                     # 16-key block of the program
    tnb = start_n // 64 + kb // 4
    okb = tnb < NKT
    if CAUSAL:
        okb = okb & (tnb <= tm)
    idxb = ds_tile_index(bh, tm, tnb, NKT, TPH, CAUSAL)
    j = tl.arange(0, 8)
    c_offs = ((idxb * 2048 + (kb % 4) * 8)[:, None, None] + j[None, :, None]
              + rows[None, None, :] * 32)
    tl.store(codes_ptr + c_offs, byte, mask=okb[:, None, None])
    tl.store(scales_ptr + idxb[:, None] * 256 + rows[None, :] * 4 + (kb % 4)[:, None],
             sbits.to(tl.uint8), mask=okb[:, None])
    tnt = start_n // 64 + tl.arange(0, BN // 64)
    okt = tnt < NKT
    if CAUSAL:
        okt = okt & (tnt <= tm)
    tl.store(dec_ptr + ds_tile_index(bh, tm, tnt, NKT, TPH, CAUSAL), dec, mask=okt)
    return enc6, dec


@triton.jit
def _e2m1_bits(c):
    """FP32 bit pattern of the E2M1 value of code ``c`` (0…15), integer ops only: magnitude m =
    c & 7 ≥ 2 is ``2^((m >> 1) − 1) · (1 + (m & 1)/2)`` = bits ``(m << 22) + 0x3F000000``;
    m = 0, 1 (0 and 0.5) is ``m · 0x3F000000``; the sign is bit 3 → bit 31."""
    m = c & 7
    mag = tl.where(m < 2, m * 0x3F000000, (m << 22) + 0x3F000000)
    return mag | ((c & 8) << 28)


@triton.jit
def _dq_ds_loop(dq, codes_ptr, scales_ptr, dec_ptr, ks_ptr, bh, bkv, lo, hi, tm_row, r_row,
                NQT, NKT, TPH, Sk, dec_ks,
                D: tl.constexpr, BM: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
                INTERP: tl.constexpr):
    offs_d = tl.arange(0, D)
    cb = tl.arange(0, 32)
    sb = tl.arange(0, 4)
    for tn in range(lo, hi):
        idx = ds_tile_index(bh, tm_row, tn, NKT, TPH, CAUSAL)               # [BM]
        c_offs = idx[:, None] * 2048 + r_row[:, None] * 32 + cb[None, :]
        s_offs = idx[:, None] * 256 + r_row[:, None] * 4 + sb[None, :]
        offs_n = tn * 64 + tl.arange(0, 64)
        kv_offs = bkv * Sk * D + offs_n[:, None] * D + offs_d[None, :]
        if MASK:
            ok = tm_row < NQT
            if CAUSAL:
                ok = ok & (tn <= tm_row)
            byte = tl.load(codes_ptr + c_offs, mask=ok[:, None], other=0)
            sc = tl.load(scales_ptr + s_offs, mask=ok[:, None], other=0)
            dec = tl.load(dec_ptr + idx, mask=ok, other=0.0)
            ks = tl.load(ks_ptr + kv_offs, mask=offs_n[:, None] < Sk, other=0.0)
        else:
            byte = tl.load(codes_ptr + c_offs)
            sc = tl.load(scales_ptr + s_offs)
            dec = tl.load(dec_ptr + idx)
            ks = tl.load(ks_ptr + kv_offs)
        b = tl.reshape(byte.to(tl.int32), [BM, 4, 8])          # byte j: keys j, j + 8
        v = tl.join(_e2m1_bits(b & 15), _e2m1_bits(b >> 4))     # [BM, 4, 8, 2]
        v = tl.reshape(tl.permute(v, (0, 1, 3, 2)), [BM, 4, 16]).to(tl.float32, bitcast=True)
        v = v * _e4m3_value(sc.to(tl.int32))[:, :, None]                     # exact
        vals = to_bf16(tl.reshape(v, [BM, 64]), INTERP)
        dq += dot_bf16(vals, ks, INTERP) * (dec * dec_ks)[:, None]
    return dq


@triton.jit
def _dq_ds_kernel(codes_ptr, scales_ptr, dec_ptr, ks_ptr, decks_ptr, dq_ptr,
                  Sq, Sk, H, GROUPS, NQT, NKT, TPH, scale, dq_sb, dq_sh, dq_ss,
                  D: tl.constexpr, BM: tl.constexpr, CAUSAL: tl.constexpr,
                  DQ_BF16: tl.constexpr, INTERP: tl.constexpr):
    pid = tl.program_id(0)
    if CAUSAL:
        pid = tl.num_programs(0) - 1 - pid      # longest (last) query blocks first
    start_m = pid * BM
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    bkv = b * (H // GROUPS) + h // GROUPS
    offs_m = start_m + tl.arange(0, BM)
    tm_row = offs_m // 64
    r_row = offs_m % 64
    dec_ks = tl.load(decks_ptr + bkv)
    dq = tl.zeros([BM, D], tl.float32)
    # key tiles [0, nlo) stored for every row of the program and inside Sk (no masks); the rest
    # up to nhi masked: the causal diagonal of a 128-row program, a ragged key tail, a last
    # program reaching past the query tiles
    if CAUSAL:
        nhi = tl.minimum(tl.cdiv(start_m + BM, 64), NKT)
        nlo = tl.minimum(start_m // 64 + 1, Sk // 64)
    else:
        nhi = NKT
        nlo = Sk // 64
    if start_m + BM > NQT * 64:
        nlo = 0
    dq = _dq_ds_loop(dq, codes_ptr, scales_ptr, dec_ptr, ks_ptr, bh, bkv, 0, nlo, tm_row, r_row,
                     NQT, NKT, TPH, Sk, dec_ks, D, BM, False, CAUSAL, INTERP)
    dq = _dq_ds_loop(dq, codes_ptr, scales_ptr, dec_ptr, ks_ptr, bh, bkv, nlo, nhi, tm_row,
                     r_row, NQT, NKT, TPH, Sk, dec_ks, D, BM, True, CAUSAL, INTERP)
    dq = dq * scale
    m_ok = offs_m < Sq
    # dQ in the caller's layout (triton_bwd.attention_backward's out_orders, layout.py)
    dq_offs = b * dq_sb + h * dq_sh + offs_m[:, None] * dq_ss + tl.arange(0, D)[None, :]
    if DQ_BF16:
        tl.store(dq_ptr + dq_offs, to_bf16(dq, INTERP), mask=m_ok[:, None])
    else:
        tl.store(dq_ptr + dq_offs, dq, mask=m_ok[:, None])


# ----------------------------------------------------------------------------- host side
def ds_store_tiles(b: int, h: int, sq: int, sk: int, causal: bool) -> tuple:
    """``(NQT, NKT, tiles per head, n_tiles)`` of the scratch (module docstring)."""
    nqt, nkt = cdiv(sq, TILE), cdiv(sk, TILE)
    tph = nqt * (nqt + 1) // 2 if causal else nqt * nkt
    return nqt, nkt, tph, b * h * tph


def ds_store_bytes(b: int, h: int, sq: int, sk: int, causal: bool) -> int:
    """Scratch bytes of the stored-dS path: ``n_tiles · 2308``."""
    return ds_store_tiles(b, h, sq, sk, causal)[3] * TILE_BYTES


def max_bytes() -> int:
    """``FP4_QATTN_DS_STORE_MAX_BYTES`` (default 256 MiB): the largest scratch the stored-dS path
    may allocate (it is transient: freed when the backward returns)."""
    v = os.environ.get("FP4_QATTN_DS_STORE_MAX_BYTES", "").strip()
    return int(v) if v else DEFAULT_MAX_BYTES


def use_ds_store(b, h, sq, sk, d, causal, ds_fp4, ds_store=None) -> bool:
    """Whether the backward stores dS in the dkdv kernel and runs ``_dq_ds_kernel``.

    ``ds_store`` (the ``attention_backward`` argument) else ``FP4_QATTN_DS_STORE`` (``0``/``1``,
    default 0: measured slower on the H200, module docstring) asks for it; it is taken only for the NVFP4 dS path, head_dim 64/128, and when
    the scratch fits ``max_bytes()`` and int32 offsets (< 2³¹ code bytes); else the recompute
    ``_dq_kernel`` runs."""
    if ds_store is None:
        ds_store = os.environ.get("FP4_QATTN_DS_STORE", "0").strip() not in ("0", "")
    if not (ds_store and ds_fp4 and d in (64, 128)):
        return False
    n_tiles = ds_store_tiles(b, h, sq, sk, causal)[3]
    return n_tiles * TILE_BYTES <= max_bytes() and n_tiles * CODE_BYTES < 2 ** 31


def ds_scratch(b, h, sq, sk, causal, device) -> tuple:
    """``(codes, scales, dec, NQT, NKT, TPH)``: uninitialised (every slot gets written)."""
    nqt, nkt, tph, n = ds_store_tiles(b, h, sq, sk, causal)
    codes = torch.empty(n, TILE, TILE // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(n, TILE, TILE // 16, dtype=torch.uint8, device=device)
    dec = torch.empty(n, dtype=torch.float32, device=device)
    return codes, scales, dec, nqt, nkt, tph
