"""qdq_rows (many samples, one tensor scale per row) against one quantize/dequantize per sample."""
from __future__ import annotations

import pytest
import torch

from fullstack_fp4.nvfp4 import DEFAULT_SIGNS, dequantize, quantize
from fullstack_fp4.telemetry.batched_qdq import qdq_rows
from fullstack_fp4.telemetry.stats import inverse_rht16


def _samples(tile, seed=0):
    """Three samples of different magnitude (one with heavy outliers, one all-zero block),
    each with its own tensor amax that is larger than the sample's own (as for a sample drawn
    from a bigger tensor)."""
    g = torch.Generator().manual_seed(seed)
    th = tile[0]
    a = torch.randn(2 * th, 32, generator=g) * 1e-3
    b = torch.randn(th, 32, generator=g) * torch.exp(2 * torch.randn(th, 32, generator=g))
    c = torch.randn(3 * th, 32, generator=g) * 50.0
    c[:th, :16] = 0.0
    amax = [s.abs().amax() * f for s, f in zip((a, b, c), (1.0, 7.5, 3.0))]
    return [a, b, c], amax


# the kinds the collector quantizes (the RHT only with 1×16 blocks: the wgrad operands), and
# 16×16 with stochastic rounding for completeness
@pytest.mark.parametrize("tile,rounding,rht", [((1, 16), "nearest", False), ((1, 16), "stochastic", False),
                                               ((1, 16), "nearest", True), ((1, 16), "stochastic", True),
                                               ((16, 16), "nearest", False), ((16, 16), "stochastic", False)])
def test_qdq_rows_is_the_per_sample_composition_bit_for_bit(tile, rounding, rht):
    parts, amax = _samples(tile)
    x = torch.cat(parts)
    gam = torch.cat([a.reshape(1).expand(p.shape[0]) for p, a in zip(parts, amax)])
    rand = torch.rand(x.shape, generator=torch.Generator().manual_seed(5))
    signs = DEFAULT_SIGNS if rht else None
    got = qdq_rows(x, gam, tile=tile, rounding=rounding, rand=rand, rht_signs=signs)
    want, lo = [], 0
    for p, a in zip(parts, amax):
        r = rand[lo: lo + p.shape[0]]
        lo += p.shape[0]
        q = dequantize(quantize(p, tile=tile, rounding=rounding, global_amax=a, rand=r,
                                rht_signs=signs, backend="reference"))
        want.append(inverse_rht16(q, signs) if rht else q)
    want = torch.cat(want)
    assert torch.equal(got, want)
    assert not torch.equal(got, x)        # it did quantize


def test_qdq_rows_rejects_bad_input():
    x = torch.randn(16, 32)
    with pytest.raises(ValueError):
        qdq_rows(x, torch.ones(15))
    with pytest.raises(ValueError):
        qdq_rows(torch.randn(8, 32), torch.ones(8), tile=(16, 16))
    with pytest.raises(ValueError):
        qdq_rows(x, torch.ones(16), rounding="stochastic")
