"""H200 benchmark: Newton–Schulz in BF16 vs emulated NVFP4, and the Muon / Root optimizer step.

Part 1, NS on the 3b shapes 3072×3072, 3072×8192, 8192×3072 (5 steps): time (median of CUDA-event
timings after warm-up) and relative Frobenius error against FP64 NS with the same coefficients,
for: bf16 (Muon's triple, the baseline), nvfp4 naive (every operand quantized, Muon's triple:
the ~60 % error case), nvfp4 shifted + Muon's triple, nvfp4 ours
(shifted + fitted "fp4" schedule) with one-term operands and with two-term operands (the default,
``nvfp4_terms=2``: ~2.4× the GEMM FLOPs of one term), each on the fused Triton operand path,
plus ours on the reference path (``fullstack_fp4.nvfp4.quantize`` + ``nvfp4_matmul``) to show what fusing buys.

Part 2, optimizer step over the 2-D weights of 4 decoder blocks of the 3b preset (hidden 3072,
ffn 8192, 24 heads, 8 kv groups of 128): QKV [5120, 3072] split [3072, 1024, 1024], proj
[3072, 3072], fc1 [16384, 3072] split [8192, 8192] (gate / up), fc2 [3072, 8192]; FP32 params
and grads (megatron's main params). muon / q_muon and root / q_root (q_* = NVFP4 NS with the
"fp4" table, Triton path; q_root also with one-term operands). Prints each q_* step time over
the BF16 step (target: q_root ≤ 1.5× root).

The NS part also runs the two-term method in its composed form (``LEAN_TWO_TERM = False``)
and checks that the lean step gives the same bits. Both parts also
run every capturable method as a CUDA graph (``newton_schulz_graphed``; the
optimizers' ``ns_cuda_graph=True``, the trainer's default): each graphed result is first checked
bit for bit against the eager one (NS: the same contiguous input; optimizers: two steps from the
same params, grads and state), and the run exits 1 if any differs; then both are timed.

Prints markdown tables; writes $OUT/bench_newton_schulz.json when $OUT is set.
Usage (GPU): python benchmarks/bench_newton_schulz.py [--iters 20] [--parts ns,steps]
"""

import argparse
import importlib
import json
import os
import statistics
import sys

import torch

from fullstack_fp4.optim.muon import Muon
from fullstack_fp4.optim.newton_schulz import graphable, newton_schulz, newton_schulz_graphed
from fullstack_fp4.optim.ns_coefficients import resolve_schedule
from fullstack_fp4.optim.root import Root

ns_mod = importlib.import_module("fullstack_fp4.optim.newton_schulz")   # the module, not the function

