"""Benchmark Q-AdamW's fused step on the GPU against torch fused AdamW and torchao's low-bit AdamW.

    python benchmarks/bench_q_adamw.py [--params 1.0e9] [--steps 10] [--grad-dtype fp32|bf16]
    python benchmarks/bench_q_adamw.py --sweep [--params 1.0e9]   # kernel configurations only
    python benchmarks/bench_q_adamw.py --fast-div-rows   # + rows with the approximate division
    python benchmarks/bench_q_adamw.py --flat-row        # + all params as one tensor, one launch
    python benchmarks/bench_q_adamw.py --multi-rows      # + one multi-tensor launch (triton_multi)
    python benchmarks/bench_q_adamw.py --streams-rows    # + QAdamW(launch_streams=1, 3) rows

``--fast-div-rows``: kernel rows and a ``QAdamW(approx_division=True)`` row whose update divides
as ``m · rcp.approx(d)`` (docs/perf/q-adamw.md), checked first: states bit for bit the reference's, p'
within ``_fast_div_check``'s bound of the reference's (plain, a Philox-path piece, model_out).

``--sweep``: every candidate launch configuration of the fused kernel — chunks per program
(``cpp`` 1, 2, 4 → 2, 4, 8 warps), register cap (``maxnreg`` 0 = Triton's choice, 128, 96; None = the default), nibble decode
(``fast_dec`` on/off) — first checked bit for bit against the reference on the GPU (a plain
and a phased tensor, 3 steps; a config that differs is reported and not timed), then timed
over the same ~1e9 parameters as the kernel rows, all in this one process; prints a table
sorted by time with the ratio to torch fused AdamW (timed too) and the best configuration to
set as ``triton_step.CPP`` / ``FAST_DEC`` (and ``maxnreg``). Default list: 5 likely configs
(~5 min of compiles) plus Philox-path options (``rounds=7``; ``u8=False``: 16-bit uniforms
from two Philox calls per block — SR bias bound 2^-16 instead of the default's 2^-9 of a
step), each also checked on its Philox path (``kernel_uniforms``); ``--sweep-all`` 24 configs;
``--sweep-configs 'cpp,maxnreg,fast_dec[,u8,rounds];…'`` a chosen few.

1. Correctness first: on a small tensor (n = 100_003, odd on purpose) the fused Triton kernel
   with explicit uniforms vs ``q_adamw_step_reference`` on the same GPU, 3 steps: counts of
   differing parameters / state bytes (expected: 0; the kernel uses IEEE div/sqrt and no FMA
   contraction, so any mismatch is a bug to report, not noise). The same with ``model_out``
   (the BF16 model-param write), whose BF16 values must be ``p.to(bfloat16)`` bit for bit.
2. ~1.0e9 FP32 parameters as 3b-shaped matrices (3072×3072, 3072×8192, 8192×3072 repeated),
   random gradients; per optimizer: 3 warm-up steps, then ``--steps`` steps each timed with
   CUDA events; median ms/step; optimizer-state bytes per parameter.
Rows: QAdamW (fused kernel), torch AdamW(fused=True), torchao AdamW4bit / AdamW8bit (skipped
if torchao is missing). Before them, kernel-only rows (launch() over the same ~1e9 params, no
optimizer bookkeeping): the kernel at 1, 2, 4 chunks per program (``--cpp``), and the kernel +
megatron's separate main -> model BF16 copy against the kernel writing the BF16 model param
itself (``model_out``), so a table shows what each option costs or saves
(docs/perf/q-adamw.md has the yardsticks; current figures: ``BENCHMARKS.md#q-adamw``). Prints a markdown table; writes JSON to $OUT/bench_q_adamw.json if $OUT.
Bytes per parameter that must move (FP32 grad): QAdamW p 8 + g 4 + states ~2.33 = ~14.3 B;
fused AdamW 28 B: the floor is ~0.5× of fused AdamW's time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fullstack_fp4.optim import QAdamW, optimizer_state_bytes  # noqa: E402
from fullstack_fp4.optim.q_adamw.codecs import padded_numel  # noqa: E402
from fullstack_fp4.optim.q_adamw.optimizer import (  # noqa: E402
    kernel_hyper, kernel_views, kernel_uniforms, q_adamw_step_reference)
from fullstack_fp4.optim.q_adamw.state import init_state  # noqa: E402
from fullstack_fp4.optim.q_adamw.triton_step import launch  # noqa: E402

SHAPES = ((3072, 3072), (3072, 8192), (8192, 3072))


def correctness(n=100_003, steps=3, phase=0, model_out=False, philox=False, **launch_kw):
    """Kernel vs reference, same uniforms; ``model_out``: the variant that also writes the BF16
    model param (checked against ``p.to(bfloat16)``, torch's CUDA cast); ``philox``: the kernel
    draws its own uniforms (the path QAdamW runs) and the reference gets the same stream from
    ``kernel_uniforms`` (PyTorch Philox). ``fast_div``: the states must still be the reference's
    bit for bit, p' within ``_fast_div_check``'s bound of the reference's (each step compared,
    then the kernel's p' reset to the reference's)."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    npad = padded_numel(n)
    p = torch.randn(n, device=dev, generator=gen)
    st = init_state(n, dev, phase)
    p2, st2 = p.clone(), {k: v.clone() for k, v in st.items()}
    bf16 = torch.empty(n, dtype=torch.bfloat16, device=dev) if model_out else None
    out = {}
    fast_div = bool(launch_kw.get("fast_div"))
    for t in range(1, steps + 1):
        p_old = p.clone()
        g = torch.randn(n, device=dev, generator=gen) * torch.exp(
            2 * torch.randn(n, device=dev, generator=gen))
        if philox:
            u = kernel_uniforms(1000 + t, npad, 5, u8=launch_kw.get("u8", True),
                                rounds=launch_kw.get("rounds", 10), device=dev)
        else:
            u = torch.rand(npad, device=dev, generator=gen)
        q_adamw_step_reference(p, g, st, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=0.01, step=t, rand=u, phase=phase)
        launch(p2, g, kernel_views(st2), n, npad, seed=1000 + t, rand=None if philox else u,
               phase=phase, row0=5, model_out=bf16, **launch_kw,
               **kernel_hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, t, dev))
        if model_out:   # the BF16 write is the cast of the kernel's own p'
            out["model_out_mismatches"] = out.get("model_out_mismatches", 0) + int(
                (bf16.view(torch.int16) != p2.to(torch.bfloat16).view(torch.int16)).sum())
        if fast_div:    # p' within the bound of docs/perf/q-adamw.md, then resynchronised
            _fast_div_check(out, p_old, p, p2, 0.01 * 1e-3)
            p2.copy_(p)
    torch.cuda.synchronize()
    if not fast_div:
        out["param_mismatches"] = int((p != p2).sum())
        out["param_max_abs_diff"] = float((p - p2).abs().max())
    for k in st:
        out[f"{k}_mismatches"] = int((st[k] != st2[k]).sum())
    out["ok"] = out.get("param_out_of_bound", 0) == 0 and all(
        v == 0 for k, v in out.items() if k.endswith("_mismatches"))
    return out


