"""The paper's efficiency setting: 4 decoder blocks of the 3b preset, sequence 4096.

Every arm runs in ONE process, through the same `Trainer` a real run uses (megatron-core
GPTModel, DDP, Float16Module, megatron-core optimizer wrappers), on synthetic tokens:

    python benchmarks/bench_blocks.py [--arms bf16,nvfp4_linear,...] [--steps 10] [--out DIR]

Per arm: forward+backward time, optimizer-step time, whole-step time, tokens/s, model TFLOP/s,
MFU against the datasheet dense BF16 peak (989 TFLOP/s on H100/H200) and against 790 TFLOP/s
(the measured BF16 GEMM rate the repo's reference anchors use), peak memory of the whole step
and of the optimizer phase (the `optimizer.step()` call, with params, grads and states live).

On Hopper the NVFP4 GEMMs are emulated (exact BF16 operands, FP32 accumulation): an NVFP4
arm's time is an emulation's time, not what a Blackwell GPU would do.
Writes bench_blocks.{md,json,png} to --out (default $OUT or runs/bench_blocks).

Telemetry overhead (docs/telemetry.md): ``--quant-stats-interval N`` runs every arm with
``logging.quant_stats_interval=N`` and alternates measured steps between a telemetry step (the
trainer's collector hooks + optimizer pre-hooks installed, ``end_step``'s host sync included)
and a plain step (``begin_step`` returns at once). The usual columns then come from the plain
steps only; extra columns give the telemetry step's time and its amortised overhead
``(t_telemetry − t_plain) / (N · t_plain)`` (target ≤ 2 % at the default N = 100).

``--set KEY=VALUE`` (repeatable) overrides the config of every arm alike, e.g.
``--set train.manual_gc=true``: the arm then runs its steps under the trainer's collector
policy (megatron/training/gc_policy.py) and reports what one full collection costs
(``gc_collect_ms``, paid every ``train.manual_gc_interval`` steps in a run).

``--profile``: after the timed steps, one more forward+backward and one optimizer step run under
``torch.profiler`` (CUDA activity only). Printed per arm: the wall time, the sum of kernel
times (the device busy time: one GPU, one compute stream), their difference (the time the GPU
waited for the host; CUPTI tracing adds host time per launch, so the difference is also given
against the unprofiled median of the timed steps), and the kernel time by family (``kernel_family``) — whether an arm is
host-bound, and what its extra device time is made of.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron.training.config import load_config  # noqa: E402
from megatron.training.errors import UserError  # noqa: E402

# Arm -> overrides on top of the common 4-block 3b config. Same names as configs/3b_64b/.
ARMS = {
    "bf16": [],
    "nvfp4_linear": ["fp4.linear=nvfp4"],
    "lora_svd": ["fp4.linear=lora_svd"],            # the dense route (fp4.lora_svd.route default)
    # the paper's routing: W_res gets the projected gradient, L1 the in-subspace part
    "lora_svd_projected": ["fp4.linear=lora_svd", "fp4.lora_svd.route=projected"],
    # diagnostic: the projected route's reparametrisation with W_res unquantized (docs/lora-svd.md;
    # the dense route unquantized is the BF16 model)
    "lora_svd_unquantized": ["fp4.linear=lora_svd", "fp4.lora_svd.route=projected",
                             "fp4.lora_svd.unquantized=true"],
    # the dense route named explicitly
    "lora_svd_dense": ["fp4.linear=lora_svd", "fp4.lora_svd.route=dense"],
    "q_adamw": ["optimizer.name=q_adamw"],
    "root": ["optimizer.name=root"],
    "q_root": ["optimizer.name=q_root"],
    # Recipe switches only: the learning rates are tuned per optimizer family
    # (benchmarks/lr_sweep.py; ablation.py --family-lr; docs/optimizers.md, "Learning rates").
    "muon": ["optimizer.name=muon"],
    "q_muon": ["optimizer.name=q_muon"],
    "q_attn": ["fp4.attention=q_attn"],
    # levers on the NVFP4 linear (megatron/training/precision.py): 4/6 block scales on every
    # operand; the last 10% of the steps in BF16; the first and last block in BF16. "_levers": the
    # two that cost no step time where FP4 GEMMs are emulated (4/6 costs +20-24% there, and on every
    # operand it raised quickstart's gap: BENCHMARKS.md, "NVFP4 loss levers")
    "nvfp4_linear_4over6": ["fp4.linear=nvfp4", "fp4.linear_scale_rule=4over6"],
    # 4/6 on the forward operands only, dY at rule 6: separates what 4/6 costs on dY (stochastically
    # rounded after the choice; tensor-scale bound 256 instead of 448) from what it does to x and W
    "nvfp4_linear_4over6_xw": ["fp4.linear=nvfp4", "fp4.linear_scale_rule.x=4over6",
                               "fp4.linear_scale_rule.w=4over6"],
    "nvfp4_linear_bf16_from": ["fp4.linear=nvfp4", "fp4.bf16_from=0.9"],
    "nvfp4_linear_keep_ends": ["fp4.linear=nvfp4", "fp4.bf16_first_layers=1", "fp4.bf16_last_layers=1"],
    "nvfp4_linear_levers": ["fp4.linear=nvfp4", "fp4.bf16_from=0.9",
                            "fp4.bf16_first_layers=1", "fp4.bf16_last_layers=1"],
    "full_stack_levers": ["fp4.linear=lora_svd", "optimizer.name=q_adamw", "fp4.attention=q_attn",
                          "fp4.bf16_from=0.9", "fp4.bf16_first_layers=1", "fp4.bf16_last_layers=1"],
    # diagnostics: which operand of the NVFP4 linear costs the loss (that one held exactly, its
    # GEMMs in FP64: fullstack_fp4/linear/partial_nvfp4.py; ablation scale only)
    "nvfp4_linear_exact_x": ["fp4.linear=nvfp4", "fp4.unquantized_operands=[x]"],
    "nvfp4_linear_exact_w": ["fp4.linear=nvfp4", "fp4.unquantized_operands=[w]"],
    "nvfp4_linear_exact_dy": ["fp4.linear=nvfp4", "fp4.unquantized_operands=[dy]"],
    "full_stack": ["fp4.linear=lora_svd", "optimizer.name=q_adamw", "fp4.attention=q_attn"],
    "full_stack_root": ["fp4.linear=lora_svd", "optimizer.name=q_root", "fp4.attention=q_attn"],
    # LoRA-SVD + Q-Attn + Q-Muon (QAdamW for the rest: fullstack_fp4/integration/optimizers.py)
    "full_stack_muon": ["fp4.linear=lora_svd", "optimizer.name=q_muon", "fp4.attention=q_attn"],
    # BF16 grad buffer read in place by Q-AdamW (docs/perf/q-adamw.md, memory)
    "q_adamw_bf16_grads": ["optimizer.name=q_adamw", "parallel.grad_reduce_in_fp32=false"],
    "full_stack_bf16_grads": ["fp4.linear=lora_svd", "optimizer.name=q_adamw", "fp4.attention=q_attn",
                              "parallel.grad_reduce_in_fp32=false"],
}
COMMON = ["model.preset=3b", "model.num_layers=4", "model.vocab_size=32000", "data.mock=true",
          "train.global_batch_size=2", "train.micro_batch_size=2", "train.precision=bf16",
          "train.iters=1000", "train.eval_iters=0", "checkpoint.load=none", "checkpoint.save_dir=null",
          "checkpoint.save_on_exit=false", "logging.dir=null", "optimizer.warmup_iters=0"]
PEAK_DATASHEET, PEAK_ANCHOR = 989.4, 790.0


def cuda_time(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


# Kernel families for --profile, first match wins (lower-case substrings of the kernel name).
FAMILIES = (("attention (SDPA: cuDNN / flash)", ("sdpa", "flash", "fmha", "softmax", "attention",
                                                 "compute_dot_do_o", "convert_dq")),
            ("gemm (cuBLAS)", ("gemm", "cutlass", "xmma", "nvjet", "cublas")),
            ("q_attn (Triton)", ("_dkdv_kernel", "_dq_kernel", "_fwd_kernel", "_prologue_kernel",
                                 "_unpack_kernel", "_delta_kernel", "_amax_kernel", "_ds_")),
            ("nvfp4 quantize/decode/epilogue (Triton)", ("quant", "decode", "dequant", "amax",
                                                         "scale_cast", "epilogue", "_pack")),
            ("q_adamw (Triton)", ("_step_kernel", "q_adamw", "_rows")),
            ("elementwise / reduce / copy (torch)", ("elementwise", "reduce", "copy", "fill",
                                                     "memset", "memcpy", "cat", "index")))


def kernel_family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def profile_phase(fn) -> dict:
    """Wall time of ``fn`` and its CUDA kernels' summed time, by family (ms)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = cuda_time(fn)
    fam: dict = {}
    per: dict = {}
    for ev in prof.events():  # (a kernel name shared by two packages, e.g. _amax_kernel, goes to the first family)
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            f = kernel_family(ev.name)
            fam[f] = fam.get(f, 0.0) + ev.device_time_total / 1e3
            n, t = per.get(ev.name, (0, 0.0))
            per[ev.name] = (n + 1, t + ev.device_time_total / 1e3)
    busy = sum(fam.values())
    top = sorted(per.items(), key=lambda kv: -kv[1][1])[:15]
    return {"wall_ms": 1e3 * wall, "kernel_ms": busy, "gpu_idle_ms": 1e3 * wall - busy,
            "by_family_ms": dict(sorted(fam.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"name": n[:120], "launches": c, "ms": t} for n, (c, t) in top]}


