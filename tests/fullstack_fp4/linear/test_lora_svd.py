"""LoRA-SVD linear: forward formula, split/merge, Cholesky-QR, routed backward.

Oracles are independent of the code under test: FP64 matmuls, `torch.linalg.svd` / `qr` /
`lstsq`, autograd of the dense formula, and the (separately tested) NVFP4 linear.
"""
from __future__ import annotations

import pytest
import torch

from fullstack_fp4.linear import BufferAccumulator, nvfp4_linear
from fullstack_fp4.linear.lora_svd import (cholesky_qr, lora_svd_linear, lora_svd_split, merge,
                                           randomized_svd)

OUT, IN, R, T, BETA = 64, 96, 8, 48, 0.5


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _spectrum_matrix(m, n, s, seed=0):
    g = _gen(seed)
    u, _ = torch.linalg.qr(torch.randn(m, len(s), generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, len(s), generator=g, dtype=torch.float64))
    return (u * torch.as_tensor(s, dtype=torch.float64)) @ v.T


def _factors(dtype=torch.float32, seed=0):
    g = _gen(seed)
    w = torch.randn(OUT, IN, generator=g) * 0.05
    w_res, l2, l1 = lora_svd_split(w, R, BETA, generator=_gen(seed + 1))
    return w, w_res.to(dtype), l2.to(dtype), l1.to(dtype)


# ------------------------------------------------------------------ randomized SVD / split
def test_randomized_svd_matches_exact_svd():
    s = [10.0 * 0.7 ** i for i in range(40)]
    w = _spectrum_matrix(OUT, IN, s).float()
    u, sv, vh = randomized_svd(w, R, oversample=8, power_iters=2, generator=_gen(3))
    s_exact = torch.linalg.svdvals(w.double())[:R]
    torch.testing.assert_close(sv.double(), s_exact, rtol=1e-4, atol=1e-5)
    # the rank-R reconstruction is the best one (Eckart-Young): error = sigma_{R+1}
    err = torch.linalg.matrix_norm((w - (u * sv) @ vh).double(), ord=2)
    assert err == pytest.approx(s[R], rel=1e-3)
    u2, s2, vh2 = randomized_svd(w, R, generator=_gen(3))
    assert torch.equal(u, u2) and torch.equal(s2, sv) and torch.equal(vh, vh2)


def test_split_is_exact_orthonormal_and_takes_the_top_subspace():
    s = [5.0 * 0.8 ** i for i in range(60)]
    w = _spectrum_matrix(OUT, IN, s, seed=1).float()
    w_res, l2, l1 = lora_svd_split(w, R, BETA, generator=_gen(0))
    torch.testing.assert_close(w_res + BETA * l2 @ l1, w, rtol=0, atol=2e-6)
    # orthonormal split: L2ᵀL2 = I, β L1 L1ᵀ β = diag(S)²
    torch.testing.assert_close(l2.T @ l2, torch.eye(R), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.linalg.svdvals(BETA * l1.double()),
                               torch.tensor(s[:R], dtype=torch.float64), rtol=1e-3, atol=1e-5)
    # the branch is the best rank-R approximation: the residual keeps the tail of the spectrum
    assert torch.linalg.matrix_norm(w_res.double(), ord=2) == pytest.approx(s[R], rel=1e-3)


def test_split_with_bf16_factor_rounding_still_sums_to_w():
    w = torch.randn(OUT, IN, generator=_gen(4)) * 0.02
    w_res, l2, l1 = lora_svd_split(w, R, BETA, generator=_gen(5), factor_dtype=torch.bfloat16)
    assert torch.equal(l2, l2.to(torch.bfloat16).float())
    torch.testing.assert_close(w_res + BETA * l2 @ l1, w, rtol=0, atol=1e-7)


