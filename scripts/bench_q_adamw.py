"""Benchmark Q-AdamW's fused step on the GPU against torch fused AdamW and torchao's low-bit AdamW.

    python scripts/bench_q_adamw.py [--params 1.0e9] [--steps 10] [--grad-dtype fp32|bf16]

1. Correctness first: on a small tensor (n = 100_003, odd on purpose) the fused Triton kernel
   with explicit uniforms vs ``q_adamw_step_reference`` on the same GPU, 3 steps: counts of
   differing parameters / state bytes (expected: 0; the kernel uses IEEE div/sqrt and no FMA
   contraction, so any mismatch is a bug to report, not noise).
2. ~1.0e9 FP32 parameters as 3b-shaped matrices (3072×3072, 3072×8192, 8192×3072 repeated),
   random gradients; per optimizer: 3 warm-up steps, then ``--steps`` steps each timed with
   CUDA events; median ms/step; optimizer-state bytes per parameter.
Rows: QAdamW (fused kernel), torch AdamW(fused=True), torchao AdamW4bit / AdamW8bit (skipped
if torchao is missing). Before them, kernel-only rows (launch() over the same ~1e9 params, no
optimizer bookkeeping): the first kernel (removed; 29.4 ms, BENCHMARKS.md) and the current
kernel at 1, 2, 4 chunks per program (``--cpp``), so a table shows what each change bought
(fullstack_fp4/optim/q_adamw/PERF.md has the predictions). Prints a markdown table; writes JSON to $OUT/bench_q_adamw.json if $OUT.
Bytes per parameter that must move (FP32 grad): QAdamW p 8 + g 4 + states ~2.4 = ~14.4 B;
fused AdamW 28 B: the floor is ~0.5× of fused AdamW's time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fullstack_fp4.optim import QAdamW, optimizer_state_bytes  # noqa: E402
from fullstack_fp4.optim.q_adamw.codecs import padded_numel  # noqa: E402
from fullstack_fp4.optim.q_adamw.optimizer import (_hyper, _init_state,  # noqa: E402
                                                   _kernel_views, q_adamw_step_reference)
from fullstack_fp4.optim.q_adamw.triton_step import launch  # noqa: E402

SHAPES = ((3072, 3072), (3072, 8192), (8192, 3072))


def correctness(n=100_003, steps=3):
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    npad = padded_numel(n)
    p = torch.randn(n, device=dev, generator=gen)
    st = _init_state(n, dev)
    p2, st2 = p.clone(), {k: v.clone() for k, v in st.items()}
    out = {}
    for t in range(1, steps + 1):
        g = torch.randn(n, device=dev, generator=gen) * torch.exp(
            2 * torch.randn(n, device=dev, generator=gen))
        u = torch.rand(npad, device=dev, generator=gen)
        q_adamw_step_reference(p, g, st, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=0.01, step=t, rand=u)
        launch(p2, g, _kernel_views(st2), n, npad, seed=1, rand=u,
               **_hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, t, dev))
    torch.cuda.synchronize()
    out["param_mismatches"] = int((p != p2).sum())
    out["param_max_abs_diff"] = float((p - p2).abs().max())
    for k in st:
        out[f"{k}_mismatches"] = int((st[k] != st2[k]).sum())
    out["ok"] = out["param_mismatches"] == 0 and all(
        v == 0 for k, v in out.items() if k.endswith("_mismatches"))
    return out


def make_params(total: float, grad_dtype):
    params, n, i = [], 0, 0
    while n < total:
        r, c = SHAPES[i % 3]
        p = torch.nn.Parameter(torch.randn(r, c, device="cuda") * 0.02)
        p.grad = (torch.randn(r, c, device="cuda") * 1e-3).to(grad_dtype)
        params.append(p)
        n += r * c
        i += 1
    return params, n


def time_kernel(fn, params, states, steps):
    """Median ms of one pass of ``fn(p, g, st, step)`` over all params (the kernel alone)."""
    def one(t):
        for p, st in zip(params, states):
            n = p.numel()
            fn(p.data.view(-1), p.grad.view(-1), st, n, padded_numel(n), seed=t,
               **_hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, t, "cuda"))
    for t in range(1, 4):
        one(t)
    torch.cuda.synchronize()
    ts = []
    for t in range(4, 4 + steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        one(t)
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts), ts


def kernel_rows(args, gd, res):
    params, n = make_params(args.params, gd)
    states = [_kernel_views(_init_state(p.numel(), "cuda")) for p in params]
    variants = []
    for cpp in args.cpp:
        variants.append((f"kernel (thread per block, cpp={cpp}, {2 * cpp} warps)",
                         lambda *a, _c=cpp, **k: launch(*a, cpp=_c, **k)))
    for name, fn in variants:
        try:
            med, ts = time_kernel(fn, params, states, args.steps)
        except Exception as e:  # noqa: BLE001 - report and go on to the next variant
            print(f"{name}: FAILED {type(e).__name__}: {e}")
            continue
        gbs = n * 14.4 / (med * 1e-3) / 1e9
        row = {"optimizer": name, "params": n, "ms_per_step": med, "all_ms": ts,
               "eff_GBps_at_14.4B": gbs, "state_bytes_per_param": float("nan")}
        res["rows"].append(row)
        print(row)
    del params, states
    torch.cuda.empty_cache()


def time_opt(opt, steps):
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    ts = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        opt.step()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts), ts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=1.0e9)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--grad-dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--cpp", type=int, nargs="*", default=[1, 2],
                    help="chunks per program for the kernel-only rows")
    ap.add_argument("--no-kernel-rows", action="store_true")
    args = ap.parse_args()
    gd = torch.float32 if args.grad_dtype == "fp32" else torch.bfloat16
    res = {"device": torch.cuda.get_device_name(), "correctness": correctness(), "rows": []}
    print("correctness (kernel vs reference, same uniforms):", res["correctness"])
    if not args.no_kernel_rows:
        kernel_rows(args, gd, res)

    makers = [("QAdamW (fused Triton)", lambda ps: QAdamW(ps, lr=1e-3)),
              ("torch AdamW(fused=True)", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True))]
    try:
        try:
            from torchao.optim import AdamW4bit, AdamW8bit
        except ImportError:
            from torchao.prototype.low_bit_optim import AdamW4bit, AdamW8bit
        makers += [("torchao AdamW4bit", lambda ps: AdamW4bit(ps, lr=1e-3)),
                   ("torchao AdamW8bit", lambda ps: AdamW8bit(ps, lr=1e-3))]
    except Exception as e:  # noqa: BLE001 - any import failure means: skip the rows
        print(f"torchao not importable ({type(e).__name__}: {e}); skipping its rows")

    for name, mk in makers:
        params, n = make_params(args.params, gd)
        opt = mk(params)
        med, ts = time_opt(opt, args.steps)
        row = {"optimizer": name, "params": n, "ms_per_step": med, "all_ms": ts,
               "state_bytes_per_param": optimizer_state_bytes(opt) / n,
               "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30}
        res["rows"].append(row)
        print(row)
        del opt, params
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    base = next(r for r in res["rows"] if r["optimizer"].startswith("torch AdamW"))
    print(f"\n{res['device']}, {base['params'] / 1e9:.3f}B params, grads {args.grad_dtype}\n")
    print("| optimizer | ms/step (median) | × torch fused | state B/param | GB/s at 14.4 B/param |")
    print("|---|---|---|---|---|")
    for r in res["rows"]:
        gbs = r["params"] * 14.4 / (r["ms_per_step"] * 1e-3) / 1e9
        print(f"| {r['optimizer']} | {r['ms_per_step']:.2f} | "
              f"{r['ms_per_step'] / base['ms_per_step']:.2f} | {r['state_bytes_per_param']:.3f} "
              f"| {gbs:.0f} |")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_q_adamw.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
