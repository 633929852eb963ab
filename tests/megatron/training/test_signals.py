"""SIGTERM: the run saves a checkpoint at the iteration it reached, exits 0, and a resume
continues at the next iteration."""
from __future__ import annotations

import os
import signal
import time

from megatron.training.checkpointing import check_complete
from tests.megatron.training import helpers


def _train_records(logdir: str) -> int:
    path = os.path.join(logdir, "metrics.jsonl")
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if '"val_loss"' not in line)


def test_sigterm_saves_and_resume_continues(tmp_path):
    d = str(tmp_path)
    cfg = helpers.base_config(d)
    save = os.path.join(d, "ckpt")
    common = ["train.iters=500", "train.eval_interval=1000", f"checkpoint.save_dir={save}"]
    p = helpers.start(cfg, common + [f"logging.dir={d}/log1"], log=os.path.join(d, "first.txt"))
    deadline = time.time() + 180
    while _train_records(os.path.join(d, "log1")) < 2:
        assert p.poll() is None, open(os.path.join(d, "first.txt")).read()[-3000:]
        assert time.time() < deadline, "no training progress"
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    rc, out = helpers.finish(p, timeout=120)
    assert rc == 0, out[-3000:]
    train, _ = helpers.read_metrics(os.path.join(d, "log1"))
    stopped = max(train)
    assert 2 <= stopped < 500
    assert sorted(train) == list(range(1, stopped + 1))
    assert f"stopping at iteration {stopped}" in out

    with open(os.path.join(save, "latest")) as f:
        name = f.read().strip()
    assert name == f"iter_{stopped:07d}"
    meta = check_complete(os.path.join(save, name))
    assert meta["iteration"] == stopped and meta["consumed_samples"] == 4 * stopped

    q = helpers.start(cfg, common + ["checkpoint.load=auto", f"train.exit_interval={stopped + 2}",
                                     f"logging.dir={d}/log2"], log=os.path.join(d, "resumed.txt"))
    rc, out2 = helpers.finish(q)
    assert rc == 0, out2[-3000:]
    resumed, _ = helpers.read_metrics(os.path.join(d, "log2"))
    assert sorted(resumed) == [stopped + 1, stopped + 2]
    assert resumed[stopped + 1]["consumed_samples"] == 4 * (stopped + 1)
    assert f"resumed from {os.path.join(save, name)} at iteration {stopped}" in out2
    assert check_complete(os.path.join(save, f"iter_{stopped + 2:07d}"))["iteration"] == stopped + 2
