"""Shared helpers for the training-stack tests: run `pretrain_gpt.py` as a subprocess.

Every run uses a tiny fp32 model on mock data (vocab 256, seq 32, global batch 4, micro 2) and
one CPU thread per process (so a 1-process run and a 2-process torchrun run reduce in the same
order inside each matmul, and concurrent runs do not fight over the 2 CI cores).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
PRETRAIN = os.path.join(REPO, "pretrain_gpt.py")

TINY = [
    "model.preset=tiny", "model.seq_length=32", "model.vocab_size=256", "data.mock=true",
    "train.global_batch_size=4", "train.micro_batch_size=2", "train.precision=fp32",
    "train.eval_iters=1", "train.log_interval=1", "logging.tensorboard=false",
    # A real lr after 2 warmup steps, so that the losses move and a wrong resume would show.
    "optimizer.lr=3e-3", "optimizer.min_lr=3e-4", "optimizer.warmup_iters=2", "optimizer.schedule=cosine",
]


def env() -> dict:
    """The runs' environment. CUDA is hidden (``CUDA_VISIBLE_DEVICES=""``): these are CPU runs by
    design — a 1-process and a 2-process run are compared at CPU reduction orders, and on a
    one-GPU machine rank 1 of a torchrun would ask for ``cuda:1`` ("invalid device ordinal").
    The GPU paths have their own tests (skipped without CUDA) and benchmarks/."""
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
             PYTHONPATH=REPO + os.pathsep + e.get("PYTHONPATH", ""), CUDA_VISIBLE_DEVICES="")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def base_config(directory: str) -> str:
    """An (almost empty) YAML file; everything else comes as overrides."""
    path = os.path.join(directory, "run.yaml")
    with open(path, "w") as f:
        f.write("model:\n  preset: tiny\n")
    return path


def pretrain_cmd(config: str, overrides: list[str], nproc: int = 1, extra_args: list[str] = ()) -> list[str]:
    args = [PRETRAIN, "--config", config, *extra_args, *TINY, *overrides]
    if nproc == 1:
        return [sys.executable, *args]
    # --standalone: torchrun binds its rendezvous store to a port it picks itself, where a port
    # found free here first could be taken by another run's gloo sockets before torchrun binds it
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            *args]


def start(config: str, overrides: list[str], *, nproc: int = 1, log: str | None = None) -> subprocess.Popen:
    """Start a run; stdout+stderr go to `log` (a file: no pipe can fill up and block)."""
    out = open(log, "w") if log else subprocess.DEVNULL
    p = subprocess.Popen(pretrain_cmd(config, overrides, nproc), cwd=REPO, env=env(),
                         stdout=out, stderr=subprocess.STDOUT)
    p.log_path = log
    return p


def finish(p: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    text = open(p.log_path).read() if p.log_path else ""
    return rc, text


def run(config: str, overrides: list[str], *, nproc: int = 1, timeout: float = 300,
        extra_args: list[str] = ()) -> subprocess.CompletedProcess:
    return subprocess.run(pretrain_cmd(config, overrides, nproc, extra_args), cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=timeout)


def read_metrics(logdir: str) -> tuple[dict[int, dict], dict[int, float]]:
    """(train records by iteration, validation loss by iteration) from metrics.jsonl."""
    train, val = {}, {}
    with open(os.path.join(logdir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "val_loss" in rec:
                val[rec["iter"]] = rec["val_loss"]
            else:
                train[rec["iter"]] = rec
    return train, val


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def read_quant_records(logdir: str) -> dict[int, dict]:
    """iteration -> {quant/... name: value} of the telemetry records in metrics.jsonl."""
    out = {}
    for line in open(os.path.join(logdir, "metrics.jsonl")):
        rec = json.loads(line)
        q = {k: v for k, v in rec.items() if k.startswith("quant/")}
        if q:
            out[rec["iter"]] = q
    return out


def cpu_path_oracle(why: str):
    """Skip marker for a test whose oracle is the CPU path's exact arithmetic: on a machine with
    a GPU the Trainer builds the model there (megatron.training.initialize), where the same
    quantities come from other kernels (equal only up to rounding) or another initialisation
    path; ``why`` says which. CI runs these on its CPU."""
    import pytest
    import torch

    return pytest.mark.skipif(torch.cuda.is_available(), reason=f"CPU-path oracle: {why}")


def spawn_gloo(target, runs, timeout: float = 300) -> None:
    """In-process multi-rank runs: for each ``(world, args)`` of ``runs``, ``world`` spawned
    processes ``target(rank, world, init, *args)`` sharing a fresh rendezvous ``init`` (a
    ``file://`` URL; the target calls ``join_gloo``); all runs start together and every process
    must exit 0.

    A file rendezvous, not a TCP port: a port found free here is only reserved once rank 0's
    store binds it, seconds later (the workers import megatron first), and meanwhile the other
    runs' gloo connections take ephemeral ports from the same range, so a worker's
    init_process_group can fail on a port taken in between.

    The workers are CPU processes on any machine: CUDA is hidden from them
    (``CUDA_VISIBLE_DEVICES=""``), else on a one-GPU machine rank 1 would ask for ``cuda:1``
    (megatron.training.initialize picks the GPU when there is one)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    rendezvous = tempfile.mkdtemp(prefix="gloo_rendezvous_")
    procs = []
    for i, (world, args) in enumerate(runs):
        init = "file://" + os.path.join(rendezvous, f"run{i}")
        procs += [ctx.Process(target=_run_worker, args=(target.__module__, target.__qualname__, r, world,
                                                        init, *args)) for r in range(world)]
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""       # read by each spawned child at start
        try:
            for p in procs:
                p.start()
        finally:
            if hidden is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = hidden
        for p in procs:
            p.join(timeout=timeout)
            assert p.exitcode == 0, f"worker exit code {p.exitcode}"
    finally:   # a hung or failed run leaves no process behind
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(rendezvous, ignore_errors=True)


def _run_worker(module: str, name: str, *args) -> None:
    """A spawned worker's entry: import megatron-core the way pretrain_gpt.py does on a CPU
    (``cpu_compat.import_megatron_core``: without TorchInductor, ~2 s less per process) before
    the target's module, which may import megatron-core itself, then run the target. The
    target travels by name: unpickling it would import its module first. Then the ranks meet
    and tear their process groups down (``initialize.shutdown``) before the interpreter exits: a
    gloo group left to the exit's destructors can abort the process ("terminate called without an
    active exception", exit code -6) after the target has passed."""
    import importlib

    import torch.distributed as dist

    from megatron.training import cpu_compat

    cpu_compat.import_megatron_core()
    getattr(importlib.import_module(module), name)(*args)
    from megatron.training import initialize

    if dist.is_initialized():
        dist.barrier()
    initialize.shutdown()


def join_gloo(rank: int, world: int, init: str) -> None:
    """A spawn_gloo worker's torch.distributed set-up (gloo, the file rendezvous); the
    trainer's ``initialize`` then finds the process group made and only adds megatron's."""
    import datetime

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))


