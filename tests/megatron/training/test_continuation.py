"""Continuing from a checkpoint (megatron/training/continuation.py, schedules.py's LRSchedule).

Oracles: learning rates computed here by hand from the closed forms (cosine re-anchored at
the resume step, the linear ramp of an override), the checkpoint's own tensors as loaded by
the full-resume path, and the command line the quickstart prints.

Runs (subprocesses of pretrain_gpt.py, tiny fp32 model, mock data, lr 3e-3 -> 3e-4, cosine,
warmup 2): `base` trains 6 steps and saves at 3 and 6; the resumes start from those.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

from megatron.training import continuation
from megatron.training.config import load_config
from megatron.training.errors import CheckpointError, ConfigError
from megatron.training.schedules import LRSchedule, Segment, Setting
from tests.megatron.training import helpers

LR, MIN_LR, WARMUP, ITERS = 3e-3, 3e-4, 2, 6


def cosine(i, *, lr=LR, min_lr=MIN_LR, warmup=WARMUP, horizon=ITERS):
    """The plain schedule, written out: linear warmup lr·(i+1)/W, then cosine to min_lr."""
    if i < warmup:
        return lr * (i + 1) / warmup
    p = min(1.0, (i - warmup) / (horizon - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * p))


def reanchored(i, r, old_horizon, new_horizon, warmup=WARMUP):
    """extend, by hand: the cosine's progress p(R) carried on linearly to 1 at the new horizon."""
    p_r = (r - warmup) / (old_horizon - warmup)
    p = min(1.0, p_r + (1 - p_r) * (i - r) / (new_horizon - r))
    return MIN_LR + 0.5 * (LR - MIN_LR) * (1 + math.cos(math.pi * p))


def setting(**kw):
    base = dict(lr=LR, min_lr=MIN_LR, schedule="cosine", warmup_iters=WARMUP, decay_iters=ITERS,
                wsd_decay_fraction=0.2)
    return Setting(**{**base, **kw})


def plain(**kw) -> LRSchedule:
    return LRSchedule([Segment(0, setting(**kw))])


# ------------------------------------------------------------------------- LRSchedule
def test_extend_mid_decay_is_the_cosine_reanchored_at_the_resume_step():
    s = plain()
    ext = s.then(3, setting(decay_iters=10), "extend")
    for i in range(0, 3):
        assert ext.lr(i) == s.lr(i) == pytest.approx(cosine(i), rel=1e-15)
    for i in range(3, 14):
        assert ext.lr(i) == pytest.approx(reanchored(i, 3, 6, 10), rel=1e-12), i
    assert ext.lr(3) == pytest.approx(s.lr(3), rel=1e-15)   # no jump at the resume step
    assert ext.lr(10) == pytest.approx(MIN_LR, rel=1e-12)


def test_extend_after_the_old_horizon_stays_at_min_lr():
    # the quickstart's numbers: 300 steps (warmup 30) done, continued to 600
    q = dict(lr=3e-3, min_lr=3e-4, warmup_iters=30)
    s = plain(decay_iters=300, **q)
    ext = s.then(300, setting(decay_iters=600, **q), "extend")
    assert [ext.lr(i) for i in range(300, 600)] == [3e-4] * 300
    # the last step before and the first after differ less than two steps of the saved curve did
    assert abs(ext.lr(300) - s.lr(299)) <= abs(s.lr(299) - s.lr(298))


def test_extend_of_wsd_in_its_stable_phase_moves_the_decay_to_the_end():
    old = setting(schedule="wsd", decay_iters=100, warmup_iters=10, wsd_decay_fraction=0.2)   # decay 80..100
    s = LRSchedule([Segment(0, old)])
    ext = s.then(50, dataclasses.replace(old, decay_iters=200), "extend")
    # by hand: [50, 200] maps linearly onto [50, 100]: the stable phase ends at 50 + 30·3 = 140
    assert all(ext.lr(i) == LR for i in range(50, 141))
    assert ext.lr(170) == pytest.approx((LR + MIN_LR) / 2, rel=1e-12)
    assert ext.lr(200) == pytest.approx(MIN_LR, rel=1e-12)


