"""LoRA-SVD linear (recipe 1): ``W = W_res + β · L2 · L1``, principal subspace in BF16.

Shapes: ``x [..., in]`` flattened to ``X [T, in]``; ``W_res [out, in]`` (used through the
NVFP4 linear, :func:`fullstack_fp4.linear.nvfp4_linear`); ``L2 [out, r]``, ``L1 [r, in]``
(BF16 in a BF16 run, never quantized); ``β`` a fixed scalar.

Forward
-------
    Y = NVFP4(X, W_res) + β · (X L1ᵀ) L2ᵀ

i.e. the dense weight ``W = W_res + β L2 L1`` with only ``W_res`` seen through NVFP4 (fprop,
dgrad and wgrad quantized as in the NVFP4 linear recipe). The branch costs two thin GEMMs.

Initial split and realignment (randomized SVD)
----------------------------------------------
``W ≈ U S Vᵀ`` by randomized SVD (Halko–Martinsson–Tropp: Gaussian sketch with ``r + p``
columns, ``q`` power iterations with re-orthonormalisation, exact SVD of the small
projected matrix). The branch takes the top-r part, split **symmetrically**:

    L2 = U_r · diag(√(S_r/β)),   L1 = diag(√(S_r/β)) · V_rᵀ,   W_res = W − β L2 L1

Why symmetric: (i) the two factors are *balanced* (``L2ᵀL2 = L1L1ᵀ = S_r/β``), the invariant
manifold of gradient flow on a factorisation, so neither factor carries all the scale;
(ii) the Gram matrix of L2, which the backward factorises, is ``diag(S_r)/β`` with condition
number ``σ1/σr`` — the *square root* of what ``L2 = U S`` would give (``(σ1/σr)²``), and ``L2 =
U`` would make L1 carry the full dynamic range; (iii) both factors see the same relative BF16
rounding. ``W_res`` is computed *after* L2 has been rounded to its storage dtype, so it
absorbs that rounding: ``W_res + β L2 L1`` equals ``W`` up to the rounding of ``W_res`` and
``L1`` themselves. The split is exact by construction (``W_res`` is the difference), whatever
the accuracy of the randomized SVD; the SVD only decides *which* subspace is in BF16.

Backward: the subspace-constrained routing (our decision, argued here)
------------------------------------------------------------------------
Let ``G = dYᵀ X`` (``[out, in]``) be the gradient of the loss w.r.t. the dense ``W``.
Orthonormalise the column space of L2 by Cholesky-QR (:func:`cholesky_qr`):
``R = chol(L2ᵀ L2)`` (upper), ``Q = L2 R⁻¹`` (so ``QᵀQ = I`` and ``L2 = Q R``). Then

    g_Wres = (I − QQᵀ) G_q                  (G_q: the NVFP4 wgrad of W_res)
    g_L1   = (1/β) · R⁻¹ · Qᵀ G            (Qᵀ G = (dY Q)ᵀ X, computed in BF16/FP32, exact)
    g_L2   = 0                              (L2 is frozen between realignments)
    dX     = NVFP4-dgrad(dY, W_res) + β (dY L2) L1      (the true input gradient)

Why this routing:

* **It is an orthogonal split of G.** The first-order change of W that a gradient step on the
  three tensors causes is ``g_Wres + β (L2 g_L1 + g_L2 L1)`` (the Jacobian of
  ``(W_res, L1, L2) ↦ W``). With the routing above it is ``(I − QQᵀ)G + β Q R (1/β) R⁻¹ QᵀG
  = (I − QQᵀ)G + QQᵀG = G`` in the unquantized limit (``G_q = G``): the routed gradients
  sum to the dense gradient, the BF16 branch gets exactly the component of G inside the
  principal (column) subspace ``col(L2)``, and W_res exactly the rest — the two pieces are
  Frobenius-orthogonal, nothing is counted twice or lost. With NVFP4, the residual gets the
  orthogonal-complement part of the *quantized* wgrad, so the quantization noise inside the
  principal subspace is projected away, and the in-subspace part is computed from
  unquantized ``dY`` and ``X`` (it is cheap: ``dY Q`` is ``T×out×r``, then ``(dYQ)ᵀX``).
* **Why L2 gets no gradient.** Any update of the branch that stays inside ``col(L2)`` has
  the form ``Q·(something)``; a change of L2 outside its column space would move part of the
  out-of-subspace gradient into the branch, which is exactly what the constraint forbids, and
  a change inside it is only a reparametrisation of L1's job. So the subspace itself is held
  fixed between realignments and re-detected by the randomized SVD every
  ``realign_interval`` steps, where it follows the dominant directions of the *whole* W.
  ``L2`` is therefore a parameter with ``requires_grad=False``: no optimizer state, no weight
  decay. (Decoupled weight decay on L1 and W_res then shrinks W uniformly by ``(1 − ηλ)``,
  as for a dense weight; decaying L2 too would decay the principal part twice.)
* **Why ``R⁻¹`` (and not the plain LoRA gradient ``β L2ᵀ G``).** The plain gradient induces
  ``ΔW = β² L2 L2ᵀ G = β² Q R Rᵀ QᵀG``: the in-subspace update is distorted by the
  singular values of the branch (directions with large σ learn σ-times faster). Solving
  ``β L2 g_L1 = QQᵀG`` in the least-squares sense gives ``g_L1 = (1/β) (L2ᵀL2)⁻¹ L2ᵀ G =
  (1/β) R⁻¹ QᵀG``, the plain gradient preconditioned by the inverse Gram matrix (the
  "scaled gradient descent" of low-rank factorisation), whose induced update of W is the
  undistorted projection. The Cholesky factor needed for Q is the same one that solves it.

The Cholesky-QR is CholeskyQR2 in FP64 (two passes; the second removes the loss of
orthogonality of one pass). If the Cholesky fails or is numerically rank-deficient (pivot
ratio below 1e-4, i.e. cond(L2) ≳ 1e4; after a realignment cond(L2) = √(σ1/σr) of W), one
pass on the shifted Gram ``L2ᵀL2 + sI``, ``s = 1e-6 ‖L2‖₂²``, is used instead (a ridge
projection). ``Q = L2 R⁻¹`` is used in *both* routes, so the operator applied to G by the
residual route and the one induced by the branch route are the same
(``L2 (RᵀR)⁻¹ L2ᵀ``) and the routed gradients still sum to G; ``R⁻¹`` stays bounded. A zero
L2 gives ``Q = 0``: everything goes to W_res.

``exact=True`` replaces the NVFP4 GEMMs of the W_res path by exact matmuls (the
"unquantized limit" the tests and the merged-export check use).

Memory: besides what the NVFP4 linear saves (NVFP4 codes only), the branch saves ``X`` in its
input dtype (needed for ``(dY Q)ᵀ X``) and the factors.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .nvfp4_linear import nvfp4_linear

__all__ = ["cholesky_qr", "randomized_svd", "lora_svd_split", "lora_svd_linear",
           "LoRASVDLinearFunction", "merge", "route_gradient"]


_PIVOT_RATIO = 1e-4   # min/max diagonal of the Cholesky factor below this: treated as failed
_RIDGE = 1e-6         # shift = _RIDGE · ‖A‖₂² when it failed


def _chol_pass(a: torch.Tensor, allow_shift: bool = True):
    """One Cholesky-QR pass in FP64: ``R = chol(aᵀa [+ s I])``, ``Q = a R⁻¹``; returns
    ``(Q, R, shifted)``."""
    r = a.shape[1]
    gram = a.T @ a
    chol, info = torch.linalg.cholesky_ex(gram)
    d = torch.diagonal(chol)
    ok = int(info) == 0 and bool(torch.isfinite(chol).all()) and bool(d.min() > _PIVOT_RATIO * d.max())
    shifted = False
    if not ok and allow_shift:
        shift = max(_RIDGE * float(torch.linalg.matrix_norm(a, ord=2)) ** 2,
                    torch.finfo(torch.float64).tiny)
        eye = torch.eye(r, dtype=a.dtype, device=a.device)
        chol, info = torch.linalg.cholesky_ex(gram + shift * eye)
        while int(info) != 0:  # only when the Gram matrix itself is not finite-positive
            shift *= 100.0
            chol, info = torch.linalg.cholesky_ex(gram + shift * eye)
        shifted = True
    rr = chol.T  # upper
    q = torch.linalg.solve_triangular(rr, a, upper=True, left=False)  # a R⁻¹
    return q, rr, shifted


def cholesky_qr(a: torch.Tensor):
    """CholeskyQR2 of ``a [m, r]`` (m ≥ r): ``a = Q R``, ``QᵀQ ≈ I``, R upper triangular.

    Computed in FP64 (the Gram matrix is r×r; the cost is O(m r²)); returns FP32 ``Q, R``.
    Fallback when ``a`` is (numerically) rank-deficient — the Cholesky fails or its pivots
    fall below ``1e-4`` of the largest: one pass on the shifted Gram matrix
    ``aᵀa + s I`` with ``s = 1e-6 ‖a‖₂²``. Then ``a = Q R`` still holds exactly
    (``Q = a R⁻¹``), ``QQᵀ = a (aᵀa + sI)⁻¹ aᵀ`` is a ridge-regularised projection (a
    contraction, equal to the projection on the well-conditioned directions) and ``R⁻¹`` is
    bounded by ``1e3 / ‖a‖₂``, so the routed gradients stay finite and still sum to G.
    """
    a64 = a.detach().to(torch.float64)
    q, r1, shifted = _chol_pass(a64)
    if not shifted:
        q2, r2, shifted2 = _chol_pass(q, allow_shift=False)
        if not shifted2 and torch.isfinite(q2).all():
            q, r1 = q2, r2 @ r1
    return q.to(torch.float32), r1.to(torch.float32)


def randomized_svd(w: torch.Tensor, rank: int, *, oversample: int = 8, power_iters: int = 2,
                   generator: Optional[torch.Generator] = None):
    """Top-``rank`` SVD ``w ≈ U diag(S) Vᵀ`` by randomized range finding (FP32).

    Returns ``U [m, rank]``, ``S [rank]`` (descending), ``Vh [rank, n]``. Deterministic for a
    given generator state.
    """
    w = w.detach().to(torch.float32)
    m, n = w.shape
    k = min(rank + oversample, m, n)
    omega = torch.randn(n, k, generator=generator, device=w.device, dtype=torch.float32)
    y, _ = torch.linalg.qr(w @ omega)
    for _ in range(power_iters):
        z, _ = torch.linalg.qr(w.T @ y)
        y, _ = torch.linalg.qr(w @ z)
    b = y.T @ w  # [k, n]
    ub, s, vh = torch.linalg.svd(b, full_matrices=False)
    u = y @ ub
    return u[:, :rank], s[:rank], vh[:rank]


def lora_svd_split(w: torch.Tensor, rank: int, beta: float, *, oversample: int = 8,
                   power_iters: int = 2, generator: Optional[torch.Generator] = None,
                   factor_dtype: Optional[torch.dtype] = None):
    """Split ``w`` into ``(w_res, l2, l1)`` (all FP32 except l2, rounded to ``factor_dtype``).

    ``β l2 l1`` is the top-``rank`` part of ``w`` split symmetrically (see module docstring);
    ``w_res = w − β l2 l1`` computed after rounding l2, so the sum reproduces ``w``.
    """
    u, s, vh = randomized_svd(w, rank, oversample=oversample, power_iters=power_iters,
                              generator=generator)
    root = torch.sqrt(s.clamp(min=0) / beta)
    l2 = u * root
    if factor_dtype is not None:
        l2 = l2.to(factor_dtype).to(torch.float32)
    l1 = root[:, None] * vh
    w_res = w.detach().to(torch.float32) - beta * (l2 @ l1)
    return w_res, l2, l1


def merge(w_res: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor, beta: float,
          dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The dense weight ``W_res + β L2 L1`` (computed in FP32, returned in ``dtype``)."""
    w = w_res.detach().float() + beta * (l2.detach().float() @ l1.detach().float())
    return w.to(dtype if dtype is not None else w_res.dtype)