def _fast_div_check(out, p_old, p_ref, p_fast, wd_lr):
    """``fast_div``: p' = fma(−step, m'·rcp(d), p·decay) against the reference's IEEE m'/d.
    The update u differs by at most |u|·2^-22 (rcp.approx ≤ 1 ulp, the FMUL ½ ulp, div_rn's
    ½ ulp), so |Δp'| ≤ step·|u|·2^-22 + the two FMAs' roundings of p' (2 ulp: the kernel's p'
    may lie a binade above); step·|u| is read off the reference as |p' − p·decay| (its 2^-22
    doubled for that proxy's own rounding). tests/.../test_q_adamw_kernel.py checks the same."""
    upd = (p_ref.double() - p_old.double() * (1 - wd_lr)).abs()
    a = p_ref.abs()
    ulp = (torch.nextafter(a, torch.full_like(a, float("inf"))) - a).double()
    bound = upd * 2.0 ** -21 + 2 * ulp
    diff = (p_fast.double() - p_ref.double()).abs()
    out["param_out_of_bound"] = out.get("param_out_of_bound", 0) + int((diff > bound).sum())
    out["param_differing"] = out.get("param_differing", 0) + int((diff > 0).sum())
    rel = diff / upd.clamp_min(1e-30)
    out["max_diff_over_update"] = max(out.get("max_diff_over_update", 0.0), float(rel.max()))


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


