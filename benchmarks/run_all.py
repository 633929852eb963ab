#!/usr/bin/env python3
"""Regenerate the headline tables of BENCHMARKS.md: one JSON per table, in one schema.

    python benchmarks/run_all.py --list                      # groups, tables, commands, expected time
    python benchmarks/run_all.py --out DIR                   # every single-GPU group, one after another
    python benchmarks/run_all.py --out DIR --group kernels [--group optim ...]

Each table is made by the benchmark scripts of this folder (their own CLIs, unchanged): run_all
runs them with ``OUT`` pointing at ``DIR/raw/<table>/<script>/``, keeps their stdout and stderr
there (``run.log``), reads the JSON they write, and writes ``DIR/<table>.json``:

    {"table": ..., "title": ..., "hardware": ..., "software": {"torch", "triton", "cuda",
     "megatron_core", "python"}, "date": "YYYY-MM-DD", "commit": ..., "command": ..., "rows": [...]}

the schema of the curated copies in ``benchmarks/results/``. Software versions are read in this
process; the commit is ``git rev-parse HEAD`` (else the env var FULLSTACK_COMMIT, else null);
the date is today's (UTC). ``headline`` is composed from ``blocks_3b`` and ``ablation`` whenever
both are in DIR (after either group, or alone with ``--group summary``).

A group is sized to fit one 10-minute call on one H200 with a cold Triton cache (the estimate in
``--list`` comes from the recorded runs); every script call has its own time limit, so a group
never runs past its sum. ``multi_gpu`` is the exception: it needs 2 GPUs (scripts/multi_gpu_check.sh)
and is run only when asked for by name. Without CUDA the command prints one ``error:`` line and
exits 2 (``--list`` needs no GPU). A script that fails is reported with its log and the other
tables still run; the exit status is then 1.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PY = "python"          # how commands are written in the JSON; they run with sys.executable


@dataclass(frozen=True)
class Step:
    """One script call: argv after the interpreter (or a bash script), the JSON it writes into $OUT."""
    argv: tuple[str, ...]
    produces: str
    timeout_s: int
    env: tuple[tuple[str, str], ...] = ()

    def command(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env)
        head = ["bash"] if self.argv[0].endswith(".sh") else [PY]
        argv = [a.replace("{raw}", "runs/ablation") for a in self.argv]
        return (env + " " if env else "") + shlex.join([*head, *argv])


@dataclass(frozen=True)
class Table:
    name: str
    group: str
    title: str
    steps: tuple[Step, ...]
    convert: Callable[[dict], list]
    gpus: int = 1
    needs: tuple[str, ...] = field(default=())   # tables it is composed from (no steps)
    plot: str | None = None                      # a PNG the last step writes, kept as DIR/<table>.png

    def command(self) -> str:
        if not self.steps:
            return f"{PY} benchmarks/run_all.py --group {self.group} --out DIR"
        return " && ".join(s.command() for s in self.steps)


# --------------------------------------------------------------------------- converters
# Each takes {file name: parsed JSON} of the files its steps wrote and returns the table's rows.
# They are pure functions of the scripts' recorded output (tests/benchmarks/test_run_all.py).

def _num(x, nd=None):
    """A JSON-safe number: NaN/inf -> None; rounded to nd significant decimals when given."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return None
    x = round(x, nd) if nd is not None else x
    return x + 0.0 if isinstance(x, float) else x      # -0.0 -> 0.0


QUANTIZE_DROP = (", eo kernels", ", legacy kernels", ", tiled default", "sweep ", "reference quantize")


def conv_nvfp4_quantize(raw: dict) -> list:
    d = raw["bench_nvfp4_quantize.json"]
    rows = [{"kernel": "device-to-device copy (peer)", "timing": "graph", "us": _num(d["copy_us"], 1),
             "pct_of_copy": 100.0, "note": f"{d['copy_gbs']:.0f} GB/s read + write"}]
    for r in d["rows"]:
        if r.get("ms") is None or any(s in r["name"] for s in QUANTIZE_DROP):
            continue
        rows.append({"kernel": r["name"], "timing": r["timing"], "us": _num(r["ms"] * 1e3, 1),
                     "pct_of_copy": _num(100 * r["frac_copy_actual"], 1), "note": r.get("note", "")})
    return rows


def conv_nvfp4_linear(raw: dict) -> list:
    d = raw["bench_nvfp4_linear.json"]
    return [{"shape": r["shape"], "bf16_eager_ms": _num(r["bf16_ms"], 3), "nvfp4_eager_ms": _num(r["nvfp4_ms"], 3),
             "eager_ratio": _num(r["ratio"], 2), "bf16_graph_ms": _num(r["graph_bf16_ms"], 3),
             "nvfp4_graph_ms": _num(r["graph_nvfp4_ms"], 3), "graph_ratio": _num(r["graph_ratio"], 2)}
            for r in d["rows"]]


