"""The save_dir lock (megatron/training/save_lock.py): a clean exit marks it released, so the next
run takes it silently; only a holder that died leaves a record, and the next run names it.

CPU only, fast: the holders are small Python processes that take the lock and exit (or are
killed); one pair of tiny training runs checks the note a resume prints.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from megatron.training import save_lock
from megatron.training.errors import CheckpointError
from tests.megatron.training import helpers

HOLDER = ("import sys, time; sys.path.insert(0, sys.argv[1]);"
          "from megatron.training import save_lock; save_lock.acquire(sys.argv[2]);"
          "print('held', flush=True); mode = sys.argv[3]\n"
          "if mode == 'release_all': save_lock.release_all()\n"
          "elif mode == 'raise': raise SystemExit('error: some failure after the lock was taken')\n"
          "elif mode == 'wait': time.sleep(120)\n")


def _holder(save_dir, mode) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLDER, helpers.REPO, str(save_dir), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=helpers.env())


def _lock_text(save_dir) -> str:
    with open(os.path.join(save_dir, save_lock.LOCK_NAME)) as f:
        return f.read()


@pytest.fixture
def acquire():
    """save_lock.acquire in this process, released again after the test."""
    yield save_lock.acquire
    save_lock.release_all()


@pytest.mark.parametrize("mode", ["exit", "release_all", "raise"])
def test_clean_exit_releases_the_lock_and_the_next_run_says_nothing(tmp_path, acquire, mode):
    p = _holder(tmp_path, mode)
    out, err = p.communicate(timeout=120)
    assert out.strip() == "held", err[-2000:]
    assert _lock_text(tmp_path) == ""            # the holder record is cleared on release
    assert acquire(str(tmp_path)) is None        # no "taking over the lock of a run that is gone"
    assert json.loads(_lock_text(tmp_path))["pid"] == os.getpid()


def test_killed_holder_leaves_its_record_and_the_next_run_names_it(tmp_path, acquire):
    p = _holder(tmp_path, "wait")
    try:
        assert p.stdout.readline().strip() == "held"
        assert json.loads(_lock_text(tmp_path))["pid"] == p.pid
        with pytest.raises(CheckpointError, match=f"in use by another run .*pid {p.pid}"):
            save_lock.acquire(str(tmp_path))     # still alive: refused
    finally:
        p.send_signal(signal.SIGKILL)
        p.communicate()
    note = acquire(str(tmp_path))
    assert note and "taking over the lock of a run that is gone" in note and f"pid {p.pid}" in note


def test_record_of_a_dead_pid_is_taken_over_with_a_note(tmp_path, acquire):
    (tmp_path / save_lock.LOCK_NAME).write_text(
        json.dumps({"host": "elsewhere", "pid": 2 ** 22 + 17, "started": "2020-01-01T00:00:00Z"}))
    note = acquire(str(tmp_path))
    assert note and "host elsewhere, pid 4194321" in note
    for junk in ("[1, 2]", "not json", "null"):   # a record that is not one: taken over, no traceback
        save_lock.release_all()
        (tmp_path / save_lock.LOCK_NAME).write_text(junk)
        assert acquire(str(tmp_path)) is None


def test_a_forked_child_does_not_release_its_parents_lock(tmp_path, acquire):
    acquire(str(tmp_path))
    record = _lock_text(tmp_path)
    pid = os.fork()
    if pid == 0:   # the child: what a forked worker's exit does
        try:
            save_lock.release_all()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert _lock_text(tmp_path) == record
    p = subprocess.run([sys.executable, "-c", HOLDER, helpers.REPO, str(tmp_path), "exit"],
                       capture_output=True, text=True, env=helpers.env(), timeout=120)
    assert p.returncode != 0 and "in use by another run" in p.stderr, p.stderr[-2000:]


def test_resume_after_a_clean_run_prints_no_takeover_note(tmp_path):
    d, save = str(tmp_path), str(tmp_path / "ckpt")
    first = helpers.run(helpers.base_config(d), ["train.iters=2", f"checkpoint.save_dir={save}",
                                                  "checkpoint.load=none"])
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert _lock_text(save) == ""
    again = helpers.run(helpers.base_config(d), ["train.iters=3", "train.continue_with=[extend]",
                                                  f"checkpoint.save_dir={save}"])
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"resumed from {save}/iter_0000002" in again.stdout
    assert "taking over the lock" not in again.stdout + again.stderr
