"""When Python's cyclic garbage collector runs during training (``train.manual_gc``).

Why: the collector runs whenever enough container objects have been allocated, i.e. at some
point inside a step, and a full (generation-2) pass walks every live object of the process —
megatron-core's modules, the Triton and torch caches, the data pipeline — while the GPU, fed by
this one host thread, drains its queue and waits. The FP4 recipes allocate more small Python
objects a step than BF16 (NVFP4 operands, autograd contexts), so they trigger it more often.
Megatron-LM has the same switch (``--manual-gc``, ``--manual-gc-interval``): turn automatic
collection off for the training loop and collect at points where the GPU waits anyway.

What stays true with it on: reference counting still frees every object that is not in a cycle
the moment it is dropped (activations, NVFP4 codes, gradients), so only cyclic garbage waits
for the next collection. ``manual_gc_interval`` bounds how long that is (0: only around
validation and checkpoints, Megatron-LM's default).
"""

from __future__ import annotations

import gc


class GarbageCollection:
    """The collector policy of one training run: ``start()`` before the first step,
    ``after_step(iteration)`` after each, ``checkpoint()`` around validation and saving,
    ``stop()`` when the loop ends (also on an exception: the caller uses try/finally)."""

    def __init__(self, manual: bool, interval: int = 0):
        if interval < 0:
            raise ValueError(f"manual_gc_interval must be >= 0, got {interval}")
        self.manual, self.interval = manual, interval
        self._was_enabled = None

    @classmethod
    def from_config(cls, train_cfg) -> "GarbageCollection":
        return cls(train_cfg.manual_gc, train_cfg.manual_gc_interval)

    def start(self) -> None:
        if not self.manual or self._was_enabled is not None:
            return
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()          # start from a clean heap: model build and checkpoint load garbage

    def after_step(self, iteration: int) -> None:
        if self.manual and self.interval and iteration % self.interval == 0:
            gc.collect()

    def checkpoint(self) -> None:
        """Validation or a checkpoint save: the step loop pauses there anyway."""
        if self.manual:
            gc.collect()

    def stop(self) -> None:
        if self._was_enabled is None:
            return
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
