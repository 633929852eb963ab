"""Where the NVFP4 linear's CUDA-graph time goes beyond its kernels' own times.

``benchmarks/bench_nvfp4_linear.py`` times fwd+bwd as a CUDA graph replayed after an L2 flush
(``do_bench``), which can take longer than the kernels' own times summed
(``profile_linear_device.py``, eager; figures: ``BENCHMARKS.md#nvfp4-quantize-and-linear``).
This replays each graph ``REPS`` times under torch.profiler (CUPTI records the kernels of a
graph replay), each replay after the same flush (a 256 MB write, here a ``neg_`` so that it
marks where a replay starts; then again without the flush, a 4 KB ``neg_`` marking the start),
and prints per kernel of the replay: its mean device time, the mean idle gap before it (from the
preceding kernel's end), and for the replay the span from the first kernel's start to the last
one's end, the kernels' sum and the gaps' sum. The same fwd+bwd run eagerly (no flush, as the
eager profile) is listed beside, to show what the graph and the flush each change.
The NVFP4 GEMMs are emulated (decoded BF16 operands, FP32 accumulation).

``--sustained``: only ``SUSTAINED`` replays queued back to back, each after the flush, as
``do_bench`` runs them, kernel times over the last half (after the GPU has run at that load for
a while), then ``do_bench``'s own median for the same graph.

Usage (GPU): ``python benchmarks/profile/graph_kernel_trace.py [--fout 3072] [--sustained]``.
"""

import argparse
import os
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _timing import capture_graph  # noqa: E402

from fullstack_fp4.linear import nvfp4_linear  # noqa: E402

REPS = 10
SUSTAINED = 200


def short(name: str) -> str:
    for key in ("nvjet", "_quantize_two_ways", "_amax_pair", "_amax_two_ways", "_decode_pair",
                "_dequantize_flat", "FillFunctor", "BinaryFunctor", "Memset", "neg_kernel"):
        if key in name:
            return name.split("<")[0][:48] if key == "nvjet" else key
    return name[:40]


def kernels(prof):
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ev.sort(key=lambda e: e.time_range.start)
    return [(short(e.name), e.time_range.start, e.time_range.end) for e in ev]


def segments(ks):
    """Split the kernel list at each flush (``neg_``): one list per replay."""
    out, cur = [], None
    for k in ks:
        if k[0] == "neg_kernel":
            if cur:
                out.append(cur)
            cur = []
        elif cur is not None:
            cur.append(k)
    if cur:
        out.append(cur)
    return out


def table(segs, label):
    segs = [s for s in segs if s]
    if not segs:
        print(f"\n{label}: the profiler recorded no kernels between the markers")
        return
    n = min(len(s) for s in segs)
    segs = [s for s in segs if len(s) == n]
    dur, gap = defaultdict(float), defaultdict(float)
    span = ksum = gsum = 0.0
    for s in segs:
        span += (s[-1][2] - s[0][1]) / len(segs)
        for i, (name, a, z) in enumerate(s):
            dur[i] += (z - a) / len(segs)
            ksum += (z - a) / len(segs)
            if i:
                g = a - s[i - 1][2]
                gap[i] += g / len(segs)
                gsum += g / len(segs)
    print(f"\n{label}: {len(segs)} replays, {n} kernels; span {span / 1000:.3f} ms = kernels "
          f"{ksum / 1000:.3f} + gaps {gsum / 1000:.3f}")
    print("| # | kernel | µs | gap before, µs |")
    print("| ---: | --- | ---: | ---: |")
    for i, (name, _, _) in enumerate(segs[0]):
        print(f"| {i} | {name} | {dur[i]:.1f} | {gap[i]:.1f} |")


def sustained(g, flush, label):
    """``SUSTAINED`` replays queued back to back, each after the flush (what ``do_bench``
    times, without its events): the mean of each kernel over the last half, where the GPU has
    run at this load for a while (clocks under its power limit), and do_bench's median."""
    import triton
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(SUSTAINED):
            flush.neg_()
            g.replay()
        torch.cuda.synchronize()
    segs = segments(kernels(prof))
    table(segs[len(segs) // 2:], f"{label}, graph after flush, {SUSTAINED} replays back to back "
          f"(the last {len(segs) - len(segs) // 2})")
    print(f"do_bench of the replay (median, L2 flushed): "
          f"{triton.testing.do_bench(g.replay, warmup=25, rep=200, return_mode='median'):.3f} ms")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fout", type=int, default=3072)
    ap.add_argument("--sustained", action="store_true",
                    help="only the back-to-back replays (sustained load) and do_bench")
    a = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(8192, 3072, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(a.fout, 3072, device="cuda", dtype=torch.bfloat16) / 3072 ** 0.5).requires_grad_()
    dy = torch.randn(8192, a.fout, device="cuda", dtype=torch.bfloat16)
    flush = torch.empty(256 * 2 ** 20 // 4, dtype=torch.float32, device="cuda")
    for name, f in (("nvfp4_linear", nvfp4_linear), ("BF16 F.linear", F.linear)):
        def run():
            x.grad = w.grad = None
            f(x, w).backward(dy)
        g = capture_graph(run)   # an eager call first, one on a side stream, the capture
        if a.sustained:
            sustained(g, flush, f"3072->{a.fout} {name}")
            continue
        for mode in ("graph after flush", "graph, no flush", "eager, no flush"):
            torch.cuda.synchronize()
            marker = flush if mode.endswith("after flush") else flush[:1024]
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(REPS):
                    marker.neg_()
                    torch.cuda.synchronize()
                    if mode.startswith("graph"):
                        g.replay()
                    else:
                        run()
                    torch.cuda.synchronize()
            table(segments(kernels(prof)), f"3072->{a.fout} {name}, {mode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