def test_override_ramps_from_the_saved_lr_to_the_new_schedule():
    s = plain()
    new = setting(lr=1e-3, warmup_iters=4, decay_iters=12)
    o = s.then(5, new, "override")
    a = cosine(5)   # the saved curve's lr at the resume step
    for i in range(5, 9):   # 4 equal steps from a to the new schedule
        target = cosine(i, lr=1e-3, warmup=4, horizon=12)
        assert o.lr(i) == pytest.approx(a + (i - 5 + 1) / 4 * (target - a), rel=1e-12), i
    for i in range(9, 15):
        assert o.lr(i) == pytest.approx(cosine(i, lr=1e-3, warmup=4, horizon=12), rel=1e-12), i
    # warmup_iters = 0: the new schedule at once
    at_once = s.then(5, dataclasses.replace(new, warmup_iters=0), "override")
    assert at_once.lr(5) == pytest.approx(cosine(5, lr=1e-3, warmup=0, horizon=12), rel=1e-12)


def test_a_chain_of_joins_survives_the_checkpoint_record():
    chain = plain().then(3, setting(decay_iters=10), "extend").then(7, setting(decay_iters=20), "extend") \
                   .then(12, setting(lr=2e-3, decay_iters=20, warmup_iters=3), "override")
    back = LRSchedule.from_record(json.loads(json.dumps(chain.to_record())))
    assert [back.lr(i) for i in range(25)] == [chain.lr(i) for i in range(25)]
    for k, r in ((1, 3), (2, 7)):   # each extend starts where the curve before it was
        assert chain.lr(r) == pytest.approx(LRSchedule(chain.segments[:k]).lr(r), rel=1e-12)


# ------------------------------------------------------------------------- the resume check
def _cfg(*overrides):
    return load_config(None, helpers.TINY + ["train.iters=6", *overrides])


def _meta(cfg, iteration=6, **extra):
    return {"iteration": iteration, "consumed_samples": 4 * iteration, "config": dataclasses.asdict(cfg), **extra}


@pytest.mark.parametrize("override, key_text, hint", [
    ("optimizer.warmup_iters=3", "optimizer.warmup_iters 2 → 3", "checkpoint.override_scheduler=true"),
    ("train.iters=10", "train.iters 6 → 10", "train.continue_with=extend"),
    ("data.path=[other/prefix]", "data.path [] → [other/prefix]", "train.continue_with=new_data"),
    ("train.global_batch_size=8", "train.global_batch_size 4 → 8", "train.continue_with=new_batch_size"),
    ("optimizer.weight_decay=0.05", "optimizer.weight_decay 0.1 → 0.05", "checkpoint.override_scheduler=true"),
])
def test_an_unstated_change_is_refused_naming_the_key(override, key_text, hint):
    saved = _cfg()
    with pytest.raises(CheckpointError) as e:
        continuation.plan_resume(_meta(saved), _cfg(override), "ck/iter_0000006")
    msg = str(e.value)
    assert key_text in msg and hint in msg and "\n" not in msg, msg
    assert "checkpoint.load_mode=weights_only" in msg


def test_data_path_change_between_real_prefixes_is_refused():
    saved = _cfg("data.mock=false", "data.path=[a/train]", "data.tokenizer=t.model")
    with pytest.raises(CheckpointError, match=r"data\.path \[a/train\] → \[b/train\]"):
        continuation.plan_resume(_meta(saved), _cfg("data.mock=false", "data.path=[b/train]", "data.tokenizer=t.model"),
                                 "ck")
    # the same prefixes written differently, the same split in other units: no change
    same = _cfg("data.mock=false", "data.path=[a/./train]", "data.tokenizer=t.model", "data.split=49,1,0")
    state, lines = continuation.plan_resume(_meta(saved), same, "ck")
    assert lines == []


def test_stated_changes_are_accepted_and_reported():
    saved = _cfg()
    state, lines = continuation.plan_resume(_meta(saved, iteration=3),
                                            _cfg("train.iters=10", "train.continue_with=extend"), "ck")
    assert [s.join for s in state.schedule.segments] == ["start", "extend"]
    assert state.lr(5) == pytest.approx(reanchored(5, 3, 6, 10), rel=1e-12)
    assert len(lines) == 1 and "train.iters 6 → 10" in lines[0]
    state, lines = continuation.plan_resume(
        _meta(saved, iteration=3), _cfg("optimizer.lr=1e-3", "checkpoint.override_scheduler=true",
                                        "train.continue_with=[new_data,new_batch_size]",
                                        "train.seed=7", "train.global_batch_size=8"), "ck")
    assert [s.join for s in state.schedule.segments] == ["start", "override"]
    assert len(lines) == 3 and "train.seed 1234 → 7" in lines[2]
    # a second resume of the continued run with the same config: nothing changes, the joins stay
    continued = plain().then(3, setting(decay_iters=10), "extend")
    now = _cfg("train.iters=10", "train.continue_with=extend")
    again, lines = continuation.plan_resume(_meta(now, iteration=8, lr_schedule=continued.to_record()), now, "ck")
    assert lines == [] and [s.join for s in again.schedule.segments] == ["start", "extend"]


