"""Error of the NVFP4 linear under each block-scale rule (CPU, reference composition).

For one random linear layer (activations with log-normally spread channel scales, weights of
std 1/√in, a Gaussian output gradient), computes y, dX and dW through ``nvfp4_linear`` with
``scale_rule`` = ``6``, ``4over6`` and 4/6 on x and W only, and reports the relative squared
error ‖·−exact‖² / ‖exact‖² against the FP64 layer on the same inputs, averaged over stochastic-
rounding seeds (dY and the wgrad operands are stochastically rounded). A second table gives the
quantizer alone on i.i.d. Gaussian values: nearest and stochastic rounding, per rule.

``--real-operands``: the same errors on the operands of a trained model instead of drawn ones.
Trains ``--config`` (default configs/quickstart.yaml, whose data `make quickstart` prepares) in
this process for ``--iters`` steps, takes every decoder linear's x, W and dY of the last training
micro-batch (the output layer stays BF16 in every recipe), and per layer kind (qkv, proj, fc1,
fc2; the mean over the blocks) gives the change against rule 6 of the layer's y, dX, dW errors
and of each operand's own quantization error (x 1x16 and dY 1x16 as the layer rounds them,
nearest and stochastic; W in 16x16 tiles, nearest).

Usage: python benchmarks/studies/nvfp4_linear_error_table.py [--tokens 256] [--fan-in 256]
[--fan-out 384] [--seeds 4]. Prints two markdown tables.
       python benchmarks/studies/nvfp4_linear_error_table.py --real-operands [--iters 300]
[--config CONFIG] [key=value ...]. Prints one markdown table.
"""

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from fullstack_fp4.linear.nvfp4_linear import nvfp4_linear, scale_rules  # noqa: E402
from fullstack_fp4.nvfp4 import quantize_reference  # noqa: E402

RULES = {"6": "6", "4over6": "4over6", "4over6 on x, W": {"x": "4over6", "w": "4over6", "dy": "6"}}


def rel2(a: torch.Tensor, exact: torch.Tensor) -> float:
    return ((a.double() - exact) ** 2).sum().item() / (exact ** 2).sum().item()