# ----------------------------------------------------------------- the shared baseline run
STRAIGHT_ITERS = 8
STRAIGHT = ["train.iters=8", "train.eval_interval=4"]


_STRAIGHT_LOCK = threading.Lock()
_STRAIGHT: list[str] = []


def straight_run_dir() -> str:
    """A directory with a finished 1-process run of STRAIGHT_ITERS steps (no checkpoints),
    run once per pytest process and shared by the resume and distributed tests."""
    with _STRAIGHT_LOCK:
        if not _STRAIGHT:
            _STRAIGHT.append(_straight_run())
        return _STRAIGHT[0]


def _straight_run() -> str:
    d = tempfile.mkdtemp(prefix="straight_run_")
    p = start(base_config(d), STRAIGHT + [f"logging.dir={d}/log", "checkpoint.load=none"],
              log=os.path.join(d, "out.txt"))
    rc, text = finish(p)
    assert rc == 0, text[-3000:]
    return d


def start_straight_run_async():
    """Kick off the baseline in a background thread (so it overlaps with another run)."""
    t = threading.Thread(target=straight_run_dir, daemon=True)
    t.start()
    return t


def in_process_megatron():
    """Module fixture body for tests that build Trainers in the pytest process: one CPU thread
    while the module runs (small ops: more threads only contend on a loaded 2-core box), and
    megatron's process groups shut down after it. Use as
    ``_dist = pytest.fixture(scope="module", autouse=True)(helpers.in_process_megatron)``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    from megatron.training.initialize import shutdown
    shutdown()
