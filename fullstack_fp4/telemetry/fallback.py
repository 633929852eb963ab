"""Per-module BF16 fallback on sustained quantization error (``fp4.fallback: off | warn | bf16``).

``FallbackPolicy.observe(stats)`` takes one interval's telemetry (``quant/<path>/<t>/rel_err``);
a module whose any rel_err exceeds ``threshold`` for ``k_intervals`` consecutive intervals is
*triggered*: with ``mode="warn"`` it is reported (once), with ``mode="bf16"`` ``switch_fn(module)``
(``fullstack_fp4.integration.nvfp4_linear_layers.switch_module_to_bf16``) is applied. Every
trigger is returned so the trainer can log it loudly.

Checkpoint: ``fallback_state(model)`` lists the module paths in fallback (the per-instance flag
``fp4_fallback_bf16``) plus the policy's counters; the trainer stores it in the checkpoint's
``extra`` and calls ``restore_fallback_state(model, state, switch_fn)`` on resume.
Decisions must agree across ranks: the statistics are computed per rank on its shard, so the
trainer should all-reduce (MAX) the values before ``observe`` with TP/DP > 1 (docs § Wiring).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from .collector import module_path

__all__ = ["FallbackPolicy", "fallback_state", "restore_fallback_state"]


def _modules_by_path(model) -> Dict[str, torch.nn.Module]:
    models = model if isinstance(model, (list, tuple)) else [model]
    return {module_path(n): m for chunk in models for n, m in chunk.named_modules()}


def fallback_state(model) -> dict:
    return {"bf16_modules": sorted(p for p, m in _modules_by_path(model).items()
                                   if getattr(m, "fp4_fallback_bf16", False))}


def restore_fallback_state(model, state: Optional[dict], switch_fn: Callable) -> List[str]:
    if not state:
        return []
    mods = _modules_by_path(model)
    missing = [p for p in state.get("bf16_modules", []) if p not in mods]
    if missing:
        raise KeyError(f"checkpoint lists BF16-fallback modules absent from the model: {missing}")
    for p in state.get("bf16_modules", []):
        switch_fn(mods[p])
    return list(state.get("bf16_modules", []))


class FallbackPolicy:
    def __init__(self, mode: str, threshold: float, k_intervals: int = 3,
                 switch_fn: Optional[Callable] = None):
        if mode not in ("off", "warn", "bf16"):
            raise ValueError(f"mode must be off|warn|bf16, got {mode!r}")
        if mode == "bf16" and switch_fn is None:
            raise ValueError("mode='bf16' needs switch_fn")
        self.mode, self.threshold, self.k, self.switch_fn = mode, threshold, k_intervals, switch_fn
        self.over: Dict[str, int] = {}
        self.triggered: set = set()

    def observe(self, model, stats: Dict[str, float]) -> List[dict]:
        """One telemetry interval; returns the triggers [{"module", "rel_err", "action"}]."""
        if self.mode == "off":
            return []
        worst: Dict[str, float] = {}
        for k, v in stats.items():
            parts = k.split("/")
            if len(parts) >= 4 and parts[0] == "quant" and parts[-1] == "rel_err":
                path = "/".join(parts[1:-2])
                worst[path] = max(worst.get(path, 0.0), v) if v == v else float("inf")
        events, mods = [], None
        for path, v in worst.items():
            self.over[path] = self.over.get(path, 0) + 1 if v > self.threshold else 0
            if self.over[path] >= self.k and path not in self.triggered:
                self.triggered.add(path)
                action = "warn"
                if self.mode == "bf16":
                    mods = mods or _modules_by_path(model)
                    self.switch_fn(mods[path])
                    action = "bf16"
                events.append({"module": path, "rel_err": v, "action": action})
        return events

    def state_dict(self) -> dict:
        return {"over": dict(self.over), "triggered": sorted(self.triggered)}

    def load_state_dict(self, sd: dict) -> None:
        self.over = dict(sd.get("over", {}))
        self.triggered = set(sd.get("triggered", []))
