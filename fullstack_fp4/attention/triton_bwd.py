"""Triton Q-Attn backward: two flash-style kernels, S and dS never materialised.

Both recompute ``P = exp2(τ·log2e · S − lse2)`` from the head_dim views and compute, per
64×64 tile (queries × keys),

    dP = dO Vᵀ (BF16),   dS = P ⊙ (dP − D)   (FP32, D = rowsum(dO ⊙ O) from a torch pre-pass)

then quantize dS **in registers** with the tile's own tensor scale (its amax; ``quant.py``
argues the granularity) in 1×16 blocks along the reduction dimension of the GEMM it feeds:

* ``_dkdv_kernel`` — one program per (b, kv head, 64 keys); loops over the group's query heads
  and the query blocks (causal: only blocks at or below the diagonal). ``dV += Pᵀ dO`` (BF16),
  ``dK += dec_tile·dec_q · (dS₄ᵀ)(Q₄ˢ)`` with dSᵀ blocks along queries. GQA needs no atomics:
  the group's heads are summed inside the program.
* ``_dq_kernel`` — one program per (b, head, 64 queries); loops over key blocks;
  ``dQ += dec_tile·dec_k · (dS₄)(K₄ˢ)`` with dS blocks along keys.

The tiles are 64×64 and aligned at (0, 0) in both kernels, i.e. exactly the reference's dS
tiles, so the two kernels and ``reference.backward`` quantize the same numbers (up to the FP32
accumulation order of the recomputed S and dP). Stochastic rounding draws ``tl.rand`` (Philox)
per element, keyed by (seed, b·h, query, key); the dQ and dK kernels use different seeds.
"""

import math
import os

import torch
import triton
import triton.language as tl

from .triton_nvfp4 import dot_bf16, to_bf16, encode_scales, block_scales, qdq_apply

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634
BLOCK = 64   # = quant.DS_TILE: the dS tile is the kernel tile