def route_gradient(g_q: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, l2: torch.Tensor,
                   beta: float):
    """The routing of the module docstring: ``(g_Wres, g_L1)`` in FP32.

    ``g_q`` the wgrad of W_res as its GEMM produced it (NVFP4 or exact), ``dy [T, out]`` and
    ``x [T, in]`` unquantized.
    """
    q, r = cholesky_qr(l2)
    g_q = g_q.float()
    g_res = g_q - q @ (q.T @ g_q)
    a = (dy.float() @ q).T @ x.float()          # Qᵀ G, [r, in]
    g_l1 = torch.linalg.solve_triangular(r, a, upper=True) / beta
    return g_res, g_l1


class LoRASVDLinearFunction(torch.autograd.Function):
    """``y = NVFP4(x, W_res) + β (x L1ᵀ) L2ᵀ`` with the routed backward (module docstring)."""

    @staticmethod
    def forward(ctx, x, w_res, l1, l2, beta, exact, generator, amax_reduce):
        in_f, out_f = w_res.shape[1], w_res.shape[0]
        if x.shape[-1] != in_f:
            raise ValueError(f"x last dim {x.shape[-1]} != in_features {in_f}")
        x2 = x.reshape(-1, in_f)
        ctx.inner = None
        if exact:
            y_res = x2 @ w_res.to(x2.dtype).T
        else:
            with torch.enable_grad():
                xd = x2.detach().requires_grad_(ctx.needs_input_grad[0])
                wd = w_res.detach().requires_grad_(True)
                y_inner = nvfp4_linear(xd, wd, generator=generator, amax_reduce=amax_reduce)
            ctx.inner = (y_inner, xd, wd)
            y_res = y_inner.detach()
        y = y_res + beta * ((x2 @ l1.to(x2.dtype).T) @ l2.to(x2.dtype).T)
        ctx.save_for_backward(x2, w_res, l1, l2)
        ctx.beta, ctx.exact, ctx.x_shape = beta, exact, x.shape
        return y.reshape(*x.shape[:-1], out_f)

    @staticmethod
    def backward(ctx, grad_out):
        x2, w_res, l1, l2 = ctx.saved_tensors
        beta = ctx.beta
        dy2 = grad_out.reshape(-1, w_res.shape[0])
        need_dx = ctx.needs_input_grad[0]
        dx_res = g_q = None
        if ctx.exact:
            if need_dx:
                dx_res = dy2.to(x2.dtype) @ w_res.to(x2.dtype)
            g_q = dy2.float().T @ x2.float()
        else:
            y_inner, xd, wd = ctx.inner
            inputs = (xd, wd) if need_dx else (wd,)
            grads = torch.autograd.grad(y_inner, inputs, dy2.to(y_inner.dtype))
            dx_res, g_q = (grads if need_dx else (None, grads[0]))
            ctx.inner = None
        dx = dw_res = dl1 = None
        if need_dx:
            branch = beta * ((dy2.to(x2.dtype) @ l2.to(x2.dtype)) @ l1.to(x2.dtype))
            dx = (dx_res + branch).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            g_res, g_l1 = route_gradient(g_q, dy2, x2, l2, beta)
            dw_res = g_res.to(w_res.dtype) if ctx.needs_input_grad[1] else None
            dl1 = g_l1.to(l1.dtype) if ctx.needs_input_grad[2] else None
        return dx, dw_res, dl1, None, None, None, None, None


def lora_svd_linear(x: torch.Tensor, w_res: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor,
                    beta: float, bias: Optional[torch.Tensor] = None, *, exact: bool = False,
                    generator: Optional[torch.Generator] = None,
                    amax_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
    """Functional LoRA-SVD linear: ``x [..., in]``, ``w_res [out, in]``, ``l1 [r, in]``,
    ``l2 [out, r]``. ``exact=True``: the W_res GEMMs unquantized. L2 never gets a gradient."""
    y = LoRASVDLinearFunction.apply(x, w_res, l1, l2, float(beta), bool(exact), generator,
                                    amax_reduce)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y
