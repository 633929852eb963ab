"""Per-module BF16 fallback on sustained quantization error (``fp4.fallback: off | warn | bf16``).

``FallbackPolicy.observe(stats)`` takes one interval's telemetry (``quant/<path>/<t>/rel_err``);
a module whose worst guarded rel_err (``GUARDED[recipe]``) exceeds its recipe's threshold for
``k_intervals`` consecutive intervals is *triggered*: with ``mode="warn"`` it is reported (once),
with ``mode="bf16"`` ``switch_fn(module)`` is applied (the trainer's dispatcher: NVFP4 linear ->
``switch_module_to_bf16``, LoRA-SVD -> ``lora_exact``, Q-Attn -> SDPA). Optimizer statistics
(``quant/optimizer/...``) have no BF16 path: they only warn, in every mode. Every trigger is
returned so the trainer can log it loudly.

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


# Which statistics can trigger, per recipe (docs/telemetry.md § Fallback). Only errors of
# operands the recipe quantizes count; ``lora_energy`` (a fraction, not an error), Q-AdamW's
# m / v (their error reaches training only through the update) and the NS orthogonality
# (not 0 even in exact arithmetic: compare with ns_orth_fp32) are logged, never acted on.
GUARDED = {
    "linear": ("x", "w", "dy", "wgrad_x", "wgrad_dy"),
    "lora_svd": ("x", "w_res", "dy", "wgrad_x", "wgrad_dy"),
    "attention": ("s", "ds"),
    "optimizer": ("update", "ns_step"),
}
# Recipes with a per-module BF16 path; the optimizers have none: warn only, in every mode.
SWITCHABLE = ("linear", "lora_svd", "attention")


def _recipe_of(path: str, mods) -> Optional[str]:
    if path.startswith("optimizer/"):
        return "optimizer"
    if mods is None:
        return None
    from .collector import module_recipe

    return module_recipe(mods.get(path))


class FallbackPolicy:
    """``threshold``: the default; ``thresholds``: per recipe (``linear``, ``lora_svd``,
    ``attention``, ``optimizer``) overriding it. A statistic name's recipe is that of its module
    (``optimizer/...`` paths: the optimizer); with no model to look modules up (``model=None``)
    every ``rel_err`` counts against ``threshold``."""

    def __init__(self, mode: str, threshold: float, k_intervals: int = 3,
                 switch_fn: Optional[Callable] = None, thresholds: Optional[Dict[str, float]] = None):
        if mode not in ("off", "warn", "bf16"):
            raise ValueError(f"mode must be off|warn|bf16, got {mode!r}")
        if mode == "bf16" and switch_fn is None:
            raise ValueError("mode='bf16' needs switch_fn")
        unknown = set(thresholds or {}) - set(GUARDED)
        if unknown:
            raise ValueError(f"unknown recipe(s) in thresholds: {sorted(unknown)}; known: {sorted(GUARDED)}")
        self.mode, self.threshold, self.k, self.switch_fn = mode, threshold, k_intervals, switch_fn
        self.thresholds = dict(thresholds or {})
        self.over: Dict[str, int] = {}
        self.triggered: set = set()

    def threshold_for(self, recipe: Optional[str]) -> float:
        return self.thresholds.get(recipe, self.threshold)

    def observe(self, model, stats: Dict[str, float]) -> List[dict]:
        """One telemetry interval; returns the triggers
        [{"module", "rel_err", "action", "recipe", "tensor", "threshold"}]."""
        if self.mode == "off":
            return []
        mods = None if model is None else _modules_by_path(model)
        worst: Dict[str, tuple] = {}
        for k, v in stats.items():
            parts = k.split("/")
            if len(parts) >= 4 and parts[0] == "quant" and parts[-1] == "rel_err":
                path, tensor = "/".join(parts[1:-2]), parts[-2]
                recipe = _recipe_of(path, mods)
                if recipe is not None and tensor not in GUARDED[recipe]:
                    continue
                v = v if v == v else float("inf")
                if path not in worst or v > worst[path][0]:
                    worst[path] = (v, tensor, recipe)
        events = []
        for path, (v, tensor, recipe) in sorted(worst.items()):
            thr = self.threshold_for(recipe)
            self.over[path] = self.over.get(path, 0) + 1 if v > thr else 0
            if self.over[path] >= self.k and path not in self.triggered:
                self.triggered.add(path)
                action = "warn"
                if self.mode == "bf16" and recipe != "optimizer":
                    if mods is None:
                        raise ValueError("mode='bf16' needs the model to switch modules")
                    self.switch_fn(mods[path])
                    action = "bf16"
                events.append({"module": path, "rel_err": v, "action": action, "recipe": recipe,
                               "tensor": tensor, "threshold": thr})
        return events

    def state_dict(self) -> dict:
        return {"over": dict(self.over), "triggered": sorted(self.triggered)}

    def load_state_dict(self, sd: dict) -> None:
        self.over = dict(sd.get("over", {}))
        self.triggered = set(sd.get("triggered", []))
