"""StepGuard decisions, and guarded_optimizer_step against megatron-core's optimizers on CPU.

Oracle for "healthy": two trainers built from the same seed run the same forward/backward; one
takes megatron's plain optimizer.step(), the other guarded_optimizer_step(): params must be
bit-identical (fp32 and bf16 precision; grad clipping on, so the clip path is exercised).
Forced NaN: one main-grad element set to NaN after backward -> no param moves, skip reported.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron.training.config import load_config
from megatron.training.guards import DivergenceError, StepGuard, guarded_optimizer_step
from tests.megatron.training import helpers

TINY = ["model.preset=tiny", "model.seq_length=32", "model.vocab_size=256", "data.mock=true",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_iters=1",
        "logging.tensorboard=false", "checkpoint.load=none", "train.grad_clip=0.05"]


def _trainer(precision="fp32", extra=()):
    from megatron.training.trainer import Trainer

    cfg = load_config(None, TINY + [f"train.precision={precision}", *extra])
    cfg.logging.dir = None
    return Trainer(cfg, verbose=False)


_dist = pytest.fixture(scope="module", autouse=True)(helpers.in_process_megatron)


def _forward_backward(tr):
    tr.model.zero_grad_buffer()
    tr.optimizer.zero_grad()
    return tr._run_schedule(tr.train_ds, tr.consumed_samples, forward_only=False)


def _params(tr):
    return [p.detach().clone() for p in tr.model.parameters()]


# --------------------------------------------------------------------------- StepGuard
def test_guard_nonfinite_and_consecutive_limit():
    g = StepGuard(max_consecutive_skips=3)
    assert g.check(2.0, 1.0) is None
    assert g.check(2.0, float("nan")) == "nonfinite_grad_norm"
    assert g.check(float("inf"), 1.0) == "nonfinite_loss"
    assert g.check(None, None) is None   # non-last pipeline stage, overflow-free
    for i in range(3):
        assert not g.exhausted
        g.record_skip("nonfinite_grad_norm")
    assert g.exhausted and g.consecutive_skips == 3
    err = g.error(17)
    assert isinstance(err, DivergenceError) and "3 consecutive" in str(err) and "17" in str(err)
    g.record_applied(2.0)
    assert not g.exhausted and g.consecutive_skips == 0 and g.total_skips == 3
    g.record_skip("grad_scaler_overflow", counted=False)
    assert g.consecutive_skips == 0 and g.total_skips == 4
    assert StepGuard(skip_nonfinite=False).check(float("nan"), float("nan")) is None
    never = StepGuard(max_consecutive_skips=0)
    for _ in range(100):
        never.record_skip("x")
    assert not never.exhausted


def test_guard_loss_spike_rule_and_state():
    g = StepGuard(loss_spike_factor=1.5, window=4, min_history=3)
    assert g.spike_threshold() is None
    for loss in (4.0, 100.0):            # no history yet: never a spike
        assert g.check(loss, 1.0) is None
    for loss in (4.0, 4.0, 4.0, 2.0):
        g.record_applied(loss)
    assert g.spike_threshold() == pytest.approx(1.5 * (4 + 4 + 4 + 2) / 4)  # window 4
    g.record_applied(2.0)                # oldest 4.0 leaves the window
    assert g.spike_threshold() == pytest.approx(1.5 * 3.0)
    assert g.check(4.5, 1.0) is None and g.check(4.51, 1.0) == "loss_spike"
    g.record_skip("loss_spike")          # a skipped spike does not enter the window
    assert g.spike_threshold() == pytest.approx(4.5)
    h = StepGuard(loss_spike_factor=1.5, window=4, min_history=3)
    h.load_state_dict(g.state_dict())
    assert h.spike_threshold() == g.spike_threshold() and h.consecutive_skips == 1
    with pytest.raises(ValueError):
        StepGuard(loss_spike_factor=0.9)


# --------------------------------------------------------------------- megatron-core
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_healthy_step_identical_to_plain_step(precision):
    a, b = _trainer(precision), _trainer(precision)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    la, lb = _forward_backward(a), _forward_backward(b)
    assert la == lb
    before = _params(a)
    ok, norm_a, _ = a.optimizer.step()
    guard = StepGuard(loss_spike_factor=2.0)
    applied, norm_b, reason = guarded_optimizer_step(b.optimizer, guard, lb)
    assert ok and applied and reason is None
    assert norm_b == pytest.approx(float(norm_a), rel=0, abs=0)
    assert norm_b > 0.05                 # clipping really happened
    moved = 0
    for p0, pa, pb in zip(before, a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
        moved += not torch.equal(p0, pa)
    assert moved > 0
    assert list(guard.good_losses) == [lb] and guard.consecutive_skips == 0


def test_forced_nan_gradient_is_skipped():
    tr = _trainer("fp32")
    loss = _forward_backward(tr)
    before = _params(tr)
    p = next(q for q in tr.model.parameters() if q.requires_grad)
    p.main_grad.view(-1)[0] = float("nan")
    guard = StepGuard(max_consecutive_skips=2)
    applied, norm, reason = guarded_optimizer_step(tr.optimizer, guard, loss)
    assert not applied and reason == "nonfinite_grad_norm" and math.isnan(norm)
    for p0, p1 in zip(before, tr.model.parameters()):
        assert torch.equal(p0, p1)
    assert guard.consecutive_skips == 1 and not guard.exhausted
    # the next healthy step applies and resets the counter
    loss = _forward_backward(tr)
    applied, norm, reason = guarded_optimizer_step(tr.optimizer, guard, loss)
    assert applied and math.isfinite(norm) and guard.consecutive_skips == 0
    assert any(not torch.equal(p0, p1) for p0, p1 in zip(before, tr.model.parameters()))


def test_loss_spike_skips_update():
    tr = _trainer("fp32")
    loss = _forward_backward(tr)
    before = _params(tr)
    guard = StepGuard(loss_spike_factor=1.1, min_history=1)
    guard.record_applied(loss / 2)       # history says the loss was half of this one
    applied, norm, reason = guarded_optimizer_step(tr.optimizer, guard, loss)
    assert not applied and reason == "loss_spike" and math.isfinite(norm)
    for p0, p1 in zip(before, tr.model.parameters()):
        assert torch.equal(p0, p1)
