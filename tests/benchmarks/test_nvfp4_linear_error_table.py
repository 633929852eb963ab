"""benchmarks/studies/nvfp4_linear_error_table.py: its forward error is the quantized product's,
the real operands it captures are the ones the layer's weight gradient came from, and bad input
gets one error line.

Oracle for y (no stochastic rounding in the forward): x and W quantized by ``quantize_reference``
(1x16 blocks and 16x16 tiles, each rule), decoded, multiplied in FP64, against the FP64 product of
the same inputs the study draws. Oracle for the captured x and dY: megatron's own weight gradient
of that step (``main_grad``), which must equal dYᵀ·x.
"""
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "studies"))

import nvfp4_linear_error_table as table  # noqa: E402
from fullstack_fp4.nvfp4 import quantize_reference  # noqa: E402
from tests.megatron.training import helpers  # noqa: E402

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


def test_bad_flags_are_one_error_line():
    r = subprocess.run([sys.executable, SCRIPT, "train.iters=3"], capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.strip() == "error: --config and KEY=VALUE overrides go with --real-operands"
    r = subprocess.run([sys.executable, SCRIPT, "--real-operands", "--iters", "0"], capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.strip() == "error: --iters must be at least 1, got 0"
    r = subprocess.run([sys.executable, SCRIPT, "--real-operands", "--iters", "1", "model.num_layerz=2"],
                       capture_output=True, text=True)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: ") and "num_layerz" in lines[0]


_dist = pytest.fixture(scope="module")(helpers.in_process_megatron)


def test_captured_operands_are_the_ones_of_the_weight_gradient(_dist, monkeypatch):
    from megatron.training.trainer import Trainer
    trainers, train = [], Trainer.train

    def keep(self):
        trainers.append(self)
        return train(self)
    monkeypatch.setattr(Trainer, "train", keep)
    # one micro-batch a step and no clipping: the last step's main_grad is exactly that micro-batch's
    overrides = helpers.TINY + ["train.global_batch_size=2", "train.grad_clip=0"]
    layers = table.capture_operands(None, overrides, iters=2)
    modules = dict(trainers[0].gpt.named_modules())
    kinds = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    assert [n for n, *_ in layers] == [f"decoder.layers.{i}.{k}" for i in range(4) for k in kinds]
    for name, x, w, dy in layers:
        assert x.shape == (2 * 32, w.shape[1]) and dy.shape == (2 * 32, w.shape[0]), name
        want = dy.double().t() @ x.double()
        got = modules[name].weight.main_grad.double()
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), name
    rows = table.real_operand_table(layers[:4], seeds=1)
    assert {(k, r) for k, r, _ in rows} == {(k, r) for k in ("qkv", "proj", "fc1", "fc2", "all")
                                            for r in ("4over6", "4over6 on x, W")}
    # 4/6 on x and W only leaves dY's own error as it was
    assert all(row[5] == 0 for _, rule, row in rows if rule == "4over6 on x, W")