def conv_nvfp4_gemm(raw: dict) -> list:
    rows = []
    for r in raw["bench_nvfp4_gemm.json"]:
        rows.append({"gemm": r["gemm"], "mnk": f"{r['m']}x{r['n']}x{r['k']}",
                     "bf16_mm_ms": _num(r["ms_bf16_mm"], 3), "nvfp4_cublaslt_ms": _num(r["ms_cublaslt"], 3),
                     "ratio_vs_bf16": _num(r["ms_cublaslt"] / r["ms_bf16_mm"], 2),
                     "exact_operands_equal": r.get("exact_equal")})
    return rows


def conv_q_adamw_step(raw: dict) -> list:
    d = raw["bench_q_adamw.json"]
    torch_ms = next((r["ms_per_step"] for r in d["rows"] if r["optimizer"].startswith("torch AdamW")), None)
    rows = []
    for r in d["rows"]:
        ms = r.get("ms_per_step")
        rows.append({"optimizer": r["optimizer"], "ms_per_step": _num(ms, 2),
                     "x_torch_fused": _num(ms / torch_ms, 2) if ms and torch_ms else None,
                     "state_bytes_per_param": _num(r.get("state_bytes_per_param"), 3),
                     "peak_mem_gib": _num(r.get("peak_mem_gib"), 2)})
    return rows


def conv_newton_schulz(raw: dict) -> list:
    d = raw["bench_newton_schulz.json"]
    return [{"shape": "x".join(map(str, r["shape"])), "method": r["method"], "eager_ms": _num(r["ms"], 2),
             "graph_ms": _num(r.get("graph_ms"), 2),
             "rel_err_vs_fp64_pct": _num(100 * r["relerr_vs_fp64_same_coefs"], 1)}
            for r in d["ns"] or []]


def conv_orthogonal_step(raw: dict) -> list:
    d = raw["bench_newton_schulz.json"]
    return [{"optimizer": r["optimizer"], "eager_ms": _num(r["ms"], 1), "graph_ms": _num(r.get("graph_ms"), 1),
             "graph_x_bf16_root": _num(r.get("graph_ratio_vs_graphed_bf16_root"), 2)}
            for r in d["steps"] or []]


def conv_q_attn(raw: dict) -> list:
    bench, prof = raw["q_attn_bench.json"], raw["q_attn_profile.json"]
    rows = []
    for shape, p in prof.items():
        b = bench[shape]
        q_dev = sum(k[1] for k in p["kernels"])
        s_dev = sum(k[1] for k in p["sdpa_kernels"])
        rows.append({"shape": shape, "sdpa_kernels_ms": _num(s_dev, 3), "q_attn_kernels_ms": _num(q_dev, 3),
                     "device_ratio": _num(q_dev / s_dev, 2),
                     "sdpa_eager_ms": _num(b["sdpa_default"]["fwd_bwd_ms"], 3),
                     "q_attn_eager_ms": _num(b["q_attn"]["fwd_bwd_ms"], 3),
                     "eager_ratio": _num(b["q_attn"]["fwd_bwd_ms"] / b["sdpa_default"]["fwd_bwd_ms"], 2),
                     "sdpa_saved_mib": _num(b["sdpa_default"]["saved_bytes"] / 2**20, 1),
                     "q_attn_saved_mib": _num(b["q_attn"]["saved_bytes"] / 2**20, 1)})
    return rows


def conv_blocks(raw: dict) -> list:
    rows = raw["bench_blocks.json"]["rows"]
    base = next((r for r in rows if r["arm"] == "bf16"), None)
    out = []
    for r in rows:
        out.append({"arm": r["arm"], "fwd_bwd_ms": _num(r["fwd_bwd_ms"], 1), "opt_step_ms": _num(r["opt_step_ms"], 1),
                    "step_ms": _num(r["step_ms"], 1), "tokens_per_s": _num(round(r["tokens_per_s"])),
                    "mfu_989_pct": _num(100 * r["mfu_datasheet"], 1), "mfu_790_pct": _num(100 * r["mfu_vs_790"], 1),
                    "peak_gib": _num(r["peak_mem_gib"], 2), "opt_phase_peak_gib": _num(r["opt_phase_peak_gib"], 2),
                    "step_vs_bf16": _num(r["step_ms"] / base["step_ms"], 2) if base else None,
                    "opt_phase_mem_vs_bf16_pct":
                        _num(100 * (r["opt_phase_peak_gib"] / base["opt_phase_peak_gib"] - 1), 1) if base else None})
    return out


