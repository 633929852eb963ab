"""Divergence guards: skip an optimizer update on a non-finite grad norm / loss or a loss spike.

`StepGuard` decides, from numbers the step already computes (the loss the trainer `.item()`s and
megatron-core's total grad norm), whether this step's update may be applied. It keeps a window
of recent *good* losses, counts consecutive skips and, past `max_consecutive_skips`, reports
`exhausted`; the trainer then raises `DivergenceError` naming the checkpoint to resume from.

What is kept on divergence: the parameters in memory are those of the last *applied* step,
the one after which every update was skipped — the likely destructive step — so they are not
saved. Checkpoints holding them or later ones (iteration >= that step) are renamed
`iter_N.diverged`, and the newest checkpoint before it (which pruning never removes while a
newer one is unconfirmed: checkpointing.py) is the one the message names and `load: auto`
resumes from. A resume whose optimizer settings differ from the checkpoint's starts the guard
afresh (`reset`): the good-loss window and the skip count described the old settings.
NaN/Inf inside an FP4 recipe does not raise (the recipes propagate it into the loss / grads),
so it is skipped here like any other non-finite step, on the CPU and the GPU.

`guarded_optimizer_step` is megatron-core's `optimizer.step()` cut in two so that the decision
sits *before* the update:

    found_inf = optimizer.prepare_grads()        # model grads -> main grads, unscale (fp16)
    grad_norm = optimizer.get_grad_norm()        # the same total norm step() computes
    decide(loss, grad_norm)                      # skip here: nothing was applied yet
    clip_grad_by_total_norm_fp32(..., grad_norm) # what clip_grad_norm() does, norm reused
    optimizer.step_with_ready_grads()            # inner step + main -> model params copy

For `FP32Optimizer`, `Float16OptimizerWithFloat16Params` and `ChainedOptimizer` this computes
the same grad norm and the same clipped grads as their `step()` (tested bit-for-bit on CPU).
Cost: one more `get_grad_norm()` only when clipping is off (step() skips the norm then); with
clipping on, the norm is computed once, as before. The single host sync is `float(grad_norm)`,
which the trainer already did to log it.

Spike rule (`loss_spike_factor = f`): skip when `loss > f * mean(last `window` good losses)`,
active once `min_history` good losses are recorded. Why a ratio to the running mean and not a
z-score: the pretraining loss trends down and its step-to-step spread is tiny late in training
(a z-score then flags ordinary noise — std → 0 makes any blip "10σ") and large early (where it
misses real blowups); a ratio is scale-free, has one interpretable knob ("1.5 = 50 % above the
recent level"), and because the loss trends down the mean of the previous good losses lies
slightly *above* the current level, so the rule errs on the side of not skipping. Only good
(applied) steps enter the window, so a burst of spikes cannot raise its own threshold.

Distributed: megatron's grad norm is all-reduced over the model-parallel group and the grads
over data parallel, so every rank sees the same norm and takes the same decision. The loss is
known only on the last pipeline stage (None elsewhere): with pipeline parallelism > 1, the
loss-based checks are skipped on ranks where loss is None, which would desynchronise ranks if
the spike rule is on, so `loss_spike_factor` must then be broadcast first (not wired here;
non-finite *grad norm* detection covers a non-finite loss anyway, since its gradient is
non-finite too).
"""
from __future__ import annotations

import math
from collections import deque
from typing import Optional

__all__ = ["StepGuard", "DivergenceError", "guarded_optimizer_step"]


class DivergenceError(RuntimeError):
    """Raised by the trainer after `max_consecutive_skips` consecutive skipped updates."""


