"""NVFP4 reference vs hand-computed examples.

Most cases pin the tensor scale to 1 by passing ``global_amax = 6 · 448 = 2688`` (then
``enc = dec = 1``), and put a 6 in the block so that the block scale is
``e4m3(6 · fp32(1/6)) = e4m3(1.0000000298 -> 1.0 in FP32) = 1``: the scaled values ``y`` are
then the inputs themselves and every code can be read off by hand.
"""

import math

import pytest
import torch

from fullstack_fp4.nvfp4 import E2M1_VALUES, quantize, unpack_codes

FP32_MAX = torch.finfo(torch.float32).max
UNIT = 2688.0   # global_amax giving enc = dec = 1 for the 6-rule
UNIT46 = 1536.0  # same for the 4/6 rule (256 · 6)


def q1(values, **kw):
    return quantize(torch.tensor(values, dtype=torch.float32).reshape(1, -1), **kw)


def test_every_positive_and_negative_code():
    # One block per sign; 6 is the block max so the block scale is exactly 1 (see docstring).
    pos = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.3, 0.7, 1.1, 1.6, 2.2, 2.9, 4.4, 5.9]
    want_pos = [0, 1, 2, 3, 4, 5, 6, 7, 1, 1, 2, 3, 4, 5, 6, 7]
    neg = [-v for v in pos]
    # -0.0 keeps code 0; every other negative value has the sign bit.
    want_neg = [0] + [c | 8 for c in want_pos[1:]]
    q = q1(pos + neg, global_amax=UNIT)
    assert q.block_scale.float().tolist() == [[1.0, 1.0]]
    assert q.tensor_scale.item() == 1.0
    assert q.codes().flatten().tolist() == want_pos + want_neg
    want_vals = [E2M1_VALUES[c] for c in want_pos]
    assert q.dequantize().flatten().tolist() == want_vals + [-v for v in want_vals]


def test_decode_of_every_code_by_hand():
    from fullstack_fp4.nvfp4.e2m1 import e2m1_decode

    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for dtype in (torch.uint8, torch.int32, torch.long):
        codes = torch.arange(16, dtype=dtype).reshape(2, 8)
        got = e2m1_decode(codes)
        assert got.dtype == torch.float32 and got.shape == (2, 8)
        assert got.flatten().tolist() == mags + [-m for m in mags]
        assert math.copysign(1.0, got[1, 0].item()) == -1.0   # code 8 is -0.0
        assert math.copysign(1.0, got[0, 0].item()) == 1.0
    # only the low 4 bits count (a byte that still holds its neighbour's nibble)
    assert e2m1_decode(torch.tensor([0x17, 0xF9], dtype=torch.uint8)).tolist() == [6.0, -0.5]


def test_every_tie_goes_to_even():
    # Midpoints 0.25 0.75 1.25 1.75 2.5 3.5 5 -> 0 1 1 2 2 4 4 (even mantissa), both signs.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0, 2, 2, 4, 4, 6, 6]
    block = ties + [-t for t in ties] + [6.0, 0.0]
    q = q1(block, global_amax=UNIT)
    assert q.block_scale.float().item() == 1.0
    # -0.25 rounds to zero but keeps its sign bit: code 8 (TE's cast_to_fp4x2 / hardware cvt).
    assert q.codes().flatten().tolist() == want + [c | 8 for c in want] + [7, 0]
    assert q.dequantize().flatten()[:7].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_just_off_the_ties():
    eps = 1e-3
    vals = [0.25 + eps, 0.75 - eps, 1.25 + eps, 1.75 - eps, 2.5 + eps, 3.5 - eps, 5 + eps, 6.0]
    q = q1(vals + [0.0] * 8, global_amax=UNIT)
    assert q.codes().flatten()[:8].tolist() == [1, 1, 3, 3, 5, 5, 7, 7]