def conv_telemetry(raw: dict) -> list:
    return [{"arm": r["arm"], "plain_step_ms": _num(r["step_ms"], 1),
             "telemetry_step_ms": _num(r.get("telemetry_step_ms"), 1), "metrics": r.get("telemetry_names"),
             "overhead_pct_at_interval_100": _num(r.get("telemetry_overhead_pct"), 2)}
            for r in raw["bench_blocks.json"]["rows"]]


def conv_ablation(raw: dict) -> list:
    d = raw["ablation.json"]
    return [{"arm": r["arm"], "status": r["status"], "final_train_loss": _num(r.get("final_train_loss"), 4),
             "val_loss": _num(r.get("val_loss"), 4), "val_gap_pct": _num(r.get("val_gap_pct"), 2),
             "heldout_ppl": _num(r.get("heldout_perplexity"), 2), "cloze_greedy": r.get("cloze_greedy_accuracy"),
             "cloze_choice": r.get("cloze_choice_accuracy"), "tokens": r.get("tokens"),
             "wall_min": _num(r["wall_s"] / 60, 1) if r.get("wall_s") else None, "arms_at_once": r.get("jobs")}
            for r in d["rows"]]


def conv_multi_gpu(raw: dict) -> list:
    return [{"run": c["run"], "arm": c["arm"], "layout": c["layout"], "reference": c["ref"], "steps": c["steps"],
             "max_rel_diff": _num(c["max_rel_diff"], 6), "at_iter": c.get("argmax_iter"),
             "mean_rel_diff": _num(c["mean_rel_diff"], 6),
             "val_max_rel_diff": _num((c.get("val") or {}).get("max_rel_diff"), 6)}
            for c in raw["summary.json"]["comparisons"]]


def conv_headline(raw: dict) -> list:
    """One row an arm: step time and optimizer-phase memory (blocks_3b) beside the loss gap (ablation)."""
    blocks = {r["arm"]: r for r in raw["blocks_3b.json"]["rows"]}
    abl = {r["arm"]: r for r in raw["ablation.json"]["rows"]}
    rows = []
    for arm in [*blocks, *[a for a in abl if a not in blocks]]:
        b, a = blocks.get(arm, {}), abl.get(arm, {})
        rows.append({"arm": arm, "step_ms": b.get("step_ms"), "step_vs_bf16": b.get("step_vs_bf16"),
                     "opt_phase_mem_vs_bf16_pct": b.get("opt_phase_mem_vs_bf16_pct"),
                     "val_loss": a.get("val_loss"), "val_gap_pct": a.get("val_gap_pct")})
    return rows


# --------------------------------------------------------------------------- the tables
B = "benchmarks/"
ALL_ARMS = "bf16,nvfp4_linear,lora_svd,q_adamw,muon,q_muon,root,q_root,q_attn,full_stack,full_stack_root"
ABL_ARMS = "bf16,nvfp4_linear,lora_svd,q_adamw,q_attn,full_stack"   # the AdamW family, at its tuned lr
TEL_ARMS = "bf16,nvfp4_linear,lora_svd,q_adamw,q_attn,full_stack"

