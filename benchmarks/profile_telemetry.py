#!/usr/bin/env python3
"""Where a telemetry step's extra time goes: torch.profiler over one plain and one telemetry step.

    python benchmarks/profile_telemetry.py [--arm nvfp4_linear] [--rows 25]

Same model and arms as benchmarks/bench_blocks.py (4 decoder blocks of the 3b preset, seq 4096).
Prints the wall time of a plain step and of a telemetry step (logging.quant_stats_interval=100,
iterations 101 and 200), then the telemetry functions by cumulative time (cProfile, host side) and the ops of the
telemetry step sorted by self CUDA time and by self CPU time, so the cost of fullstack_fp4.telemetry can be read beside the training step's own.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench_blocks import ARMS, COMMON  # noqa: E402
from megatron.training.config import load_config  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", default="nvfp4_linear", choices=sorted(ARMS))
    ap.add_argument("--rows", type=int, default=25)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from megatron.training.trainer import Trainer

    cfg = load_config(None, COMMON + list(ARMS[a.arm]) + ["logging.quant_stats_interval=100"])
    tr = Trainer(cfg, verbose=False)

    def step(it: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tr.model.zero_grad_buffer()
        tr.optimizer.zero_grad()
        tr.telemetry.begin_step([tr.model], it, tr.optimizer)
        tr._run_schedule(tr.train_ds, 0, False)
        tr.optimizer.step()
        tr.telemetry.end_step()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for it in (100, 101, 200, 201):  # warm-up: compile every kernel of both kinds of step
        step(it)
    plain, tel = step(301), step(400)
    print(f"{a.arm}: plain step {1e3 * plain:.1f} ms, telemetry step {1e3 * tel:.1f} ms "
          f"(+{1e3 * (tel - plain):.1f} ms; amortised over 100 steps: {100 * (tel - plain) / (100 * plain):.2f}%)")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        step(500)
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    step(600)
    pr.disable()
    print("\n== telemetry step, Python functions of fullstack_fp4/telemetry by cumulative time")
    pstats.Stats(pr).sort_stats("cumulative").print_stats("telemetry", a.rows)
    ka = prof.key_averages()
    print("\n== telemetry step, by self CUDA time")
    print(ka.table(sort_by="self_cuda_time_total", row_limit=a.rows, max_name_column_width=60))
    print("\n== telemetry step, by self CPU time")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=a.rows, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
