"""benchmarks/studies/nvfp4_linear_error_table.py: its forward error is the quantized product's,
and bad sizes get one error line.

Oracle for y (no stochastic rounding in the forward): x and W quantized by ``quantize_reference``
(1x16 blocks and 16x16 tiles, each rule), decoded, multiplied in FP64, against the FP64 product of
the same inputs the study draws.
"""
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "studies"))

import nvfp4_linear_error_table as table  # noqa: E402
from fullstack_fp4.nvfp4 import quantize_reference  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "studies",
                      "nvfp4_linear_error_table.py")


def test_forward_error_is_the_quantized_products():
    tokens, fan_in, fan_out = 32, 48, 64
    errs = table.layer_errors(tokens, fan_in, fan_out, seeds=1)
    g = torch.Generator().manual_seed(0)           # the study's inputs, drawn the same way
    x = (torch.randn(tokens, fan_in, generator=g) * torch.logspace(-0.5, 0.5, fan_in)).double()
    w = (torch.randn(fan_out, fan_in, generator=g) / fan_in ** 0.5).double()
    exact = x @ w.t()
    for name, rule in (("6", "6"), ("4over6", "4over6")):
        qx = quantize_reference(x.float(), scale_rule=rule).dequantize().double()
        qw = quantize_reference(w.float(), tile=(16, 16), scale_rule=rule).dequantize().double()
        want = ((qx @ qw.t() - exact) ** 2).sum().item() / (exact ** 2).sum().item()
        assert errs[name][0] == pytest.approx(want, rel=1e-4), name
    # the backward errors are errors, and 4/6 on x and W only leaves y as full 4/6 gives it
    assert all(0 < e < 0.2 for err in errs.values() for e in err)
    assert errs["4over6 on x, W"][0] == errs["4over6"][0]


def test_bad_size_is_one_error_line():
    r = subprocess.run([sys.executable, SCRIPT, "--fan-in", "40"], capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.strip() == "error: --fan-in must be a positive multiple of 16, got 40"
