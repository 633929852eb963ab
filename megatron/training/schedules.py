"""Learning-rate schedules: linear warmup, then cosine, warmup-stable-decay, or constant.

`learning_rate(o, i, total)` is the schedule of one config, a pure function of the iteration.

A run continued from a checkpoint follows an `LRSchedule`: one `Segment` per setting the run
has had, each governing the iterations from its `start` on, joined so that the lr does not
jump where a setting changes (megatron/training/continuation.py decides when a change is
allowed and which join it gets):

  * `extend` (a longer run: `train.iters` or `optimizer.decay_iters` changed): the rest of
    the previous curve, from the resume iteration R (or the end of warmup, if later) to its
    decay horizon D_old, is stretched over [R, D_new]:
    lr(i) = prev(R + (i - R) (D_old - R) / (D_new - R)). For a cosine that is the cosine
    progress re-anchored at R: p(i) = p(R) + (1 - p(R)) (i - R) / (D_new - R). A run resumed
    at or after D_old has nothing left to stretch and stays at the curve's last value.
  * `override` (`checkpoint.override_scheduler=true`: any new setting): the new schedule, a
    function of the absolute iteration as for a fresh run with these settings, reached from
    the previous curve's lr at R in `warmup_iters` (the new setting's) equal steps:
    lr(i) = a + (i - R + 1) / W (new(i) - a) for R <= i < R + W, a = prev(R); new(i) after.
    With warmup_iters = 0 the new schedule applies at once (the one way to ask for a jump).

The checkpoint records the segments (`LRSchedule.to_record`), so a second resume continues
the same curve.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from megatron.training.config_schema import OptimizerConfig


def learning_rate(o: OptimizerConfig, iteration: int, total_iters: int) -> float:
    """lr for the step that takes the model from `iteration` to `iteration + 1`."""
    return Setting.from_config(o, total_iters).at(iteration)


@dataclass(frozen=True)
class Setting:
    """The lr schedule of one config; `decay_iters` is the resolved decay horizon."""
    lr: float
    min_lr: float
    schedule: str
    warmup_iters: int
    decay_iters: int
    wsd_decay_fraction: float

    @classmethod
    def from_config(cls, o: OptimizerConfig, total_iters: int) -> "Setting":
        return cls(float(o.lr), float(o.min_lr), o.schedule, int(o.warmup_iters),
                   int(o.decay_iters or total_iters), float(o.wsd_decay_fraction))

    def at(self, iteration: int) -> float:
        if self.warmup_iters > 0 and iteration < self.warmup_iters:
            return self.lr * (iteration + 1) / self.warmup_iters
        if self.schedule == "constant":
            return self.lr
        if self.schedule == "cosine":
            span = max(1, self.decay_iters - self.warmup_iters)
            progress = min(1.0, (iteration - self.warmup_iters) / span)
            return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))
        # wsd: hold lr, then decay linearly to min_lr over the last wsd_decay_fraction of decay_iters
        decay_start = self.decay_iters - int(round(self.wsd_decay_fraction * self.decay_iters))
        if iteration < decay_start:
            return self.lr
        progress = min(1.0, (iteration - decay_start) / max(1, self.decay_iters - decay_start))
        return self.lr + (self.min_lr - self.lr) * progress


@dataclass(frozen=True)
class Segment:
    start: int           # first iteration this setting governs
    setting: Setting
    join: str = "start"  # start (the first segment) | extend | override


class LRSchedule:
    def __init__(self, segments: list[Segment]):
        if not segments or segments[0].start != 0 or segments[0].join != "start":
            raise ValueError("an LRSchedule starts with a 'start' segment at iteration 0")
        for a, b in zip(segments, segments[1:]):
            if b.start < a.start or b.join not in ("extend", "override"):
                raise ValueError(f"bad lr schedule segment {b}")
        self.segments = list(segments)

    @classmethod
    def fresh(cls, o: OptimizerConfig, total_iters: int) -> "LRSchedule":
        return cls([Segment(0, Setting.from_config(o, total_iters))])

    @property
    def setting(self) -> Setting:
        """The setting in force now (the last segment's)."""
        return self.segments[-1].setting

    def then(self, start: int, setting: Setting, join: str) -> "LRSchedule":
        """This schedule up to `start`, continued by `setting` joined as `join`."""
        if start < self.segments[-1].start:
            raise ValueError(f"a segment at {start} would come before the one at {self.segments[-1].start}")
        return LRSchedule(self.segments + [Segment(start, setting, join)])

    def lr(self, iteration: int) -> float:
        """lr for the step that takes the model from `iteration` to `iteration + 1`."""
        return self._lr(len(self.segments) - 1, iteration)

    def _lr(self, k: int, i: float) -> float:
        while k > 0 and i < self.segments[k].start:
            k -= 1
        seg = self.segments[k]
        if seg.join == "start":
            return seg.setting.at(i)
        if seg.join == "extend":
            return self._lr(k - 1, self._stretch(k, i))
        w = seg.setting.warmup_iters
        target = seg.setting.at(i)
        if w <= 0 or i >= seg.start + w:
            return target
        a = self._lr(k - 1, seg.start)
        return a + (i - seg.start + 1) / w * (target - a)

    def _stretch(self, k: int, i: float) -> float:
        """Where iteration i of extend segment k falls on the previous curve."""
        seg = self.segments[k]
        r = max(seg.start, seg.setting.warmup_iters)   # warmup is not stretched
        d_old, d_new = self.segments[k - 1].setting.decay_iters, seg.setting.decay_iters
        if i < r or d_old <= r:
            return i          # before the stretch; or the old curve is already at its end value
        if d_new <= r:
            return max(i, d_old)   # the decay ends now (continuation.py refuses this join)
        return r + (i - r) * (d_old - r) / (d_new - r)

    def to_record(self) -> list[dict]:
        return [{"start": s.start, "join": s.join, **asdict(s.setting)} for s in self.segments]

    @classmethod
    def from_record(cls, record: list[dict]) -> "LRSchedule":
        segs = []
        for r in record:
            r = dict(r)
            start, join = int(r.pop("start")), r.pop("join")
            segs.append(Segment(start, Setting(**r), join))
        return cls(segs)
