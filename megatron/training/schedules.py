"""Learning-rate schedules: linear warmup, then cosine, warmup-stable-decay, or constant.

A pure function of the iteration, so resuming needs no scheduler state beyond the iteration
(the checkpoint still records the resolved schedule, so a changed config is detected).
"""
from __future__ import annotations

import math

from megatron.training.config_schema import OptimizerConfig


def learning_rate(o: OptimizerConfig, iteration: int, total_iters: int) -> float:
    """lr for the step that takes the model from `iteration` to `iteration + 1`."""
    decay_iters = o.decay_iters or total_iters
    if o.warmup_iters > 0 and iteration < o.warmup_iters:
        return o.lr * (iteration + 1) / o.warmup_iters
    if o.schedule == "constant":
        return o.lr
    if o.schedule == "cosine":
        span = max(1, decay_iters - o.warmup_iters)
        progress = min(1.0, (iteration - o.warmup_iters) / span)
        return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + math.cos(math.pi * progress))
    # wsd: hold lr, then decay linearly to min_lr over the last wsd_decay_fraction of decay_iters
    decay_start = decay_iters - int(round(o.wsd_decay_fraction * decay_iters))
    if iteration < decay_start:
        return o.lr
    progress = min(1.0, (iteration - decay_start) / max(1, decay_iters - decay_start))
    return o.lr + (o.min_lr - o.lr) * progress