def run_arm(name: str, overrides: list[str], steps: int, warmup: int, quant_interval: int = 0,
            profile: bool = False, extra: list[str] = ()) -> dict:
    from megatron.training.gc_policy import GarbageCollection
    from megatron.training.trainer import Trainer

    if quant_interval:
        overrides = overrides + [f"logging.quant_stats_interval={quant_interval}"]
    cfg = load_config(None, COMMON + overrides + list(extra))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    tr = Trainer(cfg, verbose=False)
    collector = GarbageCollection.from_config(cfg.train)   # as Trainer.train runs the steps
    collector.start()
    try:
        out = _measure(name, overrides, tr, cfg, steps, warmup, quant_interval, profile)
        if collector.manual:    # the pause a collection costs where the policy places it
            t0 = time.perf_counter()
            gc.collect()
            out["gc_collect_ms"] = 1e3 * (time.perf_counter() - t0)
    finally:
        collector.stop()
    del tr
    # the orthogonal optimizers' Newton-Schulz graphs live for the process (module cache):
    # drop them, or the next arm's peak memory would count this arm's graphs
    from fullstack_fp4.optim.newton_schulz import clear_ns_graphs
    clear_ns_graphs()
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _measure(name, overrides, tr, cfg, steps, warmup, quant_interval, profile) -> dict:
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    fb, opt, opt_peak, tel = [], [], 0, []

    def fwd_bwd(tr, i, it):  # `tr` passed in: the closure must not outlive `del tr` below
        if quant_interval:  # as Trainer.train_step: hooks only when `it` is a multiple of N
            tr.telemetry.begin_step([tr.model], it, tr.optimizer)
        tr._run_schedule(tr.train_ds, i * cfg.train.global_batch_size, False)

    for i in range(warmup + steps):
        # with telemetry: odd steps are telemetry steps (iteration a multiple of N), even ones
        # are plain steps (iteration off the interval), so both are measured under one warm state
        tel_step = bool(quant_interval) and i % 2 == 1
        it = quant_interval * (i + 1) + (0 if tel_step else 1) if quant_interval else i + 1
        tr.model.zero_grad_buffer()
        tr.optimizer.zero_grad()
        t_fb = cuda_time(lambda tr=tr: fwd_bwd(tr, i, it))
        torch.cuda.reset_peak_memory_stats()
        t_opt = cuda_time(tr.optimizer.step)
        t_end = cuda_time(tr.telemetry.end_step) if quant_interval else 0.0
        if i >= warmup:
            if tel_step:
                tel.append(t_fb + t_opt + t_end)
                continue
            fb.append(t_fb)
            opt.append(t_opt + t_end)
            opt_peak = max(opt_peak, torch.cuda.max_memory_allocated())
    prof = None
    if profile:
        tr.model.zero_grad_buffer()
        tr.optimizer.zero_grad()
        prof = {"fwd_bwd": profile_phase(lambda tr=tr: tr._run_schedule(tr.train_ds, 0, False)),
                "opt_step": profile_phase(tr.optimizer.step)}
    # whole-step peak: one more full step with the counter reset first
    torch.cuda.reset_peak_memory_stats()
    tr.model.zero_grad_buffer()
    tr.optimizer.zero_grad()
    tr._run_schedule(tr.train_ds, 0, False)
    tr.optimizer.step()
    torch.cuda.synchronize()
    step_peak = torch.cuda.max_memory_allocated()
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    step_s = med(fb) + med(opt)
    tflops = tokens * tr.flops_per_token / step_s / 1e12
    out = {"arm": name, "overrides": overrides, "fwd_bwd_ms": 1e3 * med(fb), "opt_step_ms": 1e3 * med(opt),
           "step_ms": 1e3 * step_s, "tokens_per_s": tokens / step_s, "tflops": tflops,
           "mfu_datasheet": tflops / PEAK_DATASHEET, "mfu_vs_790": tflops / PEAK_ANCHOR,
           "peak_mem_gib": step_peak / 2**30, "opt_phase_peak_gib": opt_peak / 2**30,
           "params": sum(p.numel() for p in tr.gpt.parameters())}
    if prof:
        out["profile"] = prof
    if quant_interval:
        t_tel = med(tel)
        out.update(quant_stats_interval=quant_interval, telemetry_step_ms=1e3 * t_tel,
                   telemetry_overhead_pct=100 * (t_tel - step_s) / (quant_interval * step_s),
                   telemetry_names=len(tr.telemetry.last) if hasattr(tr.telemetry, "last") else 0)
    return out


