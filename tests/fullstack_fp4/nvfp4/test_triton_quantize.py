"""Triton NVFP4 quantize / dequantize kernels vs the pure-PyTorch reference (the oracle), bit for bit.

Runs on CUDA when present, else on CPU under the Triton interpreter (``TRITON_INTERPRET=1``,
which ``make test`` sets); skipped otherwise. The reference always runs on CPU. Shapes are small
so the whole file stays well under a minute in the interpreter.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton not installed")

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not (_INTERPRET or torch.cuda.is_available()):
    pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 (CPU interpreter)",
                allow_module_level=True)

from fullstack_fp4.nvfp4 import DEFAULT_SIGNS, NVFP4Tensor, hadamard16  # noqa: E402
from fullstack_fp4.nvfp4.e2m1 import e2m1_round_nearest  # noqa: E402
from fullstack_fp4.nvfp4.reference import quantize_reference  # noqa: E402
from fullstack_fp4.nvfp4.kernels.decode import dequantize_triton  # noqa: E402
from fullstack_fp4.nvfp4.kernels.quantize import (e4m3_rne_triton, philox_uniforms,  # noqa: E402
                                                 quantize_triton)

DEV = "cuda" if (torch.cuda.is_available() and not _INTERPRET) else "cpu"


def _ref(x, *, rht_signs=None, **kw):
    x = x.detach().cpu()
    dtype = x.dtype
    if rht_signs is not None:
        x = hadamard16(x, rht_signs)   # FP32; the fused kernel keeps the input dtype as metadata
    if kw.get("rand") is not None:
        kw["rand"] = kw["rand"].cpu()
    t = quantize_reference(x, **kw)
    t.dtype = dtype
    return t


def _assert_same(a: NVFP4Tensor, b: NVFP4Tensor, what=""):
    assert a.data.shape == b.data.shape and a.block_scale.shape == b.block_scale.shape, what
    sa = a.block_scale.cpu().view(torch.uint8)
    sb = b.block_scale.cpu().view(torch.uint8)
    nbad_s = int((sa != sb).sum())
    nbad_d = int((a.data.cpu() != b.data.cpu()).sum())
    assert nbad_s == 0, f"{what}: {nbad_s} block scales differ"
    assert nbad_d == 0, f"{what}: {nbad_d} code bytes differ"
    ts_a = a.tensor_scale.cpu().reshape(()).view(torch.int32)
    ts_b = b.tensor_scale.cpu().reshape(()).view(torch.int32)
    assert int(ts_a) == int(ts_b), f"{what}: tensor scale {a.tensor_scale} vs {b.tensor_scale}"
    assert a.shape == b.shape and a.tile == b.tile and a.dtype == b.dtype


def _test_input(shape, dtype, seed=0):
    """Gaussian rows with per-column magnitudes over 6 decades, an outlier, a zero block."""
    g = torch.Generator().manual_seed(seed)
    k = shape[-1]
    x = torch.randn(shape, generator=g) * torch.logspace(-4, 2, k)
    flat = x.view(-1, k)
    flat[1, 5] = 3.0e3                     # outlier
    flat[2, :16] = 0.0                     # zero block
    flat[3, 16:32] = 1e-7 * torch.randn(16, generator=g)   # subnormal E4M3 scale region
    flat[4, 32:48] = 2.0                   # all-equal block
    return x.to(dtype).to(DEV)


MODES = list(itertools.product([(1, 16), (16, 16)], ["nearest", "stochastic"], ["6", "4over6"],
                               [False, True], [torch.bfloat16, torch.float32]))


@pytest.mark.parametrize("tile,rounding,rule,rht,dtype", MODES,
                         ids=[f"{t[0]}x{t[1]}-{r}-{s}-{'rht' if h else 'plain'}-{str(d)[6:]}"
                              for t, r, s, h, d in MODES])
def test_quantize_bit_exact_all_modes(tile, rounding, rule, rht, dtype):
    x = _test_input((3, 16, 48), dtype, seed=hash((tile, rounding, rule, rht)) % 1000)
    rand = torch.rand(x.shape, generator=torch.Generator().manual_seed(1)).to(DEV) \
        if rounding == "stochastic" else None
    signs = DEFAULT_SIGNS if rht else None
    a = quantize_triton(x, tile=tile, rounding=rounding, scale_rule=rule, rand=rand,
                        rht_signs=signs)
    b = _ref(x, tile=tile, rounding=rounding, scale_rule=rule, rand=rand, rht_signs=signs)
    _assert_same(a, b, f"{tile} {rounding} {rule} rht={rht} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantize_fp16_odd_shapes(dtype):
    # 1-D input, odd leading dims, K not a multiple of the kernel's block width
    g = torch.Generator().manual_seed(2)
    for shape in [(80,), (5, 3, 32), (7, 208)]:
        x = torch.randn(shape, generator=g) * 10
        x.view(-1)[3] = 500.0
        x = x.to(dtype).to(DEV)
        _assert_same(quantize_triton(x), _ref(x), f"{shape}")
        _assert_same(quantize_triton(x, scale_rule="4over6", rht_signs=DEFAULT_SIGNS),
                     _ref(x, scale_rule="4over6", rht_signs=DEFAULT_SIGNS), f"{shape} 4/6 rht")


def test_all_zero_tensor_and_zero_amax():
    x = torch.zeros(16, 32, dtype=torch.bfloat16, device=DEV)
    for tile in [(1, 16), (16, 16)]:
        a = quantize_triton(x, tile=tile)
        _assert_same(a, _ref(x, tile=tile), f"zeros {tile}")
        assert int(a.data.abs().sum()) == 0


def test_tiny_values_subnormal_scales():
    # block amaxes 2^-20 .. 1 of a tensor whose amax is 1: scales cover E4M3 subnormals and 0
    g = torch.Generator().manual_seed(3)
    k = 16 * 24
    mags = torch.pow(2.0, -torch.arange(24, dtype=torch.float32)).repeat_interleave(16)
    x = (torch.rand(32, k, generator=g) * 2 - 1) * mags
    x[:, 0] = 1.0
    for rule in ["6", "4over6"]:
        a = quantize_triton(x.to(DEV), scale_rule=rule)
        b = _ref(x, scale_rule=rule)
        _assert_same(a, b, rule)
        s = b.block_scale.view(torch.uint8)
        assert bool(((s > 0) & (s < 8)).any()), "test must reach subnormal E4M3 scales"
        assert bool((s == 0).any()), "test must reach zero scales"


def test_global_amax_given():
    x = _test_input((32, 64), torch.bfloat16)
    amax = float(x.float().abs().max()) * 3.0
    for tile, rule in [((1, 16), "6"), ((16, 16), "4over6")]:
        a = quantize_triton(x, tile=tile, scale_rule=rule, global_amax=amax)
        _assert_same(a, _ref(x, tile=tile, scale_rule=rule, global_amax=amax), f"{tile} {rule}")
    # smaller than the true amax: saturating blocks, still bit-exact
    amax_small = float(x.float().abs().max()) / 10
    _assert_same(quantize_triton(x, global_amax=torch.tensor(amax_small)),
                 _ref(x, global_amax=amax_small), "small amax")
    # RHT with the amax of the transformed tensor
    amax_t = float(hadamard16(x.cpu(), DEFAULT_SIGNS).abs().max())
    _assert_same(quantize_triton(x, global_amax=amax_t, rht_signs=DEFAULT_SIGNS),
                 _ref(x, global_amax=amax_t, rht_signs=DEFAULT_SIGNS), "rht + amax")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_raises(bad):
    x = torch.randn(16, 32)
    x[7, 9] = bad
    x = x.to(DEV)
    with pytest.raises(ValueError):
        quantize_triton(x)
    with pytest.raises(ValueError):
        quantize_triton(x, global_amax=1.0)          # given amax: still detected
    with pytest.raises(ValueError):
        quantize_triton(torch.randn(16, 32, device=DEV), global_amax=bad)


def test_bad_shapes_raise():
    with pytest.raises(ValueError):
        quantize_triton(torch.randn(4, 24, device=DEV))
    with pytest.raises(ValueError):
        quantize_triton(torch.randn(8, 32, device=DEV), tile=(16, 16))


@pytest.mark.parametrize("tile,rule,rht", [((1, 16), "6", False), ((16, 16), "4over6", False),
                                           ((1, 16), "6", True)])
def test_in_kernel_philox_matches_reference_with_dumped_uniforms(tile, rule, rht):
    x = _test_input((2, 16, 80), torch.bfloat16, seed=5)
    signs = DEFAULT_SIGNS if rht else None
    a = quantize_triton(x, tile=tile, scale_rule=rule, rounding="stochastic", seed=1234,
                        rht_signs=signs)
    u = philox_uniforms(x.shape, 1234, device=DEV)
    assert u.shape == x.shape and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    b = _ref(x, tile=tile, scale_rule=rule, rounding="stochastic", rand=u, rht_signs=signs)
    _assert_same(a, b, "philox")
    # a different seed gives different codes (the seed reaches the kernel)
    c = quantize_triton(x, tile=tile, scale_rule=rule, rounding="stochastic", seed=99,
                        rht_signs=signs)
    assert not torch.equal(a.data, c.data)


def test_philox_uniforms_look_uniform():
    u = philox_uniforms((64, 256), 7, device=DEV).cpu().flatten().double()
    n = u.numel()
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    hist = torch.histc(u, bins=16, min=0, max=1)
    expected = n / 16
    chi2 = float(((hist - expected) ** 2 / expected).sum())
    assert chi2 < 45.0   # 15 dof: P(chi2 > 45) < 1e-4


def test_in_kernel_stochastic_rounding_unbiased():
    # 512 identical rows: identical block scales, independent uniforms per row, so the column
    # mean of the decoded values estimates E[q] for each element; bound from the SR variance.
    g = torch.Generator().manual_seed(11)
    row = torch.randn(64, generator=g) * 2
    rows = 512
    x = row.expand(rows, 64).contiguous().to(DEV)
    t = quantize_triton(x, rounding="stochastic", seed=2024)
    xhat = dequantize_triton(t, torch.float32).double().cpu()
    mean = xhat.mean(0)
    # expected value: x exactly up to the clamp at the scale; per-element SR std from the grid step
    scale = (t.block_scale.float().cpu()[0].repeat_interleave(16) * t.tensor_scale.cpu()).double()
    y = (row.double() / scale).abs().clamp(max=6)
    step = torch.where(y >= 4, 2.0, torch.where(y >= 2, 1.0, 0.5)).double()
    var = (step * scale) ** 2 / 4 + 1e-30     # frac·(1−frac) ≤ 1/4
    # the block max may map past 6 when its scale rounds down: the clamp (not SR) moves it
    expect = torch.sign(row.double()) * y * scale
    z = (mean - expect).abs() / torch.sqrt(var / rows)
    assert float(z.max()) < 5.0, f"max z {float(z.max())}"
    # and it is really stochastic: rows differ
    assert not torch.equal(t.data[0], t.data[1])
    # nearest rounding of the same input is biased in comparison (sanity of the statistic)
    tn = quantize_triton(x)
    bias_n = (dequantize_triton(tn).double().cpu().mean(0) - row.double()).abs().max()
    assert float(bias_n) > float((mean - expect).abs().max())


def test_e4m3_rne_against_torch():
    allv = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (allv[:-1] + allv[1:]) / 2
    below = torch.nextafter(mids, torch.zeros(1))
    above = torch.nextafter(mids, torch.full((1,), 1e9))
    g = torch.Generator().manual_seed(0)
    v = torch.cat([allv, mids, below, above, torch.rand(2000, generator=g) * 448,
                   torch.rand(2000, generator=g) * 0.02, torch.rand(1000, generator=g) * 2e-3,
                   torch.tensor([448.0, 449.0, 1e6, 2.0 ** -10, 2.0 ** -9 * 0.5,
                                 2.0 ** -9 * 1.5, 2.0 ** -9 * 2.5, 1e-30])])
    sv, sb, _ = e4m3_rne_triton(v.to(DEV))
    ref = v.abs().clamp(max=448).to(torch.float8_e4m3fn)
    assert torch.equal(sv.cpu(), ref.float())
    assert torch.equal(sb.cpu().to(torch.uint8), ref.view(torch.uint8))


def test_e2m1_nearest_against_reference():
    ties = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0])
    v = torch.cat([ties, -ties, torch.nextafter(ties, torch.zeros(1)),
                   torch.nextafter(ties, torch.full((1,), 9.0)), torch.randn(3000) * 3,
                   torch.tensor([-0.0, -1e-30, 1e-30])])
    _, _, c = e4m3_rne_triton(v.to(DEV))
    assert torch.equal(c.cpu().to(torch.uint8), e2m1_round_nearest(v.clamp(-6, 6)))


@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_bit_exact(tile, dtype):
    x = _test_input((2, 16, 48), torch.float32, seed=9).cpu()
    t = quantize_reference(x, tile=tile, scale_rule="4over6")
    td = NVFP4Tensor(t.data.to(DEV), t.block_scale.to(DEV), t.tensor_scale.to(DEV), t.shape,
                     t.dtype, t.tile)
    a = dequantize_triton(td, dtype).cpu()
    b = t.dequantize(dtype)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if dtype != torch.float32 \
        else torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("shape", [(5, 48), (3, 7, 48)])
def test_dequantize_ragged_block_count(shape):
    """The flat decode kernel's last program is partial (15 and 63 blocks, 8 a program under the
    interpreter): every element still decodes exactly, nothing is written past the end."""
    x = _test_input(shape, torch.float32, seed=3).cpu()
    t = quantize_reference(x)
    td = NVFP4Tensor(t.data.to(DEV), t.block_scale.to(DEV), t.tensor_scale.to(DEV), t.shape,
                     t.dtype, t.tile)
    for dtype, view in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
        a = dequantize_triton(td, dtype).cpu()
        assert torch.equal(a.view(view), t.dequantize(dtype).view(view))


def test_roundtrip_error_gaussian():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(4)).to(DEV)
    xhat = dequantize_triton(quantize_triton(x))
    rel = float((xhat - x).norm() / x.norm())
    assert 0.07 < rel < 0.12     # the format's ~9.5% for Gaussian input
