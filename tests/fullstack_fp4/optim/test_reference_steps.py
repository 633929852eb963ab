"""Muon and Root against their public reference steps, re-derived here in FP64.

References (read from their public sources; re-written here, nothing imported):
- Muon: Keller Jordan's ``muon.py`` (``muon_update``): M ← lerp(M, G, 1 − μ); Nesterov
  D = lerp(G, M, μ); NS₅ (Muon's triple, X/(‖X‖_F + 1e-7), tall matrices transposed);
  U·sqrt(max(1, rows/cols)); W ← W(1 − lr·wd) − lr·U.
- Root: the ROOT authors' ``ROOT/examples/example_train.py`` (huawei-noah/noah-research):
  M ← μM + G; Nesterov D = G + μM; ε = 0.9 quantile of |D| (linear interpolation) + 1e-9;
  B = D − sign(D)·relu(|D| − ε); NS₅ with the shape table (Muon's triple elsewhere);
  W ← W(1 − lr·wd) − lr·0.2·sqrt(max(rows, cols))·U.

Each optimizer takes a few steps on one tall and one wide matrix with weight decay, Nesterov on,
on fixed heavy-tailed gradients (Student-t, 3 degrees of freedom: many entries far above the
0.9 quantile, so Root's clamp matters), and is compared with the reference:
- with its NS in FP64: the same step up to rounding (tolerance 1e-6 relative; Root's ε is
  computed in FP32, as in the reference, which moves entries clamped at ε by ~1e-7 relative);
- with its default BF16 NS: each step's update within 6 % (relative L2) of the reference's
  and pointing the same way (cosine ≥ 0.998). Why 6 %: BF16 keeps 8 significant bits (unit
  roundoff 2⁻⁹ ≈ 0.2 %); each of the 5 NS steps rounds three products and its output, and the
  quintic's slope near σ ≈ 1 (|f'| up to ~3 for Muon's triple) amplifies what earlier steps
  left, so the final error is a few percent: 2.0 % at 3072×8192
  (BENCHMARKS.md#newtonschulz-root-and-muon), 1.8–4.6 % on the 3b NS inputs and 5.1 % on
  average over small random matrices (fullstack_fp4/optim/ORTHOGONAL.md, "BF16 NS" rows). The
  variant the reference is not (Root clamping the plain momentum at the quantile of |G|) is
  43–52 % away on these gradients from the second step on (cosine 0.86–0.91) and fails
  this test (checked below); ours is 3–4 % away (cosine 0.9994).
"""
from __future__ import annotations

import math

import pytest
import torch

from fullstack_fp4.optim.muon import Muon
from fullstack_fp4.optim.root import Root

MUON_ABC = (3.4445, -4.7750, 2.0315)
ROOT_TABLE = {(2048, 2048): (3.4916, -4.8224, 2.1095), (2048, 3072): (3.4509, -4.5790, 1.9325),
              (2048, 8192): (2.9794, -3.6674, 1.6207), (2048, 16384): (3.1943, -3.8221, 1.5322)}
SHAPES = [(96, 40), (36, 88)]          # tall, wide
LR, WD, MU, STEPS = 0.02, 0.1, 0.95, 4


def ns64(G, abc):
    a, b, c = abc
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(5):
        A = X @ X.T
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.T if tall else X


def quantile64(x, q):
    """Linear interpolation between order statistics (the reference's ``simple_quantile``)."""
    s = x.flatten().sort().values
    pos = q * (s.numel() - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, s.numel() - 1)
    return s[lo] + (pos - lo) * (s[hi] - s[lo])


def muon_reference(W, grads):
    """W after each step (FP64), Keller Jordan's Muon."""
    W, M, out = W.double().clone(), torch.zeros_like(W, dtype=torch.float64), []
    for g in grads:
        g = g.double()
        M = M + (1 - MU) * (g - M)                    # lerp(M, G, 1 − μ)
        D = g + MU * (M - g)                          # lerp(G, M, μ)
        U = ns64(D, MUON_ABC) * max(1.0, W.shape[0] / W.shape[1]) ** 0.5
        W = W * (1 - LR * WD) - LR * U
        out.append(W.clone())
    return out


def root_reference(W, grads, form="reference"):
    """W after each step (FP64), the ROOT authors' step; ``form="grad_eps"``: plain momentum
    clamped at the quantile of |G| (the negative control)."""
    W, M, out = W.double().clone(), torch.zeros_like(W, dtype=torch.float64), []
    for g in grads:
        g = g.double()
        M = MU * M + g
        D = g + MU * M if form == "reference" else M
        eps = quantile64((D if form == "reference" else g).abs(), 0.9) + 1e-9
        B = D - torch.sign(D) * torch.relu(D.abs() - eps)
        abc = ROOT_TABLE.get((min(W.shape), max(W.shape)), MUON_ABC)
        U = ns64(B, abc) * 0.2 * math.sqrt(max(W.shape))
        W = W * (1 - LR * WD) - LR * U
        out.append(W.clone())
    return out