def layer_errors(tokens: int, fan_in: int, fan_out: int, seeds: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x0 = (torch.randn(tokens, fan_in, generator=g) * torch.logspace(-0.5, 0.5, fan_in)).double()
    w0 = (torch.randn(fan_out, fan_in, generator=g) / fan_in ** 0.5).double()
    dy = torch.randn(tokens, fan_out, generator=g).double()
    return operand_errors(x0, w0, dy, seeds)


def operand_errors(x0: torch.Tensor, w0: torch.Tensor, dy: torch.Tensor, seeds: int) -> dict:
    """{rule name: [y, dX, dW relative squared error]} of ``nvfp4_linear`` on x0 [tokens, in],
    w0 [out, in] and the output gradient dy [tokens, out], against the FP64 layer."""
    x0, w0, dy = x0.double(), w0.double(), dy.double()
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


def own_errors(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, rule: str, seeds: int) -> list:
    """Each operand's own relative squared error under ``rule``, quantized as the layer's forward
    and dgrad take it: x 1x16 nearest, W 16x16 nearest, dY 1x16 stochastic (mean of ``seeds``)."""
    def rel(q, v):
        return rel2(q.dequantize(), v.double())
    g = torch.Generator().manual_seed(0)
    dy_err = sum(rel(quantize_reference(dy.float(), scale_rule=rule, rounding="stochastic", generator=g), dy)
                 for _ in range(seeds)) / seeds
    return [rel(quantize_reference(x.float(), scale_rule=rule), x),
            rel(quantize_reference(w.float(), tile=(16, 16), scale_rule=rule), w), dy_err]


def capture_operands(config, overrides: list, iters: int) -> list:
    """Trains ``config`` (a YAML path, or None for overrides only) in this process for ``iters``
    steps; returns ``[(name, x [tokens, in], W [out, in], dY [tokens, out])]`` in FP32 for every
    linear of the decoder, from the last training micro-batch (its forward input and the gradient
    of its output)."""
    from megatron.training import cpu_compat  # noqa: PLC0415
    from megatron.training.config import load_config  # noqa: PLC0415
    cfg = load_config(config, [*overrides, f"train.iters={iters}", "train.eval_iters=0",
                               "checkpoint.load=none", "checkpoint.save_interval=null",
                               "checkpoint.save_on_exit=false", "logging.tensorboard=false"])
    cfg.logging.dir = None
    cpu_compat.import_megatron_core()       # as pretrain_gpt.py: after the config, its known warnings filtered
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: PLC0415
    from megatron.training.trainer import Trainer  # noqa: PLC0415
    trainer = Trainer(cfg, verbose=False)
    seen, hooks = {}, []

    def keep_input(name):
        def hook(module, inputs, _):
            if torch.is_grad_enabled():
                seen[name] = [inputs[0].detach().float().clone(), module.weight.detach().float().clone(), None]
        return hook

    def keep_grad(name):
        def hook(_, __, grad_outputs):
            seen[name][2] = grad_outputs[0].detach().float().clone()
        return hook

    for name, m in trainer.gpt.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and ".decoder." in f".{name}":
            hooks += [m.register_forward_hook(keep_input(name)), m.register_full_backward_hook(keep_grad(name))]
    try:
        with contextlib.redirect_stdout(sys.stderr):   # the run's log apart from the table
            trainer.train()
    finally:
        for h in hooks:
            h.remove()
    return [(n, x.reshape(-1, x.shape[-1]), w, dy.reshape(-1, dy.shape[-1])) for n, (x, w, dy) in seen.items()]


def real_operand_table(layers: list, seeds: int) -> list:
    """Rows (layer kind, [change against rule 6 of y, dX, dW, x, W, dY error] per rule other than
    6), each change the mean over the layers of that kind; the last row ``all`` over every layer."""
    changes = {}
    for name, x, w, dy in layers:
        errs = operand_errors(x, w, dy, seeds)
        own = {rule: own_errors(x, w, dy, rule, seeds) for rule in ("6", "4over6")}
        kind = name.rsplit(".", 1)[-1].removeprefix("linear_")
        for rule in RULES:
            if rule == "6":
                continue
            own_r = [own[r][i] / own["6"][i] - 1 for i, r in enumerate(scale_rules(RULES[rule]))]
            row = [e / b - 1 for e, b in zip(errs[rule], errs["6"])] + own_r
            for key in (kind, "all"):
                changes.setdefault((key, rule), []).append(row)
    return [(key, rule, [sum(col) / len(col) for col in zip(*rows)]) for (key, rule), rows in changes.items()]


def main_real(a) -> None:
    from megatron.training.errors import UserError  # noqa: PLC0415
    config = a.config or os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.yaml")
    try:
        layers = capture_operands(config, a.overrides, a.iters)
    except UserError as e:                  # a bad config, override or data path: one line
        sys.exit(f"error: {e}")
    if not layers:
        sys.exit("error: the model has no decoder linear to measure")
    rows = real_operand_table(layers, a.seeds)
    print(f"Operands of {len(layers)} decoder linears after {a.iters} steps of {os.path.relpath(config)}; "
          f"change of the relative squared error against rule 6, mean over the layers of a kind; "
          f"{a.seeds} SR seeds\n")
    print("| layers | rule | y | dX | dW | x alone | W alone | dY alone |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    order = {k: i for i, k in enumerate(("qkv", "proj", "fc1", "fc2"))}
    for key, rule, row in sorted(rows, key=lambda r: (order.get(r[0], 9), r[1])):
        print(f"| {key} | {rule} | " + " | ".join(f"{c:+.1%}" for c in row) + " |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--fan-in", type=int, default=256)
    ap.add_argument("--fan-out", type=int, default=384)
    ap.add_argument("--seeds", type=int, default=4, help="stochastic-rounding seeds averaged")
    ap.add_argument("--real-operands", action="store_true",
                    help="operands of a model trained here for --iters steps (module docstring)")
    ap.add_argument("--iters", type=int, default=300, help="with --real-operands: training steps")
    ap.add_argument("--config", default=None, help="with --real-operands (default configs/quickstart.yaml)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="with --real-operands: config overrides")
    a = ap.parse_args(argv)
    for n, v in (("--tokens", a.tokens), ("--fan-in", a.fan_in), ("--fan-out", a.fan_out)):
        if v <= 0 or v % 16:
            sys.exit(f"error: {n} must be a positive multiple of 16, got {v}")
    if a.seeds < 1:
        sys.exit(f"error: --seeds must be at least 1, got {a.seeds}")
    if a.real_operands:
        if a.iters < 1:
            sys.exit(f"error: --iters must be at least 1, got {a.iters}")
        return main_real(a)
    if a.overrides or a.config:
        sys.exit("error: --config and KEY=VALUE overrides go with --real-operands")
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
