"""Forward prologue: the quantized views of Q and K, made once and saved for the backward.

Four views (each ``values`` in the layout ``[B, H, S, D]`` plus a per-(b, head) FP32 decode
tensor scale, see ``quant.py``):

    q_hd, k_hd : Q, K in 1×16 blocks along head_dim   -> S  = Q₄ K₄ᵀ   (forward, recompute)
    q_sq, k_sq : Q, K in 1×16 blocks along seq        -> dK = dS₄ᵀ Q₄,  dQ = dS₄ K₄

Rounding: nearest (RNE) for all four. Q and K are activations that the forward and the
backward both read; stochastic rounding would add variance to every score without removing
any bias that matters (the softmax sees each score once, not a sum of many roundings of it),
and the two directions of one tensor would carry unrelated noise.

K-smoothing (``smooth=True``): the views of K are taken of ``K − mean_seq(K)``; the mean is
saved so the backward can project dK to zero seq-mean (the exact dK has zero seq-mean because
softmax is shift-invariant, so the projection only removes quantization error). When a path is
BF16 its views are the plain BF16 tensors with decode scale 1 (K unsmoothed: smoothing is a
quantization aid only).

Two backends produce bit-identical views: ``"reference"`` (``quant.per_head_view``, loops, CPU)
and ``"triton"`` (``triton_prologue.py``, one fused kernel for both directions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .quant import per_head_view, smooth_k


@dataclass
class QAttnViews:
    q_hd: torch.Tensor
    k_hd: torch.Tensor
    q_sq: torch.Tensor
    k_sq: torch.Tensor
    dec_q_hd: torch.Tensor   # [B, H]   FP32 decode scales (1 for a BF16 view)
    dec_k_hd: torch.Tensor   # [B, Hkv]
    dec_q_sq: torch.Tensor   # [B, H]
    dec_k_sq: torch.Tensor   # [B, Hkv]
    k_mean: Optional[torch.Tensor]   # [B, Hkv, 1, D] FP32 when K-smoothing is on

    def nbytes(self) -> int:
        ts = (self.q_hd, self.k_hd, self.q_sq, self.k_sq,
              self.dec_q_hd, self.dec_k_hd, self.dec_q_sq, self.dec_k_sq)
        seen, total = set(), 0
        for t in ts + ((self.k_mean,) if self.k_mean is not None else ()):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def _amax_per_head(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax(dim=(2, 3)).to(torch.float32)


def make_views(q: torch.Tensor, k: torch.Tensor, *, qk_fp4: bool, ds_fp4: bool, smooth: bool,
               backend: str = "reference") -> QAttnViews:
    """Build the four views (see module docstring); values FP32 (reference) or BF16 (triton)."""
    b, h, _, _ = q.shape
    hk = k.shape[1]
    dev = q.device
    one_q = torch.ones(b, h, dtype=torch.float32, device=dev)
    one_k = torch.ones(b, hk, dtype=torch.float32, device=dev)
    any_fp4 = qk_fp4 or ds_fp4
    k_src, k_mean = (smooth_k(k) if (smooth and any_fp4) else (k, None))

    if backend == "triton" and any_fp4:
        from .triton_prologue import quantize_both_views
        q_hd, q_sq, dec_q = quantize_both_views(q, _amax_per_head(q))
        k_hd, k_sq, dec_k = quantize_both_views(k_src, _amax_per_head(k_src))
    elif any_fp4:
        q_hd, dec_q = per_head_view(q, "head_dim")
        q_sq, _ = per_head_view(q, "seq")
        k_hd, dec_k = per_head_view(k_src, "head_dim")
        k_sq, _ = per_head_view(k_src, "seq")
    plain_dtype = torch.bfloat16 if backend == "triton" else torch.float32
    qp, kp = q.to(plain_dtype), k.to(plain_dtype)
    if not any_fp4:
        return QAttnViews(qp, kp, qp, kp, one_q, one_k, one_q, one_k, None)
    # One dec per tensor is shared by its two quantized views; a BF16 view decodes with 1.
    hd = (q_hd, k_hd, dec_q, dec_k) if qk_fp4 else (qp, kp, one_q, one_k)
    sq = (q_sq, k_sq, dec_q, dec_k) if ds_fp4 else (qp, kp, one_q, one_k)
    return QAttnViews(hd[0], hd[1], sq[0], sq[1], hd[2], hd[3], sq[2], sq[3], k_mean)
