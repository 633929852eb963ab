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
projected matrix). The branch takes the top-r part with an **orthonormal** L2:

    L2 = U_r,   L1 = diag(S_r) V_rᵀ / β,   W_res = W − β L2 L1

Why orthonormal (and not the balanced ``L2 = U√(S/β)``, ``L1 = √(S/β)Vᵀ``): the optimizer is
Adam, which moves every element of L1 by about ``η`` per step whatever the gradient's scale.
The induced change of W is ``β L2 ΔL1``: with L2 = U it is ``β U ΔL1``, i.e. the coordinates of
W's update in the principal directions move by ``β η``, for every direction, at every point of
training, so β *is* the branch's learning-rate multiplier. With the balanced split it is ``U
diag(√(βσ_k)) ΔL1``: a multiplier ``√(βσ_k)``, non-uniform and tied to W's spectrum (≈
0.02(√m+√n) at init, growing during training and jumping at each realignment). That step comes
*on top of* W_res's own Adam update, which (normalised elementwise) already moves W inside the
subspace by about what dense Adam would; so a large β over-steps the subspace. Measured in the
unquantized limit (4 layers × 256, 200 steps on the quickstart corpus, docs/lora-svd.md):
val-loss gap to BF16 +1.16% at β = 1, +0.83% at β = 0.5, +0.39% at β = 0.25; the balanced split
at β = 1 (multiplier ≈ 0.5–0.9) gave +0.70%. Hence β well below 1 (0.25 recommended). (All of
this concerns the projected route; under the dense route L1 gets no gradient and β only sets
L1's scale.) At the ablation width (8 × 512, docs/lora-svd.md) the unquantized recipe at β =
0.25 still trails BF16 by a gap that grows with training (+2.0% validation loss at step 150 on
the CPU, +2.1% at step 300 on the H200): these are the projected route's dynamics, not NVFP4's,
and the dense route (the default, below) removes them. Also ``L2ᵀL2 = I`` up to L2's BF16
rounding, so the Gram matrix the backward factorises has condition number ≈ 1 and ``R ≈ I``. L1
carries the dynamic range ``S``; it is a floating-point tensor, so that costs nothing.
``W_res`` is computed *after* L2 has been rounded to its storage dtype, so it absorbs that
rounding: ``W_res + β L2 L1`` equals ``W`` up to the rounding of ``W_res`` and ``L1``
themselves. The split is exact by construction (``W_res`` is the difference), whatever the
accuracy of the randomized SVD; the SVD only decides *which* subspace is in BF16.

Backward, projected route (``route="projected"``: the paper's routing, argued here)
------------------------------------------------------------------------------------
The default is the dense route (next section); this one is kept as the paper's method and as
the diagnostic of its dynamics.

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
  unquantized ``dY`` and ``X`` (it is cheap: rank-r products, see "What runs when").
* **Why L2 gets no gradient.** Any update of the branch that stays inside ``col(L2)`` has
  the form ``Q·(something)``; a change of L2 outside its column space would move part of the
  out-of-subspace gradient into the branch, which is exactly what the constraint forbids, and
  a change inside it is only a reparametrisation of L1's job. So the subspace itself is held
  fixed between realignments and re-detected by the randomized SVD every
  ``realign_interval`` steps, where it follows the dominant directions of the *whole* W.
  ``L2`` is therefore a parameter with ``requires_grad=False``: no optimizer state, no weight
  decay. (Decoupled weight decay on L1 and W_res then shrinks W uniformly by ``(1 − ηλ)``,
  as for a dense weight; decaying L2 too would decay the principal part twice.)
  Freezing L2 does not restrict what W can learn: W_res receives the whole out-of-subspace
  gradient, so the sum of the routed updates reaches every direction a dense W could. L2 only
  decides *which* part of W is carried in BF16; the realignment makes it follow W's dominant
  directions (in short runs it cost more than it brought, see docs/lora-svd.md).
* **Why ``R⁻¹`` (and not the plain LoRA gradient ``β L2ᵀ G``).** The plain gradient induces
  ``ΔW = β² L2 L2ᵀ G = β² Q R Rᵀ QᵀG``: the in-subspace update is distorted by the
  singular values of the branch (directions with large σ learn σ-times faster). Solving
  ``β L2 g_L1 = QQᵀG`` in the least-squares sense gives ``g_L1 = (1/β) (L2ᵀL2)⁻¹ L2ᵀ G =
  (1/β) R⁻¹ QᵀG``, the plain gradient preconditioned by the inverse Gram matrix (the
  "scaled gradient descent" of low-rank factorisation), whose induced update of W is the
  undistorted projection. The Cholesky factor needed for Q is the same one that solves it.
  (With the orthonormal split ``R ≈ I`` right after a split, so this matters only between the
  BF16 rounding of L2 and a degenerate L2; under Adam the per-element normalisation undoes
  row scalings of g_L1 anyway, and the split's scale is what sets the step — see above.)

The Cholesky-QR is CholeskyQR2 in FP64 (two passes; the second removes the loss of
orthogonality of one pass). If the Cholesky fails or is numerically rank-deficient (pivot
ratio below 1e-4, i.e. cond(L2) ≳ 1e4), one pass on the shifted Gram ``L2ᵀL2 + sI``,
``s = 1e-6 ‖L2‖₂²``, is used instead (a ridge projection). ``Q = L2 R⁻¹`` is used in *both*
routes, so the operator applied to G by the residual route and the one induced by the branch
route are the same (``L2 (RᵀR)⁻¹ L2ᵀ``) and the routed gradients still sum to G; ``R⁻¹`` stays
bounded. A zero L2 gives ``Q = 0``: everything goes to W_res.

Backward, dense route (``route="dense"``, the default; our choice, not the paper's)
----------------------------------------------------------------------------------
    g_Wres = G_q,   g_L1 = 0,   g_L2 = 0,   dX as above

W_res takes the whole NVFP4 wgrad and the branch holds still between realignments (a zero
gradient: Adam leaves L1 where it is except for weight decay, so ``W`` still decays uniformly).
Why offer it: Adam is elementwise, so ``Adam((I − QQᵀ)G) + β L2 Adam(g_L1)`` — the projected
route's update of W — is not dense Adam's ``Adam(G)``; inside the subspace W moves at a rate set
by β rather than by Adam's per-element normalisation of G. At the ablation width that difference
costs the projected route, *without any quantization*, a loss gap to BF16 that grows with
training (+2.1% validation loss at step 300 on the H200, docs/lora-svd.md), and β does not
remove it (0.1 and 0.25 alike). Under the dense route the unquantized limit *is* dense AdamW
(same gradient, same elementwise moments, same uniform decay; tested), so whatever gap is left
is the NVFP4 quantization of W_res — whose block scales no longer span W's top-r singular
values, the branch keeps them in BF16 (after each realignment: the top-r of the current W).
What it gives up: the branch does not learn between realignments, and W_res's wgrad keeps its
in-subspace quantization noise (the projected route removes it). At realignment W_res's
moments stay as they are (they are the dense W's moments) and L1's are reset.
Measured on the H200 ablation model (8 × 512, 300 steps, docs/lora-svd.md): validation loss
+2.33% against BF16 with the projected route (+2.14% unquantized), +0.30% to +0.88% with the
dense route over three runs, hence the default. The dense route is still not below the plain
NVFP4 linear: +0.42% / +0.46% in the same call as the dense route's +0.73% / +0.88%. Its
backward also skips the routing products (``QᵀG_q``, the rank-r update of ``G_q``,
``(dYQ)ᵀX``).

What runs when (cost)
---------------------
``(Q, R⁻¹)`` depend on L2 only, and L2 changes only at a split/realignment or a checkpoint
load: :class:`BasisCache` recomputes them when L2's storage or version counter changes, so
the Cholesky-QR (and its host syncs) runs once per realignment, not per micro-batch. Per
micro-batch, besides the NVFP4 GEMMs of W_res, all in the input dtype (BF16) with FP32
accumulation, no FP32 copies of ``dY``, ``X`` or ``G_q``:

* forward: ``x L1ᵀ`` (T·in·r) and ``addmm(y_res, ·, L2ᵀ, β)`` (T·r·out, fused with the sum);
* backward: ``P = dY L2`` (T·out·r) for the input gradient ``addmm(dX_res, P, L1, β)``
  (T·r·in) — all the dense route adds to the NVFP4 linear's backward — and, shared with it,
  the projected route's routing: ``dY Q = P R⁻¹`` (T·r², FP32, instead of a second T·out·r GEMM),
  ``QᵀG = (dYQ)ᵀX`` (T·r·in), ``g_L1 = R⁻¹QᵀG/β`` (r²·in, FP32), and
  ``g_Wres = addmm(G_q, −Q, QᵀG_q)`` (2·out·r·in, in G_q's dtype).

Numerics: the routed gradients are exact in FP32; in BF16 each product is rounded once, so the
in-subspace residual of ``g_Wres`` is ≈ 2⁻⁹ of the in-subspace part of ``G_q`` (instead of 0)
and ``g_L1`` carries the BF16 rounding of ``(dYQ)ᵀX`` — the same order as the BF16 gradient
tensors they are stored in. ``dY Q = P R⁻¹`` amplifies the rounding of P by cond(L2), which is
≈ 1 after a split (it would matter only for a near-degenerate L2, where the ridge bounds it).

``exact=True`` replaces the NVFP4 GEMMs of the W_res path by exact matmuls (the
"unquantized limit" the tests and the merged-export check use).

Gradient-accumulation fusion (``wgrad_accumulator``, the NVFP4 linear's
:class:`~fullstack_fp4.linear.nvfp4_linear.WgradAccumulator`): under the dense route
``g_Wres = G_q`` is the NVFP4 wgrad unchanged, so its epilogue adds ``acc·(ts_a·ts_b)`` straight
into the accumulator's buffer (megatron's ``main_grad``), rounded once, as the NVFP4 linear does;
with ``exact=True`` (the BF16 fallback's W_res path) the FP32 ``dYᵀX`` is added the same way
(``alpha = 1``). The projected route is **not** fused: ``g_Wres = G_q − Q(QᵀG_q)`` needs the
whole ``G_q`` before anything can be added (``QᵀG_q`` reduces over all its rows), so fusing it
would still materialise ``G_q`` and only move the final add; it refuses an accumulator.

Memory: the W_res GEMMs are the NVFP4 linear's forward/backward functions called directly (no
nested autograd graph), so they save what the NVFP4 linear saves, its 4-bit codes, and nothing
of their BF16 output. The branch adds the factors and, under the projected route only, ``X`` in
its input dtype (for ``(dY Q)ᵀ X``; a view of the layer input, shared with whatever else holds
it). The dense route's backward never reads ``X``, so it does not keep it.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from fullstack_fp4.nvfp4.gemm import scale_accumulate

from .nvfp4_linear import (WgradAccumulator, nvfp4_linear_backward, nvfp4_linear_forward,
                           pack_saved, scale_rules, unpack_saved)

__all__ = ["cholesky_qr", "randomized_svd", "lora_svd_split", "lora_svd_linear",
           "LoRASVDLinearFunction", "merge", "route_gradient", "subspace_basis", "BasisCache"]


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

    ``β l2 l1`` is the top-``rank`` part of ``w`` with **orthonormal** ``l2 = U_r`` and
    ``l1 = diag(S_r) V_rᵀ / β`` (see module docstring for why not the balanced split);
    ``w_res = w − β l2 l1`` computed after rounding l2, so the sum reproduces ``w``.
    """
    u, s, vh = randomized_svd(w, rank, oversample=oversample, power_iters=power_iters,
                              generator=generator)
    l2 = u
    if factor_dtype is not None:
        l2 = l2.to(factor_dtype).to(torch.float32)
    l1 = (s.clamp(min=0) / beta)[:, None] * vh
    w_res = w.detach().to(torch.float32) - beta * (l2 @ l1)
    return w_res, l2, l1


def merge(w_res: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor, beta: float,
          dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The dense weight ``W_res + β L2 L1`` (computed in FP32, returned in ``dtype``)."""
    w = w_res.detach().float() + beta * (l2.detach().float() @ l1.detach().float())
    return w.to(dtype if dtype is not None else w_res.dtype)


def subspace_basis(l2: torch.Tensor):
    """``(Q, R⁻¹)`` (FP32) of the Cholesky-QR ``L2 = Q R`` (:func:`cholesky_qr`; the
    ridge-shifted one when it fell back). All the backward needs from the orthonormalisation.
    It depends on L2 only, so layers cache it per L2 version (:class:`BasisCache`)."""
    q, r = cholesky_qr(l2)
    eye = torch.eye(r.shape[0], dtype=torch.float64, device=r.device)
    rinv = torch.linalg.solve_triangular(r.double(), eye, upper=True)
    return q, rinv.to(torch.float32)


class BasisCache:
    """:func:`subspace_basis` (L2) recomputed only when L2 changed (its storage or in-place
    version counter: L2 is written only by the split/realignment and by checkpoint loading)."""

    def __init__(self):
        self._key = None
        self._basis = None

    def get(self, l2: torch.Tensor):
        key = (l2.data_ptr(), l2._version, tuple(l2.shape), l2.device)
        if key != self._key:
            self._basis = subspace_basis(l2)
            self._key = key
        return self._basis


def _route(g_q, p, x, beta, basis):
    """The routing given ``p = dY L2`` (``[T, r]``, compute dtype): ``(g_Wres, g_L1)``.

    ``dY Q = p R⁻¹`` (a ``[T, r]·[r, r]`` product instead of a second ``T·out·r`` GEMM);
    ``QᵀG = (dY Q)ᵀ X``; ``g_L1 = (1/β) R⁻¹ QᵀG``; ``g_Wres = G_q − Q (Qᵀ G_q)``. The big
    products (``(dYQ)ᵀX``: T·r·in; ``QᵀG_q`` and the rank-r update: out·r·in each) run in the
    compute dtype with FP32 accumulation; ``g_Wres`` is one fused ``addmm`` in ``G_q``'s dtype.
    """
    q, rinv = basis
    dyq = (p.float() @ rinv).to(x.dtype)                    # dY Q            [T, r]
    a = (dyq.T @ x).float()                                 # Qᵀ G            [r, in]
    g_l1 = (rinv @ a) / beta
    qg = q.to(g_q.dtype)
    g_res = torch.addmm(g_q, qg, (qg.T @ g_q), alpha=-1.0)
    return g_res, g_l1


def route_gradient(g_q: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, l2: torch.Tensor,
                   beta: float, basis=None):
    """The routing of the module docstring: ``(g_Wres, g_L1)``.

    ``g_q`` the wgrad of W_res as its GEMM produced it (NVFP4 or exact), ``dy [T, out]`` and
    ``x [T, in]`` unquantized; ``basis`` = :func:`subspace_basis` (L2) if cached. Computed in
    ``x``'s dtype (FP32 accumulation); ``g_Wres`` in ``g_q``'s dtype, ``g_L1`` in FP32.
    """
    if basis is None:
        basis = subspace_basis(l2)
    return _route(g_q, dy.to(x.dtype) @ l2.to(x.dtype), x, beta, basis)


class LoRASVDLinearFunction(torch.autograd.Function):
    """``y = NVFP4(x, W_res) + β (x L1ᵀ) L2ᵀ`` with the routed backward (module docstring)."""

    @staticmethod
    def forward(ctx, x, w_res, l1, l2, beta, exact, generator, amax_reduce, basis, route,
                wgrad_accumulator=None, rules=None):
        in_f, out_f = w_res.shape[1], w_res.shape[0]
        if x.shape[-1] != in_f:
            raise ValueError(f"x last dim {x.shape[-1]} != in_features {in_f}")
        x2 = x.reshape(-1, in_f)
        need_dx = ctx.needs_input_grad[0]
        # G_q is needed for W_res's gradient, and for L1's under the projected route only
        need_gq = ctx.needs_input_grad[1] or (ctx.needs_input_grad[2] and route == "projected")
        ctx.meta = None
        if exact:
            y_res = x2 @ w_res.to(x2.dtype).T
            saved = [x2, w_res]
        else:
            # the NVFP4 GEMMs called directly (no nested autograd graph, which would keep y_res
            # alive until the backward): only their 4-bit codes are saved
            y_res, qw, qxt = nvfp4_linear_forward(x2, w_res, need_dx, need_gq, amax_reduce, rules)
            saved, ctx.meta = pack_saved(qw, qxt)
            # X in BF16 only where the backward reads it: the projected route's (dY Q)ᵀ X
            saved = [x2 if route == "projected" else None] + saved
        # branch: two thin GEMMs, the second fused with the sum (one pass over y)
        y = torch.addmm(y_res, x2 @ l1.to(x2.dtype).T, l2.to(x2.dtype).T, alpha=beta)
        ctx.save_for_backward(l1, l2, *saved)
        ctx.beta, ctx.exact, ctx.x_shape, ctx.basis, ctx.route = beta, exact, x.shape, basis, route
        ctx.x_dtype, ctx.w_dtype, ctx.need_gq = x2.dtype, w_res.dtype, need_gq
        ctx.generator, ctx.amax_reduce, ctx.rules = generator, amax_reduce, rules
        # fused only where g_Wres is the wgrad itself (dense route; see module docstring)
        ctx.wgrad_accumulator = (wgrad_accumulator
                                 if route == "dense" and ctx.needs_input_grad[1] else None)
        return y.reshape(*x.shape[:-1], out_f)

    @staticmethod
    def backward(ctx, grad_out):
        l1, l2, *saved = ctx.saved_tensors
        beta, x_dtype, w_dtype = ctx.beta, ctx.x_dtype, ctx.w_dtype
        dy2 = grad_out.reshape(-1, l2.shape[0]).to(x_dtype)
        need_dx = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        accumulator = ctx.wgrad_accumulator
        wgrad_into = accumulator.buffer() if accumulator is not None else None
        dx_res = g_q = None
        if ctx.exact:
            x2, w_res = saved
            if need_dx:
                dx_res = dy2 @ w_res.to(x_dtype)
            if ctx.need_gq:
                g_q = dy2.float().T @ x2.float()
                if wgrad_into is not None:
                    one = g_q.new_ones(())
                    scale_accumulate(g_q, one, one, wgrad_into)   # alpha = 1: g_q added exactly
        else:
            x2, codes = saved[0], saved[1:]
            qw, qxt = unpack_saved(codes, ctx.meta)
            dx_res, g_q = nvfp4_linear_backward(dy2, qw, qxt, x_dtype, w_dtype, ctx.generator,
                                                ctx.amax_reduce, wgrad_into=wgrad_into,
                                                scale_rule=ctx.rules)
        l2c = l2.to(x_dtype)
        p = dy2 @ l2c                                            # dY L2, [T, r]: shared
        dx = dw_res = dl1 = None
        if need_dx:
            dx = torch.addmm(dx_res.to(x_dtype), p, l1.to(x_dtype), alpha=beta)
            dx = dx.reshape(ctx.x_shape)
        if need_w and ctx.route == "dense":
            # W_res takes the whole gradient, the branch holds still (zero gradient: Adam moves
            # it by weight decay only, so W = W_res + β L2 L1 decays uniformly)
            if accumulator is not None:
                dw_res = accumulator.accumulated()   # G_q is in the accumulator's buffer already
            else:
                dw_res = g_q.to(w_dtype) if ctx.needs_input_grad[1] else None
            dl1 = torch.zeros_like(l1) if ctx.needs_input_grad[2] else None
        elif need_w:
            basis = ctx.basis if ctx.basis is not None else subspace_basis(l2)
            g_res, g_l1 = _route(g_q, p, x2, beta, basis)
            dw_res = g_res.to(w_dtype) if ctx.needs_input_grad[1] else None
            dl1 = g_l1.to(l1.dtype) if ctx.needs_input_grad[2] else None
        ctx.basis = None
        return dx, dw_res, dl1, None, None, None, None, None, None, None, None, None


def lora_svd_linear(x: torch.Tensor, w_res: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor,
                    beta: float, bias: Optional[torch.Tensor] = None, *, exact: bool = False,
                    route: str = "dense", generator: Optional[torch.Generator] = None,
                    amax_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                    basis=None, wgrad_accumulator: Optional[WgradAccumulator] = None,
                    scale_rule="6"):
    """Functional LoRA-SVD linear: ``x [..., in]``, ``w_res [out, in]``, ``l1 [r, in]``,
    ``l2 [out, r]``. ``exact=True``: the W_res GEMMs unquantized. L2 never gets a gradient.
    ``route``: ``"dense"`` (the default: W_res gets the whole wgrad ``G_q``, L1 a zero gradient)
    or ``"projected"`` (the paper's routing); both in the module docstring.
    ``basis``: :func:`subspace_basis` (L2), if the caller caches it (else computed in backward).
    ``wgrad_accumulator``: add W_res's gradient into its buffer instead of returning it (dense
    route only; module docstring, "Gradient-accumulation fusion"). ``scale_rule``: the W_res
    GEMMs' block-scale rules (:func:`fullstack_fp4.linear.nvfp4_linear.scale_rules`; ``w`` is
    W_res's)."""
    if route not in ("projected", "dense"):
        raise ValueError(f"route must be 'projected' or 'dense', got {route!r}")
    if wgrad_accumulator is not None and route != "dense":
        raise ValueError("wgrad_accumulator needs route='dense' (the projected route rewrites "
                         "the wgrad before use)")
    y = LoRASVDLinearFunction.apply(x, w_res, l1, l2, float(beta), bool(exact), generator,
                                    amax_reduce, basis, route, wgrad_accumulator,
                                    scale_rules(scale_rule))
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y
