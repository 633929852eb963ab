"""One run per `checkpoint.save_dir`: an exclusive lock, and the start-up checks of the run's dirs.

`prepare_run_dirs(cfg)` runs at start-up, before a checkpoint is looked for. Global rank 0
  - refuses a `checkpoint.save_dir` or `logging.dir` that exists as a file, and a `latest` that
    is not a file;
  - takes `fcntl.flock(LOCK_EX | LOCK_NB)` on `<save_dir>/.lock` and writes the holder's host,
    pid and start time into it. The lock lives as long as the process (the kernel drops it when
    the process dies, SIGKILL included), so a second run on the same save_dir gets one `error:`
    line naming the holder instead of resuming from, and overwriting, the first run's
    checkpoints (tests/megatron/training/test_reliability.py::test_second_run_on_same_save_dir_is_refused).
    A clean release (`release_all`, also run at interpreter exit) empties the holder record
    while it still holds the flock, then unlocks: the next run finds an empty file and says
    nothing. A record left behind by a process that died without releasing (SIGKILL, OOM,
    os._exit, a crashed host) is simply taken over (flock is free), with a line saying whose it
    was (tests/megatron/training/test_save_lock.py);
  - removes `iter_N.tmp/` leftovers of interrupted saves (only the lock holder may).
The verdict is broadcast, so every rank raises the same `CheckpointError` (exit 2) together.
flock is advisory and per host: two runs on different hosts sharing a save_dir over NFS
are detected only where the file system implements flock across clients (NFSv4, Lustre do).
"""
from __future__ import annotations

import atexit
import fcntl
import json
import os
import socket
import time

import torch.distributed as dist

from megatron.training import checkpoint_integrity as integrity
from megatron.training.errors import CheckpointError, ConfigError

LOCK_NAME = ".lock"
_HELD: list = []  # open lock files of this process (closing one releases its lock)
_OWNER: dict = {}  # id(lock file) -> pid that took it: a forked child must not clear its parent's record
_ATEXIT = False


def _holder_text(path: str) -> str:
    try:
        with open(path) as f:
            h = json.load(f)
        return f"host {h.get('host')}, pid {h.get('pid')}, started {h.get('started')}"
    except (OSError, ValueError):
        return "holder unknown"


def acquire(save_dir: str) -> str | None:
    """Take the lock on save_dir for this process; returns a note about a stale previous holder
    (or None). Raises CheckpointError when another live process holds it."""
    path = os.path.join(save_dir, LOCK_NAME)
    if any(f.name == path for f in _HELD):
        return None  # this process holds it already (a second Trainer in one process)
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise CheckpointError(
            f"checkpoint.save_dir={save_dir} is in use by another run ({_holder_text(path)}): "
            "wait for it to finish or give this run another checkpoint.save_dir") from None
    note = None
    f.seek(0)
    try:
        prev = json.loads(f.read() or "null")
    except ValueError:
        prev = None
    if isinstance(prev, dict) and prev and prev.get("pid") != os.getpid():
        note = (f"[checkpoint] {save_dir}: taking over the lock of a run that is gone "
                f"(host {prev.get('host')}, pid {prev.get('pid')}, started {prev.get('started')})")
    f.seek(0)
    f.truncate()
    json.dump({"host": socket.gethostname(), "pid": os.getpid(),
               "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f)
    f.flush()
    _HELD.append(f)
    _OWNER[id(f)] = os.getpid()
    global _ATEXIT
    if not _ATEXIT:   # a normal exit (return, sys.exit, an exception) releases cleanly; SIGKILL cannot
        atexit.register(release_all)
        _ATEXIT = True
    return note


def release_all() -> None:
    """Release every lock this process holds, marking each as released: the holder record is
    emptied while the flock is still held, then the flock is dropped. The next run then takes
    the lock without a note; a record is left behind only by a holder that died."""
    while _HELD:
        f = _HELD.pop()
        try:
            if _OWNER.pop(id(f), None) == os.getpid():   # not in a forked child: the record is the parent's
                f.seek(0)
                f.truncate()
                f.flush()
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        except (OSError, ValueError):   # a full or vanished file system: closing still drops the flock
            pass
        finally:
            f.close()


def _check_dirs(cfg) -> list[str]:
    """Rank 0's checks and lock; returns the lines to print. Raises UserError."""
    notes = []
    for key, d in (("checkpoint.save_dir", cfg.checkpoint.save_dir), ("logging.dir", cfg.logging.dir)):
        if d and os.path.exists(d) and not os.path.isdir(d):
            raise ConfigError(f"{key}={d} exists and is not a directory: give a directory path")
    save_dir = cfg.checkpoint.save_dir
    if not save_dir:
        return notes
    try:
        os.makedirs(save_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"checkpoint.save_dir={save_dir} cannot be created ({e.strerror})") from None
    try:
        note = acquire(save_dir)
    except OSError as e:   # read-only or not ours: no lock file can be made
        raise CheckpointError(f"checkpoint.save_dir={save_dir}: cannot take its lock ({e.strerror})") from None
    if note:
        notes.append(note)
    latest = os.path.join(save_dir, "latest")
    if os.path.lexists(latest) and not os.path.isfile(latest):
        raise CheckpointError(f"{latest} is not a file (the run writes its pointer there): remove it")
    try:
        removed = integrity.clean_stale_tmp(save_dir)
    except OSError as e:
        raise CheckpointError(f"checkpoint.save_dir={save_dir}: cannot remove interrupted saves ({e.strerror})") from None
    if removed:
        notes.append(f"[checkpoint] removed {len(removed)} interrupted save(s) in {save_dir}: {', '.join(removed)}")
    return notes


def prepare_run_dirs(cfg) -> None:
    """Collective: every rank calls it; all raise the same error together."""
    verdict = [None, None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            for line in _check_dirs(cfg):
                print(line, flush=True)
        except (CheckpointError, ConfigError) as e:
            verdict = [type(e).__name__, str(e)]
        except OSError as e:   # any other file-system fault: one line on every rank, not a hang
            verdict = ["CheckpointError", f"checkpoint.save_dir={cfg.checkpoint.save_dir}: {e}"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise (ConfigError if verdict[0] == "ConfigError" else CheckpointError)(verdict[1])