def test_merge_round_trip():
    w, w_res, l2, l1 = _factors()
    torch.testing.assert_close(merge(w_res, l1, l2, BETA), w, rtol=0, atol=1e-7)
    w2, w_res2, l2b, l1b = _factors(torch.bfloat16)
    m = merge(w_res2, l1b, l2b, BETA)
    assert m.dtype == torch.bfloat16
    # BF16: each of W_res, L1, L2 rounded once (relative 2^-9), the merge rounded once more
    assert (m.float() - w2).abs().max() <= 4 * 2 ** -9 * w2.abs().max()
    # split the merged weight again: same dense weight
    w_res3, l2c, l1c = lora_svd_split(merge(w_res, l1, l2, BETA), R, BETA, generator=_gen(9))
    torch.testing.assert_close(merge(w_res3, l1c, l2c, BETA), w, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ Cholesky-QR
def test_cholesky_qr_matches_householder_qr():
    a = torch.randn(OUT, R, generator=_gen(6)) * torch.logspace(0, -3, R)  # cond ~ 1e3
    q, r = cholesky_qr(a)
    torch.testing.assert_close(q.T @ q, torch.eye(R), rtol=0, atol=1e-5)
    torch.testing.assert_close(q @ r, a, rtol=0, atol=1e-6)
    assert torch.equal(r, torch.triu(r)) and (torch.diagonal(r) > 0).all()
    qh, rh = torch.linalg.qr(a.double())
    sign = torch.sign(torch.diagonal(rh))
    torch.testing.assert_close(q.double(), qh * sign, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["zero_column", "duplicate_columns", "zero"])
def test_cholesky_qr_rank_deficient_falls_back_and_stays_exact(kind):
    a = torch.randn(OUT, R, generator=_gen(7))
    if kind == "zero_column":
        a[:, 3] = 0
    elif kind == "duplicate_columns":
        a[:, 5] = a[:, 2]
    else:
        a.zero_()
    q, r = cholesky_qr(a)
    assert torch.isfinite(q).all() and torch.isfinite(r).all()
    torch.testing.assert_close(q @ r, a, rtol=0, atol=1e-5)
    # Q spans (a subset of) col(a) and QQᵀ is a contraction (no blow-up of the routed grads)
    assert torch.linalg.matrix_norm(q.double(), ord=2) <= 1 + 1e-3


# ------------------------------------------------------------------ forward
def test_forward_equals_formula_exact_and_nvfp4():
    _, w_res, l2, l1 = _factors()
    x = torch.randn(3, 16, IN, generator=_gen(8))
    y_exact = lora_svd_linear(x, w_res, l1, l2, BETA, exact=True)
    ref = x.double() @ w_res.double().T + BETA * (x.double() @ l1.double().T) @ l2.double().T
    torch.testing.assert_close(y_exact.double(), ref, rtol=1e-5, atol=1e-5)
    y = lora_svd_linear(x, w_res, l1, l2, BETA)
    ref_q = nvfp4_linear(x, w_res) + BETA * (x @ l1.T) @ l2.T
    torch.testing.assert_close(y, ref_q, rtol=1e-6, atol=1e-6)
    bias = torch.randn(OUT, generator=_gen(9))
    torch.testing.assert_close(lora_svd_linear(x, w_res, l1, l2, BETA, bias, exact=True),
                               y_exact + bias)


# ------------------------------------------------------------------ routed backward
# (the projected route, the paper's; the dense route, the default, is tested after it)
def _grads(x, dy, w_res, l1, l2, exact):
    x = x.clone().requires_grad_(True)
    w_res = w_res.clone().requires_grad_(True)
    l1 = l1.clone().requires_grad_(True)
    lora_svd_linear(x, w_res, l1, l2, BETA, exact=exact, route="projected").backward(dy)
    return x.grad, w_res.grad, l1.grad


@pytest.mark.parametrize("degenerate", [False, True])
def test_routed_gradients_sum_to_dense_gradient_unquantized(degenerate):
    _, w_res, l2, l1 = _factors(seed=2)
    if degenerate:  # a rank-deficient L2 exercises the shifted Cholesky path
        l2 = l2.clone()
        l2[:, 1] = l2[:, 0]
    x = torch.randn(T, IN, generator=_gen(10))
    dy = torch.randn(T, OUT, generator=_gen(11))
    dx, g_res, g_l1 = _grads(x, dy, w_res, l1, l2, exact=True)
    # oracle: the dense gradient of W = W_res + β L2 L1 via autograd in FP64
    w = (w_res.double() + BETA * l2.double() @ l1.double()).requires_grad_(True)
    xd = x.double().requires_grad_(True)
    (xd @ w.T).backward(dy.double())
    g = w.grad
    total = g_res.double() + BETA * l2.double() @ g_l1.double()
    torch.testing.assert_close(total, g, rtol=0, atol=1e-4 * g.abs().max())
    torch.testing.assert_close(dx.double(), xd.grad, rtol=0, atol=1e-4 * xd.grad.abs().max())
    # the split is the orthogonal one: residual ⟂ col(L2), branch = projection (Householder QR)
    qh, _ = torch.linalg.qr(l2.double())
    if not degenerate:
        proj = qh @ (qh.T @ g)
        torch.testing.assert_close(g_res.double(), g - proj, rtol=0, atol=1e-4 * g.abs().max())
        # g_L1 = least-squares solution of β L2 g_L1 = QQᵀG
        ls = torch.linalg.lstsq(BETA * l2.double(), proj).solution
        torch.testing.assert_close(g_l1.double(), ls, rtol=0, atol=1e-4 * ls.abs().max())
        inner = (g_res.double() * proj).sum() / (g.norm() ** 2)
        assert abs(float(inner)) < 1e-5
    else:  # residual ⟂ the (rank R-1) column space of L2
        u, sv, _ = torch.linalg.svd(l2.double(), full_matrices=False)
        basis = u[:, sv > 1e-6 * sv[0]]
        assert basis.shape[1] == R - 1
        assert (basis.T @ g_res.double()).abs().max() < 1e-4 * g.abs().max()


def test_routed_gradients_with_nvfp4_residual():
    _, w_res, l2, l1 = _factors(seed=3)
    x = torch.randn(T, IN, generator=_gen(12))
    dy = torch.randn(T, OUT, generator=_gen(13))
    dx_q, g_res_q, g_l1_q = _grads(x, dy, w_res, l1, l2, exact=False)
    dx_e, g_res_e, g_l1_e = _grads(x, dy, w_res, l1, l2, exact=True)
    # the branch gradient comes from unquantized dY and X: identical to the exact one
    torch.testing.assert_close(g_l1_q, g_l1_e, rtol=1e-5, atol=1e-6)
    # the residual gradient is orthogonal to the principal subspace
    qh, _ = torch.linalg.qr(l2.double())
    assert (qh.T @ g_res_q.double()).abs().max() < 1e-4 * g_res_q.abs().max()
    # and it is the NVFP4 wgrad, projected: within quantization noise of the exact one
    rel = (g_res_q - g_res_e).norm() / g_res_e.norm()
    assert 0 < rel < 0.4
    rel_dx = (dx_q - dx_e).norm() / dx_e.norm()
    assert 0 < rel_dx < 0.4
    assert l2.grad is None


def _grads_route(x, dy, w_res, l1, l2, exact, route, generator=None):
    x = x.clone().requires_grad_(True)
    w_res = w_res.clone().requires_grad_(True)
    l1 = l1.clone().requires_grad_(True)
    lora_svd_linear(x, w_res, l1, l2, BETA, exact=exact, route=route,
                    generator=generator).backward(dy)
    return x.grad, w_res.grad, l1.grad


def test_dense_route_gives_w_res_the_whole_gradient():
    _, w_res, l2, l1 = _factors(seed=5)
    x = torch.randn(T, IN, generator=_gen(15))
    dy = torch.randn(T, OUT, generator=_gen(16))
    dx, g_res, g_l1 = _grads_route(x, dy, w_res, l1, l2, True, "dense")
    # oracle: the dense gradient of W = W_res + β L2 L1 (autograd in FP64)
    w = (w_res.double() + BETA * l2.double() @ l1.double()).requires_grad_(True)
    xd = x.double().requires_grad_(True)
    (xd @ w.T).backward(dy.double())
    torch.testing.assert_close(g_res.double(), w.grad, rtol=0, atol=1e-5 * w.grad.abs().max())
    torch.testing.assert_close(dx.double(), xd.grad, rtol=0, atol=1e-5 * xd.grad.abs().max())
    assert torch.equal(g_l1, torch.zeros_like(l1))
    # unlike the projected route, W_res keeps the in-subspace part of G
    qh, _ = torch.linalg.qr(l2.double())
    assert (qh.T @ g_res.double()).norm() > 0.05 * g_res.norm()
    # with NVFP4: W_res's gradient is the NVFP4 linear's own wgrad (same SR draws)
    _, g_res_q, g_l1_q = _grads_route(x, dy, w_res, l1, l2, False, "dense", _gen(99))
    wq = w_res.clone().requires_grad_(True)
    nvfp4_linear(x.clone().requires_grad_(True), wq, generator=_gen(99)).backward(dy)
    assert torch.equal(g_res_q, wq.grad)
    assert torch.equal(g_l1_q, torch.zeros_like(l1))
    with pytest.raises(ValueError, match="route"):
        lora_svd_linear(x, w_res, l1, l2, BETA, route="sideways")


def test_no_grad_for_l2_and_dtype_of_grads_bf16():
    _, w_res, l2, l1 = _factors(torch.bfloat16, seed=4)
    x = torch.randn(T, IN, generator=_gen(14)).to(torch.bfloat16).requires_grad_(True)
    w_res.requires_grad_(True)
    l1.requires_grad_(True)
    y = lora_svd_linear(x, w_res, l1, l2, BETA, route="projected")
    assert y.dtype == torch.bfloat16
    y.float().square().mean().backward()
    assert x.grad.dtype == w_res.grad.dtype == l1.grad.dtype == torch.bfloat16
    assert l2.grad is None


def test_basis_cache_recomputes_only_when_l2_changes_and_matches_uncached_backward():
    from fullstack_fp4.linear.lora_svd import BasisCache

    _, w_res, l2, l1 = _factors(seed=5)
    l2 = l2.clone()
    cache = BasisCache()
    b1 = cache.get(l2)
    assert cache.get(l2) is b1                      # same L2: no recomputation
    q, rinv = b1
    qh, rh = torch.linalg.qr(l2.double())           # oracle: Householder QR
    sign = torch.sign(torch.diagonal(rh))
    torch.testing.assert_close(q.double(), qh * sign, rtol=0, atol=1e-5)
    torch.testing.assert_close(rinv.double(), torch.linalg.inv(rh * sign[:, None]), rtol=1e-4, atol=1e-5)
    l2.mul_(2.0)                                    # in-place write (what a realignment does)
    b2 = cache.get(l2)
    assert b2 is not b1
    torch.testing.assert_close(b2[1], b1[1] / 2, rtol=1e-5, atol=0)
    # the backward with the cached basis is the backward without it, bit for bit
    x = torch.randn(T, IN, generator=_gen(15))
    dy = torch.randn(T, OUT, generator=_gen(16))
    grads = []
    for basis in (None, cache.get(l2)):
        xx, wr, a = (t.clone().requires_grad_(True) for t in (x, w_res, l1))
        lora_svd_linear(xx, wr, a, l2, BETA, exact=True, basis=basis,
                        route="projected").backward(dy)
        grads.append((xx.grad, wr.grad, a.grad))
    for g0, g1 in zip(*grads):
        assert torch.equal(g0, g1)


@pytest.mark.parametrize("route", ["dense", "projected"])
def test_saved_for_backward_codes_not_bf16_activations(route):
    """What the autograd graph keeps between forward and backward (recorded by
    saved_tensors_hooks): the NVFP4 codes and the factors; X in BF16 only under the projected
    route (its (dY Q)ᵀ X), and never a tensor shaped like the output (y_res)."""
    _, w_res, l2, l1 = _factors(torch.bfloat16, seed=6)
    w_res.requires_grad_(True)
    l1.requires_grad_(True)
    x = torch.randn(T, IN, generator=_gen(17)).to(torch.bfloat16).requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = lora_svd_linear(x, w_res, l1, l2, BETA, route=route)
    bf16_x = [t for t in saved if t.dtype == torch.bfloat16 and t.shape == (T, IN)]
    assert len(bf16_x) == (1 if route == "projected" else 0)
    assert not [t for t in saved if t.shape == (T, OUT)]
    # the plain NVFP4 linear's codes: W's 16×16 codes (uint8, [OUT, IN/2]) and RHT(xᵀ)'s
    assert any(t.dtype == torch.uint8 and t.shape == (OUT, IN // 2) for t in saved)
    assert any(t.dtype == torch.uint8 and t.shape == (IN, T // 2) for t in saved)
    y.float().square().mean().backward()     # and the backward runs from exactly those
    assert x.grad is not None and w_res.grad is not None


# ------------------------------------------------- gradient-accumulation fusion (W_res wgrad)
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("buf_dtype", [torch.float32, torch.bfloat16])
def test_dense_route_fuses_w_res_wgrad_into_the_buffer(exact, buf_dtype):
    """Dense route: the buffer gets W_res's FP32 wgrad (the unfused gradient computed with an
    FP32 W_res: acc·alpha, or dYᵀX exact) added and rounded once; dX and L1's zero gradient
    unchanged; W_res's autograd gradient is accumulated()'s (None)."""
    _, w_res, l2, l1 = _factors(seed=6)
    x = torch.randn(T, IN, generator=_gen(17))
    dy = torch.randn(T, OUT, generator=_gen(18))
    dx_ref, g_ref, l1_ref = _grads_route(x, dy, w_res, l1, l2, exact, "dense", _gen(5))  # FP32 W_res
    b0 = torch.randn(OUT, IN, generator=_gen(19)).to(buf_dtype)
    sink = BufferAccumulator(b0.clone())
    xx, ww, ll = (t.clone().requires_grad_(True) for t in (x, w_res, l1))
    lora_svd_linear(xx, ww, ll, l2, BETA, exact=exact, route="dense", generator=_gen(5),
                    wgrad_accumulator=sink).backward(dy)
    assert ww.grad is None
    assert torch.equal(sink.buf, (b0.float() + g_ref).to(buf_dtype))
    assert torch.equal(xx.grad, dx_ref) and torch.equal(ll.grad, l1_ref)


def test_projected_route_refuses_a_wgrad_accumulator():
    _, w_res, l2, l1 = _factors(seed=7)
    x = torch.randn(T, IN, generator=_gen(20))
    with pytest.raises(ValueError, match="route='dense'"):
        lora_svd_linear(x, w_res, l1, l2, BETA, route="projected",
                        wgrad_accumulator=BufferAccumulator(torch.zeros(OUT, IN)))
