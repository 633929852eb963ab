"""train.manual_gc: the collector is off during the loop, collects where the policy says, and is
restored afterwards, also when the loop raises. The oracle for "collected" is a weak reference
to an object that only a cycle keeps alive (reference counting alone never frees it)."""
from __future__ import annotations

import gc
import weakref

import pytest

from megatron.training.config import load_config
from megatron.training.config_validate import validate_config
from megatron.training.errors import ConfigError
from megatron.training.gc_policy import GarbageCollection
from tests.megatron.training import helpers


class _Node:
    pass


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def auto_gc():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_manual_policy_collects_only_at_its_points(auto_gc):
    policy = GarbageCollection(manual=True, interval=3)
    policy.start()
    try:
        assert not gc.isenabled()
        ref = _cycle()
        for it in (1, 2):
            policy.after_step(it)
        junk = [[i] for i in range(200_000)]   # would trigger automatic collections
        del junk
        assert ref() is not None               # off-interval: the cycle is still there
        policy.after_step(3)
        assert ref() is None                   # interval step: collected
        ref = _cycle()
        policy.checkpoint()
        assert ref() is None
    finally:
        policy.stop()
    assert gc.isenabled()


def test_interval_zero_and_off(auto_gc):
    policy = GarbageCollection(manual=True, interval=0)
    policy.start()
    ref = _cycle()
    for it in range(1, 50):
        policy.after_step(it)
    assert ref() is not None
    policy.stop()
    assert gc.isenabled()
    off = GarbageCollection(manual=False, interval=5)
    off.start()
    assert gc.isenabled()
    ref = _cycle()
    off.after_step(5)
    off.checkpoint()
    off.stop()
    assert gc.isenabled()
    gc.collect()
    assert ref() is None


def test_stop_restores_a_disabled_collector():
    was = gc.isenabled()
    gc.disable()
    try:
        policy = GarbageCollection(manual=True)
        policy.start()
        policy.stop()
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    with pytest.raises(ValueError):
        GarbageCollection(manual=True, interval=-1)


def test_config_validates_interval():
    with pytest.raises(ConfigError, match="manual_gc_interval"):
        validate_config(load_config(None, ["model.preset=tiny", "train.manual_gc=true",
                                          "train.manual_gc_interval=-2"]),
                        world_size=1)


_dist = pytest.fixture(scope="module")(helpers.in_process_megatron)


def test_trainer_restores_the_collector_when_the_loop_raises(auto_gc, _dist, monkeypatch):
    from megatron.training.trainer import Trainer

    cfg = load_config(None, ["model.preset=tiny", "model.seq_length=32", "model.vocab_size=256",
                             "data.mock=true", "train.global_batch_size=4",
                             "train.micro_batch_size=2", "train.precision=fp32", "train.iters=3",
                             "train.eval_iters=0", "logging.tensorboard=false",
                             "checkpoint.load=none", "train.manual_gc=true",
                             "train.manual_gc_interval=2"])
    cfg.logging.dir = None
    tr = Trainer(cfg, verbose=False)
    seen = []
    real_step = tr.train_step

    def step():
        seen.append(gc.isenabled())
        if len(seen) == 3:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(tr, "train_step", step)
    with pytest.raises(RuntimeError, match="boom"):
        tr.train()
    assert seen == [False, False, False] and gc.isenabled()
