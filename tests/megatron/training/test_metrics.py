"""Metrics: Megatron-LM's TensorBoard tag names (read back from the event files), and one
`[train] done` line per job.

The tag names are Megatron-LM's own (megatron/training/training.py: `training_log` writes
'lm loss', 'learning-rate', 'grad-norm', 'throughput', 'iteration-time',
'mem-max-allocated-bytes' and '<name> vs samples'; `evaluate_and_print_results` writes
'lm loss validation' and 'lm loss validation ppl'), written here from that source, not from
metrics.py.
"""
from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pytest

from megatron.training.metrics import MetricsLogger, dashboard_scalars
from tests.megatron.training import helpers

TRAIN = {"iter": 7, "consumed_samples": 28, "loss": 5.5, "lr": 3e-4, "grad_norm": 1.25, "tokens_per_s": 5000.0,
         "step_ms": 20.0, "tflops": 0.5, "mfu": None, "skipped": 0, "total_skips": 1, "peak_mem_gib": 2.0}


def test_dashboard_names_are_megatron_lm_s():
    by_iter, by_samples = dashboard_scalars(TRAIN)
    assert by_iter == {"lm loss": 5.5, "learning-rate": 3e-4, "grad-norm": 1.25, "tokens_per_s": 5000.0,
                       "iteration-time": 0.02, "throughput": 0.5, "skipped": 0, "total_skips": 1,
                       "mem-max-allocated-bytes": 2.0 * 2**30, "consumed_samples": 28}
    assert by_samples == {"lm loss vs samples": 5.5, "learning-rate vs samples": 3e-4, "grad-norm vs samples": 1.25}
    by_iter, by_samples = dashboard_scalars({"iter": 7, "val_loss": 2.0})
    assert by_iter == {"lm loss validation": 2.0, "lm loss validation ppl": math.exp(2.0)} and by_samples == {}
    q, _ = dashboard_scalars({"iter": 7, "quant/decoder.layers.0.mlp.linear_fc1/x/rel_err": 0.1})
    assert q == {"quant/decoder.layers.0.mlp.linear_fc1/x/rel_err": 0.1}


def test_tensorboard_event_files_carry_the_megatron_tags(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = SimpleNamespace(logging=SimpleNamespace(dir=str(tmp_path), tensorboard=True, wandb=False,
                                                  wandb_mode="offline", wandb_project="x"))
    m = MetricsLogger(cfg, enabled=True)
    m.log(TRAIN)
    m.log({"iter": 7, "val_loss": 2.0})
    m.close()
    acc = EventAccumulator(os.path.join(tmp_path, "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "lm loss vs samples", "lm loss validation",
            "lm loss validation ppl", "iteration-time", "throughput"} <= tags
    assert "loss" not in tags and "lr" not in tags
    (ev,) = acc.Scalars("lm loss vs samples")
    assert ev.step == 28 and ev.value == pytest.approx(5.5)
    (ev,) = acc.Scalars("learning-rate")
    assert ev.step == 7 and ev.value == pytest.approx(3e-4)
    # metrics.jsonl keeps the record's own keys
    recs = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
    assert recs[0]["loss"] == 5.5 and recs[1]["val_loss"] == 2.0


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], pytest.param(["parallel.pipeline_model_parallel_size=2"], marks=pytest.mark.long)],
                         ids=["dp2", "pp2"])
def test_one_train_done_line_per_job(tmp_path, layout):
    d = str(tmp_path)
    p = helpers.start(helpers.base_config(d), ["train.iters=2", "train.eval_interval=2", "checkpoint.load=none",
                                               f"logging.dir={d}/log", *layout],
                      nproc=2, log=os.path.join(d, "out.txt"))
    rc, out = helpers.finish(p)
    assert rc == 0, out[-3000:]
    done = [line for line in out.splitlines() if "[train] done" in line]
    _, val = helpers.read_metrics(os.path.join(d, "log"))
    assert done == [f"[train] done at iteration 2, validation loss {val[2]:.4f}"], out[-3000:]