class StepGuard:
    """Decide whether a step's update may be applied; track skips.

    skip_nonfinite: skip on a NaN/Inf loss or grad norm (else they are applied, as megatron does).
    max_consecutive_skips: after this many skipped updates in a row `exhausted` turns True
        (0: never). A grad-scaler overflow (fp16 dynamic loss scale) is reported but not counted:
        the scaler handles those and skips several in a row by design at the start.
    loss_spike_factor: None (off) or f > 1: skip when loss > f * mean of the last `window`
        good losses (once `min_history` of them exist).
    """

    def __init__(self, *, skip_nonfinite: bool = True, max_consecutive_skips: int = 5,
                 loss_spike_factor: Optional[float] = None, window: int = 32, min_history: int = 8):
        if loss_spike_factor is not None and not loss_spike_factor > 1.0:
            raise ValueError(f"loss_spike_factor must be > 1 or None, got {loss_spike_factor}")
        if max_consecutive_skips < 0 or window < 1 or min_history < 1:
            raise ValueError("max_consecutive_skips >= 0, window >= 1, min_history >= 1")
        self.skip_nonfinite = skip_nonfinite
        self.max_consecutive_skips = max_consecutive_skips
        self.loss_spike_factor = loss_spike_factor
        self.min_history = min(min_history, window)
        self.good_losses: deque = deque(maxlen=window)
        self.consecutive_skips = 0
        self.total_skips = 0
        self.last_reason: Optional[str] = None

    # ------------------------------------------------------------------ decisions
    def check(self, loss: Optional[float], grad_norm: Optional[float]) -> Optional[str]:
        """None if the update may be applied, else a short reason ("nonfinite_grad_norm", ...)."""
        if self.skip_nonfinite:
            if grad_norm is not None and not math.isfinite(grad_norm):
                return "nonfinite_grad_norm"
            if loss is not None and not math.isfinite(loss):
                return "nonfinite_loss"
        thr = self.spike_threshold()
        if thr is not None and loss is not None and loss > thr:
            return "loss_spike"
        return None

    def spike_threshold(self) -> Optional[float]:
        if self.loss_spike_factor is None or len(self.good_losses) < self.min_history:
            return None
        return self.loss_spike_factor * sum(self.good_losses) / len(self.good_losses)

    def record_applied(self, loss: Optional[float]) -> None:
        self.consecutive_skips = 0
        self.last_reason = None
        if loss is not None and math.isfinite(loss):
            self.good_losses.append(float(loss))

    def record_skip(self, reason: str, *, counted: bool = True) -> None:
        self.last_reason = reason
        self.total_skips += 1
        if counted:
            self.consecutive_skips += 1

    @property
    def exhausted(self) -> bool:
        return 0 < self.max_consecutive_skips <= self.consecutive_skips

    def error(self, iteration: int, resume_from: Optional[str] = None,
              save_dir: Optional[str] = None) -> DivergenceError:
        """resume_from: the newest checkpoint from before the last applied step (None: none)."""
        if resume_from:
            where = (f"resume from {resume_from} (the newest checkpoint from before the divergence; "
                     f"checkpoint.load=auto picks it)")
        elif save_dir:
            where = (f"no checkpoint from before the divergence exists in {save_dir}: start again "
                     "(checkpoint.load=auto starts from iteration 0)")
        else:
            where = "no checkpoint.save_dir is set: start again"
        return DivergenceError(
            f"training diverged: {self.consecutive_skips} consecutive optimizer updates skipped "
            f"(last reason: {self.last_reason}) at iteration {iteration}; "
            f"train.max_consecutive_skips={self.max_consecutive_skips}. Lower the lr (a resume with "
            f"another lr needs checkpoint.override_scheduler=true) or raise "
            f"train.max_consecutive_skips, and {where}.")

    def reset(self) -> None:
        """Forget the good-loss window and the skip counts (a resume with other optimizer settings)."""
        self.good_losses.clear()
        self.consecutive_skips = 0
        self.last_reason = None

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        return {"good_losses": list(self.good_losses), "consecutive_skips": self.consecutive_skips,
                "total_skips": self.total_skips}

    def load_state_dict(self, sd: dict) -> None:
        self.good_losses.clear()
        self.good_losses.extend(sd.get("good_losses", []))
        self.consecutive_skips = int(sd.get("consecutive_skips", 0))
        self.total_skips = int(sd.get("total_skips", 0))


def guarded_optimizer_step(optimizer, guard: StepGuard, loss: Optional[float]):
    """megatron-core `optimizer.step()` with the guard's decision before the update.

    Returns (applied: bool, grad_norm: float | None, reason: str | None). grad_norm is None
    only on a grad-scaler overflow (as megatron's step() returns). Does not raise on
    exhaustion: the trainer checks `guard.exhausted`, sets diverged checkpoints aside, then
    raises `guard.error(...)` naming the checkpoint to resume from.
    Every rank must call it (grad-norm reduction is collective).
    """
    import torch

    with torch.no_grad():
        if optimizer.prepare_grads():          # fp16 loss-scaler overflow; scaler already updated
            guard.record_skip("grad_scaler_overflow", counted=False)
            return False, None, "grad_scaler_overflow"
        grad_norm = optimizer.get_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else None
        reason = guard.check(loss, grad_norm)
        if reason is not None:
            guard.record_skip(reason)
            return False, grad_norm, reason
        if grad_norm is not None:
            # clip by the norm already computed, each sub through the attribute its grads use
            from fullstack_fp4.integration.bf16_grads import clip_by_total_norm

            clip_by_total_norm(optimizer, grad_norm)
        applied = bool(optimizer.step_with_ready_grads())
    if applied:
        guard.record_applied(loss)
    else:
        guard.record_skip("step_not_successful")
    return applied, grad_norm, None if applied else "step_not_successful"