SHAPES = [(3072, 3072), (3072, 8192), (8192, 3072)]
NS_METHODS = {  # name: (precision, form, coefficients, backend, nvfp4_terms)
    "bf16": ("bf16", "shifted", "muon", "auto", 1),
    "nvfp4 naive (muon)": ("nvfp4", "naive", "muon", "triton", 1),
    "nvfp4 shifted (muon), 1 term": ("nvfp4", "shifted", "muon", "triton", 1),
    "nvfp4 ours 1-term (fp4)": ("nvfp4", "shifted", "fp4", "triton", 1),
    "nvfp4 ours (fp4, 2-term operands)": ("nvfp4", "shifted", "fp4", "triton", 2),
    "nvfp4 ours 2-term, composed (not lean)": ("nvfp4", "shifted", "fp4", "triton", 2),
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


MISMATCHES = []
LEAN_CHECKS = []


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
            kw = dict(coefficients=sched, precision=prec, nvfp4_form=form, backend=backend,
                      nvfp4_terms=terms)
            composed = "composed" in name     # the two-term step before its lean rewrite
            fn = lambda: newton_schulz(G, **kw)  # noqa: E731
            if composed:
                fn = lambda: _composed(G, kw)  # noqa: E731
            out = fn()
            if composed:   # the lean step must give the same bits as the composition it replaced
                same = bool(torch.equal(out, newton_schulz(G, **kw)))
                if not same:
                    MISMATCHES.append(f"lean two-term NS {shape}")
                LEAN_CHECKS.append(f"lean two-term step == composed two-term step at "
                                   f"{shape[0]}×{shape[1]}: {'bit-equal' if same else 'DIFFERS'}")
            err = rel(out, refs[key]) if torch.isfinite(out).all() else float("inf")
            n_it = iters if backend != "reference" else max(3, iters // 4)
            row = dict(shape=list(shape), method=name, ms=cuda_time(fn, 2, n_it),
                       relerr_vs_fp64_same_coefs=err, graph_ms=None, graph_bit_equal=None)
            if graphable(G, prec, backend) and not composed:
                gfn = lambda: newton_schulz_graphed(G, **kw)  # noqa: E731
                row["graph_bit_equal"] = bool(torch.equal(gfn(), out))
                if not row["graph_bit_equal"]:
                    MISMATCHES.append(f"NS {shape} {name}")
                row["graph_ms"] = cuda_time(gfn, 2, n_it)
            rows.append(row)
            g = "–" if row["graph_ms"] is None else \
                f"{row['graph_ms']:.2f} ({'bit-equal' if row['graph_bit_equal'] else 'DIFFERS'})"
            print(f"| {shape[0]}×{shape[1]} | {name} | {row['ms']:.2f} | {g} | "
                  f"{100 * err:.1f}% |", flush=True)
    return rows


def _composed(G, kw):
    """newton_schulz with the two-term step's composed form (ns.LEAN_TWO_TERM off)."""
    ns_mod.LEAN_TWO_TERM = False
    try:
        return newton_schulz(G, **kw)
    finally:
        ns_mod.LEAN_TWO_TERM = True


def block_params(seed=0):
    torch.manual_seed(seed)
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
    opts = {"muon": lambda ps, g: Muon(ps, ns_precision="bf16", ns_cuda_graph=g),
            "q_muon": lambda ps, g: Muon(ps, ns_precision="nvfp4", ns_coefficients="fp4",
                                         ns_cuda_graph=g),
            "q_muon 1-term": lambda ps, g: Muon(ps, ns_precision="nvfp4", ns_coefficients="fp4",
                                                ns_nvfp4_terms=1, ns_cuda_graph=g),
            "root": lambda ps, g: Root(ps, ns_precision="bf16", ns_cuda_graph=g),
            "q_root": lambda ps, g: Root(ps, ns_precision="nvfp4", ns_coefficients="fp4",
                                         ns_cuda_graph=g),
            "q_root 1-term": lambda ps, g: Root(ps, ns_precision="nvfp4", ns_coefficients="fp4",
                                                ns_nvfp4_terms=1, ns_cuda_graph=g)}
    rows = []
    for name, make in opts.items():
        row = dict(optimizer=name)
        # the check: two steps eager and two graphed from the same params, grads and state
        pe, pg = block_params(), block_params()
        oe, og = make(pe, False), make(pg, True)
        for _ in range(2):
            oe.step()
            og.step()
        same = all(torch.equal(a, b) for a, b in zip(pe, pg)) and all(
            torch.equal(oe.state[a]["momentum_buffer"], og.state[b]["momentum_buffer"])
            for a, b in zip(pe, pg))
        row["graph_bit_equal"] = bool(same)
        if not same:
            MISMATCHES.append(f"step {name}")
        row["params"] = sum(p.numel() for p in pe)
        row["ms"] = cuda_time(oe.step, 1, max(3, iters // 2))
        row["graph_ms"] = cuda_time(og.step, 1, max(3, iters // 2))
        rows.append(row)
        print(f"| {name} | {row['ms']:.1f} | {row['graph_ms']:.1f} | "
              f"{'yes' if same else 'NO'} |", flush=True)
        del oe, og, pe, pg
        torch.cuda.empty_cache()
    base = {r["optimizer"]: r for r in rows}
    for q, b in (("q_muon", "muon"), ("q_muon 1-term", "muon"), ("q_root", "root"),
                 ("q_root 1-term", "root")):
        print(f"- {q} / {b} (BF16) step time: eager {base[q]['ms'] / base[b]['ms']:.2f}×, "
              f"both graphed {base[q]['graph_ms'] / base[b]['graph_ms']:.2f}×, graphed vs "
              f"eager BF16 {base[q]['graph_ms'] / base[b]['ms']:.2f}× (target ≤ 1.5×)")
    for r in rows:
        r["ratio_vs_bf16_root"] = r["ms"] / base["root"]["ms"]
        r["graph_ratio_vs_graphed_bf16_root"] = r["graph_ms"] / base["root"]["graph_ms"]
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--parts", default="ns,steps", help="comma list of: ns, steps")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if not parts or parts - {"ns", "steps"}:
        sys.exit(f"error: --parts takes ns and/or steps, got {args.parts!r}")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    ns = steps = None
    if "ns" in parts:
        print("| shape | NS method | ms | as a CUDA graph, ms | error vs FP64 NS (same coefs) |\n"
              "| --- | --- | --- | --- | --- |")
        ns = bench_ns(args.iters)
        print("\n" + "\n".join(f"- {c}" for c in LEAN_CHECKS))
    if "steps" in parts:
        print("\n| optimizer (4 blocks of 3b) | step ms | NS as CUDA graphs, step ms | "
              "bit-equal |\n| --- | --- | --- | --- |")
        steps = bench_steps(args.iters)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_newton_schulz.json"), "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), ns=ns, steps=steps,
                           graph_mismatches=MISMATCHES), fh, indent=1)
    if MISMATCHES:
        print(f"FAIL: graphed != eager for {MISMATCHES}")
        sys.exit(1)
    print("PASS: every graphed result bit-equal to the eager one")


if __name__ == "__main__":
    main()