@triton.jit
def _quantize_tile(x, u, ROWS: tl.constexpr, COLS: tl.constexpr, STOCH: tl.constexpr):
    """``(values, dec)``: ``x [ROWS, COLS]`` in 1×16 blocks along axis 1, tile tensor scale.

    Block scale and encode factor are computed once per 16-block (``block_scales``) on the
    reduced ``[ROWS, COLS/16]`` amax and broadcast in 3D; only the E2M1 rounding is per element.
    """
    x3 = tl.reshape(x, [ROWS, COLS // 16, 16])
    bam = tl.max(tl.abs(x3), axis=2)
    enc6, dec = encode_scales(tl.max(tl.max(bam, 1), 0))
    s, f = block_scales(bam, enc6, dec)
    if STOCH:
        u3 = tl.reshape(u, [ROWS, COLS // 16, 16])
    else:
        u3 = x3
    v3 = qdq_apply(x3, s[:, :, None], f[:, :, None], u3, STOCH)
    return tl.reshape(v3, [ROWS, COLS]), dec


@triton.jit
def _dkdv_kernel(qh_ptr, kh_ptr, qs_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr,
                 decqh_ptr, deckh_ptr, decqs_ptr, dk_ptr, dv_ptr,
                 Sq, Sk, H, GROUPS, scale2, seed,
                 D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
                 DS_FP4: tl.constexpr, STOCH: tl.constexpr, INTERP: tl.constexpr):
    start_n = tl.program_id(0) * BN
    bkv = tl.program_id(1)
    hk_n = H // GROUPS
    b = bkv // hk_n
    hk = bkv % hk_n
    offs_n = start_n + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    n_ok = offs_n < Sk
    kv_offs = bkv * Sk * D + offs_n[:, None] * D + offs_d[None, :]
    k = tl.load(kh_ptr + kv_offs, mask=n_ok[:, None], other=0.0)
    v = tl.load(v_ptr + kv_offs, mask=n_ok[:, None], other=0.0)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    dec_k = tl.load(deckh_ptr + bkv)
    if CAUSAL:
        lo = start_n          # BM == BN: the first query block that sees these keys
    else:
        lo = 0
    for g in range(0, GROUPS):
        bh = b * H + hk * GROUPS + g
        qk_mul = tl.load(decqh_ptr + bh) * dec_k * scale2
        dec_qs = tl.load(decqs_ptr + bh)
        for start_m in range(lo, Sq, BM):
            offs_m = start_m + tl.arange(0, BM)
            m_ok = offs_m < Sq
            q_offs = bh * Sq * D + offs_m[:, None] * D + offs_d[None, :]
            q = tl.load(qh_ptr + q_offs, mask=m_ok[:, None], other=0.0)
            do = tl.load(do_ptr + q_offs, mask=m_ok[:, None], other=0.0)
            lse = tl.load(lse_ptr + bh * Sq + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(delta_ptr + bh * Sq + offs_m, mask=m_ok, other=0.0)
            qkT = dot_bf16(k, tl.trans(q), INTERP) * qk_mul                  # [BN, BM]
            valid = m_ok[None, :] & n_ok[:, None]
            if CAUSAL:
                valid = valid & (offs_m[None, :] >= offs_n[:, None])
            pT = tl.where(valid, tl.math.exp2(qkT - lse[None, :]), 0.0)
            dv += dot_bf16(to_bf16(pT, INTERP), do, INTERP)
            dpT = dot_bf16(v, tl.trans(do), INTERP)
            dsT = pT * (dpT - delta[None, :])
            qs = tl.load(qs_ptr + q_offs, mask=m_ok[:, None], other=0.0)
            if DS_FP4:
                u = dsT
                if STOCH:
                    u = tl.rand(seed, (bh * Sq + offs_m[None, :]) * Sk + offs_n[:, None])
                vals, dec_t = _quantize_tile(dsT, u, BN, BM, STOCH)
                dk += dot_bf16(to_bf16(vals, INTERP), qs, INTERP) * (dec_t * dec_qs)
            else:
                dk += dot_bf16(to_bf16(dsT, INTERP), qs, INTERP)
    tl.store(dk_ptr + kv_offs, dk, mask=n_ok[:, None])
    tl.store(dv_ptr + kv_offs, dv, mask=n_ok[:, None])


@triton.jit
def _dq_kernel(qh_ptr, kh_ptr, ks_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr,
               decqh_ptr, deckh_ptr, decks_ptr, dq_ptr,
               Sq, Sk, H, GROUPS, scale2, seed,
               D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
               DS_FP4: tl.constexpr, STOCH: tl.constexpr, INTERP: tl.constexpr):
    start_m = tl.program_id(0) * BM
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    bkv = b * (H // GROUPS) + h // GROUPS
    offs_m = start_m + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    m_ok = offs_m < Sq
    q_offs = bh * Sq * D + offs_m[:, None] * D + offs_d[None, :]
    q = tl.load(qh_ptr + q_offs, mask=m_ok[:, None], other=0.0)
    do = tl.load(do_ptr + q_offs, mask=m_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + bh * Sq + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(delta_ptr + bh * Sq + offs_m, mask=m_ok, other=0.0)
    qk_mul = tl.load(decqh_ptr + bh) * tl.load(deckh_ptr + bkv) * scale2
    dec_ks = tl.load(decks_ptr + bkv)
    dq = tl.zeros([BM, D], tl.float32)
    if CAUSAL:
        hi = tl.minimum(start_m + BM, Sk)
    else:
        hi = Sk
    for start_n in range(0, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        n_ok = offs_n < Sk
        kv_offs = bkv * Sk * D + offs_n[:, None] * D + offs_d[None, :]
        k = tl.load(kh_ptr + kv_offs, mask=n_ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=n_ok[:, None], other=0.0)
        qk = dot_bf16(q, tl.trans(k), INTERP) * qk_mul                       # [BM, BN]
        valid = m_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(valid, tl.math.exp2(qk - lse[:, None]), 0.0)
        dp = dot_bf16(do, tl.trans(v), INTERP)
        ds = p * (dp - delta[:, None])
        ks = tl.load(ks_ptr + kv_offs, mask=n_ok[:, None], other=0.0)
        if DS_FP4:
            u = ds
            if STOCH:
                u = tl.rand(seed, (bh * Sq + offs_m[:, None]) * Sk + offs_n[None, :])
            vals, dec_t = _quantize_tile(ds, u, BM, BN, STOCH)
            dq += dot_bf16(to_bf16(vals, INTERP), ks, INTERP) * (dec_t * dec_ks)
        else:
            dq += dot_bf16(to_bf16(ds, INTERP), ks, INTERP)
    tl.store(dq_ptr + q_offs, dq, mask=m_ok[:, None])


def bwd_config(d: int):
    """``((warps, stages) of _dkdv_kernel, (warps, stages) of _dq_kernel)``; the tile is fixed
    at 64×64 (the dS quantization tile). ``FP4_QATTN_BWD="w_kv,st_kv,w_q,st_q"`` overrides
    (``scripts/bench_q_attn.py --sweep``)."""
    from .triton_fwd import _env_ints
    cfg = _env_ints("FP4_QATTN_BWD", 4)
    if cfg is not None:
        return (cfg[0], cfg[1]), (cfg[2], cfg[3])
    w = 4 if d <= 64 else 8
    return (w, 2), (w, 2)


def attention_backward(do, o, lse, v, views, *, causal: bool, scale: float, ds_fp4: bool = True,
                       ds_stochastic: bool = False, seed: int = 0):
    """``(dQ, dK, dV)`` FP32. ``lse`` is the forward's natural-log LSE [B, H, Sq]; ``ds_fp4``
    says whether the ds path is NVFP4 (else dS and the seq views are plain BF16)."""
    qh, kh = views.q_hd, views.k_hd
    b, h, sq, d = qh.shape
    hk, sk = kh.shape[1], kh.shape[2]
    groups = h // hk
    lse2 = (lse * (1.0 / math.log(2.0))).contiguous()
    delta = (do.float() * o.float()).sum(-1).contiguous()
    v = v.to(torch.bfloat16).contiguous()
    do = do.to(torch.bfloat16).contiguous()
    dq = torch.empty(qh.shape, dtype=torch.float32, device=qh.device)
    dk = torch.empty(kh.shape, dtype=torch.float32, device=qh.device)
    dv = torch.empty_like(dk)
    scale2 = scale * LOG2E
    (w_kv, st_kv), (w_q, st_q) = bwd_config(d)
    common = dict(D=d, BM=BLOCK, BN=BLOCK, CAUSAL=causal, DS_FP4=ds_fp4, STOCH=ds_stochastic,
                  INTERP=INTERPRET)
    _dkdv_kernel[(triton.cdiv(sk, BLOCK), b * hk)](
        qh, kh, views.q_sq, v, do, lse2, delta, views.dec_q_hd, views.dec_k_hd, views.dec_q_sq,
        dk, dv, sq, sk, h, groups, scale2, seed, **common, num_warps=w_kv, num_stages=st_kv)
    _dq_kernel[(triton.cdiv(sq, BLOCK), b * h)](
        qh, kh, views.k_sq, v, do, lse2, delta, views.dec_q_hd, views.dec_k_hd, views.dec_k_sq,
        dq, sq, sk, h, groups, scale2, seed + 1, **common, num_warps=w_q, num_stages=st_q)
    dq *= scale
    dk *= scale
    if views.k_mean is not None:
        dk -= dk.mean(dim=2, keepdim=True)   # K-smoothing: project out the seq-mean (prologue.py)
    return dq, dk, dv
