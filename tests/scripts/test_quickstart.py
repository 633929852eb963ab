"""scripts/quickstart.py: started again once its run is complete, and what it prints at the end.

Runs (subprocesses, CPU): configs/quickstart.yaml made small by overrides (mock data, seq 32,
batch 4, 6 steps, checkpoints at 3 and 6) into a temporary directory, never runs/quickstart.
Oracles: the exit code and stderr of the script, the files of the run directory (hashed
before and after), and the commands it prints, followed with pretrain_gpt.py (what the script
runs after its data step, which is left out here: it would touch data/quickstart) or planned
with continuation.plan_resume.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.megatron.training import helpers

REPO = helpers.REPO
SCRIPT = os.path.join(REPO, "scripts", "quickstart.py")
SMALL = ["data.mock=true", "model.vocab_size=256", "model.seq_length=32", "train.global_batch_size=4",
         "train.micro_batch_size=2", "train.eval_iters=1", "train.eval_interval=3", "checkpoint.save_interval=3",
         "logging.tensorboard=false", "optimizer.warmup_iters=2", "train.log_interval=1", "train.iters=6"]


def _quickstart():
    spec = importlib.util.spec_from_file_location("quickstart_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pretrain(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, helpers.PRETRAIN, "--config", "configs/quickstart.yaml", *args],
                          cwd=REPO, env=helpers.env(), capture_output=True, text=True, timeout=300)


def _dirs(run: str) -> list[str]:
    return [f"checkpoint.save_dir={run}/checkpoints", f"logging.dir={run}"]


def snapshot(root: str) -> dict:
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs:
            out[os.path.relpath(os.path.join(d, n), root) + "/"] = None
        for n in files:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A complete 6-step quickstart-config run (checkpoints at 3 and 6)."""
    run = str(tmp_path_factory.mktemp("quickstart") / "run")
    r = _pretrain(SMALL + ["checkpoint.load=none", *_dirs(run)])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return run


def _copy(finished: str, dst: str) -> str:
    shutil.copytree(finished, dst, ignore=shutil.ignore_patterns(".lock"))
    return dst


@pytest.mark.long   # several training runs end to end (make test-all)
def test_started_again_when_complete_it_refuses_in_one_line_before_anything_runs(finished, tmp_path):
    """`make quickstart` (300 steps) after the run was extended to 600 by the closing hint used to
    be refused with advice (a shorter train.iters with extend) that then trained nothing, exited
    0 and rewrote config.yaml. Now: exit 2, one `error:` line, no step run, no file touched (the
    lock neither); the command it names trains on. (Started again exactly as it was, the run is
    simply complete: test_the_quickstart_run_itself_is_told_make_clean_quickstart.)"""
    run = _copy(finished, str(tmp_path / "run"))
    before = snapshot(run)
    for extra in (["train.iters=3"], ["train.iters=3", "train.continue_with=extend"]):
        p = subprocess.run([sys.executable, SCRIPT, *SMALL, *_dirs(run), *extra], cwd=REPO, env=helpers.env(),
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
        assert len(p.stderr.splitlines()) == 1 and p.stderr.startswith("error: "), p.stderr[-3000:]
        assert p.stdout == ""   # neither the data step nor training started
        assert f"checkpoint {run}/checkpoints/iter_0000006 is already at iteration 6 (its run is complete)" in p.stderr
        assert "give it its own checkpoint.save_dir and logging.dir" in p.stderr   # not runs/quickstart
        assert snapshot(run) == before
    command = re.search(r"To train on from it, run `([^`]*)`", p.stderr).group(1)
    args = shlex.split(command)
    assert args[:2] == [".venv/bin/python", "scripts/quickstart.py"]
    assert args[-2:] == ["train.iters=12", "train.continue_with=extend"]
    r = _pretrain(args[2:])   # what the script runs after its data step
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    train, _ = helpers.read_metrics(run)
    assert sorted(train) == list(range(1, 13))


def test_the_quickstart_run_itself_is_told_make_clean_quickstart(finished, tmp_path, monkeypatch):
    qs = _quickstart()
    run = _copy(finished, str(tmp_path / "runs" / "quickstart"))
    monkeypatch.setattr(qs, "RUN", run)
    why = qs.refusal(SMALL + _dirs(run) + ["train.iters=3"])
    assert "run `make clean-quickstart` (it deletes runs/quickstart and data/quickstart)" in why, why
    assert "run `.venv/bin/python scripts/quickstart.py " in why and "train.iters=12 train.continue_with=extend`" in why
    assert qs.refusal(SMALL + _dirs(run) + ["train.iters=7", "train.continue_with=extend"]) is None
    assert qs.refusal(SMALL + _dirs(run)) is None   # complete, started again as it was: trains nothing, exit 0


def test_the_closing_lines_give_commands_that_go_on(finished, tmp_path, monkeypatch, capsys):
    """The run's own overrides are kept in the printed command (without them the resume would be
    refused: here optimizer.warmup_iters=2); a run stopped early is told to finish, not to
    double; a run stopped before its first evaluation has no validation loss to print."""
    from megatron.training import continuation
    from megatron.training.config import load_config

    qs = _quickstart()
    data = tmp_path / "data"
    data.mkdir()
    (data / "stats.json").write_text(json.dumps({"valid_unigram_entropy_nats": 6.0}))
    monkeypatch.setattr(qs, "DATA", str(data))

    def printed(run: str, argv: list[str]) -> tuple[str, list[str]]:
        qs.summary(argv)
        out = capsys.readouterr().out
        command = re.search(r"`(\.venv/bin/python scripts/quickstart.py [^`]*)`", out).group(1)
        args = shlex.split(command)[2:]
        meta = json.load(open(qs._newest_checkpoint(f"{run}/checkpoints")[0] + "/meta.json"))
        cfg = load_config(os.path.join(REPO, "configs", "quickstart.yaml"), args)
        continuation.plan_resume(meta, cfg, "ck")   # the command plans a resume ...
        assert cfg.train.iters > meta["iteration"]    # ... that trains
        return out, args

    run = _copy(finished, str(tmp_path / "complete"))
    out, args = printed(run, SMALL + _dirs(run) + ["checkpoint.load=auto"])
    assert "validation loss" in out and "at iteration 6" in out and "to train on from there" in out, out
    assert "optimizer.warmup_iters=2" in args and "checkpoint.load=auto" not in args
    assert args[-2:] == ["train.iters=12", "train.continue_with=extend"]
    assert "make clean-quickstart" not in out   # not the quickstart's own directory

    run = _copy(finished, str(tmp_path / "stopped"))
    shutil.rmtree(f"{run}/checkpoints/iter_0000006")
    os.remove(f"{run}/metrics.jsonl")
    out, args = printed(run, SMALL + _dirs(run))
    assert "stopped at iteration 3 of 6; to finish it" in out and args[-1] == "train.iters=6", out
    assert "no validation loss yet" in out
