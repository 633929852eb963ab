"""CPU time of one QAdamW step on the reference path (the CPU path and the tests' oracle).

``python benchmarks/time_q_adamw_reference.py [--numel 2000000] [--steps 5]``: one flat FP32
parameter of ``--numel`` entries, random gradients, two warm-up steps, then the median of
``--steps`` timed steps (torch's default CPU threads). Figures: docs/perf/q-adamw.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=2_000_000)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args(argv)
    from fullstack_fp4.optim.q_adamw.optimizer import QAdamW
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(a.numel))
    opt = QAdamW([p], lr=1e-3, use_kernel=False)
    ts = []
    for i in range(2 + a.steps):
        p.grad = torch.randn_like(p)
        t = time.perf_counter()
        opt.step()
        if i >= 2:
            ts.append(time.perf_counter() - t)
    print(f"QAdamW reference step, {a.numel} params, {torch.get_num_threads()} threads: "
          f"{sorted(ts)[len(ts) // 2] * 1e3:.0f} ms (median of {a.steps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