def test_packing_layout_even_element_low_nibble():
    q = q1([0.5, 1.0, 6.0, -0.5] + [0.0] * 12, global_amax=UNIT)
    # codes 1, 2, 7, 9 -> bytes 0x21, 0x97
    assert q.data.dtype == torch.uint8 and q.data.shape == (1, 8)
    assert q.data[0, :2].tolist() == [0x21, 0x97]
    assert unpack_codes(q.data).flatten()[:4].tolist() == [1, 2, 7, 9]


def test_zero_block_and_zero_tensor():
    # Block 0 all zero, block 1 has data: block scale 0 and codes 0 for the zero block.
    q = q1([0.0] * 16 + [6.0] + [0.0] * 15, global_amax=UNIT)
    assert q.block_scale.float().tolist() == [[0.0, 1.0]]
    assert q.codes().flatten()[:16].tolist() == [0] * 16
    # All-zero tensor: TE's enc = min(2688 / 0 = inf, FP32_MAX) -> dec = 1 / FP32_MAX.
    z = quantize(torch.zeros(2, 32))
    assert z.tensor_scale.item() == (torch.tensor(1.0) / torch.tensor(FP32_MAX)).item()
    assert z.data.eq(0).all() and z.block_scale.float().eq(0).all()
    assert z.dequantize().eq(0).all()


def test_all_equal_blocks():
    # Block max 3 with unit tensor scale: s = e4m3(3 · fp32(1/6)) = 0.5, factor 2, y = 6.
    q = q1([3.0] * 16, global_amax=UNIT)
    assert q.block_scale.float().item() == 0.5
    assert q.codes().flatten().tolist() == [7] * 16
    assert q.dequantize().flatten().tolist() == [3.0] * 16
    # Local amax: enc = 2688/1.3, s = e4m3(1.3 · enc/6) = 448, every element -> -6 (code 15).
    q = q1([-1.3] * 16)
    assert q.block_scale.float().item() == 448.0
    assert q.codes().flatten().tolist() == [15] * 16
    assert torch.allclose(q.dequantize(), torch.full((1, 16), -1.3), rtol=1e-6, atol=0)


def test_block_scale_rounds_down_then_clamps():
    # bamax 5.2 with unit tensor scale: s = e4m3(5.2/6 = 0.8667) = 0.875 (E4M3 step 1/16 there),
    # factor 1/0.875: y(5.2) = 5.943 -> 6; y(3.4) = 3.886 -> 4; y(-1.0) = -1.143 -> -1.
    q = q1([5.2, 3.4, -1.0] + [0.0] * 13, global_amax=UNIT)
    assert q.block_scale.float().item() == 0.875
    assert q.codes().flatten()[:3].tolist() == [7, 6, 10]
    assert q.dequantize().flatten()[:3].tolist() == [6 * 0.875, 4 * 0.875, -0.875]


def test_subnormal_e4m3_block_scales():
    # E4M3 subnormals are m · 2^-9 (m = 1..7). Block max 6 · 2^-8 -> scale 2^-8 (m = 2);
    # block max 6 · 7 · 2^-9 -> scale 7 · 2^-9 (m = 7). Values on the grid times the scale
    # come back exactly.
    s1, s2 = 2.0 ** -8, 7 * 2.0 ** -9
    grid = [6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0] * 2
    vals = [g * s1 for g in grid] + [g * s2 for g in grid]
    q = q1(vals, global_amax=UNIT)
    assert q.block_scale.float().tolist() == [[s1, s2]]
    assert q.codes().flatten().tolist() == [7, 6, 5, 4, 3, 2, 1, 0] * 4
    assert q.dequantize().flatten().tolist() == pytest.approx(vals, rel=1e-6, abs=0)


