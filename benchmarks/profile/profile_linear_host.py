#!/usr/bin/env python3
"""Where the host time of one NVFP4 linear fwd+bwd goes (8192 x 3072 -> 3072, BF16, one GPU).

The eager fwd+bwd takes well over its CUDA-graph replay at this size (1.460 against 0.809 ms,
``BENCHMARKS.md#nvfp4-quantize-and-linear``): the host, not the GPU, sets the pace. This runs
200 fwd+bwd under cProfile with the GPU kept busy (no sync inside the loop) and prints the
functions by their own time, then the host time per call of the pieces measured alone (a loop
of launches, synchronised once at the end).

    python benchmarks/profile/profile_linear_host.py
"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch
import torch.nn.functional as F

from fullstack_fp4.linear import nvfp4_linear
from fullstack_fp4.nvfp4.kernels import quantize_two_ways as tqd


def host_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main() -> int:
    torch.manual_seed(0)
    t, cin, cout = 8192, 3072, 3072
    x = torch.randn(t, cin, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(cout, cin, device="cuda", dtype=torch.bfloat16) / cin ** 0.5).requires_grad_()
    dy = torch.randn(t, cout, device="cuda", dtype=torch.bfloat16)

    def fb(f):
        x.grad = w.grad = None
        f(x, w).backward(dy)

    print(f"host us per fwd+bwd (launch loop, GPU not waited on): "
          f"bf16 {host_us(lambda: fb(F.linear)):.0f}, nvfp4 {host_us(lambda: fb(nvfp4_linear)):.0f}")
    xd = x.detach()
    obs = tqd.amax_two_ways(xd)
    pieces = {
        "torch.empty x3": lambda: [torch.empty(t, cin, dtype=torch.bfloat16, device="cuda") for _ in range(3)],
        "amax_two_ways(x)": lambda: tqd.amax_two_ways(xd),
        "quantize_two_ways(x, row+col)": lambda: tqd.quantize_two_ways(xd, obs, row=tqd.RowWay(),
                                                                       col=tqd.ColWay()),
        "torch.mm fp32 out": lambda: torch.mm(xd, w.detach().t(), out_dtype=torch.float32),
        "F.linear fwd": lambda: F.linear(xd, w.detach()),
    }
    for name, fn in pieces.items():
        print(f"  host us, {name}: {host_us(fn):.1f}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        fb(nvfp4_linear)
    prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