TABLES = (
    Table("nvfp4_quantize", "kernels", "NVFP4 quantize of 8192x8192 BF16 beside a copy and the peers",
          (Step((B + "bench_nvfp4_quantize.py",), "bench_nvfp4_quantize.json", 200),), conv_nvfp4_quantize),
    Table("nvfp4_gemm", "kernels", "Emulated NVFP4 GEMMs (one cuBLASLt call) beside BF16 torch.mm",
          (Step((B + "bench_nvfp4_gemm.py",), "bench_nvfp4_gemm.json", 100),), conv_nvfp4_gemm),
    Table("nvfp4_linear", "kernels", "NVFP4 linear fwd+bwd, 8192 tokens, beside BF16 F.linear",
          (Step((B + "bench_nvfp4_linear.py",), "bench_nvfp4_linear.json", 240),), conv_nvfp4_linear),
    Table("q_adamw_step", "optim", "Q-AdamW step, 1.016e9 FP32 params in 3b-shaped matrices",
          (Step((B + "bench_q_adamw.py", "--cpp", "1", "--steps", "10", "--fast-div-rows"),
                "bench_q_adamw.json", 330),), conv_q_adamw_step),
    Table("newton_schulz", "optim", "One Newton-Schulz (5 steps) at the 3b shapes: time and error vs FP64",
          (Step((B + "bench_newton_schulz.py", "--parts", "ns", "--iters", "10"), "bench_newton_schulz.json", 120),),
          conv_newton_schulz),
    Table("orthogonal_step", "optim", "Root/Muon optimizer step over the matrices of 4 blocks of 3b",
          (Step((B + "bench_newton_schulz.py", "--parts", "steps", "--iters", "12"), "bench_newton_schulz.json", 120),),
          conv_orthogonal_step),
    Table("q_attn", "attention", "Q-Attn fwd+bwd beside torch SDPA (cuDNN), causal, BF16 inputs",
          (Step((B + "bench_q_attn.py",), "q_attn_bench.json", 300),
           Step((B + "profile/profile_q_attn.py",), "q_attn_profile.json", 180)), conv_q_attn),
    Table("blocks_3b", "blocks", "4 decoder blocks of the 3b preset, every arm in one process",
          (Step((B + "bench_blocks.py", "--arms", ALL_ARMS, "--steps", "6", "--warmup", "2"),
                "bench_blocks.json", 420),), conv_blocks, plot="bench_blocks.png"),
    Table("blocks_3b_bf16_grads", "blocks", "4 blocks of 3b with the BF16 grad buffer that Q-AdamW reads",
          (Step((B + "bench_blocks.py", "--arms", "bf16,q_adamw_bf16_grads,full_stack_bf16_grads",
                 "--steps", "6", "--warmup", "2"), "bench_blocks.json", 150),), conv_blocks),
    Table("telemetry", "telemetry", "Telemetry overhead at logging.quant_stats_interval = 100",
          (Step((B + "bench_blocks.py", "--arms", TEL_ARMS, "--steps", "6", "--warmup", "2",
                 "--quant-stats-interval", "100"), "bench_blocks.json", 480),), conv_telemetry),
    Table("ablation", "ablation", "Convergence ablation, 8 x 512 model, 300 steps x 32,768 tokens, seed 1234, "
          "AdamW family at lr 2e-3",
          (Step((B + "ablation.py", "--arms", ABL_ARMS, "--family-lr", "adamw=2e-3", "--iters", "300",
                 "--jobs", "9", "--time-budget", "450", "--ppl-tokens", "65536", "--cloze-items", "200",
                 "--out", "{raw}"), "ablation.json", 580),),
          conv_ablation, plot="ablation.png"),
    Table("multi_gpu", "multi_gpu", "Multi-GPU layouts against one GPU, 50 steps of the ablation model",
          (Step(("scripts/multi_gpu_check.sh",), "summary.json", 590, (("MG_BUDGET", "540"),)),),
          conv_multi_gpu, gpus=2),
    Table("headline", "summary", "Every arm: step time and memory (4 blocks of 3b) beside the loss gap (ablation)",
          (), conv_headline, needs=("blocks_3b", "ablation")),
)
BY_NAME = {t.name: t for t in TABLES}
GROUPS = {}
for _t in TABLES:
    GROUPS.setdefault(_t.group, []).append(_t)
# minutes on a cold H200, from the recorded runs (each group < one 10-minute call)
ESTIMATE_MIN = {"kernels": 7, "optim": 7, "attention": 6, "blocks": 8, "telemetry": 6, "ablation": 9.5,
                "multi_gpu": 9.5, "summary": 0}
DEFAULT_GROUPS = [g for g in GROUPS if g != "multi_gpu"]


# --------------------------------------------------------------------------- running
def _read(path: str):
    with open(path) as fh:
        return json.load(fh)


def software() -> dict:
    import importlib.metadata as md

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None
    import torch
    try:
        import triton
        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    return {"torch": torch.__version__, "triton": triton_v, "cuda": torch.version.cuda,
            "megatron_core": version("megatron-core"), "python": platform.python_version()}


def commit() -> str | None:
    try:
        p = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if p.returncode == 0 and p.stdout.strip():
            return p.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return os.environ.get("FULLSTACK_COMMIT") or None


def document(table: Table, rows: list, hardware: str | None, sw: dict | None, sha: str | None,
             date: str | None = None) -> dict:
    return {"table": table.name, "title": table.title, "hardware": hardware, "software": sw,
            "date": date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "commit": sha, "command": table.command(), "rows": rows}


