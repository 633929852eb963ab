"""The flat quantize kernels (fullstack_fp4/nvfp4/kernels/quantize.py, "Flat kernels") against
``quantize_reference``, bit for bit, and against the tiled kernels; where they apply and where
they must refuse; NaN/Inf handling as the tiled kernels do it.

Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``; skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton not installed")

from tests.fullstack_fp4.nvfp4.kernel_checks import (DEV, assert_same_nvfp4 as _same,  # noqa: E402
                                                   skip_module_without_kernels)

skip_module_without_kernels()

from fullstack_fp4.nvfp4.kernels import quantize as tq  # noqa: E402
from fullstack_fp4.nvfp4.reference import quantize_reference  # noqa: E402


def _x(rows, k, seed, outliers=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    if outliers and rows >= 4 and k >= 32:
        # heavy tails, an all-zero block, a block of one repeated value, tiny values (E4M3
        # subnormal block scales) and exact E2M1 midpoints after scaling
        x = x * torch.exp(2 * torch.randn(rows, 1, generator=g))
        x[0, :16] = 0
        x[1, 16:32] = 3.0
        x[2, :16] = 1e-6 * torch.randn(16, generator=g)
        x[3, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * x[3, 16:].abs().max() / 6
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("shape,seed", [((8, 64), 0), ((5, 48), 1), ((3, 4, 96), 2), ((1, 16), 3)],
                         ids=["8x64", "ragged-programs", "3d", "one-block"])
def test_flat_equals_reference(shape, seed):
    x = _x(shape[0] * (shape[1] if len(shape) == 3 else 1), shape[-1], seed).reshape(shape).to(DEV)
    got = tq.quantize_triton(x, flat=True)
    ref = quantize_reference(x.cpu())
    _same(got, ref, f"flat vs reference {shape}")
    # and the tiled kernels give the same bits (three forms of one contract)
    _same(got, tq.quantize_triton(x, flat=False), "flat vs tiled")


def test_flat_with_given_amax_and_small_program():
    x = _x(6, 160, 4).to(DEV)
    amax = float(x.float().abs().max()) * 1.5           # a delayed-scaling amax above the true one
    ref = quantize_reference(x.cpu(), global_amax=torch.tensor(amax))
    _same(tq.quantize_triton(x, flat=True, global_amax=amax), ref, "host amax")
    _same(tq.quantize_triton(x, flat=True, global_amax=torch.tensor(amax, device=DEV)), ref,
          "device amax")
    # several programs, the last one partly masked: 60 blocks over programs of 8
    _same(tq.quantize_triton(x, flat=True, config=(8, 4)), quantize_reference(x.cpu()),
          "8-block programs")


def test_flat_is_the_default_where_it_applies(monkeypatch):
    calls = []
    real = tq._quantize_flat
    monkeypatch.setattr(tq, "_quantize_flat", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = _x(4, 64, 5).to(DEV)
    tq.quantize_triton(x)
    assert calls == [1]
    # not for fp32 input, 16x16 tiles, a non-contiguous view, or when a tiled kernel is asked for
    tq.quantize_triton(x.float())
    tq.quantize_triton(_x(16, 64, 6).to(DEV), tile=(16, 16))
    tq.quantize_triton(_x(4, 128, 7).to(DEV)[:, :64])
    tq.quantize_triton(x, config=(16, 4, 4))
    assert calls == [1]


@pytest.mark.parametrize("kw", [dict(rounding="stochastic", seed=1), dict(scale_rule="4over6"),
                                dict(tile=(16, 16))], ids=["sr", "4over6", "2d"])
def test_flat_true_refuses_other_modes(kw):
    x = _x(16, 64, 8).to(DEV)
    with pytest.raises(ValueError, match="flat=True"):
        tq.quantize_triton(x, flat=True, **kw)
    with pytest.raises(ValueError, match="flat=True"):
        tq.quantize_triton(x.float(), flat=True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_flat_non_finite_input(bad):
    x = _x(4, 64, 9)
    x[2, 17] = bad
    x = x.to(DEV)
    with pytest.raises(ValueError, match="NaN or Inf"):
        tq.quantize_triton(x, flat=True)
    with pytest.raises(ValueError, match="NaN or Inf"):
        tq.quantize_triton(x, flat=True, global_amax=10.0)
    # without the check: no sync, and the tensor scale is poisoned so products are NaN
    t = tq.quantize_triton(x, flat=True, check_finite=False)
    assert torch.isnan(t.tensor_scale.cpu())
    t = tq.quantize_triton(x, flat=True, global_amax=10.0, check_finite=False)
    assert torch.isnan(t.tensor_scale.cpu())