def test_a_changed_fp4_numerics_key_is_refused_until_stated():
    saved = _cfg("fp4.linear=nvfp4")
    for override, text in (("fp4.linear_scale_rule.x=4over6", "fp4.linear_scale_rule.x 6 → 4over6"),
                           ("fp4.bf16_from=5", "fp4.bf16_from null → 5"),
                           ("fp4.unquantized_operands=[w]", "fp4.unquantized_operands [] → [w]")):
        with pytest.raises(CheckpointError) as e:
            continuation.plan_resume(_meta(saved, iteration=3), _cfg("fp4.linear=nvfp4", override), "ck")
        msg = str(e.value)
        assert text in msg and "train.continue_with=new_precision" in msg and "\n" not in msg, msg
        state, lines = continuation.plan_resume(
            _meta(saved, iteration=3), _cfg("fp4.linear=nvfp4", override, "train.continue_with=new_precision"), "ck")
        assert lines == [f"[checkpoint] train.continue_with=new_precision: {text}; from iteration 3 on"]


def test_a_fractional_switch_that_moves_with_train_iters_is_reported():
    saved = _cfg("fp4.linear=nvfp4", "fp4.bf16_from=0.75", "train.iters=4")     # switch after step 3
    now = _cfg("fp4.linear=nvfp4", "fp4.bf16_from=0.75", "train.iters=8", "train.continue_with=extend")
    _, lines = continuation.plan_resume(_meta(saved, iteration=4), now, "ck")   # 0.75 of 8: after step 6
    assert lines[-1] == ("[precision] fp4.bf16_from=0.75 follows train.iters 4 → 8: the switch to BF16 moves from "
                         "after step 3 to after step 6; the checkpoint (iteration 4) has run in BF16 since step 4, "
                         "so steps 5..6 run the FP4 recipes again (fp4.bf16_from=3 with "
                         "train.continue_with=new_precision stays in BF16)")
    _, lines = continuation.plan_resume(_meta(saved, iteration=2), now, "ck")   # still FP4 at 2: only the move
    assert lines[-1].endswith("moves from after step 3 to after step 6")
    # the same switch step written as its integer needs the statement, then stays in BF16
    stay = _cfg("fp4.linear=nvfp4", "fp4.bf16_from=3", "train.iters=8", "train.continue_with=[extend,new_precision]")
    _, lines = continuation.plan_resume(_meta(saved, iteration=4), stay, "ck")
    assert not any(ln.startswith("[precision]") for ln in lines) and "fp4.bf16_from 0.75 → 3" in lines[-1]


def test_extend_to_a_horizon_before_the_resume_step_is_refused():
    saved = _cfg("train.iters=20")
    with pytest.raises(CheckpointError, match="needs a decay horizon after the resume point"):
        continuation.plan_resume(_meta(saved, iteration=10),
                                 _cfg("train.iters=20", "optimizer.decay_iters=8", "train.continue_with=extend"), "ck")


WRITES = ["checkpoint.save_dir=ck", "logging.dir=log"]   # a training run: it would rewrite its config files


@pytest.mark.parametrize("iteration, overrides, advice", [
    (6, ["train.iters=3"], ["train.iters=12", "train.continue_with=extend"]),  # `make quickstart` after extending
    (6, ["train.iters=3", "train.continue_with=extend"],                   # the old advice, followed
     ["train.iters=12", "train.continue_with=extend"]),
    (3, ["train.iters=2"], ["train.iters=6"]),                             # unfinished: its own length
    (6, ["optimizer.lr=1e-3"], ["train.iters=12", "checkpoint.override_scheduler=true"]),
    (6, ["train.seed=7", "train.global_batch_size=8"],
     ["train.iters=12", "'train.continue_with=[extend,new_data,new_batch_size]'"]),
])
def test_a_checkpoint_at_or_past_train_iters_is_refused_naming_a_resume_that_trains(iteration, overrides, advice):
    """train.iters <= the checkpoint's iteration: one line, whatever else changed, and its
    advice, followed, plans a resume that trains (never one refused next, or a no-op)."""
    meta = _meta(_cfg(), iteration=iteration)
    with pytest.raises(CheckpointError) as e:
        continuation.plan_resume(meta, _cfg(*WRITES, *overrides), "ck/iter")
    msg = str(e.value)
    assert "\n" not in msg and f"checkpoint ck/iter is already at iteration {iteration}" in msg, msg
    assert "nothing to train" in msg and re.search(rf"To train on from it, set {re.escape(' '.join(advice))}( \(it "
                                                   r"also states this config's other changes: [^)]*\))?; ", msg), msg
    assert "its own checkpoint.save_dir" in msg and "checkpoint.load=ck/iter checkpoint.load_mode=weights_only" in msg
    followed = _cfg(*WRITES, *overrides, *[a.strip("'") for a in advice])
    state, _ = continuation.plan_resume(meta, followed, "ck/iter")
    assert followed.train.iters > iteration


