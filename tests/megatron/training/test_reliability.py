"""Fault injection: the last good state is never lost, a corrupt or foreign one is never loaded,
and every fault ends in one `error:` line (or a clean stop), never a traceback.

Runs (subprocesses of pretrain_gpt.py, tiny fp32 model, mock data, helpers.TINY):
  base:     the 8-step schedule stopped at iteration 4, saving every 2 steps (iter_2, iter_4);
            every fault below is injected into a copy of its save_dir
  straight: the same 8 steps in one go (helpers.straight_run_dir): the oracle of every resume
Some runs go through a driver (`_DRIVER`) that patches one function of the trainer before
pretrain_gpt.main runs: the lr of the later steps (a divergence), `torch.save` (a full disk),
the start-up (a signal delivered during it).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from megatron.training import checkpointing
from megatron.training.errors import CheckpointError
from tests.megatron.training import helpers

COMMON = helpers.STRAIGHT + ["checkpoint.save_interval=2", "checkpoint.keep_last=5"]

_DRIVER = r'''
import os, signal, sys
sys.path.insert(0, {repo!r})
fault = os.environ["FAULT"]
from megatron.training import cpu_compat
_import = cpu_compat.import_megatron_core

def _patched_import():
    _import()
    import torch
    import megatron.training.trainer as T
    if fault == "diverge":            # from step 5 on (the run starts at 0) an lr that blows the weights up
        import itertools
        apply, steps = T.apply_schedule, itertools.count(1)
        T.apply_schedule = lambda opt, lr, wd: apply(opt, 1e30 if next(steps) >= 5 else lr, wd)
    elif fault == "enospc":           # the disk fills up during the save of iteration 6
        save = torch.save
        def full(obj, f, *a, **k):
            if "iter_0000006.tmp" in str(f):
                raise OSError(28, "No space left on device")
            return save(obj, f, *a, **k)
        torch.save = full
    elif fault in ("SIGTERM", "SIGINT"):   # a signal while the trainer is being built
        init = T.initialize
        def init_then_signal(cfg):
            device = init(cfg)
            os.kill(os.getpid(), getattr(signal, fault))
            return device
        T.initialize = init_then_signal

cpu_compat.import_megatron_core = _patched_import
import pretrain_gpt
sys.exit(pretrain_gpt.main(sys.argv[1:]))
'''


def _run_with_fault(d: str, fault: str, overrides: list[str], name: str) -> tuple[int, str]:
    driver = os.path.join(d, "driver.py")
    with open(driver, "w") as f:
        f.write(_DRIVER.format(repo=helpers.REPO))
    cmd = [sys.executable, driver, "--config", helpers.base_config(d), *helpers.TINY, *overrides]
    env = dict(helpers.env(), FAULT=fault)
    with open(os.path.join(d, name + ".txt"), "w") as out:
        rc = subprocess.run(cmd, cwd=helpers.REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                            timeout=300).returncode
    return rc, open(os.path.join(d, name + ".txt")).read()


def _digest(root: str) -> dict:
    """sha256 of every file under root, but the lock and the resolved config.yaml a run rewrites."""
    out = {}
    for base, _, files in os.walk(root):
        for n in files:
            if base == root and n in (".lock", "config.yaml"):
                continue
            with open(os.path.join(base, n), "rb") as f:
                out[os.path.relpath(os.path.join(base, n), root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _flip(path: str, offset: int, n: int = 1) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        data = bytearray(f.read(n))
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def _largest(directory: str) -> str:
    files = [os.path.join(directory, n) for n in os.listdir(directory)]
    return max((p for p in files if os.path.isfile(p)), key=os.path.getsize)


def _assert_bit_exact(logdir: str, iters: range) -> None:
    straight, _ = helpers.read_metrics(os.path.join(helpers.straight_run_dir(), "log"))
    got, _ = helpers.read_metrics(logdir)
    assert sorted(got) == list(iters), sorted(got)
    for it in iters:
        assert got[it]["loss"] == straight[it]["loss"], it
        assert got[it]["grad_norm"] == straight[it]["grad_norm"], it


def _one_error(out: str, *needles: str) -> str:
    assert "Traceback" not in out, out[-3000:]
    errs = helpers.error_lines(out)
    assert len(errs) == 1, out[-3000:]
    for n in needles:
        assert n in errs[0], errs[0]
    return errs[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("base"))
    baseline = helpers.start_straight_run_async()
    p = helpers.start(helpers.base_config(d), COMMON + [f"checkpoint.save_dir={d}/ckpt", "train.exit_interval=4",
                                                        f"logging.dir={d}/log"], log=os.path.join(d, "out.txt"))
    rc, out = helpers.finish(p)
    assert rc == 0, out[-3000:]
    baseline.join()
    return os.path.join(d, "ckpt")


@pytest.fixture
def save_dir(base, tmp_path):
    dst = str(tmp_path / "ckpt")
    shutil.copytree(base, dst, ignore=shutil.ignore_patterns(".lock"))
    return dst


# ------------------------------------------------------------------ 1: divergence and its advice
@pytest.mark.long
def test_divergence_keeps_the_good_checkpoint_and_the_advised_resume_is_exact(tmp_path):
    d = str(tmp_path)
    save = os.path.join(d, "ckpt")
    # keep_last=1: before, each save pruned the previous one, so the pre-divergence one went too
    over = helpers.STRAIGHT + ["checkpoint.save_interval=2", "checkpoint.keep_last=1",
                               "train.max_consecutive_skips=2", f"checkpoint.save_dir={save}"]
    rc, out = _run_with_fault(d, "diverge", over + [f"logging.dir={d}/log1"], "diverge")
    assert rc == 3, out[-3000:]
    good = os.path.join(save, "iter_0000004")
    # step 5 applied the 1e30 lr (iteration 5 is the destructive step), 6 and 7 were skipped
    err = _one_error(out, "training diverged", f"resume from {good}")
    assert "iteration 7" in err
    assert checkpointing.check_complete(good)["iteration"] == 4
    assert os.path.isdir(os.path.join(save, "iter_0000006.diverged"))   # kept, out of the way
    assert checkpointing.find_latest(save) == good
    # the advised resume (a sane lr: the driver's patch is gone) continues from iteration 4
    # exactly as the straight run did, and runs to the end instead of diverging again
    r = helpers.run(helpers.base_config(d), over + [f"logging.dir={d}/log2"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"resumed from {good} at iteration 4" in r.stdout
    assert "starts a fresh window" not in r.stdout     # same optimizer settings: the guard state resumes
    _assert_bit_exact(os.path.join(d, "log2"), range(5, 9))
    # the diverged state itself, loaded explicitly with other optimizer settings: the guard
    # starts afresh (it used to restore the skip count, 1 at iteration 6, and stop after one step)
    r = helpers.run(helpers.base_config(d), helpers.STRAIGHT + [
        f"checkpoint.load={save}/iter_0000006.diverged", "optimizer.eps=1e-6", "train.max_consecutive_skips=2",
        "train.exit_interval=7", f"checkpoint.save_dir={d}/ckpt3", f"logging.dir={d}/log3"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "the divergence guard starts a fresh window" in r.stdout
    assert "[guard] iteration 7: update skipped" in r.stdout


def test_changed_optimizer_settings_reset_the_guard_window():
    from megatron.training.guards import StepGuard

    g = StepGuard(max_consecutive_skips=3, loss_spike_factor=1.5, min_history=2)
    for loss in (4.0, 4.0):
        g.record_applied(loss)
    g.record_skip("loss_spike")
    g.record_skip("loss_spike")
    restored = StepGuard(max_consecutive_skips=3, loss_spike_factor=1.5, min_history=2)
    restored.load_state_dict(g.state_dict())
    assert restored.consecutive_skips == 2 and restored.spike_threshold() == 6.0
    restored.reset()
    assert restored.consecutive_skips == 0 and restored.spike_threshold() is None
    assert restored.total_skips == 2                         # the run's history is kept


# ------------------------------------------------------------------ 2: NaN inside an FP4 recipe
def test_nan_inside_fp4_recipe_is_a_skipped_step(tmp_path):
    # NVFP4 linears and Q-Attn both see the NaN/Inf activations (the linear first in each block)
    d = str(tmp_path)
    save = os.path.join(d, "ckpt")
    rc, out = _run_with_fault(d, "diverge", helpers.STRAIGHT + [
        "fp4.linear=nvfp4", "fp4.attention=q_attn", "checkpoint.save_interval=2", "train.max_consecutive_skips=2",
        f"checkpoint.save_dir={save}", f"logging.dir={d}/log"], "nan")
    assert rc == 3, out[-3000:]
    assert "NaN or Inf" not in out
    _one_error(out, "nonfinite", f"resume from {os.path.join(save, 'iter_0000004')}")
    assert [ln for ln in out.splitlines() if ln.startswith("[guard] iteration")] == [
        "[guard] iteration 6: update skipped (nonfinite_grad_norm)",
        "[guard] iteration 7: update skipped (nonfinite_grad_norm)"]
    assert checkpointing.check_complete(os.path.join(save, "iter_0000004"))["iteration"] == 4


def test_reference_quantizer_propagates_nan_when_asked():
    import torch

    from fullstack_fp4.nvfp4 import quantize
    from fullstack_fp4.nvfp4.reference import quantize_reference

    x = torch.randn(4, 32)
    ok = quantize(x, check_finite=False)
    ref = quantize_reference(x)
    assert torch.equal(ok.data, ref.data) and torch.equal(ok.tensor_scale, ref.tensor_scale)
    x[1, 3] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(x)
    assert torch.isnan(quantize(x, check_finite=False).dequantize()).all()


# ------------------------------------------------------------------ 3, 4, 8, 9: damaged checkpoints
def test_only_checkpoint_damaged_stops_instead_of_starting_fresh(save_dir, tmp_path):
    shutil.rmtree(os.path.join(save_dir, "iter_0000002"))
    it4 = os.path.join(save_dir, "iter_0000004")
    shard = _largest(os.path.join(it4, "dist"))
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 100)
    before = _digest(save_dir)
    d = str(tmp_path)
    r = helpers.run(helpers.base_config(d), COMMON + [f"checkpoint.save_dir={save_dir}", f"logging.dir={d}/log"])
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    _one_error(r.stderr, "none is loadable", "checkpoint.allow_fresh_start=true")
    assert not os.path.exists(os.path.join(d, "log", "metrics.jsonl")) or \
        helpers.read_metrics(os.path.join(d, "log"))[0] == {}
    assert _digest(save_dir) == before
    # allowed to start fresh: it trains from 1 and, reaching iteration 4, keeps the damaged dir aside
    r = helpers.run(helpers.base_config(d), COMMON + [f"checkpoint.save_dir={save_dir}", "train.exit_interval=4",
                                                      "checkpoint.allow_fresh_start=true", f"logging.dir={d}/log2"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert _digest(os.path.join(save_dir, "iter_0000004.damaged")) == {
        k.split("/", 1)[1]: v for k, v in before.items() if k.startswith("iter_0000004/")}
    assert checkpointing.check_complete(it4)["iteration"] == 4
    _assert_bit_exact(os.path.join(d, "log2"), range(1, 5))


@pytest.mark.parametrize("where", ["dist/__0_0.distcp", "dist/.metadata", "rng/rank_00000.pt",
                                   "extra/rank_00000.pt"])
def test_flipped_bytes_are_refused_naming_the_file(save_dir, where):
    it4 = os.path.join(save_dir, "iter_0000004")
    path = os.path.join(it4, where)
    _flip(path, os.path.getsize(path) // 2, 1)      # one byte, size unchanged
    with pytest.raises(CheckpointError, match=f"file {where} does not match its checksum"):
        checkpointing.check_complete(it4)
    with pytest.raises(CheckpointError, match=where):
        checkpointing.resolve_load_path(it4, None)
    assert checkpointing.resolve_load_path("auto", save_dir) == os.path.join(save_dir, "iter_0000002")


def test_faulted_save_dir_resumes_from_newest_good_checkpoint_exactly(save_dir, tmp_path, base):
    # 64 flipped bytes in a shard of the newest, binary garbage in `latest`, an interrupted save
    _flip(_largest(os.path.join(save_dir, "iter_0000004", "dist")), 4096, 64)
    with open(os.path.join(save_dir, "latest"), "wb") as f:
        f.write(bytes(range(256)))
    shutil.copytree(os.path.join(save_dir, "iter_0000002"), os.path.join(save_dir, "iter_0000006.tmp"))
    d = str(tmp_path)
    r = helpers.run(helpers.base_config(d), COMMON + [f"checkpoint.save_dir={save_dir}", "train.exit_interval=4",
                                                      f"logging.dir={d}/log"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert f"resumed from {os.path.join(save_dir, 'iter_0000002')} at iteration 2" in r.stdout
    _assert_bit_exact(os.path.join(d, "log"), range(3, 5))
    assert not os.path.exists(os.path.join(save_dir, "iter_0000006.tmp"))
    assert os.path.isdir(os.path.join(save_dir, "iter_0000004.damaged"))     # kept, not deleted
    # the new iter_0000004 holds what the undamaged run saved, shard for shard (meta.json and
    # dist/.metadata name the save's paths)
    new = _digest(os.path.join(save_dir, "iter_0000004"))
    old = _digest(os.path.join(base, "iter_0000004"))
    same = {k for k in old if k not in ("meta.json", "dist/.metadata")}
    assert {k: new[k] for k in same} == {k: old[k] for k in same} and len(same) >= 3


def test_garbage_in_a_pre_checksum_checkpoint_is_one_error_line(save_dir, tmp_path):
    # a checkpoint written before checksums existed: only sizes are checked, so the unpickler
    # meets the garbage — one line naming the file, not an UnpicklingError traceback
    it4 = os.path.join(save_dir, "iter_0000004")
    meta_path = os.path.join(it4, "meta.json")
    meta = json.load(open(meta_path))
    meta.pop("checksums", None)
    json.dump(meta, open(meta_path, "w"))
    extra = os.path.join(it4, "extra", "rank_00000.pt")
    size = os.path.getsize(extra)
    with open(extra, "wb") as f:
        f.write(b"\x80\x02garbage" + b"\xff" * (size - 9))
    d = str(tmp_path)
    r = helpers.run(helpers.base_config(d), COMMON + [f"checkpoint.save_dir={save_dir}", f"checkpoint.load={it4}",
                                                      f"logging.dir={d}/log"])
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    _one_error(r.stderr, "extra/rank_00000.pt")


def test_newest_complete_checkpoint_wins_over_latest_and_latest_is_never_followed(save_dir, base, tmp_path):
    with open(os.path.join(save_dir, "latest"), "w") as f:
        f.write("iter_0000002")
    assert checkpointing.resolve_load_path("auto", save_dir) == os.path.join(save_dir, "iter_0000004")
    # `latest` naming another run's checkpoint by absolute path: never loaded
    other = str(tmp_path / "empty")
    os.makedirs(other)
    with open(os.path.join(other, "latest"), "w") as f:
        f.write(os.path.join(base, "iter_0000004"))
    with pytest.raises(CheckpointError, match="none is loadable"):
        checkpointing.resolve_load_path("auto", other)
    assert checkpointing.resolve_load_path("auto", other, allow_fresh_start=True) is None


def test_pruning_never_removes_damaged_or_the_newest_confirmed_checkpoint(save_dir):
    src = os.path.join(save_dir, "iter_0000004")
    for it in (6, 8, 10):
        shutil.copytree(src, os.path.join(save_dir, f"iter_{it:07d}"))
    with open(os.path.join(save_dir, "iter_0000006", "rng", "rank_00000.pt"), "ab") as f:
        f.write(b"x")                                    # damaged (size)
    # keep_last=1 at iteration 10 whose last applied step was 9: iter_10 (newest) and iter_8
    # (newest before step 9) stay, damaged iter_6 stays, complete iter_2 and iter_4 go
    checkpointing._prune(save_dir, keep_last=1, protect_before=9)
    assert sorted(n for n in os.listdir(save_dir) if n.startswith("iter_")) == [
        "iter_0000006", "iter_0000008", "iter_0000010"]


# ------------------------------------------------------------------ 5: model shape and tokenizer
def test_changed_vocab_size_or_tokenizer_is_refused(base, tmp_path):
    from megatron.training.config import load_config

    it4 = os.path.join(base, "iter_0000004")
    meta = checkpointing.check_complete(it4)
    cfg = load_config(helpers.base_config(str(tmp_path)), helpers.TINY + ["model.vocab_size=512"])
    with pytest.raises(CheckpointError, match=r"model\.vocab_size: checkpoint 256, config 512"):
        checkpointing.check_compatible(meta, cfg, it4)
    same = load_config(helpers.base_config(str(tmp_path)), helpers.TINY)
    checkpointing.check_compatible(meta, same, it4)
    tok = tmp_path / "tok.model"
    tok.write_bytes(b"one tokenizer")
    meta = dict(meta, tokenizer=checkpointing.tokenizer_identity(str(tok), 256))
    checkpointing.check_compatible(meta, same, it4, checkpointing.tokenizer_identity(str(tok), 256))
    tok.write_bytes(b"another one")
    with pytest.raises(CheckpointError, match="tokenizer crc32"):
        checkpointing.check_compatible(meta, same, it4, checkpointing.tokenizer_identity(str(tok), 256))


# ------------------------------------------------------------------ 6: one run per save_dir
def test_second_run_on_same_save_dir_is_refused(save_dir, tmp_path):
    from megatron.training import save_lock

    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time; sys.path.insert(0, sys.argv[1]);"
                               "from megatron.training import save_lock; save_lock.acquire(sys.argv[2]);"
                               "print('held', flush=True); time.sleep(120)", helpers.REPO, save_dir],
                              stdout=subprocess.PIPE, text=True, env=helpers.env())
    try:
        assert holder.stdout.readline().strip() == "held"
        before = _digest(save_dir)
        d = str(tmp_path)
        r = helpers.run(helpers.base_config(d), COMMON + [f"checkpoint.save_dir={save_dir}", f"logging.dir={d}/log"])
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
        _one_error(r.stderr, "in use by another run", f"pid {holder.pid}")
        assert _digest(save_dir) == before
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone (SIGKILL): the lock is free and the next run takes it over, saying whose it was
    note = save_lock.acquire(save_dir)
    try:
        assert note and f"pid {holder.pid}" in note
    finally:
        save_lock.release_all()


# ------------------------------------------------------------------ 7: .bin against .idx
def _indexed(prefix: str, docs) -> None:
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc in docs:
        b.add_document(torch.tensor(doc, dtype=torch.int32), [len(doc)])
    b.finalize(prefix + ".idx")


def test_bin_idx_mismatch_is_one_error_line(tmp_path):
    from megatron.training.data import _check_prefixes

    big, small = str(tmp_path / "big"), str(tmp_path / "small")
    _indexed(big, [list(range(1, 50 + i)) for i in range(40)])
    _indexed(small, [list(range(1, 30)) for _ in range(10)])
    _check_prefixes([big, small], "path")               # matching pairs pass
    shutil.copy(small + ".idx", big + ".idx")           # a foreign, smaller index
    with pytest.raises(ValueError, match="do not belong together"):
        _check_prefixes([big], "path")
    _indexed(big, [list(range(1, 50 + i)) for i in range(40)])
    with open(big + ".bin", "r+b") as f:                # a .bin cut short by 4 KB
        f.truncate(os.path.getsize(big + ".bin") - 4096)
    with pytest.raises(ValueError, match=r"big\.bin has .* bytes but .*big\.idx ends its last document"):
        _check_prefixes([big], "path")
    with open(small + ".idx", "r+b") as f:
        f.write(b"garbage!!")
    with pytest.raises(ValueError, match="is not a megatron indexed-dataset index"):
        _check_prefixes([small], "path")


# ------------------------------------------------------------------ 8: start-up, dirs, full disk
@pytest.mark.parametrize("fault", ["save_dir_is_a_file", "log_dir_is_a_file", "latest_is_a_directory"])
def test_run_dirs_that_are_files_or_a_latest_directory_are_one_error(tmp_path, fault):
    d = str(tmp_path)
    save, log = os.path.join(d, "ckpt"), os.path.join(d, "log")
    if fault == "latest_is_a_directory":
        os.makedirs(os.path.join(save, "latest"))
    else:
        with open(save if fault == "save_dir_is_a_file" else log, "w") as f:
            f.write("x")
    r = helpers.run(helpers.base_config(d), COMMON + [f"checkpoint.save_dir={save}", f"logging.dir={log}"])
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    _one_error(r.stderr, {"save_dir_is_a_file": "checkpoint.save_dir=", "log_dir_is_a_file": "logging.dir=",
                          "latest_is_a_directory": "latest is not a file"}[fault])


@pytest.mark.long
def test_full_disk_during_save_keeps_the_previous_checkpoint_and_resume_is_exact(save_dir, tmp_path):
    d = str(tmp_path)
    before = _digest(save_dir)
    over = COMMON + [f"checkpoint.save_dir={save_dir}"]
    rc, out = _run_with_fault(d, "enospc", over + [f"logging.dir={d}/log1"], "enospc")
    assert rc == 2, out[-3000:]
    _one_error(out, "could not save checkpoint", "iter_0000006", "No space left on device")
    assert not os.path.exists(os.path.join(save_dir, "iter_0000006.tmp"))     # the partial save is gone
    assert _digest(save_dir) == before
    r = helpers.run(helpers.base_config(d), over + [f"logging.dir={d}/log2"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    _assert_bit_exact(os.path.join(d, "log2"), range(5, 9))


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_signal_during_startup_stops_cleanly(tmp_path, sig):
    d = str(tmp_path)
    rc, out = _run_with_fault(d, sig, COMMON + [f"checkpoint.save_dir={d}/ckpt", f"logging.dir={d}/log"], sig)
    assert rc == 0, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert f"[train] {sig} during start-up: stopped before the first step" in out
    ckpt = os.path.join(d, "ckpt")
    assert not os.path.isdir(ckpt) or not [n for n in os.listdir(ckpt) if n.startswith("iter_")]


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs sysfs: a directory no one can write")
def test_a_save_dir_that_cannot_hold_the_lock_is_one_error():
    """Not even root can create a file in sysfs: the lock file's OSError becomes the CheckpointError
    every rank raises (one `error:` line), not a traceback on rank 0 while the others wait."""
    from megatron.training import save_lock
    from megatron.training.config import load_config

    cfg = load_config(None, ["model.preset=tiny", "data.mock=true", "checkpoint.save_dir=/sys/kernel",
                             "logging.dir=null"], validate=False)
    with pytest.raises(CheckpointError, match=r"checkpoint.save_dir=/sys/kernel: cannot take its lock"):
        save_lock.prepare_run_dirs(cfg)
