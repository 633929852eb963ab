"""Error of the NVFP4 linear under each block-scale rule (CPU, reference composition).

For one random linear layer (activations with log-normally spread channel scales, weights of
std 1/√in, a Gaussian output gradient), computes y, dX and dW through ``nvfp4_linear`` with
``scale_rule`` = ``6``, ``4over6`` and 4/6 on x and W only, and reports the relative squared
error ‖·−exact‖² / ‖exact‖² against the FP64 layer on the same inputs, averaged over stochastic-
rounding seeds (dY and the wgrad operands are stochastically rounded). A second table gives the
quantizer alone on i.i.d. Gaussian values: nearest and stochastic rounding, per rule.

Usage: python benchmarks/studies/nvfp4_linear_error_table.py [--tokens 256] [--fan-in 256]
[--fan-out 384] [--seeds 4]. Prints two markdown tables.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from fullstack_fp4.linear.nvfp4_linear import nvfp4_linear  # noqa: E402
from fullstack_fp4.nvfp4 import quantize_reference  # noqa: E402

RULES = {"6": "6", "4over6": "4over6", "4over6 on x, W": {"x": "4over6", "w": "4over6", "dy": "6"}}


def rel2(a: torch.Tensor, exact: torch.Tensor) -> float:
    return ((a.double() - exact) ** 2).sum().item() / (exact ** 2).sum().item()


def layer_errors(tokens: int, fan_in: int, fan_out: int, seeds: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x0 = (torch.randn(tokens, fan_in, generator=g) * torch.logspace(-0.5, 0.5, fan_in)).double()
    w0 = (torch.randn(fan_out, fan_in, generator=g) / fan_in ** 0.5).double()
    dy = torch.randn(tokens, fan_out, generator=g).double()
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y = x @ w.t()
    y.backward(dy)
    exact = (y.detach(), x.grad, w.grad)
    out = {}
    for name, rule in RULES.items():
        err = [0.0, 0.0, 0.0]
        for s in range(seeds):
            x, w = x0.float().requires_grad_(), w0.float().requires_grad_()
            y = nvfp4_linear(x, w, scale_rule=rule, generator=torch.Generator().manual_seed(s))
            y.backward(dy.float())
            for i, got in enumerate((y.detach(), x.grad, w.grad)):
                err[i] += rel2(got, exact[i]) / seeds
        out[name] = err
    return out


def quantizer_errors(seeds: int) -> dict:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 1024, generator=g)
    power = (x ** 2).sum().item()
    out = {}
    for rule in ("6", "4over6"):
        near = ((quantize_reference(x, scale_rule=rule).dequantize().float() - x) ** 2).sum().item() / power
        sr = sum(((quantize_reference(x, scale_rule=rule, rounding="stochastic",
                                      rand=torch.rand(x.shape, generator=g)).dequantize().float() - x) ** 2
                  ).sum().item() for _ in range(seeds)) / seeds / power
        out[rule] = (near, sr)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--fan-in", type=int, default=256)
    ap.add_argument("--fan-out", type=int, default=384)
    ap.add_argument("--seeds", type=int, default=4, help="stochastic-rounding seeds averaged")
    a = ap.parse_args(argv)
    for n, v in (("--tokens", a.tokens), ("--fan-in", a.fan_in), ("--fan-out", a.fan_out)):
        if v <= 0 or v % 16:
            sys.exit(f"error: {n} must be a positive multiple of 16, got {v}")
    if a.seeds < 1:
        sys.exit(f"error: --seeds must be at least 1, got {a.seeds}")
    layer = layer_errors(a.tokens, a.fan_in, a.fan_out, a.seeds)
    base = layer["6"]
    print(f"Linear {a.tokens} x {a.fan_in} -> {a.fan_out}, relative squared error against FP64, "
          f"mean of {a.seeds} SR seeds (change against rule 6)\n")
    print("| scale rule | y | dX | dW |\n| --- | ---: | ---: | ---: |")
    for name, err in layer.items():
        cells = [f"{e:.5f}" + ("" if name == "6" else f" ({e / b - 1:+.1%})") for e, b in zip(err, base)]
        print(f"| {name} | " + " | ".join(cells) + " |")
    q = quantizer_errors(a.seeds)
    print("\nQuantizer alone, 1024 x 1024 i.i.d. Gaussian, 1x16 blocks, relative squared error\n")
    print("| scale rule | nearest | stochastic |\n| --- | ---: | ---: |")
    for rule, (near, sr) in q.items():
        print(f"| {rule} | {near:.5f} | {sr:.5f} |")


if __name__ == "__main__":
    main()
