"""Pure-PyTorch Q-Attn forward and backward (CPU oracle; materialises S, fine at small seq).

Math (per batch b, query head h, kv head g = h // (H / Hkv); ``τ`` = softmax scale):

    S   = (Q₄ᵈ · dec_q)(K₄ᵈ · dec_k)ᵀ          Q, K in 1×16 blocks along head_dim  (path qk)
    P   = softmax(τ S  masked),  lse = logsumexp(τ S)                       FP32
    O   = P V                                  BF16 operands, FP32 accumulation (path pv)
    D   = rowsum(dO ⊙ O)                       FP32
    dV  = Pᵀ dO                                BF16 (path dv), summed over the group's heads
    dP  = dO Vᵀ                                BF16 (path dp)
    dS  = P ⊙ (dP − D)                         FP32
    dQ  = τ · dS₄ K₄ˢ        dS blocks along keys,    K in blocks along seq        (path ds)
    dK  = τ · dS₄ᵀ Q₄ˢ       dS blocks along queries, Q in blocks along seq, summed over group
    K-smoothing on: dK ← dK − mean_seq(dK)  (the exact dK has zero seq-mean; see prologue.py)

A "BF16" GEMM here is: both operands rounded to BF16, product accumulated in FP32 — what a
tensor-core BF16 MMA computes up to accumulation order. An NVFP4 GEMM is the FP32 product of
the dequantized operands: E2M1 × E4M3 values are exact, so this is the NVFP4 result up to
accumulation order (the same emulation the Triton kernels run on Hopper).

dS is quantized with a tensor scale per aligned 64×64 tile (``quant.py``); its rounding is
``ds_rounding`` (see ``function.py`` for the default and the measurement behind it).
"""

from __future__ import annotations

from typing import Optional

import torch

from .paths import quantized
from .prologue import QAttnViews
from .quant import per_head_view, tile_dequant


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    """KV heads -> query heads (head h reads kv head h // groups)."""
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _reduce(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Query heads -> KV heads: sum each group's contributions (the GQA backward)."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x.reshape(b, h // groups, groups, s, d).sum(dim=2)


def _deq(vals: torch.Tensor, dec: torch.Tensor) -> torch.Tensor:
    return vals.to(torch.float32) * dec[:, :, None, None]


def _mask(sq: int, sk: int, causal: bool, device) -> Optional[torch.Tensor]:
    if not causal:
        return None
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return j > i


def probabilities(views: QAttnViews, groups: int, causal: bool, scale: float):
    """``P`` and natural-log ``lse`` [B, H, Sq] from the head_dim views (FP32)."""
    q = _deq(views.q_hd, views.dec_q_hd)
    k = _expand(_deq(views.k_hd, views.dec_k_hd), groups)
    logits = (q @ k.transpose(-1, -2)) * scale
    m = _mask(q.shape[2], k.shape[2], causal, q.device)
    if m is not None:
        logits = logits.masked_fill(m, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    return torch.exp(logits - lse[..., None]), lse


def _gemm_ab(a_fp4: bool, a: torch.Tensor, a_along: str, b: torch.Tensor, b_along: str,
             groups_b: int = 1, gen: Optional[torch.Generator] = None) -> torch.Tensor:
    """``A @ B`` for an optional-NVFP4 path: A an in-kernel matrix [B,H,M,N] (tile scales,
    blocks along ``a_along``), B a memory operand [B,Hb,N,D] (per-head scales, blocks along
    ``b_along``). Used only for paths switched to NVFP4 off their default (error table)."""
    if not a_fp4:
        return _bf16(a) @ _expand(_bf16(b), groups_b)
    aq = tile_dequant(a, a_along, generator=gen)
    bv, bd = per_head_view(b, b_along)
    return aq @ _expand(_deq(bv, bd), groups_b)


def forward(v: torch.Tensor, views: QAttnViews, *, causal: bool, scale: float, paths: dict):
    """``(O bf16 [B,H,Sq,D], lse fp32 [B,H,Sq])``."""
    groups = views.q_hd.shape[1] // v.shape[1]
    p, lse = probabilities(views, groups, causal, scale)
    o = _gemm_ab(quantized(paths, "pv"), p, "keys", v, "seq", groups)
    return o.to(torch.bfloat16), lse


def backward(do: torch.Tensor, o: torch.Tensor, v: torch.Tensor, views: QAttnViews, *,
             causal: bool, scale: float, paths: dict, ds_rounding: str = "nearest",
             generator: Optional[torch.Generator] = None):
    """``(dQ, dK, dV)`` in FP32 (the caller casts to the input dtype)."""
    groups = views.q_hd.shape[1] // v.shape[1]
    p, _ = probabilities(views, groups, causal, scale)
    dof = do.to(torch.float32)
    delta = (dof * o.to(torch.float32)).sum(dim=-1, keepdim=True)

    # dV = Pᵀ dO : reduction over queries.
    dv_full = _gemm_ab(quantized(paths, "dv"), p.transpose(-1, -2), "keys", do, "seq")
    dv = _reduce(dv_full, groups)
    # dP = dO Vᵀ : reduction over head_dim (both operands are memory operands).
    if quantized(paths, "dp"):
        dov, dod = per_head_view(do, "head_dim")
        vv, vd = per_head_view(v, "head_dim")
        dp = _deq(dov, dod) @ _expand(_deq(vv, vd), groups).transpose(-1, -2)
    else:
        dp = _bf16(dof) @ _expand(_bf16(v), groups).transpose(-1, -2)
    ds = p * (dp - delta)

    kq = _expand(_deq(views.k_sq, views.dec_k_sq), groups)
    qq = _deq(views.q_sq, views.dec_q_sq)
    if quantized(paths, "ds"):
        ds_k = tile_dequant(ds, "keys", ds_rounding, generator)       # for dQ (sum over keys)
        ds_q = tile_dequant(ds, "queries", ds_rounding, generator)    # for dK (sum over queries)
    else:
        ds_k = ds_q = _bf16(ds)
        kq, qq = _bf16(kq), _bf16(qq)
    dq = (ds_k @ kq) * scale
    dk = _reduce(ds_q.transpose(-1, -2) @ qq, groups) * scale
    if views.smoothed:
        dk = dk - dk.mean(dim=2, keepdim=True)
    return dq, dk, dv
