"""TelemetryCollector: quantization error of NVFP4 linears, every ``interval`` steps.

Usage (trainer, see docs/telemetry.md § Wiring)::

    tel = TelemetryCollector(interval=cfg.logging.quant_stats_interval, blocks=64, seed=cfg.train.seed)
    tel.begin_step(model, iteration)     # installs hooks only if tel.enabled(iteration)
    ... forward / backward ...
    rec.update(tel.end_step())           # removes hooks; {"quant/<path>/<x|w|dy>/rel_err": float}

Zero cost when off: on a step where ``enabled(iteration)`` is False no hook exists (nothing is
installed and ``end_step`` returns ``{}`` without touching a tensor). On an enabled step, per
NVFP4 linear and per micro-batch: a forward hook samples ``x`` (1×16 blocks, nearest, as fprop
quantizes it) and ``W`` (16×16 tiles, nearest; once per step, the weight does not change within
a step), and a tensor hook on the output samples ``dy`` (1×16, stochastic rounding, as dgrad
quantizes it). Sums of squared errors and of squares are accumulated per name over
micro-batches (and activation recomputation) on the device; ``end_step`` does the one host sync.

Not measured (docs/telemetry.md): the RHT-16'd wgrad operands, TP-reduced amax (local amax is
used: on TP > 1 the tensor scale may differ slightly from the recipe's).

Which modules: ``predicate(module)``; by default anything with an ``_nvfp4_forward_impl``
method that is not in BF16 fallback (``fp4_fallback_bf16``), i.e. the NVFP4 parallel linears
of fullstack_fp4.integration, found by duck typing (no megatron import here).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from .stats import nvfp4_qdq, sampled_sums

__all__ = ["TelemetryCollector", "is_nvfp4_linear", "module_path"]


def is_nvfp4_linear(m: torch.nn.Module) -> bool:
    return hasattr(m, "_nvfp4_forward_impl") and not getattr(m, "fp4_fallback_bf16", False)


def module_path(name: str) -> str:
    """Strip wrapper prefixes (DDP / Float16Module ``module.``) from a named_modules() path."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


class TelemetryCollector:
    """Registry name -> value of sampled quantization statistics (see module docstring)."""

    def __init__(self, interval: int, *, blocks: int = 64, seed: int = 0,
                 predicate: Callable[[torch.nn.Module], bool] = is_nvfp4_linear):
        if interval < 0 or blocks < 1:
            raise ValueError("interval >= 0, blocks >= 1")
        self.interval, self.blocks, self.seed, self.predicate = interval, blocks, seed, predicate
        self.registry: Dict[str, float] = {}
        self._sums: Dict[str, list] = {}
        self._handles: list = []
        self._gen: Optional[torch.Generator] = None
        self._done_w: set = set()

    def enabled(self, iteration: int) -> bool:
        return self.interval > 0 and iteration % self.interval == 0

    @property
    def active(self) -> bool:
        return bool(self._handles)

    # -------------------------------------------------------------- accumulation
    def _add(self, path: str, tensor: str, t: torch.Tensor, tile, rounding: str):
        if t.shape[-1] % 16 or (tile[0] == 16 and t.reshape(-1, t.shape[-1]).shape[0] % 16):
            return
        t = t.detach()
        gamax = t.abs().amax().float()
        qdq = nvfp4_qdq(global_amax=gamax, tile=tile, rounding=rounding,
                        generator=self._gen if rounding == "stochastic" else None)
        e2, x2, _, _ = sampled_sums(t, qdq, blocks=self.blocks, generator=self._gen, tile=tile)
        key = f"quant/{path}/{tensor}/rel_err"
        acc = self._sums.get(key)
        if acc is None:
            self._sums[key] = [e2, x2]
        else:
            acc[0] = acc[0] + e2
            acc[1] = acc[1] + x2

    def record(self, name: str, value: float) -> None:
        """Record any other scalar statistic (e.g. Q-AdamW, Q-Root) in this interval's registry."""
        self.registry[name] = float(value)

    # -------------------------------------------------------------- hooks
    def begin_step(self, model, iteration: int) -> bool:
        """Install hooks on every matching module if ``enabled(iteration)``; returns whether it did."""
        self.end_step() if self.active else None
        if not self.enabled(iteration):
            return False
        self._gen = torch.Generator().manual_seed(self.seed * 1_000_003 + iteration)
        self._done_w = set()
        models = model if isinstance(model, (list, tuple)) else [model]
        for chunk in models:
            for name, m in chunk.named_modules():
                if self.predicate(m):
                    self._handles.append(m.register_forward_hook(self._make_hook(module_path(name))))
        return True

    def _make_hook(self, path: str):
        def hook(module, args, output):
            x = args[0] if args else None
            with torch.no_grad():
                if torch.is_tensor(x):
                    self._add(path, "x", x, (1, 16), "nearest")
                w = getattr(module, "weight", None)
                if torch.is_tensor(w) and path not in self._done_w:
                    self._done_w.add(path)
                    self._add(path, "w", w, (16, 16), "nearest")
            y = output[0] if isinstance(output, (tuple, list)) else output
            if torch.is_tensor(y) and y.requires_grad:
                def grad_hook(g):
                    with torch.no_grad():
                        self._add(path, "dy", g, (1, 16), "stochastic")
                y.register_hook(grad_hook)
        return hook

    def end_step(self) -> Dict[str, float]:
        """Remove hooks; return {name: rel_err} of this step (one host sync), also in ``registry``."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if not self._sums and not self.registry:
            return {}
        out = {k: float((e2 / x2).sqrt()) for k, (e2, x2) in self._sums.items()}
        self._sums = {}
        out.update(self.registry)
        self.registry = {}
        self.last = out
        return out
