#!/usr/bin/env python3
"""bench_blocks.py's 4-block 3b setting (its COMMON overrides and ARMS) at tensor parallelism TP:

    python3 benchmarks/bench_blocks_tp.py --arms bf16,full_stack --out DIR                 # 1 GPU
    torchrun --nproc-per-node 2 benchmarks/bench_blocks_tp.py --arms bf16,full_stack --out DIR   # TP=2

TP = the world size (every rank holds one shard; the global batch is the same, so tokens/s
per GPU = tokens/s / world size). Per arm: median step time (forward+backward and optimizer
step) over --steps after --warmup, tokens/s, tokens/s per GPU, peak memory of rank 0. Rank 0
writes DIR/bench_tp<TP>.json. `--set key=value` adds overrides after COMMON (the CPU smoke test
passes a tiny model); without CUDA the timings are CPU wall times.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

import torch  # noqa: E402

from bench_blocks import ARMS, COMMON  # noqa: E402
from megatron.training.config import load_config  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_arm(arm: str, tp: int, extra: list[str], steps: int, warmup: int) -> dict:
    import torch.distributed as dist

    from megatron.training.trainer import Trainer

    cfg = load_config(None, COMMON + list(ARMS[arm]) + [f"parallel.tensor_model_parallel_size={tp}"] + extra)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    tr = Trainer(cfg, verbose=False)
    world = dist.get_world_size()
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    times = []
    for i in range(warmup + steps):
        _sync()
        t0 = time.perf_counter()
        tr.model.zero_grad_buffer()
        tr.optimizer.zero_grad()
        tr._run_schedule(tr.train_ds, i * cfg.train.global_batch_size, False)
        tr.optimizer.step()
        _sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    t = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64,
                     device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    step_s = float(t.item())
    out = {"arm": arm, "tp": tp, "world": world, "step_ms": 1e3 * step_s, "tokens_per_s": tokens / step_s,
           "tokens_per_s_per_gpu": tokens / step_s / world,
           "tflops_per_gpu": tokens * tr.flops_per_token / step_s / world / 1e12,
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
           "steps": steps, "warmup": warmup}
    del tr
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="bf16")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="runs/bench_blocks_tp")
    p.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE")
    a = p.parse_args()
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    rows = []
    for arm in a.arms.split(","):
        try:
            rows.append(run_arm(arm, tp, a.set, a.steps, a.warmup))
        except Exception as e:  # noqa: BLE001  (report and go on to the next arm)
            rows.append({"arm": arm, "tp": tp, "world": tp, "error": f"{type(e).__name__}: {str(e)[:160]}"})
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
            os.makedirs(a.out, exist_ok=True)
            meta = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "torch": torch.__version__, "argv": sys.argv, "common": COMMON}
            with open(os.path.join(a.out, f"bench_tp{tp}.json"), "w") as f:  # rewritten after every arm
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    from megatron.training.initialize import shutdown

    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
