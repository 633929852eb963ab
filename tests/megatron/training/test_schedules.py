"""Learning-rate schedules against hand-computed values.

Convention (schedules.py): `learning_rate(o, i, total)` is the lr of the step that takes the
model from iteration i to i + 1; warmup is linear, lr·(i+1)/warmup, so the first step is not 0.
"""
from __future__ import annotations

import math

import pytest

from megatron.training.config_schema import OptimizerConfig
from megatron.training.schedules import learning_rate


def cfg(**kw):
    return OptimizerConfig(**{"lr": 1e-3, "min_lr": 1e-4, "warmup_iters": 10, **kw})


@pytest.mark.parametrize("it, expected", [
    (0, 1e-4),             # warmup start: 1/10 of lr
    (4, 5e-4),             # 5/10
    (9, 1e-3),             # last warmup step reaches lr
    (10, 1e-3),            # decay starts at lr (progress 0)
    (35, 1e-4 + 0.45e-3 * (1 + math.sqrt(0.5))),  # progress 1/4: cos(pi/4)
    (60, 5.5e-4),          # mid-decay: halfway between lr and min_lr
    (85, 1e-4 + 0.45e-3 * (1 - math.sqrt(0.5))),  # progress 3/4
    (110, 1e-4),           # end: min_lr
    (150, 1e-4),           # past the end: stays at min_lr
])
def test_cosine(it, expected):
    assert learning_rate(cfg(schedule="cosine"), it, 110) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_cosine_decay_iters_overrides_total():
    o = cfg(schedule="cosine", decay_iters=60)
    assert learning_rate(o, 35, 1000) == pytest.approx(5.5e-4, rel=1e-12)  # halfway of 10..60
    assert learning_rate(o, 60, 1000) == pytest.approx(1e-4, rel=1e-12)
    assert learning_rate(o, 500, 1000) == pytest.approx(1e-4, rel=1e-12)


@pytest.mark.parametrize("it, expected", [
    (0, 1e-4),      # warmup start
    (9, 1e-3),      # end of warmup
    (10, 1e-3),     # stable phase
    (50, 1e-3),
    (79, 1e-3),     # last stable step: decay takes the last 20% = iterations 80..100
    (80, 1e-3),     # decay progress 0
    (85, 1e-3 - 0.25 * 0.9e-3),
    (90, 5.5e-4),   # mid-decay: linear, halfway
    (100, 1e-4),    # end: min_lr
    (120, 1e-4),
])
def test_wsd(it, expected):
    o = cfg(schedule="wsd", wsd_decay_fraction=0.2)
    assert learning_rate(o, it, 100) == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("it, expected", [(0, 1e-4), (9, 1e-3), (10, 1e-3), (55, 1e-3), (100, 1e-3), (500, 1e-3)])
def test_constant(it, expected):
    assert learning_rate(cfg(schedule="constant"), it, 100) == pytest.approx(expected, rel=1e-12)


def test_no_warmup_starts_at_lr():
    for schedule in ("cosine", "wsd", "constant"):
        assert learning_rate(cfg(schedule=schedule, warmup_iters=0), 0, 100) == pytest.approx(1e-3, rel=1e-12)
    assert learning_rate(cfg(schedule="cosine", warmup_iters=0), 50, 100) == pytest.approx(5.5e-4, rel=1e-12)


def test_schedules_are_monotone_after_warmup():
    for schedule in ("cosine", "wsd"):
        o = cfg(schedule=schedule)
        lrs = [learning_rate(o, i, 200) for i in range(10, 260)]
        assert all(a >= b for a, b in zip(lrs, lrs[1:])), schedule
        assert min(lrs) == pytest.approx(1e-4) and max(lrs) == pytest.approx(1e-3)