def time_kernel(fn, params, states, steps, outs=None):
    """Median ms of one pass of ``fn(p, g, st, step)`` over all params (the kernel alone);
    ``outs``: a BF16 model-param destination per param (``model_out``)."""
    def one(t):
        for i, (p, st) in enumerate(zip(params, states)):
            n = p.numel()
            extra = {"model_out": outs[i]} if outs is not None else {}
            fn(p.data.view(-1), p.grad.view(-1), st, n, padded_numel(n), seed=t, **extra,
               **kernel_hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, t, "cuda"))
    return time_steps(one, steps)


def time_steps(one, steps, host=None):
    """``one(t)`` for t = 1..3 (warm-up), then ``steps`` more each timed with CUDA events:
    (median ms, all ms). Each step starts on an idle GPU (synchronized before), as after
    megatron's grad-norm ``.item()``, so host time the GPU waits for is in the figure.
    ``host``: a list that gets each timed step's host (Python + launch) ms."""
    for t in range(1, 4):
        one(t)
    torch.cuda.synchronize()
    ts = []
    for t in range(4, 4 + steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        h0 = time.perf_counter()
        one(t)
        h1 = time.perf_counter()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
        if host is not None:
            host.append((h1 - h0) * 1e3)
    return statistics.median(ts), ts


def kernel_rows(args, gd, res):
    params, n = make_params(args.params, gd)
    states = [kernel_views(init_state(p.numel(), "cuda")) for p in params]
    variants = []
    for cpp in args.cpp:
        variants.append((f"kernel (thread per block, cpp={cpp}, {2 * cpp} warps)",
                         lambda *a, _c=cpp, **k: launch(*a, cpp=_c, **k)))
    if args.u16_row:    # two Philox calls a block, 16-bit uniforms (the default draws 8-bit ones)
        variants.append(("kernel cpp=1, 16-bit uniforms (u8=False)",
                         lambda *a, **k: launch(*a, cpp=1, u8=False, **k)))
    if args.fast_div_rows:  # docs/perf/q-adamw.md: the update's m/d as m * rcp.approx(d)
        variants.append(("kernel cpp=1, approx division (fast_div)",
                         lambda *a, **k: launch(*a, cpp=1, fast_div=True, **k)))
        variants.append(("kernel cpp=1, approx division, 7 Philox rounds",
                         lambda *a, **k: launch(*a, cpp=1, fast_div=True, rounds=7, **k)))
    for name, fn in variants:
        try:
            med, ts = time_kernel(fn, params, states, args.steps)
        except Exception as e:  # noqa: BLE001 - report and go on to the next variant
            print(f"{name}: FAILED {type(e).__name__}: {e}")
            continue
        gbs = n * 14.3 / (med * 1e-3) / 1e9
        row = {"optimizer": name, "params": n, "ms_per_step": med, "all_ms": ts,
               "eff_GBps_at_14.3B": gbs, "state_bytes_per_param": float("nan")}
        res["rows"].append(row)
        print(row)
    if args.flat_row:
        flat_rows(args, params, n, res)
    if args.multi_rows:
        multi_rows(args, params, states, n, res)
    model_write_rows(args, params, states, n, res)
    del params, states
    torch.cuda.empty_cache()


def flat_rows(args, params, n, res):
    """The same entries as one flat tensor, stepped by one launch: what a multi-tensor launch
    could save at most. Per parameter, a launch ends with a partly filled last wave of programs
    (some SMs idle) and the next launch starts only after it; ~51 launches here. The row's
    difference to the per-parameter row bounds that overhead (the same kernel, the same work)."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    g = torch.cat([p.grad.reshape(-1) for p in params])
    st = kernel_views(init_state(flat.numel(), "cuda"))
    for name, kw in (("kernel cpp=1, one launch over all params as one flat tensor", {}),
                     ("the same, approx division", {"fast_div": True})):
        fp = torch.nn.Parameter(flat)
        fp.grad = g
        med, ts = time_kernel(lambda *a, _kw=kw, **k: launch(*a, **_kw, **k), [fp], [st],
                              args.steps)
        row = {"optimizer": name, "params": n, "ms_per_step": med, "all_ms": ts,
               "state_bytes_per_param": float("nan")}
        res["rows"].append(row)
        print(row)
    del flat, g, st
    torch.cuda.empty_cache()


def multi_rows(args, params, states, n, res):
    """The same parameters and states stepped by one multi-tensor launch (triton_multi.py), with
    the IEEE and the approximate division: what batching the ~51 launches saves in practice
    (the flat row is the bound; the table lookups cost ~90 instructions per 16 entries)."""
    from fullstack_fp4.optim.q_adamw import triton_multi
    from fullstack_fp4.optim.q_adamw.triton_multi import Item, batchable, launch_multi
    items = [Item(p.data.view(-1), p.grad.view(-1), st, p.numel(), padded_numel(p.numel()), 0,
                  0, i) for i, (p, st) in enumerate(zip(params, states))]
    assert all(batchable(it) for it in items)
    for name, kw in (("kernel cpp=1, one multi-tensor launch over all params, sub=1",
                      {"sub": 1}),
                     ("the same, sub=4", {"sub": 4}),
                     ("the same, sub=1, approx division", {"sub": 1, "fast_div": True}),
                     ("the same, sub=4, approx division", {"sub": 4, "fast_div": True})):
        def one(t, _kw=kw):
            launch_multi(items, t=t, **_kw, **kernel_hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, t, "cuda"))
        med, ts = time_steps(one, args.steps)
        row = {"optimizer": name, "params": n, "ms_per_step": med, "sub": kw["sub"],
               "all_ms": ts, "state_bytes_per_param": float("nan")}
        res["rows"].append(row)
        print(row)
    # the QAdamW(multi_tensor=True) rows below run the faster of the two (IEEE rows)
    best = min((r for r in res["rows"] if "sub" in r and "approx" not in r["optimizer"]),
               key=lambda r: r["ms_per_step"])
    triton_multi.SUB = best["sub"]
    print(f"triton_multi.SUB = {best['sub']} for the QAdamW rows")
    # the other way around a launch's tail: per-parameter launches alternating between two
    # streams, so the next launch's programs fill the SMs the last wave leaves idle
    side = torch.cuda.Stream()

    def two_streams(t):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        for i, (p, st) in enumerate(zip(params, states)):
            with torch.cuda.stream(side if i % 2 else main):
                k = p.numel()
                launch(p.data.view(-1), p.grad.view(-1), st, k, padded_numel(k), seed=t,
                       **kernel_hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, t, "cuda"))
        main.wait_stream(side)
    med, ts = time_steps(two_streams, args.steps)
    row = {"optimizer": "kernel cpp=1, per-parameter launches on two alternating streams",
           "params": n, "ms_per_step": med, "all_ms": ts,
           "state_bytes_per_param": float("nan")}
    res["rows"].append(row)
    print(row)


def model_write_rows(args, params, states, n, res):
    """The BF16 model-param write: the kernel with ``model_out`` against the kernel plus the
    separate main -> model copy megatron's Float16 / distributed optimizer makes (read 4 B,
    write 2 B per param, ``copy_`` per param as its bf16 path does; here right after each
    param's step, megatron's after all of them: the same GPU work). By the bytes the fused
    write saves ~6 B/param at ~4 TB/s less ~1% of the kernel."""
    outs = [torch.empty(p.numel(), dtype=torch.bfloat16, device="cuda") for p in params]

    def then_copy(p, g, st, k, kpad, *, model_out, **kw):
        launch(p, g, st, k, kpad, **kw)
        model_out.copy_(p)

    for name, fn in (("kernel cpp=1 + separate main->model copy (megatron's)", then_copy),
                     ("kernel cpp=1 writing the BF16 model param (model_out)", launch)):
        med, ts = time_kernel(fn, params, states, args.steps, outs=outs)
        row = {"optimizer": name, "params": n, "ms_per_step": med, "all_ms": ts,
               "state_bytes_per_param": float("nan")}
        res["rows"].append(row)
        print(row)
    del outs


# Each configuration compiles the ~3000-instruction kernel twice (explicit uniforms for the
# check, Philox for the timing; ~30-60 s each), so the default list is the likely winners
# plus a baseline without the nibble decode or a register cap (~5 min); --sweep-all: every combination (~20 min: split it with
# --sweep-configs).
SWEEP = [dict(cpp=1, maxnreg=0, fast_dec=False),                     # the baseline
         dict(cpp=1, maxnreg=0, fast_dec=True),
         dict(cpp=2, maxnreg=0, fast_dec=True),
         dict(cpp=1, maxnreg=128, fast_dec=True),
         dict(cpp=2, maxnreg=128, fast_dec=True),
         # Philox-path options (the check's philox case draws the same stream in PyTorch):
         # 7 rounds; 16-bit uniforms from two calls per block
         dict(cpp=1, maxnreg=None, fast_dec=True, rounds=7),
         dict(cpp=1, maxnreg=None, fast_dec=True, u8=False)]
SWEEP_ALL = [dict(cpp=c, maxnreg=r, fast_dec=f) for c in (1, 2, 4) for r in (0, 168, 128, 96)
             for f in (True, False)]


def _parse_configs(text: str) -> list[dict]:
    """'1,none,1;2,128,1;1,none,1,1,7,1' -> [{cpp, maxnreg, fast_dec[, u8, rounds, fast_div]}]"""
    out = []
    for item in text.split(";"):
        f = item.split(",")
        kw = dict(cpp=int(f[0]), maxnreg=0 if f[1].lower() == "none" else int(f[1]),
                  fast_dec=bool(int(f[2])))
        if len(f) > 3:
            kw["u8"] = bool(int(f[3]))
        if len(f) > 4:
            kw["rounds"] = int(f[4])
        if len(f) > 5:
            kw["fast_div"] = bool(int(f[5]))
        out.append(kw)
    return out


def sweep(args, gd, res):
    """Check every candidate config bit for bit, time the exact ones; one process."""
    params, n = make_params(args.params, gd)
    fused = torch.optim.AdamW(params, lr=1e-3, fused=True)
    t_fused, _ = time_opt(fused, args.steps)
    del fused
    torch.cuda.empty_cache()
    states = [kernel_views(init_state(p.numel(), "cuda")) for p in params]
    rows = []
    configs = (_parse_configs(args.sweep_configs) if args.sweep_configs
               else SWEEP_ALL if args.sweep_all else SWEEP)
    for kw in configs:
        name = ", ".join(f"{k}={v}" for k, v in kw.items())
        try:
            # n divisible by 16 like the timed 3b matrices: one specialization fewer to compile
            chk = [correctness(n=100_000, **kw), correctness(n=70_000, phase=448, **kw),
                   correctness(n=70_000, phase=448, philox=True, **kw)]
        except Exception as e:  # noqa: BLE001 - e.g. a register cap the compiler refuses
            print(f"{name}: FAILED to run ({type(e).__name__}: {str(e)[:200]})", flush=True)
            continue
        if not all(c["ok"] for c in chk):
            print(f"{name}: NOT bit-exact vs the reference: {chk}", flush=True)
            rows.append({**kw, "exact": False})
            continue
        med, ts = time_kernel(lambda *a, _kw=kw, **k: launch(*a, **_kw, **k), params, states,
                              args.steps)
        row = {**kw, "exact": True, "ms": med, "all_ms": ts, "x_fused": med / t_fused}
        rows.append(row)
        print(row, flush=True)
    res["sweep"] = {"torch_fused_ms": t_fused, "params": n, "rows": rows}
    timed = sorted((r for r in rows if r.get("exact")), key=lambda r: r["ms"])
    print(f"\nsweep: {n / 1e9:.3f}B params, torch AdamW(fused=True) {t_fused:.2f} ms\n")
    print("| cpp | warps | maxnreg | fast_dec | u8 | Philox rounds | fast_div | checked | "
          "ms/step | × torch fused |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in timed + [r for r in rows if not r.get("exact")]:
        ms = f"{r['ms']:.2f} | {r['x_fused']:.2f}" if r.get("exact") else "– | –"
        print(f"| {r['cpp']} | {2 * r['cpp']} | {r['maxnreg']} | {r['fast_dec']} | "
              f"{r.get('u8', True)} | {r.get('rounds', 10)} | {r.get('fast_div', False)} | "
              f"{r['exact']} | {ms} |")
    if timed:
        b = timed[0]
        print(f"\nbest: {', '.join(f'{k}={b[k]}' for k in b if k not in ('exact', 'ms', 'all_ms', 'x_fused'))}"
              f" {b['ms']:.2f} ms = {b['x_fused']:.2f}x torch fused (target <= 0.75x)")
    del params, states
    torch.cuda.empty_cache()


def time_opt(opt, steps, host=None):
    return time_steps(lambda t: opt.step(), steps, host)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=1.0e9)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--grad-dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--cpp", type=int, nargs="*", default=[1, 2],
                    help="chunks per program for the kernel-only rows")
    ap.add_argument("--no-kernel-rows", action="store_true")
    ap.add_argument("--u16-row", action="store_true",
                    help="also a kernel row with 16-bit uniforms from two Philox calls a block")
    ap.add_argument("--flat-row", action="store_true",
                    help="also the kernel over all params as one flat tensor, one launch")
    ap.add_argument("--multi-rows", action="store_true",
                    help="also kernel and QAdamW rows with one multi-tensor launch a step")
    ap.add_argument("--streams-rows", action="store_true",
                    help="also QAdamW rows with launch_streams 2 and 3 (the default is 1)")
    ap.add_argument("--fast-div-rows", action="store_true",
                    help="also kernel and QAdamW rows with the approximate update division")
    ap.add_argument("--sweep", action="store_true",
                    help="check + time kernel configurations (see the docstring), then stop")
    ap.add_argument("--sweep-all", action="store_true", help="--sweep over every combination")
    ap.add_argument("--sweep-configs", default=None,
                    help="--sweep over these: 'cpp,maxnreg,fast_dec;...' e.g. '1,none,1;2,128,1'")
    args = ap.parse_args()
    gd = torch.float32 if args.grad_dtype == "fp32" else torch.bfloat16
    res = {"device": torch.cuda.get_device_name(), "correctness": correctness(),
           "correctness_phased": correctness(n=70_001, phase=448),
           "correctness_model_out": correctness(model_out=True),
           "correctness_model_out_phased": correctness(n=70_001, phase=448, model_out=True),
           "correctness_philox": correctness(n=70_001, phase=448, philox=True),
           "rows": []}
    if args.fast_div_rows:
        res["correctness_fast_div"] = [
            correctness(fast_div=True), correctness(n=70_001, phase=448, philox=True,
                                                    fast_div=True),
            correctness(n=70_001, phase=448, model_out=True, fast_div=True)]
    print("correctness (kernel vs reference, same uniforms):", res["correctness"])
    print("correctness, a distributed-optimizer piece (grid phase 448):",
          res["correctness_phased"])
    print("correctness with the BF16 model-param write (model_out vs p.to(bfloat16)):",
          res["correctness_model_out"], res["correctness_model_out_phased"])
    print("correctness of the Philox path (the kernel's own uniforms vs kernel_uniforms):",
          res["correctness_philox"])
    if args.fast_div_rows:
        print("approx division (states bit for bit, p' within the bound; plain, Philox piece, "
              "model_out):", res["correctness_fast_div"])
    if args.sweep:
        sweep(args, gd, res)
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, "bench_q_adamw_sweep.json"), "w") as f:
                json.dump(res, f, indent=1)
        return
    if not args.no_kernel_rows:
        kernel_rows(args, gd, res)

    makers = [("QAdamW (fused Triton)", lambda ps: QAdamW(ps, lr=1e-3))]
    if args.streams_rows:   # the default launch_streams is 1
        makers.append(("QAdamW (fused Triton, launch_streams=2)",
                       lambda ps: QAdamW(ps, lr=1e-3, launch_streams=2)))
        makers.append(("QAdamW (fused Triton, launch_streams=3)",
                       lambda ps: QAdamW(ps, lr=1e-3, launch_streams=3)))
    if args.fast_div_rows:
        makers.append(("QAdamW (fused Triton, approx_division=True)",
                       lambda ps: QAdamW(ps, lr=1e-3, approx_division=True)))
    if args.fast_div_rows and args.streams_rows:
        makers.append(("QAdamW (fused Triton, approx_division=True, launch_streams=1)",
                       lambda ps: QAdamW(ps, lr=1e-3, approx_division=True, launch_streams=1)))
    if args.multi_rows:
        makers.append(("QAdamW (fused Triton, multi_tensor=True)",
                       lambda ps: QAdamW(ps, lr=1e-3, multi_tensor=True)))
        makers.append(("QAdamW (fused Triton, multi_tensor=True, approx_division=True)",
                       lambda ps: QAdamW(ps, lr=1e-3, multi_tensor=True,
                                         approx_division=True)))
    makers.append(("torch AdamW(fused=True)",
                   lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)))
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
        # each row's peak is its own: what the rows before left behind is released and the peak
        # counter reset first (otherwise the kernel rows' buffers count in the first row's peak)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        params, n = make_params(args.params, gd)
        try:
            opt = mk(params)
            host = []
            med, ts = time_opt(opt, args.steps, host)
        except Exception as e:  # noqa: BLE001 - a peer that fails here is reported, not fatal
            if not name.startswith("torchao"):
                raise
            print(f"{name} failed ({type(e).__name__}: {str(e)[:200]}); skipping its row")
            del params
            torch.cuda.empty_cache()
            continue
        row = {"optimizer": name, "params": n, "ms_per_step": med, "all_ms": ts,
               "host_ms": statistics.median(host),
               "state_bytes_per_param": optimizer_state_bytes(opt) / n,
               "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30}
        res["rows"].append(row)
        print(row)
        del opt, params

    base = next(r for r in res["rows"] if r["optimizer"].startswith("torch AdamW"))
    print(f"\n{res['device']}, {base['params'] / 1e9:.3f}B params, grads {args.grad_dtype}\n")
    print("| optimizer | ms/step (median) | × torch fused | state B/param | GB/s at 14.3 B/param "
          "| host ms/step |")
    print("|---|---|---|---|---|---|")
    for r in res["rows"]:
        gbs = r["params"] * 14.3 / (r["ms_per_step"] * 1e-3) / 1e9
        host = f"{r['host_ms']:.2f}" if "host_ms" in r else ""
        print(f"| {r['optimizer']} | {r['ms_per_step']:.2f} | "
              f"{r['ms_per_step'] / base['ms_per_step']:.2f} | {r['state_bytes_per_param']:.3f} "
              f"| {gbs:.0f} | {host} |")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_q_adamw.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
