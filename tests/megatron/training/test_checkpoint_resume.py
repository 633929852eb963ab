"""Exact resume and damaged / incompatible checkpoints.

Runs (subprocesses of pretrain_gpt.py, tiny fp32 model, mock data), shared by the module:
  straight: 8 steps in one go (helpers.straight_run_dir, also used by test_distributed)
  part:     the same config stopped by train.exit_interval=4, saving every 2 steps
  resumed:  checkpoint.load=auto from part's save_dir, continuing to 8
  shape:    resume part's checkpoint with a different model.hidden_size (must refuse)
The schedule follows train.iters=8 in all of them, so step k is the same step everywhere.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from megatron.training.checkpointing import check_complete, find_latest, resolve_load_path
from megatron.training.errors import CheckpointError
from tests.megatron.training import helpers

N, M = 4, 4


def _tree_digest(root: str) -> dict:
    out = {}
    for base, _, files in os.walk(root):
        for name in files:
            full = os.path.join(base, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("resume"))
    cfg = helpers.base_config(d)
    save = os.path.join(d, "ckpt")
    common = helpers.STRAIGHT + [f"checkpoint.save_dir={save}", "checkpoint.save_interval=2",
                                 "checkpoint.keep_last=5"]
    baseline = helpers.start_straight_run_async()  # overlaps with `part`
    part = helpers.start(cfg, common + [f"train.exit_interval={N}", f"logging.dir={d}/log_part"],
                         log=os.path.join(d, "part.txt"))
    rc, part_out = helpers.finish(part)
    assert rc == 0, part_out[-3000:]
    # Pristine copy of part's checkpoints before the resumed run adds to the directory.
    snap = os.path.join(d, "snapshot")
    shutil.copytree(save, snap)
    snap_digest = _tree_digest(snap)
    resumed = helpers.start(cfg, common + ["checkpoint.load=auto", f"logging.dir={d}/log_resumed"],
                            log=os.path.join(d, "resumed.txt"))
    shape = helpers.start(cfg, common + [f"checkpoint.save_dir={d}/shape_ckpt", f"checkpoint.load={snap}",
                                         "model.hidden_size=64", f"logging.dir={d}/log_shape"],
                          log=os.path.join(d, "shape.txt"))
    # saved with megatron's plain AdamW, resumed with its distributed optimizer: another state form
    distopt = helpers.start(cfg, common + [f"checkpoint.save_dir={d}/distopt_ckpt", f"checkpoint.load={snap}",
                                           "parallel.use_distributed_optimizer=true", f"logging.dir={d}/log_distopt"],
                            log=os.path.join(d, "distopt.txt"))
    rc_resumed, resumed_out = helpers.finish(resumed)
    rc_shape, shape_out = helpers.finish(shape)
    rc_distopt, distopt_out = helpers.finish(distopt)
    assert rc_resumed == 0, resumed_out[-3000:]
    baseline.join()
    return dict(dir=d, save=save, snap=snap, snap_digest=snap_digest, part_out=part_out,
                resumed_out=resumed_out, rc_shape=rc_shape, shape_out=shape_out,
                rc_distopt=rc_distopt, distopt_out=distopt_out,
                straight=helpers.read_metrics(os.path.join(helpers.straight_run_dir(), "log")),
                part=helpers.read_metrics(os.path.join(d, "log_part")),
                resumed=helpers.read_metrics(os.path.join(d, "log_resumed")))


# ------------------------------------------------------------------------- exact resume
def test_resume_gives_identical_losses(runs):
    straight, _ = runs["straight"]
    part, _ = runs["part"]
    resumed, _ = runs["resumed"]
    assert sorted(straight) == list(range(1, N + M + 1))
    assert sorted(part) == list(range(1, N + 1)), "exit_interval must stop after iteration N"
    assert sorted(resumed) == list(range(N + 1, N + M + 1)), "the resumed run must continue at N + 1"
    for it in range(1, N + M + 1):
        rec = (part if it <= N else resumed)[it]
        assert rec["loss"] == straight[it]["loss"], f"iteration {it}"
        assert rec["grad_norm"] == straight[it]["grad_norm"], f"iteration {it}"
        assert rec["lr"] == straight[it]["lr"], f"iteration {it}"
        assert rec["consumed_samples"] == straight[it]["consumed_samples"] == 4 * it
    # the losses actually move, so equality is not trivially met by a constant
    losses = [straight[i]["loss"] for i in range(1, N + M + 1)]
    assert len(set(losses)) == len(losses)


def test_resume_gives_identical_validation_loss(runs):
    _, straight_val = runs["straight"]
    _, part_val = runs["part"]
    _, resumed_val = runs["resumed"]
    assert part_val[N] == straight_val[N]
    assert resumed_val[N + M] == straight_val[N + M]


def test_logged_lr_follows_the_schedule(runs):
    # lr of step k (iteration k-1 -> k): warmup 2 steps to 3e-3, then cosine to 3e-4 at 8.
    import math

    straight, _ = runs["straight"]
    expected = {1: 1.5e-3, 2: 3e-3}
    for k in range(3, 9):
        expected[k] = 3e-4 + 0.5 * 2.7e-3 * (1 + math.cos(math.pi * (k - 3) / 6))
    for k, lr in expected.items():
        assert straight[k]["lr"] == pytest.approx(lr, rel=1e-9), k


def test_exit_interval_leaves_complete_checkpoint_and_latest(runs):
    snap = runs["snap"]
    with open(os.path.join(snap, "latest")) as f:
        assert f.read().strip() == "iter_0000004"
    meta = check_complete(os.path.join(snap, "iter_0000004"))
    assert meta["iteration"] == N and meta["consumed_samples"] == 4 * N
    assert meta["config"]["model"]["hidden_size"] == 128
    assert check_complete(os.path.join(snap, "iter_0000002"))["iteration"] == 2  # save_interval=2
    assert sorted(x for x in os.listdir(snap) if x.startswith("iter_")) == ["iter_0000002", "iter_0000004"]
    assert os.path.isfile(os.path.join(snap, "config.yaml"))  # resolved config beside the checkpoints
    assert "resumed from" in runs["resumed_out"] and "iter_0000004" in runs["resumed_out"]


# ------------------------------------------------------------------------- damaged checkpoints
@pytest.fixture
def copy(runs, tmp_path):
    dst = str(tmp_path / "ckpt")
    shutil.copytree(runs["snap"], dst)
    return dst


def test_missing_file(copy):
    it4 = os.path.join(copy, "iter_0000004")
    os.remove(os.path.join(it4, "rng", "rank_00000.pt"))
    with pytest.raises(CheckpointError, match=r"rng/rank_00000\.pt.*missing|missing.*rng/rank_00000\.pt"):
        check_complete(it4)
    # an explicit path to it is an error, `auto` falls back to the previous complete one
    with pytest.raises(CheckpointError):
        resolve_load_path(it4, None)
    assert resolve_load_path("auto", copy) == os.path.join(copy, "iter_0000002")


def test_truncated_shard(copy):
    it4 = os.path.join(copy, "iter_0000004")
    dist_dir = os.path.join(it4, "dist")
    shards = sorted((os.path.getsize(os.path.join(dist_dir, n)), n) for n in os.listdir(dist_dir)
                    if os.path.isfile(os.path.join(dist_dir, n)))
    size, name = shards[-1]  # the largest file: a data shard
    with open(os.path.join(dist_dir, name), "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError) as e:
        check_complete(it4)
    assert name in str(e.value) and str(size) in str(e.value)
    assert resolve_load_path("auto", copy) == os.path.join(copy, "iter_0000002")
    with pytest.raises(CheckpointError):
        resolve_load_path(it4, None)


def test_missing_meta_is_incomplete_and_auto_falls_back(copy):
    it4 = os.path.join(copy, "iter_0000004")
    os.remove(os.path.join(it4, "meta.json"))
    with pytest.raises(CheckpointError, match="incomplete"):
        check_complete(it4)
    # `latest` still names iter_0000004, yet auto must skip it
    assert resolve_load_path("auto", copy) == os.path.join(copy, "iter_0000002")
    assert resolve_load_path(copy, None) == os.path.join(copy, "iter_0000002")  # a save_dir as load path
    with pytest.raises(CheckpointError):
        resolve_load_path(it4, None)


def test_corrupt_meta_json(copy):
    it4 = os.path.join(copy, "iter_0000004")
    with open(os.path.join(it4, "meta.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError):
        check_complete(it4)
    assert resolve_load_path("auto", copy) == os.path.join(copy, "iter_0000002")


def test_interrupted_save_dir_is_ignored(copy):
    # A newer save that never got renamed: even with every file and a meta.json, `.tmp` is not a checkpoint.
    shutil.copytree(os.path.join(copy, "iter_0000004"), os.path.join(copy, "iter_0000006.tmp"))
    meta_path = os.path.join(copy, "iter_0000006.tmp", "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["iteration"] = 6
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    assert find_latest(copy) == os.path.join(copy, "iter_0000004")
    # even when `latest` is gone, the scan ignores it
    os.remove(os.path.join(copy, "latest"))
    assert resolve_load_path("auto", copy) == os.path.join(copy, "iter_0000004")


def test_no_checkpoint_at_all(tmp_path):
    assert resolve_load_path("auto", str(tmp_path)) is None
    assert resolve_load_path("auto", None) is None
    assert resolve_load_path("none", str(tmp_path)) is None
    with pytest.raises(CheckpointError):
        resolve_load_path(str(tmp_path / "nope"), None)
    with pytest.raises(CheckpointError):
        resolve_load_path(str(tmp_path), None)  # an explicit dir without a checkpoint


def test_switching_to_the_distributed_optimizer_is_refused_in_one_line(runs):
    out = runs["distopt_out"]
    assert runs["rc_distopt"] == 2, out[-3000:]
    assert "Traceback" not in out and "KeyError" not in out, out[-3000:]
    errs = helpers.error_lines(out)
    assert len(errs) == 1 and "use_distributed_optimizer=false" in errs[0], out[-3000:]
    assert not os.path.exists(os.path.join(runs["dir"], "log_distopt", "metrics.jsonl")) or \
        helpers.read_metrics(os.path.join(runs["dir"], "log_distopt"))[0] == {}
    assert _tree_digest(runs["snap"]) == runs["snap_digest"]


def test_different_model_shape_refuses_to_load(runs):
    out = runs["shape_out"]
    assert runs["rc_shape"] == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errs = helpers.error_lines(out)
    assert len(errs) == 1 and "model.hidden_size" in errs[0], out[-3000:]
    assert "128" in errs[0] and "64" in errs[0]
    # nothing trained, the checkpoint on disk is untouched
    assert not os.path.exists(os.path.join(runs["dir"], "log_shape", "metrics.jsonl")) or \
        helpers.read_metrics(os.path.join(runs["dir"], "log_shape"))[0] == {}
    assert _tree_digest(runs["snap"]) == runs["snap_digest"]


# ------------------------------------------------------------------------- a failed save's line
def _wrapped(exc):
    from torch.distributed.checkpoint.api import _wrap_exception

    try:
        raise exc
    except BaseException as e:   # with its traceback, as torch wraps a rank's failure
        return _wrap_exception(e)


def test_failed_save_line_keeps_what_failed(tmp_path):
    """The `error:` line of a failed save names what failed: megatron-core's sharding refusal is
    one head line followed by a multi-line tensor (the line once showed only its last line,
    ``[[0]]], dtype=torch.int32)``); torch.distributed.checkpoint's per-rank tracebacks give
    the failed rank's own error. Only a write error gets the disk advice."""
    import torch
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron.training.checkpointing import _raise_if_any_failed, exception_brief

    final = str(tmp_path / "iter_0000002")
    head = ("Invalid access pattern for ShardedTensor(key='decoder.layers.self_attention.linear_proj.lora_l2', "
            "dtype=torch.float32, global_shape=(4, 128, 8), prepend_axis_num=1)")
    counts = torch.tensor([[[0]], [[1]], [[1]], [[0]]], dtype=torch.int32)
    cases = [(CheckpointingException(f"{head}: {counts}"),
              f"(CheckpointingException: {head}: tensor([[[0]], [[1]], [[1]], [[0]]], dtype=torch.int32))", False),
             (CheckpointException("write failed", {0: _wrapped(OSError(28, "No space left on device"))}),
              "(CheckpointException: OSError: [Errno 28] No space left on device)", True),
             (OSError(28, "No space left on device"), "(OSError: [Errno 28] No space left on device)", True)]
    for failure, why, disk in cases:
        os.makedirs(final + ".tmp")
        with pytest.raises(CheckpointError) as e:
            _raise_if_any_failed(failure, final + ".tmp", final)
        line = str(e.value)
        assert "\n" not in line and f"could not save checkpoint {final} {why}; " in line, line
        assert ("free disk space" in line) == disk, line
        assert not os.path.exists(final + ".tmp")
    # a traceback in the text: its innermost line; a long message: its head, cut
    assert exception_brief(RuntimeError("Traceback (most recent call last):\n  File x\nValueError: bad")) == \
        "ValueError: bad"
    brief = exception_brief(RuntimeError("head " + "x" * 1000), limit=100)
    assert brief.startswith("head x") and len(brief) == 100 and brief.endswith("…")
