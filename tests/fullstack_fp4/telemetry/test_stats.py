"""Statistics against direct computation; the sampled estimator against the full value.

Statistical bounds (all seeds fixed, so the tests are deterministic; the bounds say why they
pass for *any* seed with overwhelming probability):
  * unbiasedness of the numerator / denominator: the mean of M = 400 independent estimates
    (N/n) Σ_s E lies within 4 standard errors (sample std / sqrt(M)) of the full Σ E
    (two-sided Gaussian tail at 4σ: 6e-5 per check);
  * the ratio estimator: a single n = 256 sample lies within 5 delta-method standard errors
    sqrt(Var(E - ρX)/n)/mean(X) of ρ, and the mean of M estimates within 4 of its own standard
    errors plus the O(1/n) bias bound 3·(CV(X)² + |cov|)/n.
"""
from __future__ import annotations

import math

import pytest
import torch

from fullstack_fp4.nvfp4 import dequantize, quantize
from fullstack_fp4.telemetry import (nvfp4_qdq, rel_err, sampled_rel_err, sampled_sums, snr_db,
                                     snr_db_from_rel_err)


def _x(shape=(64, 256), seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g))
    if outliers:  # heavy-tailed blocks: makes per-block errors vary a lot (a harder estimator)
        x.view(-1)[torch.randint(x.numel(), (40,), generator=g)] *= 30
    return x


def test_rel_err_and_snr_direct():
    x = torch.tensor([[3.0, 4.0]])
    xq = torch.tensor([[3.0, 3.0]])
    assert float(rel_err(x, xq)) == pytest.approx(1 / 5)
    assert float(snr_db(x, xq)) == pytest.approx(10 * math.log10(25 / 1))
    assert float(snr_db_from_rel_err(rel_err(x, xq))) == pytest.approx(float(snr_db(x, xq)), rel=1e-6)
    assert snr_db_from_rel_err(0.0) == math.inf
    y = torch.randn(8, 32, dtype=torch.bfloat16)
    yq = y + 0.01
    d = (y.float() - yq.float())
    assert float(rel_err(y, yq)) == pytest.approx(float(d.norm() / y.float().norm()), rel=1e-6)


@pytest.mark.parametrize("scale_rule", ["6", "4over6"])
@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])
def test_all_blocks_equals_full_tensor_quantization(tile, scale_rule):
    """n >= N: every block once, quantized alone at the full tensor's amax == full quantization
    (under 4over6 too: its 4-or-6 choice is per block / per tile)."""
    x = _x((48, 128))
    xq = dequantize(quantize(x, tile=tile, scale_rule=scale_rule))
    full = rel_err(x, xq)
    qdq = nvfp4_qdq(global_amax=x.abs().amax(), tile=tile, scale_rule=scale_rule)
    e2, x2, n, n_total = sampled_sums(x, qdq, blocks=10**9, tile=tile)
    assert n == n_total == x.numel() // (tile[0] * tile[1])
    torch.testing.assert_close(e2, (x - xq).pow(2).sum(), rtol=1e-5, atol=0)
    torch.testing.assert_close(x2, x.pow(2).sum(), rtol=1e-5, atol=0)
    torch.testing.assert_close(sampled_rel_err(x, qdq, blocks=10**9, tile=tile), full, rtol=1e-5, atol=0)
    if scale_rule == "4over6":   # the rule changes the error by far more than the tolerance
        other = rel_err(x, dequantize(quantize(x, tile=tile)))
        assert abs(float(other / full) - 1) > 1e-3


def test_nvfp4_qdq_4over6_is_the_reference_quantizer():
    """A sample of whole blocks through ``nvfp4_qdq(scale_rule="4over6")`` equals the reference
    quantize-dequantize of those rows at the same tensor amax, bit for bit (1×16 and 16×16,
    nearest and stochastic with the same generator draws, with and without the RHT)."""
    from fullstack_fp4.nvfp4 import DEFAULT_SIGNS, hadamard16
    from fullstack_fp4.nvfp4.reference import quantize_reference
    from fullstack_fp4.telemetry.stats import inverse_rht16

    x = _x((32, 64), seed=4)
    for tile in ((1, 16), (16, 16)):
        for rounding in ("nearest", "stochastic"):
            for signs in (None, DEFAULT_SIGNS):
                src = x if signs is None else hadamard16(x, signs)
                amax = src.abs().amax() * 1.5
                got = nvfp4_qdq(global_amax=amax, tile=tile, rounding=rounding, rht_signs=signs,
                                scale_rule="4over6",
                                generator=torch.Generator().manual_seed(9))(x)
                q = quantize_reference(src, global_amax=amax, tile=tile, rounding=rounding,
                                       scale_rule="4over6", generator=torch.Generator().manual_seed(9))
                want = dequantize(q).float()
                want = want if signs is None else inverse_rht16(want, signs)
                assert torch.equal(got, want), (tile, rounding, signs is None)


def test_gather_is_block_exact_on_noncontiguous_3d():
    x = _x((64, 128)).reshape(8, 8, 128)   # megatron's [s, b, h]
    xt = x.transpose(0, 1)                 # non-contiguous view: no full copy is needed
    qdq = nvfp4_qdq(global_amax=x.abs().amax())
    full = rel_err(xt, dequantize(quantize(xt.contiguous())))
    torch.testing.assert_close(sampled_rel_err(xt, qdq, blocks=10**9), full, rtol=1e-5, atol=0)


def _per_block(x, tile=(1, 16)):
    qdq = nvfp4_qdq(global_amax=x.abs().amax(), tile=tile)
    xb = x.reshape(-1, 16)
    e = (xb - qdq(xb)).pow(2).sum(1)
    return e, xb.pow(2).sum(1)


def test_sampled_sums_unbiased_and_ratio_consistent():
    x = _x()
    E, X = _per_block(x)
    N, n, M = E.numel(), 256, 400
    rho = float(E.sum() / X.sum())
    qdq = nvfp4_qdq(global_amax=x.abs().amax())
    g = torch.Generator().manual_seed(1)
    est_e, est_x, ratios = [], [], []
    for _ in range(M):
        e2, x2, n_s, n_tot = sampled_sums(x, qdq, blocks=n, generator=g)
        assert n_s == n and n_tot == N
        est_e.append(float(e2) * N / n)
        est_x.append(float(x2) * N / n)
        ratios.append(float(e2 / x2))
    est_e, est_x, ratios = map(torch.tensor, (est_e, est_x, ratios))
    for est, truth in ((est_e, float(E.sum())), (est_x, float(X.sum()))):
        se = float(est.std()) / math.sqrt(M)
        assert abs(float(est.mean()) - truth) < 4 * se, (float(est.mean()), truth, se)
    # ratio: delta-method standard error of one estimate, and a bias bound O(1/n)
    se1 = float((E - rho * X).std()) / math.sqrt(n) / float(X.mean())
    assert abs(float(ratios[0]) - rho) < 5 * se1
    cvx2 = float(X.var() / X.mean() ** 2)
    cov = abs(float(((E - E.mean()) * (X - X.mean())).mean() / (E.mean() * X.mean())))
    bias_bound = 3 * rho * (cvx2 + cov) / n
    se_mean = float(ratios.std()) / math.sqrt(M)
    assert abs(float(ratios.mean()) - rho) < 4 * se_mean + bias_bound
    # and rel_err = sqrt(ratio) of a large sample is close to the full value
    r = float(sampled_rel_err(x, qdq, blocks=N // 2, generator=g))
    assert r == pytest.approx(math.sqrt(rho), rel=0.1)
