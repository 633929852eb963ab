"""Multi-process CPU runs (torchrun, gloo) give the loss of the 1-process run on the same
global batch: data parallelism (DP=2), the distributed optimizer, tensor parallelism (TP=2).

The 1-process reference is helpers.straight_run_dir() (8 steps, global batch 4, micro 2: two
micro-batches); here 2 processes run the same config, stopped by train.exit_interval=4 (the
schedule still follows train.iters=8, so steps 1-4 are the same steps).
"""
from __future__ import annotations

import json
import os

import pytest

from megatron.training.checkpointing import check_complete
from tests.megatron.training import helpers

pytestmark = pytest.mark.slow
STEPS = 4
RTOL = 1e-5


def _two_process_run(tmp_path, extra: list[str]):
    d = str(tmp_path)
    p = helpers.start(helpers.base_config(d), helpers.STRAIGHT + [
        f"train.exit_interval={STEPS}", f"logging.dir={d}/log", f"checkpoint.save_dir={d}/ckpt", *extra],
        nproc=2, log=os.path.join(d, "out.txt"))
    rc, out = helpers.finish(p, timeout=300)
    assert rc == 0, out[-4000:]
    return helpers.read_metrics(os.path.join(d, "log")), out


def _compare(two, ref):
    train2, val2 = two
    train1, val1 = ref
    assert sorted(train2) == list(range(1, STEPS + 1))
    for it in range(1, STEPS + 1):
        assert train2[it]["loss"] == pytest.approx(train1[it]["loss"], rel=RTOL), f"iteration {it}"
        assert train2[it]["grad_norm"] == pytest.approx(train1[it]["grad_norm"], rel=1e-4), f"iteration {it}"
        assert train2[it]["lr"] == train1[it]["lr"]
    assert val2[STEPS] == pytest.approx(val1[STEPS], rel=RTOL)
    # the model trains: this is not a comparison of two untouched initialisations
    assert train1[STEPS]["loss"] != train1[1]["loss"]


@pytest.fixture(scope="module")
def reference():
    return helpers.read_metrics(os.path.join(helpers.straight_run_dir(), "log"))


def test_data_parallel_matches_one_process(tmp_path, reference):
    two, out = _two_process_run(tmp_path, [])
    with open(os.path.join(tmp_path, "log", "run_info.json")) as f:
        info = json.load(f)
    assert info["world_size"] == 2 and info["device"] == "cpu" and info["device_name"] == "cpu"
    _compare(two, reference)


@pytest.fixture(scope="module")
def distopt_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("distopt")
    return d, _two_process_run(d, ["parallel.use_distributed_optimizer=true"])


def test_distributed_optimizer_matches_one_process(distopt_run, reference):
    d, (two, out) = distopt_run
    _compare(two, reference)
    meta = check_complete(os.path.join(d, "ckpt", f"iter_{STEPS:07d}"))
    assert meta["iteration"] == STEPS and meta["world_size"] == 2


# Resuming megatron-core 0.16.1's DistributedOptimizer needs three things checkpointing.py does:
#  1. a fresh optimizer has no state to describe (distrib_optimizer.py:642 asserts): dummy init;
#  2. load_state_dict must run under no_grad (in-place copy into leaf views, :940);
#  3. AdamW's per-parameter `step` is restored from the saved param_groups (the dummy init left 1).
@pytest.mark.long
def test_distributed_optimizer_resume_matches_one_process(distopt_run, reference):
    d, _ = distopt_run
    p = helpers.start(helpers.base_config(str(d)), helpers.STRAIGHT + [
        f"logging.dir={d}/log_resumed", f"checkpoint.save_dir={d}/ckpt", "checkpoint.load=auto",
        "parallel.use_distributed_optimizer=true"], nproc=2, log=os.path.join(d, "resumed.txt"))
    rc, out = helpers.finish(p, timeout=300)
    assert rc == 0, out[-4000:]
    train2, val2 = helpers.read_metrics(os.path.join(d, "log_resumed"))
    train1, val1 = reference
    assert sorted(train2) == list(range(STEPS + 1, 2 * STEPS + 1))
    for it in sorted(train2):
        assert train2[it]["loss"] == pytest.approx(train1[it]["loss"], rel=RTOL), f"iteration {it}"
    assert val2[2 * STEPS] == pytest.approx(val1[2 * STEPS], rel=RTOL)