def heavy_grads(shape, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.distributions.StudentT(3.0)
    torch.manual_seed(seed)
    return [t.sample(shape).float() * 1e-2 for _ in range(STEPS)], torch.randn(shape, generator=g) * 0.05


def ours(cls, W0, grads, precision, dtype):
    p = torch.nn.Parameter(W0.to(dtype).clone())
    opt = cls([p], lr=LR, weight_decay=WD, momentum=MU, nesterov=True, ns_precision=precision)
    out = []
    for g in grads:
        p.grad = g.to(dtype).clone()
        opt.step()
        out.append(p.detach().double().clone())
    return out


def step_updates(W0, traj):
    """Each step's update U_t = (W_{t-1}(1 − lr·wd) − W_t) / lr."""
    prev, out = W0.double(), []
    for W in traj:
        out.append((prev * (1 - LR * WD) - W) / LR)
        prev = W
    return out


def rel(a, b):
    return float((a - b).norm() / b.norm())


def cos(a, b):
    return float((a * b).sum() / (a.norm() * b.norm()))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cls,reference", [(Muon, muon_reference), (Root, root_reference)])
def test_fp64_ns_takes_the_reference_step(cls, reference, shape):
    grads, W0 = heavy_grads(shape, 7 + shape[0])
    ref = reference(W0, grads)
    got = ours(cls, W0, grads, "fp64", torch.float64)
    for t, (u, r) in enumerate(zip(step_updates(W0, got), step_updates(W0, ref))):
        assert rel(u, r) < 1e-6, (t, rel(u, r))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cls,reference", [(Muon, muon_reference), (Root, root_reference)])
def test_bf16_ns_step_within_bf16_error_of_the_reference(cls, reference, shape):
    grads, W0 = heavy_grads(shape, 11 + shape[1])
    ref = reference(W0, grads)
    got = ours(cls, W0, grads, "bf16", torch.float32)
    for t, (u, r) in enumerate(zip(step_updates(W0, got), step_updates(W0, ref))):
        assert rel(u, r) < 0.06 and cos(u, r) >= 0.998, (t, rel(u, r), cos(u, r))


@pytest.mark.parametrize("shape", SHAPES)
def test_the_gradient_quantile_variant_fails_the_reference_tolerance(shape):
    """Negative control of the tolerance itself (both sides are this file's oracle, no shipped
    code): the tolerance above separates the reference step from the variant that clamps the
    plain momentum at the 0.9 quantile of |G| (no Nesterov), so a shipped step of that form
    would fail the tests above."""
    grads, W0 = heavy_grads(shape, 11 + shape[1])
    ref = step_updates(W0, root_reference(W0, grads))
    other = step_updates(W0, root_reference(W0, grads, form="grad_eps"))
    worst = max(rel(u, r) for u, r in zip(other[1:], ref[1:]))
    assert worst > 0.15, worst


def test_root_nesterov_off_clamps_the_momentum_at_its_own_quantile():
    """nesterov=False: D = M (the reference's other branch), ε from |M|."""
    torch.manual_seed(0)
    W0, g1, g2 = torch.randn(24, 40), torch.randn(24, 40), torch.randn(24, 40)
    p = torch.nn.Parameter(W0.double().clone())
    opt = Root([p], lr=LR, momentum=MU, nesterov=False, ns_precision="fp64")
    for g in (g1, g2):
        p.grad = g.double()
        opt.step()
    M = MU * g1.double() + g2.double()
    W1 = W0.double() - LR * 0.2 * math.sqrt(40) * ns64(
        _clamp(g1.double()), MUON_ABC)
    W2 = W1 - LR * 0.2 * math.sqrt(40) * ns64(_clamp(M), MUON_ABC)
    assert rel(p.detach(), W2) < 1e-6


def _clamp(D):
    eps = quantile64(D.abs(), 0.9) + 1e-9
    return D.clamp(-eps, eps)


def test_root_refuses_the_state_of_the_gradient_quantile_variant():
    p = torch.nn.Parameter(torch.zeros(8, 8))
    opt = Root([p])
    sd = opt.state_dict()
    sd["param_groups"][0]["eps_source"] = "grad"
    with pytest.raises(ValueError, match="eps_source"):
        opt.load_state_dict(sd)
