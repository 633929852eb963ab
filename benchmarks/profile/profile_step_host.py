#!/usr/bin/env python3
"""Where the host's time goes in one step of 4 blocks of the 3b preset (bench_blocks.py's
setting), and what the lean Triton launcher changes, in one process.

The full stack's step is 1.35–1.60x BF16's although its kernels alone sum to ~1.34x
(``BENCHMARKS.md#blocks-3b-shape``): the GPU waits for the one host thread. Per arm
(``--arms``, default bf16 and the full stack), after warm-up steps:

1. Host busy time of a forward+backward and of an optimizer step: the time under cProfile minus
   the time spent blocked in the step's host syncs (``.item()`` and friends), so it does not
   depend on how fast the GPU is.
2. Step time with the lean launcher off and on, alternated (off, on, off, on …) so that drift of
   the machine hits both alike: median of each.
3. The functions with the most own host time in one forward+backward and one optimizer step.

    python benchmarks/profile/profile_step_host.py [--arms bf16,full_stack_bf16_grads] [--rounds 4]
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench_blocks import ARMS, COMMON  # noqa: E402
from fullstack_fp4.nvfp4.kernels import launch as triton_launch  # noqa: E402
from megatron.training.config import load_config  # noqa: E402

# host calls that block until the GPU has caught up (their time is waiting, not host work)
_SYNCS = ("item", "cpu", "tolist", "synchronize", "_local_scalar_dense")


def _blocked_s(stats: pstats.Stats) -> float:
    total = 0.0
    for (_, _, name), (_, _, tt, _, _) in stats.stats.items():
        if any(s in name for s in _SYNCS):
            total += tt
    return total


def _phases(tr):
    def fwd_bwd():
        tr.model.zero_grad_buffer()
        tr.optimizer.zero_grad()
        tr._run_schedule(tr.train_ds, 0, False)
    return fwd_bwd, tr.optimizer.step


def _step_ms(fwd_bwd, opt_step) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fwd_bwd()
    opt_step()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def run(arm: str, rounds: int) -> None:
    from megatron.training.trainer import Trainer

    cfg = load_config(None, COMMON + ARMS[arm])
    tr = Trainer(cfg, verbose=False)
    fwd_bwd, opt_step = _phases(tr)
    for _ in range(3):
        _step_ms(fwd_bwd, opt_step)
    print(f"\n===== {arm}")
    times = {"0": [], "1": []}
    for _ in range(rounds):
        for mode in ("0", "1"):
            triton_launch.set_mode(mode)
            _step_ms(fwd_bwd, opt_step)            # one step to settle, then two measured
            times[mode] += [_step_ms(fwd_bwd, opt_step) for _ in range(2)]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(f"step ms, lean launcher off / on (alternated, {2 * rounds} steps each): "
          f"{med(times['0']):.1f} / {med(times['1']):.1f}")
    triton_launch.set_mode("1")
    for name, fn in (("forward+backward", fwd_bwd), ("optimizer step", opt_step)):
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        fn()
        torch.cuda.synchronize()
        prof.disable()
        wall = time.perf_counter() - t0
        st = pstats.Stats(prof)
        blocked = _blocked_s(st)
        print(f"\n{arm} {name}: wall under cProfile {1e3 * wall:.1f} ms, blocked in syncs "
              f"{1e3 * blocked:.1f} ms, host busy {1e3 * (wall - blocked):.1f} ms (cProfile "
              "inflates Python-heavy code)")
        st.sort_stats("tottime").print_stats(18)
    del tr, fwd_bwd, opt_step
    gc.collect()
    torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="bf16,full_stack_bf16_grads")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    for arm in args.arms.split(","):
        if arm not in ARMS:
            print(f"error: unknown arm {arm!r}", file=sys.stderr)
            return 2
        run(arm, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