def test_block_scale_underflows_to_zero():
    # bamax / 6 = 1e-8 < 2^-10 (half the smallest subnormal) -> scale 0. TE: encode factor
    # min(1/0, FP32_MAX) = FP32_MAX, so non-zero elements saturate to +-6 (codes 7/15) and all
    # decode to 0; zeros stay code 0.
    q = q1([6e-8, -3e-8, 0.0] + [0.0] * 13 + [6.0] + [0.0] * 15, global_amax=UNIT)
    assert q.block_scale.float().tolist() == [[0.0, 1.0]]
    assert q.codes().flatten()[:3].tolist() == [7, 15, 0]
    assert q.dequantize().flatten()[:16].abs().max().item() == 0.0


def test_explicit_global_amax_tensor_scale():
    # enc = fp32(2688 / 5) = 537.6, dec = fp32(1 / 537.6): 5 / 2688 up to FP32 rounding.
    q = q1([1.0] + [0.0] * 15, global_amax=5.0)
    enc = torch.tensor(2688.0) / torch.tensor(5.0)
    assert q.tensor_scale.dtype == torch.float32 and q.tensor_scale.dim() == 0
    assert q.tensor_scale.item() == (torch.tensor(1.0) / enc).item()
    assert math.isclose(q.tensor_scale.item(), 5 / 2688, rel_tol=2 ** -22)
    # block scale = e4m3(1 · (537.6 · fp32(1/6)) = 89.6) = 88 (E4M3 step 8 in [64, 128)).
    assert q.block_scale.float().item() == 88.0
    # An explicit global amax below the data's saturates the block scale at 448 and y at 6.
    q = q1([12.0] + [0.0] * 15, global_amax=1.0)
    assert q.block_scale.float().item() == 448.0 and q.codes()[0, 0].item() == 7


def test_four_over_six_picks_four_when_it_is_exact():
    # Unit tensor scale for "4over6" is global_amax = 256 · 6. Block on the 4-grid (max 4):
    # s4 = e4m3(4/4) = 1 -> exact (err 0); s6 = e4m3(4/6) = 0.6875 -> 3 becomes 2.75 (err > 0).
    block = [4.0, 3.0, 3.0, -2.0, 1.5, 0.5, 0.0, 1.0] * 2
    q = q1(block, scale_rule="4over6", global_amax=UNIT46)
    assert q.tensor_scale.item() == 1.0
    assert q.block_scale.float().item() == 1.0
    assert q.dequantize().flatten().tolist() == block
    q6 = q1(block, scale_rule="6", global_amax=UNIT46 * 448 / 256)
    assert q6.block_scale.float().item() == 0.6875


def test_four_over_six_picks_six_when_it_is_exact():
    # On the 6-grid (max 6): s6 = 1 exact; s4 = e4m3(6/4) = 1.5 turns 0.5 into 0.75.
    block = [6.0, 0.5, 1.0, 3.0, -4.0, 2.0, 0.0, 1.5] * 2
    q = q1(block, scale_rule="4over6", global_amax=UNIT46)
    assert q.block_scale.float().item() == 1.0
    assert q.dequantize().flatten().tolist() == block


def test_four_over_six_tie_goes_to_six():
    # [6, 0, ..., 0]: both candidates are exact (6 = 4 · 1.5), err4 == err6 == 0 -> keep 6.
    q = q1([6.0] + [0.0] * 15, scale_rule="4over6", global_amax=UNIT46)
    assert q.block_scale.float().item() == 1.0 and q.codes()[0, 0].item() == 7


def test_stochastic_rounding_on_grid_is_exact_and_uses_rand():
    # Values on the grid never move; 1.25 (frac 0.5 between 1 and 1.5) goes up iff u < 0.5.
    x = torch.tensor([[6.0, 1.0, 1.25, 1.25] + [0.0] * 12])
    u = torch.zeros_like(x)
    u[0, 2], u[0, 3] = 0.49, 0.5
    q = quantize(x, rounding="stochastic", rand=u, global_amax=UNIT)
    assert q.codes()[0, :4].tolist() == [7, 2, 3, 2]
