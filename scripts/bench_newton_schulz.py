"""H200 benchmark: Newton–Schulz in BF16 vs emulated NVFP4, and the Muon / Root optimizer step.

Part 1, NS on the 3b shapes 3072×3072, 3072×8192, 8192×3072 (5 steps): time (median of CUDA-event
timings after warm-up) and relative Frobenius error against FP64 NS with the same coefficients,
for: bf16 (Muon's triple, the anchor: 3.1 ms / 2.1 % at 3072×8192), nvfp4 naive (every operand
quantized, Muon's triple: the anchors' 59–62 % case), nvfp4 shifted + Muon's triple, nvfp4 ours
(shifted + fitted "fp4" schedule) with one-term operands and with two-term operands (the default,
``nvfp4_terms=2``: ~2.4× the GEMM FLOPs of one term), each on the fused Triton operand path,
plus ours on the reference path (``fullstack_fp4.nvfp4.quantize`` + ``nvfp4_matmul``) to show what fusing buys.

Part 2, optimizer step over the 2-D weights of 4 decoder blocks of the 3b preset (hidden 3072,
ffn 8192, 24 heads, 8 kv groups of 128): QKV [5120, 3072] split [3072, 1024, 1024], proj
[3072, 3072], fc1 [16384, 3072] split [8192, 8192] (gate / up), fc2 [3072, 8192]; FP32 params
and grads (megatron's main params). muon / q_muon and root / q_root (q_* = NVFP4 NS with the
"fp4" table, Triton path; q_root also with one-term operands). Prints each q_* step time over
the BF16 step (target: q_root ≤ 1.5× root).

Prints a markdown table; writes $OUT/bench_newton_schulz.json when $OUT is set.
Usage (GPU): python scripts/bench_newton_schulz.py [--iters 20]
"""

import argparse
import json
import os
import statistics

import torch

from fullstack_fp4.optim.muon import Muon
from fullstack_fp4.optim.newton_schulz import newton_schulz
from fullstack_fp4.optim.ns_coefficients import resolve_schedule
from fullstack_fp4.optim.root import Root

SHAPES = [(3072, 3072), (3072, 8192), (8192, 3072)]
NS_METHODS = {  # name: (precision, form, coefficients, backend, nvfp4_terms)
    "bf16": ("bf16", "shifted", "muon", "auto", 1),
    "nvfp4 naive (muon)": ("nvfp4", "naive", "muon", "triton", 1),
    "nvfp4 shifted (muon), 1 term": ("nvfp4", "shifted", "muon", "triton", 1),
    "nvfp4 ours 1-term (fp4)": ("nvfp4", "shifted", "fp4", "triton", 1),
    "nvfp4 ours (fp4, 2-term operands)": ("nvfp4", "shifted", "fp4", "triton", 2),
    "nvfp4 ours, reference path": ("nvfp4", "shifted", "fp4", "reference", 2),
}


def cuda_time(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def rel(x, y):
    return ((x.double() - y).norm() / y.norm()).item()


def bench_ns(iters):
    rows = []
    for shape in SHAPES:
        G = torch.randn(*shape, device="cuda")
        refs = {}
        for name, (prec, form, coefs, backend, terms) in NS_METHODS.items():
            sched = resolve_schedule(coefs, shape, 5)
            key = tuple(sched)
            if key not in refs:
                refs[key] = newton_schulz(G, coefficients=sched, precision="fp64")
            fn = lambda: newton_schulz(G, coefficients=sched, precision=prec,  # noqa: E731
                                       nvfp4_form=form, backend=backend, nvfp4_terms=terms)
            out = fn()
            err = rel(out, refs[key]) if torch.isfinite(out).all() else float("inf")
            n_it = iters if backend != "reference" else max(3, iters // 4)
            rows.append(dict(shape=list(shape), method=name, ms=cuda_time(fn, 2, n_it),
                             relerr_vs_fp64_same_coefs=err))
            print(f"| {shape[0]}×{shape[1]} | {name} | {rows[-1]['ms']:.2f} | "
                  f"{100 * err:.1f}% |", flush=True)
    return rows


def block_params():
    ps = []
    for _ in range(4):
        qkv = torch.nn.Parameter(torch.randn(5120, 3072, device="cuda") * 0.02)
        qkv.ns_split_sizes = [3072, 1024, 1024]
        fc1 = torch.nn.Parameter(torch.randn(16384, 3072, device="cuda") * 0.02)
        fc1.ns_split_sizes = [8192, 8192]
        ps += [qkv, torch.nn.Parameter(torch.randn(3072, 3072, device="cuda") * 0.02), fc1,
               torch.nn.Parameter(torch.randn(3072, 8192, device="cuda") * 0.02)]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    return ps


def bench_steps(iters):
    opts = {"muon": lambda ps: Muon(ps, ns_precision="bf16"),
            "q_muon": lambda ps: Muon(ps, ns_precision="nvfp4", ns_coefficients="fp4"),
            "root": lambda ps: Root(ps, ns_precision="bf16"),
            "q_root": lambda ps: Root(ps, ns_precision="nvfp4", ns_coefficients="fp4"),
            "q_root 1-term": lambda ps: Root(ps, ns_precision="nvfp4", ns_coefficients="fp4",
                                             ns_nvfp4_terms=1)}
    rows = []
    for name, make in opts.items():
        ps = block_params()
        opt = make(ps)
        ms = cuda_time(opt.step, 2, max(3, iters // 2))
        rows.append(dict(optimizer=name, ms=ms, params=sum(p.numel() for p in ps)))
        print(f"| {name} | {ms:.1f} |", flush=True)
        del opt, ps
        torch.cuda.empty_cache()
    base = {r["optimizer"]: r["ms"] for r in rows}
    for q, b in (("q_muon", "muon"), ("q_root", "root"), ("q_root 1-term", "root")):
        print(f"- {q} / {b} (BF16) step time: {base[q] / base[b]:.2f}× (target ≤ 1.5×)")
    for r in rows:
        r["ratio_vs_bf16_root"] = r["ms"] / base["root"]
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| shape | NS method | ms | error vs FP64 NS (same coefs) |\n| --- | --- | --- | --- |")
    ns = bench_ns(args.iters)
    print("\n| optimizer (4 blocks of 3b) | step ms |\n| --- | --- |")
    steps = bench_steps(args.iters)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_newton_schulz.json"), "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), ns=ns, steps=steps), fh, indent=1)


if __name__ == "__main__":
    main()
