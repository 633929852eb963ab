"""ROOT (arXiv 2511.20626) for plain 2-D torch params; ``ns_precision="nvfp4"`` is q_root.

The step of the ROOT authors' public training example (huawei-noah/noah-research,
``ROOT/examples/example_train.py``, class ``ROOT``), per weight ``W`` (rows × cols), gradient ``G``:

    M ← μ·M + G                                   (heavy-ball sum, μ = 0.95)
    D = G + μ·M            if nesterov else M      (Nesterov look-ahead, on by default)
    ε = quantile(|D|, 0.9) + 1e-9                  (of the update D itself)
    B = D − sign(D)·max(|D| − ε, 0) = clamp(D, −ε, ε)   (the outliers O are discarded)
    U = NS₅(B; shape-dependent (a, b, c)) · 0.2·sqrt(max(rows, cols))
    W ← W·(1 − lr·wd) − lr·U

The 0.2·sqrt(max(rows, cols)) factor gives the update an RMS of about 0.2 (an orthogonal
rows×cols matrix has RMS 1/sqrt(max)), AdamW's typical update RMS, so AdamW-like learning rates
apply (the reference multiplies the lr by it; the weight decay uses the unscaled lr, as here).
Default coefficients "root": ROOT's published shape table, Muon's triple for other shapes.

Where this step differs from the reference, and why (tested against an FP64 re-derivation of
the reference step in tests/fullstack_fp4/optim/test_reference_steps.py):
- NS precision: BF16 products (``ns_precision="bf16"``, as Muon's NS) where the reference runs
  its NS in the gradient's dtype (FP32): BF16 is the speed baseline Q-Root is measured against;
  the update differs by the BF16 NS error (~3–4 % relative on that test's matrices).
- Fused weights: a parameter with ``ns_split_sizes`` (megatron's fused QKV, SwiGLU's gate/up) is
  treated as its logical matrices: ε, NS and the shape factor per block (muon.py). The
  reference model keeps gate and up as separate weights (the same thing) but orthogonalises its
  fused QKV as one matrix.
- ε on more than 65536 entries: the 0.9 quantile of a fixed 64K-entry sample of |D|
  (``newton_schulz.abs_quantile``, ~0.3 % from the exact level); exact below, as in the reference
  (both interpolate linearly between order statistics).
- The rest of the model (embeddings, output layer, norms, biases) is megatron's AdamW (or QAdamW
  for q_root) with ``optimizer.beta1/beta2/eps`` and megatron's ``wd_mult`` (no weight decay on
  norms and biases), at ``optimizer.lr``; the reference's internal AdamW uses betas (0.9, 0.95),
  eps 1e-8, the same lr as ROOT and weight decay on every parameter.
"""

from __future__ import annotations

import math

import torch

from .muon import OrthogonalOptimizer
from .newton_schulz import abs_quantile

__all__ = ["Root"]

EPS_FLOOR = 1e-9   # added to the quantile, as in the reference (keeps ε > 0 for a zero update)


class Root(OrthogonalOptimizer):
    def __init__(self, params, lr=1e-3, momentum=0.95, nesterov=True, weight_decay=0.0,
                 eps_quantile=0.9, ns_steps=5, ns_precision="bf16", ns_coefficients="root",
                 ns_clip_percentile=None, ns_backend="auto", ns_nvfp4_terms=None,
                 ns_cuda_graph=False):
        if not 0 < eps_quantile <= 1:
            raise ValueError(f"eps_quantile must be in (0, 1], got {eps_quantile}")
        super().__init__(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                         ns_steps=ns_steps, ns_precision=ns_precision,
                         ns_coefficients=ns_coefficients, ns_clip_percentile=ns_clip_percentile,
                         ns_backend=ns_backend, ns_nvfp4_terms=ns_nvfp4_terms,
                         ns_cuda_graph=ns_cuda_graph,
                         defaults_extra=dict(nesterov=nesterov, eps_quantile=eps_quantile))

    def _momentum(self, g, state, group):
        mu = group["momentum"]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(g)
        buf = state["momentum_buffer"]
        buf.mul_(mu).add_(g)
        return g.add(buf, alpha=mu) if group["nesterov"] else buf

    def _pre_ns(self, d_block, group):
        """B = clamp(D, −ε, ε), ε the ``eps_quantile`` quantile of |D| (+1e-9), per block
        (exact up to 65536 entries, a fixed 64K sample above: ``abs_quantile``)."""
        eps = (abs_quantile(d_block, group["eps_quantile"]) + EPS_FLOOR).to(d_block.dtype)
        return d_block.clamp(-eps, eps)

    def _scale(self, rows, cols, group) -> float:
        return 0.2 * math.sqrt(max(rows, cols))

    def load_state_dict(self, state_dict):
        stale = [g for g in state_dict.get("param_groups", []) if "eps_source" in g]
        if stale:
            raise ValueError("this Root optimizer state was saved by a Root variant this version "
                             "does not implement (plain momentum clamped at the quantile of |G|, "
                             "`eps_source` in its param groups); its step differs from the "
                             "reference step taken now: resume it with the version that wrote "
                             "it, or start the optimizer fresh")
        super().load_state_dict(state_dict)
