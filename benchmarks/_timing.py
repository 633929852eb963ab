"""CUDA-event timing shared by the GPU benchmark scripts."""

import torch


def median_ms(fn, iters: int = 20, warmup: int = 5) -> float:
    """Median, over ``iters`` calls of ``fn`` after ``warmup`` untimed ones, of the CUDA-event
    time from just before the call to just after it. The GPU is synchronised after every call,
    so host time inside a call counts (a host-bound call shows as such) and nothing queued by
    one call overlaps the next."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        z.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(z))
    return sorted(ts)[len(ts) // 2]


def capture_graph(fn, calls: int = 1) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``calls`` back-to-back calls of ``fn``, after one eager call (compiles,
    allocator warm-up) and one on a side stream (what capture needs first)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g