def run_table(table: Table, out: str, meta: dict) -> str | None:
    """Run one table's scripts and write out/<table>.json; returns an error text or None."""
    raw_dir = os.path.join(out, "raw", table.name)
    raw = {}
    if table.needs:
        for dep in table.needs:
            path = os.path.join(out, dep + ".json")
            if not os.path.isfile(path):
                return f"{table.name} needs {path} (run --group {BY_NAME[dep].group} first)"
            raw[dep + ".json"] = _read(path)
        # a composed table states where its figures were measured: its first source's record
        src = raw[table.needs[0] + ".json"]
        hardware, meta = src.get("hardware"), {"software": src.get("software"), "commit": src.get("commit")}
    else:
        name = meta["gpu"]
        hardware = (f"{table.gpus}x {name}" if table.gpus > 1 else name) if name else None
    for step in table.steps:
        sub = os.path.join(raw_dir, os.path.splitext(os.path.basename(step.argv[0]))[0])
        os.makedirs(sub, exist_ok=True)
        argv = [a.replace("{raw}", sub) for a in step.argv]
        cmd = ["bash", *argv] if argv[0].endswith(".sh") else [sys.executable, *argv]
        env = dict(os.environ, OUT=sub, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   **dict(step.env))
        log = os.path.join(sub, "run.log")
        print(f"[{table.name}] {step.command()}", flush=True)
        with open(log, "w") as fh:
            try:
                rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                    timeout=step.timeout_s).returncode
            except subprocess.TimeoutExpired:
                return f"{table.name}: {step.command()} ran past {step.timeout_s} s (log: {log})"
        produced = os.path.join(sub, step.produces)
        if rc != 0 or not os.path.isfile(produced):
            return f"{table.name}: {step.command()} exited {rc} without {step.produces} (log: {log})"
        raw[step.produces] = _read(produced)
        if table.plot and os.path.isfile(os.path.join(sub, table.plot)):
            shutil.copyfile(os.path.join(sub, table.plot), os.path.join(out, table.name + ".png"))
    try:
        rows = table.convert(raw)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, StopIteration) as e:
        return f"{table.name}: the scripts' output did not convert ({type(e).__name__}: {e})"
    with open(os.path.join(out, table.name + ".json"), "w") as fh:
        json.dump(document(table, rows, hardware, meta["software"], meta["commit"]), fh, indent=1)
        fh.write("\n")
    print(f"[{table.name}] -> {os.path.join(out, table.name + '.json')} ({len(rows)} rows)", flush=True)
    return None


def list_tables() -> None:
    print("| group | est. min (cold H200) | table | command |")
    print("| --- | ---: | --- | --- |")
    for g, tables in GROUPS.items():
        for t in tables:
            extra = f" ({t.gpus} GPUs)" if t.gpus > 1 else ""
            print(f"| {g}{extra} | {ESTIMATE_MIN[g]} | {t.name} | `{t.command()}` |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="folder for <table>.json and raw/ (created)")
    ap.add_argument("--group", action="append", default=[], metavar="G",
                    help=f"run only these groups (repeatable): {', '.join(GROUPS)}; default: all but multi_gpu")
    ap.add_argument("--list", action="store_true", help="print the groups and tables, run nothing")
    a = ap.parse_args(argv)
    if a.list:
        list_tables()
        return 0
    unknown = [g for g in a.group if g not in GROUPS]
    if unknown:
        print(f"error: unknown group {', '.join(unknown)}; groups: {', '.join(GROUPS)}")
        return 2
    if not a.out:
        print("error: --out DIR is required (or --list)")
        return 2
    groups = a.group or DEFAULT_GROUPS
    missing = [os.path.join(a.out, d + ".json") for g in groups for t in GROUPS[g] for d in t.needs
               if BY_NAME[d].group not in groups and not os.path.isfile(os.path.join(a.out, d + ".json"))]
    if missing:
        print(f"error: {missing[0]} is missing: run its group into the same --out first, or add it to --group")
        return 2
    need_gpus = max((t.gpus for g in groups for t in GROUPS[g] if t.steps), default=0)
    import torch
    if need_gpus and not torch.cuda.is_available():
        print("error: run_all needs a CUDA GPU (an H200 for the recorded figures); "
              "--list shows the tables without one")
        return 2
    if need_gpus > 1 and torch.cuda.device_count() < need_gpus:
        print(f"error: the groups {', '.join(groups)} need {need_gpus} GPUs; "
              f"{torch.cuda.device_count()} visible")
        return 2
    os.makedirs(a.out, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(0) if need_gpus else None,
            "software": software(), "commit": commit()}
    errors = []
    for g in groups:
        for t in GROUPS[g]:
            err = run_table(t, a.out, meta)
            if err:
                errors.append(err)
                print(f"error: {err}", flush=True)
    head = BY_NAME["headline"]
    if "summary" not in groups and all(os.path.isfile(os.path.join(a.out, d + ".json")) for d in head.needs):
        err = run_table(head, a.out, meta)
        if err:
            errors.append(err)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