def test_a_complete_run_started_again_as_it_was_is_not_refused():
    """A requeued job of a finished run: nothing to train, exit 0 (Megatron-LM's behaviour). The
    same length with anything else changed is refused (it would record a run that never was)."""
    meta = _meta(_cfg(), iteration=6)
    state, lines = continuation.plan_resume(meta, _cfg(*WRITES), "ck")
    assert lines == []
    with pytest.raises(CheckpointError, match="nothing to train"):
        continuation.plan_resume(meta, _cfg(*WRITES, "train.seed=7", "train.continue_with=new_data"), "ck")
    with pytest.raises(CheckpointError, match="nothing to train"):      # unfinished run, cut to its step
        continuation.plan_resume(_meta(_cfg(), iteration=3), _cfg(*WRITES, "train.iters=3"), "ck")


def test_a_finished_checkpoint_read_by_a_trainer_that_writes_nothing_is_not_refused():
    # scripts/export_merged_checkpoint.py, the evaluation oracles: no save_dir, no logging.dir
    state, lines = continuation.plan_resume(_meta(_cfg(), iteration=6), _cfg(), "ck")
    assert lines == []


def test_the_old_length_of_a_complete_run_is_not_offered_as_a_way_on():
    # 6 of 6 done, asked for 10: "put the old values back" would be train.iters=6, a no-op
    with pytest.raises(CheckpointError) as e:
        continuation.plan_resume(_meta(_cfg(), iteration=6), _cfg(*WRITES, "train.iters=10"), "ck")
    assert "put the old values back" not in str(e.value) and "train.continue_with=extend" in str(e.value)
    with pytest.raises(CheckpointError) as e:
        continuation.plan_resume(_meta(_cfg(), iteration=6), _cfg(*WRITES, "train.iters=10", "train.seed=3"), "ck")
    assert "or put the old values back but train.iters (its run is complete)" in str(e.value)
    # an unfinished run's old values are a way on
    with pytest.raises(CheckpointError, match="; or put the old values back;"):
        continuation.plan_resume(_meta(_cfg(), iteration=3), _cfg(*WRITES, "train.iters=10"), "ck")


