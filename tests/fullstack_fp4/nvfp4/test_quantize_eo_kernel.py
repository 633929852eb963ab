"""The tiled eo-form quantize kernel (fullstack_fp4/nvfp4/kernels/quantize.py): its rounding
helpers (kernels/fp4_math.py) against the reference's independent formulations, and its code
paths (int32 / int64 offsets, 2-D / 1-D grid, BF16-as-words / generic loads, custom Philox /
``tl.randint4x``) against ``quantize_reference``, bit for bit.

Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``; skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton not installed")

from tests.fullstack_fp4.nvfp4.kernel_checks import (DEV, assert_same_nvfp4 as _same,  # noqa: E402
                                                   skip_module_without_kernels)

skip_module_without_kernels()

from fullstack_fp4.nvfp4 import DEFAULT_SIGNS, hadamard16  # noqa: E402
from fullstack_fp4.nvfp4.kernels import quantize as tq  # noqa: E402
from fullstack_fp4.nvfp4.e2m1 import (E2M1_VALUES, e2m1_decode, e2m1_round_nearest,  # noqa: E402
                                      e2m1_round_stochastic)
from fullstack_fp4.nvfp4.reference import quantize_reference  # noqa: E402


@pytest.fixture(autouse=True)
def _tiled_kernel(monkeypatch):
    """This module tests the tiled kernel: quantize_triton's default runs the flat kernels
    where they apply (their own module, test_quantize_flat.py), so pin flat=False here."""
    import functools

    monkeypatch.setattr(tq, "quantize_triton", functools.partial(tq.quantize_triton, flat=False))


def _ref(x, *, rht_signs=None, **kw):
    x = x.detach().cpu()
    dtype = x.dtype
    if rht_signs is not None:
        x = hadamard16(x, rht_signs)
    if kw.get("rand") is not None:
        kw["rand"] = kw["rand"].cpu()
    t = quantize_reference(x, **kw)
    t.dtype = dtype
    return t


def _x(rows, k, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 2, k)
    x[0, 3] = 900.0
    x[min(2, rows - 1), :16] = 0.0
    return x.to(dtype)


# ----------------------------------------------------------------------------- helpers
def _nextafter(v, direction):
    return torch.nextafter(v, torch.full_like(v, direction))


def test_e2m1_nearest_nibble_and_value():
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    grid = torch.tensor(E2M1_VALUES)
    g = torch.Generator().manual_seed(0)
    v = torch.cat([grid, mids, _nextafter(mids, 0.0), _nextafter(mids, 9.0), torch.tensor(
        [6.5, 7.0, 7.5, 1e30, float("inf"), 1e-30, 1e-45, 0.0]), torch.rand(4000, generator=g) * 7])
    v = torch.cat([v, -v, torch.tensor([-0.0])])
    o = tq.rounding_probe_triton(v.to(DEV))
    # nearest nibble of v itself (saturating): the reference's threshold count, sign of v
    assert torch.equal(o["nib_rne"].cpu().to(torch.uint8), e2m1_round_nearest(v))
    # the value helper (4/6 error terms) on min(|v|, 6)
    a = v.abs().clamp(max=6.0)
    assert torch.equal(o["rne_val"].cpu(), e2m1_decode(e2m1_round_nearest(a)))
    assert int(o["nib_rne"][-1]) == 0                       # y == -0.0 gets code 0 (TE)
    tiny = (v == -torch.tensor(1e-45)).nonzero()[0, 0]
    assert int(o["nib_rne"][tiny]) == 8                     # -1e-45 rounds to -0: code 8


def test_e2m1_stochastic_nibble_exact_compare():
    # u placed exactly at, just below and just above each element's fraction: the kernel's
    # u < frac must agree with the reference's for every one of them.
    g = torch.Generator().manual_seed(1)
    grid = torch.tensor(E2M1_VALUES)
    a = torch.cat([torch.rand(600, generator=g) * 6.5, grid, (grid[:-1] + grid[1:]) / 2,
                   _nextafter(grid, 0.0)[1:], _nextafter(grid, 9.0)[:-1],
                   torch.tensor([1e-30, 2.0 ** -24, 0.5 - 2.0 ** -25, 6.0, 7.0])])
    lo_idx = (a.clamp(max=6.0)[:, None] >= grid[None, 1:]).sum(1)
    lo = grid[lo_idx]
    step = torch.where(lo_idx < 7, grid[(lo_idx + 1).clamp(max=7)] - lo, torch.ones_like(lo))
    frac = torch.where(lo_idx < 7, (a.clamp(max=6.0) - lo) / step, torch.zeros_like(lo))
    u = torch.cat([frac, _nextafter(frac, 0.0), _nextafter(frac, 1.0),
                   torch.rand(a.numel(), generator=g)]).clamp(0.0, 1.0 - 2.0 ** -24)
    v = torch.cat([a, a, a, a])
    v = torch.cat([v, -v])
    u = torch.cat([u, u])
    o = tq.rounding_probe_triton(v.to(DEV), u.to(DEV))
    assert torch.equal(o["nib_sr"].cpu().to(torch.uint8), e2m1_round_stochastic(v, u))


def test_e4m3_single_add_rounding():
    allv = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (allv[:-1] + allv[1:]) / 2
    g = torch.Generator().manual_seed(2)
    v = torch.cat([allv, mids, _nextafter(mids, 0.0), _nextafter(mids, 1e9),
                   torch.rand(3000, generator=g) * 448, torch.rand(1000, generator=g) * 0.02,
                   torch.tensor([448.0, 449.0, 1e6, 2.0 ** -10, 1e-30, 0.0])])
    o = tq.rounding_probe_triton(v.to(DEV))
    ref = v.abs().clamp(max=448).to(torch.float8_e4m3fn)
    assert torch.equal(o["e4m3_val1"].cpu(), ref.float())
    assert torch.equal(o["e4m3_bits1"].cpu().to(torch.uint8), ref.view(torch.uint8))


def test_host_amax_bits_rounds_as_torch():
    for v in [1.0, 0.1, 3.0e38, 3.4028235e38, 1e-45, 1e-46, 0.0, -0.0, 2.0 ** 100 * (1 + 2.0 ** -24)]:
        assert tq._host_amax_bits(v) == int(torch.tensor(v, dtype=torch.float32).view(torch.int32))
    for bad in [float("nan"), float("inf"), -1.0, 3.5e38, 1e39]:
        with pytest.raises(ValueError):
            tq._host_amax_bits(bad)


def test_needs_i64_bounds():
    # 2^31 - 1 is the largest offset int32 holds; padding of the last tile counts
    assert not tq._needs_i64(8192, 512, 32, 8, (8192, 0))
    assert tq._needs_i64(2**18 + 1, 512, 32, 8, (8192, 0))              # 2^31 elements
    assert tq._needs_i64(16, 1, 16, 1, (2**28,))                        # a huge row stride
    assert tq._needs_i64(2**22, 128, 16, 8, (16,))                      # Philox counters 2^31


# ----------------------------------------------------------------------------- kernel paths
PATHS = [dict(), dict(tile=(16, 16)), dict(rounding="stochastic", seed=5),
         dict(scale_rule="4over6"), dict(rht_signs=DEFAULT_SIGNS, rounding="stochastic", seed=6)]


@pytest.mark.parametrize("kw", PATHS, ids=["near", "2d", "sr", "46", "rht-sr"])
def test_int64_offsets_and_1d_grid_match_default(kw, monkeypatch):
    x = _x(48, 96, 3).to(DEV)
    a = tq.quantize_triton(x, **kw)
    monkeypatch.setattr(tq, "_needs_i64", lambda *args: True)
    b = tq.quantize_triton(x, **kw)
    _same(a, b, "int64 offsets")
    monkeypatch.setattr(tq, "AMAX_L2_TAIL_BYTES", 20 * 96 * x.element_size())   # 20 rows
    _same(a, tq.quantize_triton(x, **kw), "amax pass with an evict_last tail")
    monkeypatch.setattr(tq, "_grid", lambda rows, nblk, bm, nb:
                        ((triton.cdiv(rows, bm) * triton.cdiv(nblk, nb),), False))
    _same(a, tq.quantize_triton(x, **kw), "1-D grid (and the evict_last tail)")
    if kw.get("rounding") == "stochastic":
        u = tq.philox_uniforms(x.shape, kw["seed"], device=DEV)
        kw = dict(kw, rand=u, seed=None)
    _same(a, _ref(x, **{k: v for k, v in kw.items() if k != "seed"}), "reference")


@pytest.mark.parametrize("layout", ["odd-stride", "odd-offset"])
def test_bf16_without_word_view(layout):
    # a BF16 view whose rows cannot be read as int32 words takes the generic load
    k = 64
    base = _x(20, k + 1, 4).to(DEV)
    if layout == "odd-stride":
        x = base[:, :k]                                            # stride(0) = 65
    else:
        x = base.reshape(-1)[1:1 + 20 * k].reshape(20, k)         # storage offset 1
    assert tq._x_operand(x)[2] is False
    _same(tq.quantize_triton(x), _ref(x), layout)
    _same(tq.quantize_triton(x, rht_signs=DEFAULT_SIGNS, scale_rule="4over6"),
          _ref(x, rht_signs=DEFAULT_SIGNS, scale_rule="4over6"), layout + " rht 4/6")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_edge_shapes(dtype):
    # K = 16 (one block a row), rows not a multiple of any tile, a 3-D input
    for shape in [(37, 16), (5, 7, 48), (1, 16)]:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(dtype) * 3
        _same(tq.quantize_triton(x.to(DEV)), _ref(x), f"{shape} {dtype}")
        u = torch.rand(shape, generator=torch.Generator().manual_seed(8))
        _same(tq.quantize_triton(x.to(DEV), rounding="stochastic", rand=u.to(DEV)),
              _ref(x, rounding="stochastic", rand=u), f"{shape} {dtype} sr")


def test_sign_of_zero_and_underflowing_products():
    # amax 1e38: element factors ~6e-38, so |x| ~ 1e-9 underflows to -0.0 (code 0) and
    # |x| ~ 1e-7 to a tiny negative (code 8); explicit -0.0 inputs get code 0
    x = torch.zeros(16, 32)
    x[:, 0] = 1e38
    x[:, 1] = -1e-9
    x[:, 2] = -1e-7
    x[:, 3] = -0.0
    x[:, 17] = -0.0
    x[:, 18] = -1e-30
    for dtype in [torch.bfloat16, torch.float32]:
        xd = x.to(dtype)
        a = tq.quantize_triton(xd.to(DEV))
        b = _ref(xd)
        _same(a, b, f"{dtype}")
        codes = b.data.view(torch.uint8)
        assert int(codes[0, 0] >> 4) == 0 and int(codes[0, 1] & 15) == 8     # -0 vs -tiny
    _same(tq.quantize_triton(x.to(DEV), rounding="stochastic", seed=1),
          _ref(x, rounding="stochastic", rand=tq.philox_uniforms(x.shape, 1, device=DEV)), "sr")


def test_nan_inf_detected_with_given_amax_nan_propagating_max():
    # with the amax given, NaN/Inf is seen only by the kernel's (NaN-propagating) block max
    for bad in [float("nan"), float("inf"), float("-inf")]:
        x = _x(48, 64, 9, torch.float32)
        x[41, 50] = bad                                   # in the last row tile
        for tile in [(1, 16), (16, 16)]:
            with pytest.raises(ValueError):
                tq.quantize_triton(x.to(DEV), global_amax=10.0, tile=tile)
            q = tq.quantize_triton(x.to(DEV), global_amax=10.0, check_finite=False, tile=tile)
            assert torch.isnan(q.tensor_scale.cpu())


@pytest.mark.parametrize("kw", [dict(), dict(tile=(16, 16), scale_rule="4over6"),
                                dict(rht_signs=DEFAULT_SIGNS, rounding="stochastic", seed=3)],
                         ids=["near", "2d-46", "rht-sr"])
def test_amax_triton_matches_torch(kw):
    x = _x(32, 80, 10).to(DEV)
    assert torch.equal(tq.amax_triton(x, kw.get("rht_signs")).cpu(),
                       (hadamard16(x.cpu(), kw["rht_signs"]) if "rht_signs" in kw
                        else x.cpu().float()).abs().amax())
