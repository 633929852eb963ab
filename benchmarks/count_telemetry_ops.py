#!/usr/bin/env python3
"""Count what the telemetry statistics cost on the host: aten ops and host reads (CPU).

    python benchmarks/count_telemetry_ops.py [--repo DIR]

Runs two telemetry statistics on CPU under a TorchDispatchMode that counts every aten op and
every ``aten._local_scalar_dense`` (a host read of a tensor value: on a GPU, a sync):

- ``recipe_stats.wgrad_operand_sums`` on a [4104, 1024] BF16 operand, 64 sampled blocks;
- the Q-AdamW sample statistics of 18 parameters of 64×256 (2 chunks each) after one QAdamW
  step: per parameter (``q_adamw_sample_sums``, the reference path) and, where the tree has it,
  batched per param group (``q_adamw_group_sums``, what the collector calls);
- the collector's statistics of 16 linears (x, wgrad_x, w, dy, wgrad_dy each), hooks and
  ``end_step``.

``--repo`` imports ``fullstack_fp4`` from another checkout (e.g. a ``git worktree`` of an older
commit), so the counts of two trees can be set side by side. Host-side counts only: how long
the ops take on a GPU is benchmarks/profile_telemetry.py's job.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    a = ap.parse_args()
    sys.path.insert(0, os.path.abspath(a.repo))
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from fullstack_fp4.optim import QAdamW
    from fullstack_fp4.telemetry import recipe_stats as rs

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    def count(fn):
        with Count() as c:
            fn()
        return sum(c.ops.values()), c.ops["aten._local_scalar_dense"]

    torch.manual_seed(0)
    m = torch.randn(4104, 1024).bfloat16()
    rows = [("wgrad_operand_sums [4104, 1024] bf16, 64 blocks",
             count(lambda: rs.wgrad_operand_sums(m, rounding="stochastic", blocks=64,
                                                 generator=torch.Generator().manual_seed(1))))]

    params = [torch.nn.Parameter(torch.randn(64, 256)) for _ in range(18)]
    opt = QAdamW(params, lr=1e-3, min_numel=1024)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in params:
        p.grad = torch.randn_like(p)
    (group,) = opt.param_groups
    b1, b2 = group["betas"]

    def per_param():
        g = torch.Generator().manual_seed(2)
        for p in params:
            rs.q_adamw_sample_sums(opt.state[p], p.grad, beta1=b1, beta2=b2, eps=group["eps"],
                                   chunks=2, generator=g)

    rows.append(("Q-AdamW, 18 x [64, 256], 2 chunks: per parameter", count(per_param)))
    if hasattr(rs, "q_adamw_group_sums"):
        items = [(opt.state[p], p.grad, 0) for p in params]
        rows.append(("Q-AdamW, 18 x [64, 256], 2 chunks: batched per group",
                     count(lambda: rs.q_adamw_group_sums(items, beta1=b1, beta2=b2, eps=group["eps"],
                                                         chunks=2, generator=torch.Generator().manual_seed(2)))))
    # the collector's statistics of 16 linears' five operands (x, wgrad_x, w, dy, wgrad_dy),
    # hooks and end_step, as a telemetry step calls them (docs/telemetry.md, "Cost")
    from fullstack_fp4.telemetry.collector import TelemetryCollector

    x, w = torch.randn(512, 256).bfloat16(), torch.randn(256, 256).bfloat16()

    def linears():
        tel = TelemetryCollector(100)
        tel._gen = torch.Generator().manual_seed(0)
        for i in range(16):
            tel._add(f"l{i}", "x", x, (1, 16), "nearest")
            tel._add_wgrad(f"l{i}", "wgrad_x", x, "nearest")
            tel._add(f"l{i}", "w", w, (16, 16), "nearest")
            tel._add(f"l{i}", "dy", x, (1, 16), "stochastic")
            tel._add_wgrad(f"l{i}", "wgrad_dy", x, "stochastic")
        tel.end_step()

    rows.append(("collector, 16 linears x 5 operands ([512, 256] / [256, 256] bf16): hooks + end_step",
                 count(linears)))
    print(f"tree: {os.path.abspath(a.repo)}")
    print("| statistic | aten ops | host reads |\n|---|---:|---:|")
    for name, (ops, reads) in rows:
        print(f"| {name} | {ops} | {reads} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