def markdown(rows: list[dict]) -> str:
    base = next((r for r in rows if r["arm"] == "bf16"), None)
    lines = ["| arm | fwd+bwd ms | opt step ms | step ms | tokens/s | TFLOP/s | MFU (989) | MFU (790) | "
             "peak GiB | opt-phase peak GiB | step vs bf16 | opt-phase mem vs bf16 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['arm']} | error: {r['error']} |" + " |" * 11)
            continue
        rel_t = f"{r['step_ms'] / base['step_ms']:.2f}x" if base else "-"
        rel_m = f"{100 * (r['opt_phase_peak_gib'] / base['opt_phase_peak_gib'] - 1):+.1f}%" if base else "-"
        lines.append(f"| {r['arm']} | {r['fwd_bwd_ms']:.1f} | {r['opt_step_ms']:.1f} | {r['step_ms']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {r['tflops']:.0f} | {100 * r['mfu_datasheet']:.1f}% | "
                     f"{100 * r['mfu_vs_790']:.1f}% | {r['peak_mem_gib']:.2f} | {r['opt_phase_peak_gib']:.2f} | "
                     f"{rel_t} | {rel_m} |")
    tel = [r for r in rows if "telemetry_step_ms" in r]
    if tel:
        n = tel[0]["quant_stats_interval"]
        lines += ["", f"Telemetry (logging.quant_stats_interval={n}): amortised overhead = "
                  "(telemetry step − plain step) / (N · plain step); target ≤ 2 %", "",
                  "| arm | plain step ms | telemetry step ms | metrics | overhead at N |", "|---|---|---|---|---|"]
        lines += [f"| {r['arm']} | {r['step_ms']:.1f} | {r['telemetry_step_ms']:.1f} | {r['telemetry_names']} | "
                  f"{r['telemetry_overhead_pct']:.2f}% |" for r in tel]
    prof = [r for r in rows if "profile" in r]
    if prof:
        lines += ["", "Profile of one more step (torch.profiler, CUDA kernels; ms): wall, kernel sum, "
                  "GPU idle (waiting for the host), then kernel time by family", ""]
        for r in prof:
            for phase, pr in r["profile"].items():
                fams = "; ".join(f"{k} {v:.1f}" for k, v in pr["by_family_ms"].items())
                timed = r["fwd_bwd_ms"] if phase == "fwd_bwd" else r["opt_step_ms"]
                lines.append(f"- {r['arm']} {phase}: wall {pr['wall_ms']:.1f} (profiled; {timed:.1f} "
                             f"timed), kernels {pr['kernel_ms']:.1f}, idle {pr['gpu_idle_ms']:.1f} "
                             f"({timed - pr['kernel_ms']:.1f} of the timed) — {fams}")
                lines += [f"    - {k['ms']:.2f} ms, {k['launches']}×: {k['name'][:100]}"
                          for k in pr["top_kernels"][:10]]
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no chart", flush=True)
        return
    ok = [r for r in rows if "error" not in r]
    fig, ax = plt.subplots(1, 2, figsize=(12, 4))
    names = [r["arm"] for r in ok]
    ax[0].bar(names, [r["step_ms"] for r in ok])
    ax[0].set_ylabel("step time (ms)")
    ax[1].bar(names, [r["opt_phase_peak_gib"] for r in ok])
    ax[1].set_ylabel("optimizer-phase peak memory (GiB)")
    for a in ax:
        a.tick_params(axis="x", rotation=45)
    fig.suptitle("4 blocks of the 3b preset, seq 4096, 2 sequences per step (H200; NVFP4 GEMMs emulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="bf16")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT", "runs/bench_blocks"))
    p.add_argument("--quant-stats-interval", type=int, default=0, metavar="N",
                   help="measure telemetry overhead at logging.quant_stats_interval=N in every arm "
                        "(alternating telemetry / plain steps; see the docstring). 0: off")
    p.add_argument("--profile", action="store_true",
                   help="profile one more step per arm: GPU busy vs idle, kernel time by family")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every arm (repeatable), e.g. train.manual_gc=true")
    args = p.parse_args()
    if args.quant_stats_interval < 0 or (args.quant_stats_interval and args.steps < 2):
        print("error: --quant-stats-interval must be >= 0 and needs --steps >= 2", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: bench_blocks.py needs a CUDA GPU", file=sys.stderr)
        return 2
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        print(f"error: unknown arm(s) {unknown}; choose from {', '.join(ARMS)}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for a in arms:
        try:
            rows.append(run_arm(a, ARMS[a], args.steps, args.warmup, args.quant_stats_interval,
                                args.profile, args.set))
        except UserError as e:  # e.g. a recipe not implemented in this release
            rows.append({"arm": a, "error": str(e)[:120]})
        except torch.OutOfMemoryError as e:
            rows.append({"arm": a, "error": f"OOM: {str(e)[:80]}"})
            gc.collect()
            torch.cuda.empty_cache()
        except Exception as e:  # one broken arm must not lose the others' figures
            rows.append({"arm": a, "error": f"{type(e).__name__}: {str(e)[:100]}"})
            gc.collect()
            torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "argv": sys.argv}
    table = markdown(rows)
    with open(os.path.join(args.out, "bench_blocks.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "bench_blocks.md"), "w") as f:
        f.write(table + "\n")
    plot(rows, os.path.join(args.out, "bench_blocks.png"))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