def test_another_precision_is_refused_before_a_tensor_is_read_unless_resharded(monkeypatch):
    from megatron.training import checkpointing

    meta = _meta(_cfg())
    with pytest.raises(CheckpointError) as e:
        checkpointing.check_compatible(meta, _cfg("train.precision=bf16"), "ck")
    msg = str(e.value)
    assert "\n" not in msg and "train.precision: checkpoint 'fp32', config 'bf16'" in msg, msg
    assert "resume with train.precision=fp32" in msg and "checkpoint.load_mode=weights_only" in msg
    checkpointing.check_compatible(meta, _cfg(), "ck")
    # a checkpoint converted at load (another TP size with FP4 optimizer state) goes through
    # FP32 masters, which either precision takes (measured: q_adamw TP=2 bf16 -> TP=1 fp32 and
    # fp32 -> bf16 resume with the losses of a same-precision resume)
    monkeypatch.setattr(checkpointing.ps, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(checkpointing.reshard, "needs_reshard", lambda meta, cfg: True)
    checkpointing.check_compatible(meta, _cfg("train.precision=bf16"), "ck")


@pytest.mark.parametrize("overrides, text", [
    (["checkpoint.override_scheduler=true", "train.continue_with=extend"], "keep one"),
    (["train.continue_with=longer"], "train.continue_with takes distinct values"),
    (["checkpoint.load_mode=weights_only"], "needs checkpoint.load=<checkpoint directory>"),
    (["checkpoint.load_mode=partial"], "checkpoint.load_mode must be one of full, weights_only"),
])
def test_config_rules(overrides, text):
    with pytest.raises(ConfigError, match=text):
        _cfg(*overrides)


# ------------------------------------------------------------------------- real runs
COMMON = ["train.iters=6", "train.eval_interval=3", "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("continuation"))
    p = helpers.start(helpers.base_config(d), COMMON + [f"checkpoint.save_dir={d}/ck", "checkpoint.save_interval=3",
                                                        "checkpoint.load=none", f"logging.dir={d}/log"],
                      log=os.path.join(d, "base.txt"))
    rc, out = helpers.finish(p)
    assert rc == 0, out[-3000:]
    return d


def _lrs(logdir):
    train, _ = helpers.read_metrics(logdir)
    return {it: rec["lr"] for it, rec in train.items()}   # record `it` used lr(it - 1)


def _quickstart():
    sys.path.insert(0, os.path.join(helpers.REPO, "scripts"))
    try:
        import quickstart
    finally:
        sys.path.pop(0)
    return quickstart


def test_resume_refusals_exit_2_with_one_line_and_write_nothing(base):
    cfg = helpers.base_config(base)
    procs = {}
    for name, ov in (("warmup", ["optimizer.warmup_iters=3"]), ("iters", ["train.iters=10"])):
        procs[name] = helpers.start(cfg, COMMON + ov + [f"checkpoint.load={base}/ck/iter_0000003",
                                                        f"checkpoint.save_dir={base}/refused_{name}",
                                                        f"logging.dir={base}/refused_{name}_log"],
                                    log=os.path.join(base, f"refused_{name}.txt"))
    for name, key in (("warmup", "optimizer.warmup_iters 2 → 3"), ("iters", "train.iters 6 → 10")):
        rc, out = helpers.finish(procs[name])
        errors = helpers.error_lines(out)
        assert rc == 2 and len(errors) == 1 and key in errors[0], out[-3000:]
        assert "Traceback" not in out
        saved = os.path.join(base, f"refused_{name}")
        assert not os.path.isdir(saved) or not [n for n in os.listdir(saved) if n.startswith("iter_")]


def test_the_quickstart_hint_continues_without_an_lr_jump(base):
    """The hint's own overrides, for the 6-step run: steps 7..12 stay at min_lr; from the
    mid-run checkpoint (iteration 3) the rest of the cosine is re-anchored — by hand."""
    hint = _quickstart().continue_overrides(ITERS)
    assert hint == ["train.iters=12", "train.continue_with=extend"]
    cfg = helpers.base_config(base)
    runs = {name: helpers.start(cfg, COMMON + [f"checkpoint.load={base}/ck/iter_000000{it}",
                                               f"checkpoint.save_dir={base}/{name}", f"logging.dir={base}/{name}_log",
                                               "train.eval_interval=100", *hint],
                                log=os.path.join(base, f"{name}.txt"))
            for name, it in (("from6", 6), ("from3", 3))}
    first = _lrs(f"{base}/log")
    assert sorted(first) == list(range(1, 7))
    for it, lr in first.items():
        assert lr == pytest.approx(cosine(it - 1), rel=1e-12), it
    for name in runs:
        rc, out = helpers.finish(runs[name])
        assert rc == 0, out[-3000:]
    from6, from3 = _lrs(f"{base}/from6_log"), _lrs(f"{base}/from3_log")
    assert sorted(from6) == list(range(7, 13)) and sorted(from3) == list(range(4, 13))
    assert all(from6[it] == MIN_LR for it in from6)
    for it, lr in from3.items():
        assert lr == pytest.approx(reanchored(it - 1, 3, 6, 12), rel=1e-12), it
    assert from3[4] == pytest.approx(first[4], rel=1e-12)   # the step after the checkpoint: as saved
    # the continued run's checkpoint keeps the join: resumed again, the same curve
    meta = json.load(open(os.path.join(base, "from3", "iter_0000012", "meta.json")))
    assert [s["join"] for s in meta["lr_schedule"]] == ["start", "extend"]


def test_override_scheduler_ramps_over_the_new_warmup(base):
    p = helpers.start(helpers.base_config(base), COMMON + [
        f"checkpoint.load={base}/ck/iter_0000003", f"checkpoint.save_dir={base}/override",
        f"logging.dir={base}/override_log", "optimizer.lr=1e-3", "checkpoint.override_scheduler=true"],
        log=os.path.join(base, "override.txt"))
    rc, out = helpers.finish(p)
    assert rc == 0, out[-3000:]
    lrs = _lrs(f"{base}/override_log")
    a = cosine(3)
    new = [cosine(i, lr=1e-3) for i in range(3, 6)]
    assert lrs[4] == pytest.approx(a + 0.5 * (new[0] - a), rel=1e-12)   # 1 of 2 ramp steps
    assert lrs[5] == pytest.approx(new[1], rel=1e-12) and lrs[6] == pytest.approx(new[2], rel=1e-12)
    assert "checkpoint.override_scheduler=true: optimizer.lr 0.003 → 0.001" in out


def _copy_run(base, dst):
    """A run directory of its own: the base run's checkpoints and logging dir, copied."""
    shutil.copytree(os.path.join(base, "ck"), os.path.join(dst, "ck"), ignore=shutil.ignore_patterns(".lock"))
    shutil.copytree(os.path.join(base, "log"), os.path.join(dst, "log"))
    helpers.base_config(dst)   # the run's (almost empty) YAML, written before any snapshot
    return [f"checkpoint.save_dir={dst}/ck", f"logging.dir={dst}/log"]


def snapshot(root: str) -> dict:
    """Every file (content hash) and directory under root, but the save_dir lock: its holder
    record is save_lock.py's bookkeeping of who runs, rewritten by every start."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs:
            out[os.path.relpath(os.path.join(d, n), root) + "/"] = None
        for n in files:
            if n != ".lock":
                with open(os.path.join(d, n), "rb") as f:
                    out[os.path.relpath(os.path.join(d, n), root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _start_split(name, d, overrides):
    """A run with stdout and stderr kept apart (stderr must be the one error line)."""
    out, err = open(os.path.join(d, f"{name}.out"), "w"), open(os.path.join(d, f"{name}.err"), "w")
    p = subprocess.Popen(helpers.pretrain_cmd(helpers.base_config(d), COMMON + overrides), cwd=helpers.REPO,
                         env=helpers.env(), stdout=out, stderr=err)
    p.name, p.dir = name, d
    return p


def _finish_split(p, timeout=300):
    rc = p.wait(timeout=timeout)
    read = lambda ext: open(os.path.join(p.dir, f"{p.name}.{ext}")).read()  # noqa: E731
    return rc, read("out"), read("err")


def _one_error_line(rc, out, err):
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), (rc, out[-2000:], err[-3000:])
    assert "Traceback" not in out + err
    return err.strip()


@pytest.mark.long   # several training runs end to end (make test-all)
def test_a_finished_run_started_again_is_refused_and_the_advice_trains(base, tmp_path):
    """The quickstart walk-through on the 6-step run: started again with a shorter train.iters
    (`make quickstart` after extending), or with the advice the old refusal gave (a shorter
    train.iters with extend), it used to exit 0 after training nothing and rewrite config.yaml;
    now one line, nothing written, and the command it names trains steps 7..12. Started again
    exactly as it was, it trains nothing and exits 0."""
    runs = {}
    for name, ov in (("shorter", ["train.iters=3"]), ("shorter_extend", ["train.iters=3", "train.continue_with=extend"])):
        d = str(tmp_path / name)
        os.makedirs(d)
        dirs = _copy_run(base, d)
        runs[name] = (d, dirs, snapshot(d), _start_split(name, d, dirs + ov))
    advice = {}
    for name, (d, dirs, before, p) in runs.items():
        line = _one_error_line(*_finish_split(p))
        assert f"{d}/ck/iter_0000006 is already at iteration 6 (its run is complete) and train.iters is" in line, line
        assert "[checkpoint] resumed" not in open(os.path.join(d, f"{name}.out")).read()
        os.remove(os.path.join(d, f"{name}.out")), os.remove(os.path.join(d, f"{name}.err"))
        assert snapshot(d) == before, name
        advice[name] = re.search(r"To train on from it, set (.*?); to start", line).group(1).split()
    assert advice["shorter"] == advice["shorter_extend"] == ["train.iters=12", "train.continue_with=extend"]
    d, dirs, _, _ = runs["shorter"]
    rc, out, err = _finish_split(_start_split("again", d, dirs))          # as it was: done, exit 0
    assert rc == 0 and "Traceback" not in err, out[-2000:] + err[-3000:]
    assert not os.path.exists(f"{d}/ck/iter_0000007") and sorted(helpers.read_metrics(f"{d}/log")[0]) == list(range(1, 7))
    rc, out, err = _finish_split(_start_split("followed", d, dirs + advice["shorter"]))
    assert rc == 0, out[-2000:] + err[-3000:]
    assert "[checkpoint] train.continue_with=extend: train.iters 6 → 12" in out
    train, _ = helpers.read_metrics(f"{d}/log")
    assert sorted(train) == list(range(1, 13))
    assert os.path.isdir(f"{d}/ck/iter_0000012")


def test_resumes_refused_at_load_print_one_line_and_no_extend_note(base, tmp_path):
    """Another train.precision (it used to be a KeyError from inside torch.distributed.checkpoint,
    after the extend note) and another distributed-optimizer setting (refused at load, after the
    extend note): one line each, no note, nothing written (no TensorBoard file either: the
    metrics logger opens once the checkpoint has loaded)."""
    runs = {}
    for name, ov in (("bf16", ["train.precision=bf16"]), ("distopt", ["parallel.use_distributed_optimizer=true",
                                                                        "logging.tensorboard=true"])):
        d = str(tmp_path / name)
        os.makedirs(d)
        dirs = _copy_run(base, d)
        runs[name] = (d, snapshot(d), _start_split(name, d, dirs + ov + ["train.iters=8", "train.continue_with=extend"]))
    for name, (d, before, p) in runs.items():
        rc, out, err = _finish_split(p)
        line = _one_error_line(rc, out, err)
        assert "[checkpoint] train.continue_with=extend" not in out, out[-2000:]
        if name == "bf16":
            assert line == (f"error: checkpoint {d}/ck/iter_0000006 does not match this config: train.precision: "
                            "checkpoint 'fp32', config 'bf16' (a full resume keeps the optimizer state, whose form "
                            "depends on train.precision: resume with train.precision=fp32, or start a new run from "
                            f"its weights with checkpoint.load={d}/ck/iter_0000006 checkpoint.load_mode=weights_only, "
                            "which takes another precision, and its own checkpoint.save_dir)"), line
        else:
            assert "parallel.use_distributed_optimizer=false and this run has true" in line, line
        os.remove(os.path.join(d, f"{name}.out")), os.remove(os.path.join(d, f"{name}.err"))
        assert snapshot(d) == before, name


def test_exit_interval_on_a_resumed_run_stops_at_its_next_multiple(base, tmp_path):
    """Megatron-LM's --exit-interval: stop after a step that is a multiple of it. Resumed at 6
    with exit_interval=4 the run stops at 8 (it used to stop at 7, after one step)."""
    d = str(tmp_path)
    dirs = _copy_run(base, d)
    rc, out, err = _finish_split(_start_split("exit", d, dirs + ["train.iters=12", "train.continue_with=extend",
                                                                 "train.exit_interval=4"]))
    assert rc == 0, out[-2000:] + err[-3000:]
    assert "[train] stopping at iteration 8 (train.exit_interval=4)" in out, out[-2000:]
    train, _ = helpers.read_metrics(f"{d}/log")
    assert sorted(train) == list(range(1, 9))
    assert sorted(n for n in os.listdir(f"{d}/ck") if n.startswith("iter_"))[-1] == "iter_0000008"


# ------------------------------------------------------------------------- weights only
_dist = pytest.fixture(scope="module")(helpers.in_process_megatron)


def _trainer(*overrides):
    from megatron.training.trainer import Trainer

    cfg = load_config(None, helpers.TINY + COMMON + list(overrides))
    return Trainer(cfg, verbose=False)


def test_weights_only_loads_the_weights_and_nothing_else(base, tmp_path, _dist):
    import torch

    full = _trainer(f"checkpoint.load={base}/ck/iter_0000006", "checkpoint.save_dir=null", "logging.dir=null")
    assert full.iteration == 6
    source = {k: v.clone() for k, v in full.gpt.state_dict().items() if v is not None}
    assert any(s for o in full.optimizer.chained_optimizers for s in o.optimizer.state.values())

    ft = _trainer(f"checkpoint.load={base}/ck/iter_0000006", "checkpoint.load_mode=weights_only",
                  f"checkpoint.save_dir={tmp_path}/ft", "logging.dir=null", "train.iters=2")
    assert ft.iteration == 0 and ft.consumed_samples == 0
    got = ft.gpt.state_dict()
    assert sorted(k for k in got if got[k] is not None) == sorted(source)
    for k, v in source.items():
        assert torch.equal(got[k], v), k
    fresh = _trainer("checkpoint.load=none", "checkpoint.save_dir=null", "logging.dir=null")
    assert not torch.equal(fresh.gpt.state_dict()["decoder.layers.0.mlp.linear_fc1.weight"],
                           source["decoder.layers.0.mlp.linear_fc1.weight"])   # the weights came from the file
    assert all(not o.optimizer.state for o in ft.optimizer.chained_optimizers)   # fresh optimizer state
    assert ft.run_state.lr(0) == pytest.approx(LR / WARMUP, rel=1e-15)          # fresh schedule
    ft.train()
    # restarted (to train on: a restart with nothing left to train is refused), the fine-tune
    # resumes its own checkpoint in full, not the source weights
    again = _trainer(f"checkpoint.load={base}/ck/iter_0000006", "checkpoint.load_mode=weights_only",
                     f"checkpoint.save_dir={tmp_path}/ft", "logging.dir=null", "train.iters=3",
                     "train.continue_with=extend")
    assert again.iteration == 2
    for k, v in ft.gpt.state_dict().items():
        if v is not None:
            assert torch.equal(again.gpt.state_dict()[k], v), k


def test_weights_only_refreshes_the_bf16_master_weights(tmp_path, _dist):
    """megatron-core's BF16 optimizer keeps FP32 master copies made when it was built: after a
    weights-only load they must be the loaded weights, or the first step would undo the load."""
    import torch

    src = _trainer("train.precision=bf16", "train.iters=2", "checkpoint.load=none",
                   f"checkpoint.save_dir={tmp_path}/src", "logging.dir=null")
    src.train()
    ft = _trainer("train.precision=bf16", "train.iters=2", f"checkpoint.load={tmp_path}/src",
                  "checkpoint.load_mode=weights_only", f"checkpoint.save_dir={tmp_path}/ft", "logging.dir=null")
    opt = ft.optimizer.chained_optimizers[0]
    mains = [p for g in opt.fp32_from_float16_groups for p in g]
    models = [p for g in opt.float16_groups for p in g]
    assert mains and len(mains) == len(models)
    for main, model in zip(mains, models):
        assert torch.equal(main, model.float())
    trained = {k: v for k, v in src.gpt.state_dict().items() if v is not None}
    assert all(torch.equal(ft.gpt.state_dict()[k], v) for k, v in trained.items())


def test_weights_only_takes_another_precision_of_the_same_parameters(base, tmp_path, _dist):
    """A BF16 checkpoint starts an NVFP4 + Q-Attn fine-tune (the same parameters); LoRA-SVD,
    which adds factor parameters, is refused by name."""
    import torch

    src = {k: v for k, v in _trainer(f"checkpoint.load={base}/ck/iter_0000006", "checkpoint.save_dir=null",
                                     "logging.dir=null").gpt.state_dict().items() if v is not None}
    ft = _trainer(f"checkpoint.load={base}/ck/iter_0000006", "checkpoint.load_mode=weights_only",
                  "fp4.linear=nvfp4", "fp4.attention=q_attn", f"checkpoint.save_dir={tmp_path}/ft",
                  "logging.dir=null")
    got = ft.gpt.state_dict()
    assert all(torch.equal(got[k], v) for k, v in src.items())
    with pytest.raises(CheckpointError, match="fp4.linear: checkpoint bf16, config lora_svd"):
        _trainer(f"checkpoint.load={base}/ck/iter_0000006", "checkpoint.load_mode=weights_only",
                 "fp4.linear=lora_svd", f"checkpoint.save_dir={tmp_path}/ft2", "logging.dir=null")


def test_weights_only_from_its_own_directory_is_refused(base, _dist):
    with pytest.raises(CheckpointError, match="give the new run its own checkpoint.save_dir"):
        _trainer(f"checkpoint.load={base}/ck/iter_0000006", "checkpoint.load_mode=weights_only",
                 f"checkpoint.save_dir={base}/ck", "logging.dir=null")


# ------------------------------------------------------------------------- wandb run id
class FakeWandb:
    """Records wandb.init's arguments (wandb itself is an optional extra)."""

    def __init__(self):
        self.inits = []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, *a, **k):
        pass

    def finish(self):
        pass


def test_wandb_resumes_the_run_id_kept_in_the_checkpoint(tmp_path, monkeypatch, _dist):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    common = [f"checkpoint.save_dir={tmp_path}/ck", f"logging.dir={tmp_path}/log", "logging.wandb=true",
              "train.iters=2"]
    first = _trainer(*common, "checkpoint.load=none")
    first.train()
    run_id = fake.inits[0]["id"]
    assert run_id and fake.inits[0]["resume"] == "allow" and fake.inits[0]["mode"] == "offline"
    meta = json.load(open(os.path.join(tmp_path, "ck", "iter_0000002", "meta.json")))
    assert meta["wandb_run_id"] == run_id
    _trainer(*common, "checkpoint.load=auto", "train.iters=3", "train.continue_with=extend")
    assert fake.inits[1]["id"] == run_id and fake.inits[1]["resume"] == "allow"
    _trainer(*common, "checkpoint.load=none", f"checkpoint.save_dir={tmp_path}/other")
    assert fake.inits[2]["id"] != run_id   # a new run, a new id
