"""ROOT (arXiv 2511.20626) for plain 2-D torch params; ``ns_precision="nvfp4"`` is q_root.

    M ← μ·M + G                                  (plain heavy-ball sum, as ROOT writes it)
    O = T_ε(M) = sign(M)·max(|M| − ε, 0)          (soft-threshold: the outliers, discarded)
    B = M − O = clamp(M, −ε, ε)                   (the robust part; only B is orthogonalised)
    U = NS₅(B; shape-dependent (a, b, c)) · 0.2·sqrt(max(rows, cols))
    W ← W·(1 − lr·wd) − lr·U

ε: the ``eps_quantile`` (0.9) quantile of |G| of the current gradient, as in ROOT's example
(DESIGN.md); exact up to 65536 entries, on a fixed 64K-entry sample above (``_quantile_abs``). Note what that implies: M ≈ G/(1 − μ) in steady state, so with μ = 0.95 most
entries of M exceed ε and B is close to ε·sign(M); ``eps_source="momentum"`` takes the quantile
of |M| instead (clamping only M's top 10 %), for experiments. Computed per logical block when
the param carries ``ns_split_sizes`` (each block's outliers are judged against its own scale).

The 0.2·sqrt(max(rows, cols)) factor gives the update an RMS of about 0.2 (an orthogonal
rows×cols matrix has RMS 1/sqrt(max)), i.e. AdamW's typical update RMS, so AdamW learning rates
transfer. Default coefficients "root": ROOT's published shape table, Muon's triple elsewhere.
"""

from __future__ import annotations

import math

import torch

from .muon import OrthogonalOptimizer
from .newton_schulz import abs_quantile

__all__ = ["Root"]


def _quantile_abs(x: torch.Tensor, q: float) -> torch.Tensor:
    """q-quantile of |x| (torch.quantile's interpolation): exact up to 65536 entries, above
    that on a fixed, evenly spread 64K-entry sample (``newton_schulz.abs_quantile``; the
    full-matrix CUDA kthvalue this replaces runs one thread block per matrix and made the
    4-block 3b Root step 5.8 s). ε is a soft-threshold level: the sample's rank error
    (std 0.0012 at q = 0.9) moves it by ~0.3 %."""
    return abs_quantile(x, q)


class Root(OrthogonalOptimizer):
    def __init__(self, params, lr=1e-3, momentum=0.95, weight_decay=0.0, eps_quantile=0.9,
                 eps_source="grad", ns_steps=5, ns_precision="bf16", ns_coefficients="root",
                 ns_clip_percentile=None, ns_backend="auto", ns_nvfp4_terms=None,
                 ns_cuda_graph=False):
        if eps_source not in ("grad", "momentum"):
            raise ValueError(f"eps_source must be grad | momentum, got {eps_source!r}")
        super().__init__(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                         ns_steps=ns_steps, ns_precision=ns_precision,
                         ns_coefficients=ns_coefficients, ns_clip_percentile=ns_clip_percentile,
                         ns_backend=ns_backend, ns_nvfp4_terms=ns_nvfp4_terms,
                         ns_cuda_graph=ns_cuda_graph, defaults_extra=dict(eps_quantile=eps_quantile, eps_source=eps_source))

    def _momentum(self, g, state, group):
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(g)
        buf = state["momentum_buffer"]
        buf.mul_(group["momentum"]).add_(g)
        return buf

    def _pre_ns_reads_grad(self, group) -> bool:
        return group["eps_source"] == "grad"

    def _pre_ns(self, m_block, g_block, group):
        src = g_block if group["eps_source"] == "grad" else m_block
        eps = _quantile_abs(src, group["eps_quantile"]).to(m_block.dtype)
        return m_block.clamp(-eps, eps)

    def _scale(self, rows, cols, group) -> float:
        return 0.2 * math.sqrt(max(rows, cols))
