"""Where Q-Attn's fwd+bwd spends device time: a per-kernel table from torch.profiler.

For each bench shape (1×24×4096×128 and 4×24×2048×128, causal, default paths) it times the
whole fwd+bwd with CUDA events (as benchmarks/bench_q_attn.py does) beside SDPA (torch's default
backend choice), then runs
``ITERS`` fwd+bwd under torch.profiler and prints every CUDA kernel's device time per
iteration, largest first, with its share of the sum, and SDPA's kernels the same way. The sum of kernel times against the event
time says how much of the step is gaps (launch latency / host) rather than kernels.

Last, the host side at 1×24×4096×128: 50 fwd+bwd under cProfile (the GPU never waited on
inside the loop), the functions by their own time — where Q-Attn's ~1.7 ms of host time per
fwd+bwd goes (SDPA: ~0.2 ms).

Usage (GPU): ``python benchmarks/profile/profile_q_attn.py``; writes ``q_attn_profile.json`` into
``$OUT`` if set.
"""

import cProfile
import io
import json
import os
import pstats
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _timing import median_ms  # noqa: E402
from fullstack_fp4.attention import q_attention  # noqa: E402

ITERS = 10


def kernel_table(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += ev.device_time_total / 1000.0 / ITERS   # ms per iteration
            per[ev.name][1] += 1
    return sorted(((n, t, c // ITERS) for n, (t, c) in per.items()), key=lambda r: -r[1])


def main():
    out = {}
    for b, h, s, d in ((1, 24, 4096, 128), (4, 24, 2048, 128)):
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))
        do = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)

        def qattn():
            q_attention(q, k, v, causal=True).backward(do)

        def sdpa():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

        t_q, t_s = median_ms(qattn), median_ms(sdpa)
        rows = kernel_table(qattn)
        total = sum(r[1] for r in rows)
        s_rows = kernel_table(sdpa)
        s_total = sum(r[1] for r in s_rows)
        name = f"{b}x{h}x{s}x{d}"
        print(f"\n## {name} causal: q_attn fwd+bwd {t_q:.3f} ms, SDPA (torch's default backend) "
              f"{t_s:.3f} ms ({t_q / t_s:.2f}x); kernel sums (device time) {total:.3f} vs "
              f"{s_total:.3f} ms ({total / s_total:.2f}x); q_attn {t_q - total:.3f} ms not in kernels\n")
        print("SDPA kernels: " + "; ".join(f"{n[:60]} {t:.4f}" for n, t, _ in s_rows) + "\n")
        print("| kernel | launches | ms | share |\n| --- | --- | --- | --- |")
        for n, t, c in rows:
            print(f"| {n[:90]} | {c} | {t:.4f} | {100 * t / total:.1f}% |")
        out[name] = {"q_attn_ms": t_q, "sdpa_ms": t_s, "kernels": rows, "sdpa_kernels": s_rows}
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 24, 4096, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    do = torch.randn(1, 24, 4096, 128, device="cuda", dtype=torch.bfloat16)

    def fb():
        q.grad = k.grad = v.grad = None
        q_attention(q, k, v, causal=True).backward(do)
    fb()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        fb()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    print("\n## host: 50 Q-Attn fwd+bwd at 1x24x4096x128 under cProfile, by own time\n")
    print(buf.getvalue())
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "q_attn_profile.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
