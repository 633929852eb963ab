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


# ----------------------------------------------------------------------------- the 4over6 rule
def _samples_4over6(tile, seed=0):
    """``_samples`` plus a sample whose magnitudes all lie in [0.7, 1] of its max, with random
    signs: scaled to 4 they round more finely than scaled to 6 (grid {3, 4} against {4, 6}), so
    the map-to-4 candidate wins there, while Gaussian blocks (16×16 tiles all the more) mostly
    keep the map-to-6 one."""
    parts, amax = _samples(tile, seed)
    g = torch.Generator().manual_seed(seed + 100)
    shape = (2 * tile[0], 32)
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    flat = sign * (0.7 + 0.3 * torch.rand(shape, generator=g)) * 0.02
    return parts + [flat], amax + [flat.abs().amax() * 2.0]


def _four_wins(p, amax, tile, got_scales):
    """(blocks where the map-to-4 candidate was kept, blocks where the map-to-6 one was) of
    ``p`` quantized under 4over6 at ``amax``: the kept E4M3 block scales ``got_scales`` against
    the two candidates (tensor scale with the bound 256); blocks whose candidates coincide are
    counted in neither."""
    from fullstack_fp4.nvfp4.reference import block_amax, scale_candidate, tensor_scales

    enc, dec = tensor_scales(torch.as_tensor(amax, dtype=torch.float32), "4over6")
    x3 = p.reshape(p.shape[0], -1, 16)
    bam = block_amax(p, tile)
    s4 = scale_candidate(x3, bam, enc, dec, 4.0)[0].float().reshape(got_scales.shape)
    s6 = scale_candidate(x3, bam, enc, dec, 6.0)[0].float().reshape(got_scales.shape)
    got = got_scales.float()
    differ = s4 != s6
    return int((differ & (got == s4)).sum()), int((differ & (got == s6)).sum())


@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("rht", [False, True])
def test_qdq_rows_4over6_is_the_reference_bit_for_bit(tile, rounding, rht):
    """Each sample (its own tensor amax) equals ``dequantize(quantize_reference(.., scale_rule=
    "4over6"))`` with the same uniforms; both candidates are kept in some blocks."""
    from fullstack_fp4.nvfp4 import hadamard16
    from fullstack_fp4.nvfp4.reference import quantize_reference

    parts, amax = _samples_4over6(tile, seed=3)
    x = torch.cat(parts)
    gam = torch.cat([a.reshape(1).expand(p.shape[0]) for p, a in zip(parts, amax)])
    rand = torch.rand(x.shape, generator=torch.Generator().manual_seed(7))
    signs = DEFAULT_SIGNS if rht else None
    got = qdq_rows(x, gam, tile=tile, rounding=rounding, rand=rand, rht_signs=signs,
                   scale_rule="4over6")
    want, lo, four, six = [], 0, 0, 0
    for p, a in zip(parts, amax):
        r = rand[lo: lo + p.shape[0]]
        lo += p.shape[0]
        src = hadamard16(p, signs) if rht else p
        q = quantize_reference(src, global_amax=a, tile=tile, rounding=rounding, rand=r,
                               scale_rule="4over6")
        d = dequantize(q).float()
        want.append(inverse_rht16(d, signs) if rht else d)
        f, s = _four_wins(src.float(), a, tile, q.block_scale)
        four, six = four + f, six + s
    want = torch.cat(want)
    assert torch.equal(got, want)
    assert four > 0 and six > 0, (four, six)        # the choice matters in this input
    six_rule = qdq_rows(x, gam, tile=tile, rounding=rounding, rand=rand, rht_signs=signs)
    assert not torch.equal(got, six_rule)


def test_qdq_rows_rejects_an_unknown_rule():
    with pytest.raises(ValueError, match="scale_rule"):
        qdq_rows(torch.randn(16, 32), torch.ones(16), scale_rule="4")