def test_tensor_parallel_matches_one_process(tmp_path, reference):
    two, out = _two_process_run(tmp_path, ["parallel.tensor_model_parallel_size=2"])
    _compare(two, reference)


@pytest.mark.long   # multi-run or multi-process, ~25-50 s: make test-all
def test_pipeline_parallel_trains_and_resumes_exactly(tmp_path):
    """PP=2: the last stage logs every step, and stop + resume repeats the straight run exactly.

    Not compared with 1 process: like megatron-core, each pipeline stage seeds its own layers
    (seed + 100 x stage), so a PP=2 model starts from other weights than a 1-process one.
    """
    d = str(tmp_path)
    cfg = helpers.base_config(d)
    common = ["parallel.pipeline_model_parallel_size=2", "train.iters=4", "train.eval_interval=4"]
    p = helpers.start(cfg, common + [f"logging.dir={d}/straight", "checkpoint.load=none"], nproc=2,
                      log=os.path.join(d, "straight.txt"))
    rc, out = helpers.finish(p, timeout=300)
    assert rc == 0, out[-4000:]
    p = helpers.start(cfg, common + ["train.exit_interval=2", f"checkpoint.save_dir={d}/ckpt",
                                     f"logging.dir={d}/first"], nproc=2, log=os.path.join(d, "first.txt"))
    rc, out = helpers.finish(p, timeout=300)
    assert rc == 0, out[-4000:]
    p = helpers.start(cfg, common + [f"checkpoint.save_dir={d}/ckpt", f"logging.dir={d}/second"], nproc=2,
                      log=os.path.join(d, "second.txt"))
    rc, out = helpers.finish(p, timeout=300)
    assert rc == 0, out[-4000:]
    straight, val_straight = helpers.read_metrics(os.path.join(d, "straight"))
    second, val_second = helpers.read_metrics(os.path.join(d, "second"))
    assert sorted(straight) == [1, 2, 3, 4] and sorted(second) == [3, 4]
    for it in (3, 4):
        assert second[it]["loss"] == straight[it]["loss"], f"iteration {it}"
    assert val_second[4] == val_straight[4]


@pytest.mark.long   # multi-run or multi-process, ~25-50 s: make test-all
def test_q_adamw_plain_checkpoint_resumes_at_another_dp_size(tmp_path):
    """A q_adamw checkpoint of 1 process (plain optimizer: 4-bit state replicated over DP)
    resumes with 2 processes (DP=2): steps 3-4 give the losses of the uninterrupted 1-process
    run (the same 4-bit state is loaded, the gradient reduction differs only by its order)."""
    d = str(tmp_path)
    cfg = helpers.base_config(d)
    common = ["optimizer.name=q_adamw", "optimizer.q_adamw.min_numel=1024", "train.iters=4",
              "train.eval_interval=4"]
    r = helpers.run(cfg, common + [f"logging.dir={d}/straight", "checkpoint.load=none"])
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    r = helpers.run(cfg, common + ["train.exit_interval=2", f"checkpoint.save_dir={d}/ckpt",
                                   f"logging.dir={d}/first"])
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    p = helpers.start(cfg, common + [f"checkpoint.save_dir={d}/ckpt", f"logging.dir={d}/second"], nproc=2,
                      log=os.path.join(d, "second.txt"))
    rc, out = helpers.finish(p, timeout=300)
    assert rc == 0, out[-4000:]
    assert "resumed from" in out
    straight, _ = helpers.read_metrics(os.path.join(d, "straight"))
    second, _ = helpers.read_metrics(os.path.join(d, "second"))
    assert sorted(second) == [3, 4]
    for it in (3, 4):
        assert second[it]["loss"] == pytest.approx(straight[it]["loss"], rel=RTOL), f"iteration {it}"
    assert straight[4]["loss"] != straight[1]["loss"]
