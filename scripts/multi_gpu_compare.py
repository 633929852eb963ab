#!/usr/bin/env python3
"""Helper of scripts/multi_gpu_check.sh: per-step loss comparison of runs in several layouts.

    python scripts/multi_gpu_compare.py summary --manifest M.jsonl --md OUT/summary.md --json OUT/summary.json \
        [--earlier EARLIER/summary.json ...]
    python scripts/multi_gpu_compare.py compare REF_LOGDIR RUN_LOGDIR [RUN_LOGDIR ...]
    python scripts/multi_gpu_compare.py pretrain [--cpu-init] -- --config C.yaml key=value ...

`summary` reads the manifest the shell script writes (one JSON object per run: name, part, arm,
layout, kind = train | resume | refusal | bench, logdir, ref / ref2 = names of the runs it is
compared with, rc, wall_s, log, note) and each run's `metrics.jsonl` (per logged step: iter,
loss; validation records carry val_loss), and writes one markdown + one JSON summary:
per run its status, per comparison the per-step table (loss of the reference, loss of the run,
relative difference |run - ref| / |ref|) and the max / mean relative difference over the common
steps. It judges nothing: small differences are expected (reduction order, NVFP4 amax
all-reduce, stochastic rounding streams); a human reads them.

`pretrain` runs pretrain_gpt.py's main() (also under torchrun) with, for --cpu-init, every
model built with megatron-core's `use_cpu_initialization=True`: the full weights are drawn from
one CPU generator and then split, so TP=1 and TP=2 start from the same weights (the trainer's
GPU default initialises each tensor-parallel shard from its own CUDA RNG stream).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- reading
def read_metrics(logdir: str | None) -> tuple[dict[int, float], dict[int, float]]:
    """(train loss by iteration, validation loss by iteration); empty if the file is missing.
    A record repeated for the same iteration (e.g. appended by a rerun) keeps the last one."""
    train: dict[int, float] = {}
    val: dict[int, float] = {}
    if not logdir:
        return train, val
    path = os.path.join(logdir, "metrics.jsonl")
    if not os.path.isfile(path):
        return train, val
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a killed run
            if "iter" not in rec:
                continue
            if "val_loss" in rec:
                if rec["val_loss"] is not None:
                    val[int(rec["iter"])] = float(rec["val_loss"])
            elif rec.get("loss") is not None:
                train[int(rec["iter"])] = float(rec["loss"])
    return train, val


def rel_diff(a: float, ref: float) -> float:
    if math.isnan(a) or math.isnan(ref):
        return float("nan")
    if ref == 0:
        return 0.0 if a == 0 else float("inf")
    return abs(a - ref) / abs(ref)


def compare(run: dict[int, float], ref: dict[int, float]) -> dict:
    """Per-step comparison over the iterations both have."""
    steps = sorted(set(run) & set(ref))
    rows = [{"iter": i, "ref": ref[i], "run": run[i], "rel_diff": rel_diff(run[i], ref[i])} for i in steps]
    finite = [r["rel_diff"] for r in rows if math.isfinite(r["rel_diff"])]
    out = {"steps": len(rows), "first": steps[0] if steps else None, "last": steps[-1] if steps else None,
           "max_rel_diff": max(finite) if finite else None,
           "mean_rel_diff": sum(finite) / len(finite) if finite else None,
           "argmax_iter": None, "nonfinite": len(rows) - len(finite), "rows": rows}
    if finite:
        out["argmax_iter"] = max((r for r in rows if math.isfinite(r["rel_diff"])), key=lambda r: r["rel_diff"])["iter"]
    return out


def error_line(log: str | None) -> str | None:
    """The last `error:` line of a log (pretrain_gpt.py prints bad input as one such line)."""
    if not log or not os.path.isfile(log):
        return None
    last = None
    with open(log, errors="replace") as f:
        for line in f:
            s = line.strip()
            # torchrun prefixes worker output with "[rank0]:" or "[default0]:"
            if s.startswith("[") and "]:" in s[:16]:
                s = s.split("]:", 1)[1].strip()
            if s.startswith("error:"):
                last = s
    return last[:400] if last else None


def tail(log: str | None, n: int = 3) -> str:
    if not log or not os.path.isfile(log):
        return ""
    with open(log, errors="replace") as f:
        lines = [ln.rstrip() for ln in f if ln.strip()]
    return " / ".join(lines[-n:])[-400:]


def read_manifest(path: str) -> list[dict]:
    runs = []
    if not os.path.isfile(path):
        return runs
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    runs.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return runs


# ----------------------------------------------------------------------------- summary
def fmt(x, spec=".3e") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


def summarize(runs: list[dict], earlier: list[dict] | None = None) -> dict:
    """`earlier`: run rows of summaries written by earlier calls (their `train` / `val` losses are
    stored in the JSON). A run of this manifest wins over an earlier one of the same name, unless
    it was skipped (no rc: e.g. MG_SKIP named it because an earlier call measured it); among the
    earlier rows the first that ran wins (``--earlier`` files in order of precedence). The
    earlier ones are listed with `from_earlier: true`, and runs of either call are compared with
    references of either call (same commit assumed: the caller's business)."""
    ran = lambda r: r.get("rc") is not None  # noqa: E731
    old, seen = [], {r["name"] for r in runs if ran(r)}
    for r in sorted(earlier or [], key=lambda r: not ran(r)):   # stable: rows that ran first
        if r.get("name") not in seen:
            seen.add(r.get("name"))
            old.append(dict(r, from_earlier=True))
    olds = {r["name"] for r in old}
    runs = [r for r in runs if ran(r) or r["name"] not in olds] + old
    by_name = {r["name"]: r for r in runs}
    metrics = {r["name"]: read_metrics(r.get("logdir")) for r in runs if r.get("kind") != "bench"}
    for r in old:
        if r.get("kind") != "bench":
            metrics[r["name"]] = ({int(i): v for i, v in (r.get("train") or {}).items()},
                                  {int(i): v for i, v in (r.get("val") or {}).items()})
    out_runs, comparisons, bench = [], [], []
    for r in runs:
        kind, rc = r.get("kind", "train"), r.get("rc")
        row = {k: r.get(k) for k in ("name", "part", "arm", "layout", "kind", "rc", "wall_s", "note", "expect",
                                     "ref", "ref2")}
        if r.get("from_earlier"):
            row["from_earlier"] = True
        if rc is None:
            row["status"] = "skipped" + (f" ({r['note']})" if r.get("note") else "")
        elif kind == "bench":
            row["status"] = "ok" if rc == 0 else f"failed rc={rc}"
            for b in _bench_rows(r.get("json")):
                bench.append({"run": r["name"], **b})
        else:
            train, val = metrics.get(r["name"], ({}, {}))
            # the losses themselves, so that a later call's summary can compare with this run
            row["train"] = {str(i): train[i] for i in sorted(train)}
            row["val"] = {str(i): val[i] for i in sorted(val)}
            row["steps_logged"] = len(train)
            row["last_iter"] = max(train) if train else None
            row["final_loss"] = train[max(train)] if train else None
            err = error_line(r.get("log")) if not r.get("from_earlier") else r.get("error")
            row["error"] = err
            if rc == 0:
                row["status"] = "ok" if train else "ok (no metrics)"
            elif rc in (124, 137):
                row["status"] = f"timeout rc={rc}"
            elif err:
                row["status"] = f"refused rc={rc}"
            else:
                row["status"] = f"failed rc={rc}"
                row["tail"] = tail(r.get("log")) if not r.get("from_earlier") else r.get("tail", "")
            for key in ("ref", "ref2"):
                ref = r.get(key)
                if not ref or ref not in metrics or not train:
                    continue
                rt, rv = metrics[ref]
                c = compare(train, rt)
                cv = compare(val, rv)
                comparisons.append({"run": r["name"], "ref": ref, "layout": r.get("layout"), "arm": r.get("arm"),
                                    "ref_layout": by_name.get(ref, {}).get("layout"), **c,
                                    "val": {k: cv[k] for k in ("steps", "max_rel_diff")} | {"rows": cv["rows"]}})
        out_runs.append(row)
    return {"runs": out_runs, "comparisons": comparisons, "bench": bench}


def _bench_rows(path: str | None) -> list[dict]:
    if not path or not os.path.isfile(path):
        return []
    try:
        with open(path) as f:
            return json.load(f).get("rows", [])
    except (OSError, json.JSONDecodeError):
        return []


def to_markdown(s: dict, *, per_step: bool = True) -> str:
    L = ["# multi-GPU check: summary", "",
         "Relative difference = |loss(run) - loss(reference)| / |loss(reference)| per logged step; "
         "nothing is judged here.", "", "## Runs", "",
         "| part | run | arm | layout | kind | status | steps | final loss | wall s | note / error |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["runs"]:
        note = r.get("error") or r.get("tail") or r.get("note") or ""
        if r.get("from_earlier"):
            note = "(earlier call) " + note
        L.append(f"| {r.get('part') or '-'} | {r['name']} | {r.get('arm') or '-'} | {r.get('layout') or '-'} | "
                 f"{r.get('kind') or '-'} | {r['status']} | {r.get('steps_logged', '-')} | "
                 f"{fmt(r.get('final_loss'), '.4f')} | {fmt(r.get('wall_s'), '.0f')} | {note.replace('|', '/')} |")
    L += ["", "## Loss vs reference (max / mean relative difference over the common steps)", "",
          "| run | layout | reference | ref layout | steps | max rel diff | at iter | mean rel diff | "
          "val max rel diff |", "|---|---|---|---|---|---|---|---|---|"]
    for c in s["comparisons"]:
        L.append(f"| {c['run']} | {c.get('layout') or '-'} | {c['ref']} | {c.get('ref_layout') or '-'} | "
                 f"{c['steps']} ({c['first']}-{c['last']}) | {fmt(c['max_rel_diff'])} | {c['argmax_iter']} | "
                 f"{fmt(c['mean_rel_diff'])} | {fmt(c['val']['max_rel_diff'])} |")
    if s["bench"]:
        L += ["", "## 4-block 3b benchmark (tokens/s per GPU)", "",
              "| run | arm | TP | GPUs | step ms | tokens/s (all GPUs) | tokens/s per GPU | peak GiB | error |",
              "|---|---|---|---|---|---|---|---|---|"]
        for b in s["bench"]:
            L.append(f"| {b['run']} | {b.get('arm')} | {b.get('tp', '-')} | {b.get('world', '-')} | "
                     f"{fmt(b.get('step_ms'), '.1f')} | {fmt(b.get('tokens_per_s'), '.0f')} | "
                     f"{fmt(b.get('tokens_per_s_per_gpu'), '.0f')} | {fmt(b.get('peak_mem_gib'), '.2f')} | "
                     f"{b.get('error', '')} |")
        L += ["", _bench_ratio(s["bench"])]
    if per_step:
        L += ["", "## Per-step tables", ""]
        for c in s["comparisons"]:
            L += [f"### {c['run']} vs {c['ref']}", "", "| iter | ref loss | run loss | rel diff |", "|---|---|---|---|"]
            L += [f"| {r['iter']} | {r['ref']:.6f} | {r['run']:.6f} | {fmt(r['rel_diff'])} |" for r in c["rows"]]
            for r in c["val"]["rows"]:
                L.append(f"| {r['iter']} (val) | {r['ref']:.6f} | {r['run']:.6f} | {fmt(r['rel_diff'])} |")
            L.append("")
    return "\n".join(L) + "\n"


def _bench_ratio(rows: list[dict]) -> str:
    """Per arm: tokens/s per GPU at TP>1 over the 1-GPU number."""
    one = {b["arm"]: b for b in rows if b.get("world") == 1 and b.get("tokens_per_s_per_gpu")}
    out = []
    for b in rows:
        if b.get("world", 1) > 1 and b.get("tokens_per_s_per_gpu") and b.get("arm") in one:
            ratio = b["tokens_per_s_per_gpu"] / one[b["arm"]]["tokens_per_s_per_gpu"]
            out.append(f"{b['arm']}: TP={b.get('tp')} per-GPU throughput = {ratio:.2f}x the 1-GPU run")
    return "; ".join(out) if out else "(no TP vs 1-GPU pair to compare)"


def cmd_summary(a) -> int:
    earlier = []
    for path in a.earlier or []:
        try:
            with open(path) as f:
                earlier += json.load(f).get("runs", [])
        except (OSError, json.JSONDecodeError) as e:
            print(f"error: cannot read the earlier summary {path}: {e}", file=sys.stderr)
            return 2
    s = summarize(read_manifest(a.manifest), earlier)
    md = to_markdown(s)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1, default=str)
    print(to_markdown(s, per_step=False))
    return 0


def cmd_compare(a) -> int:
    ref_train, _ = read_metrics(a.ref)
    res = {}
    for d in a.runs:
        c = compare(read_metrics(d)[0], ref_train)
        res[d] = c
        print(f"## {d} vs {a.ref}: {c['steps']} steps, max rel diff {fmt(c['max_rel_diff'])} "
              f"(iter {c['argmax_iter']}), mean {fmt(c['mean_rel_diff'])}")
        print("| iter | ref loss | run loss | rel diff |\n|---|---|---|---|")
        for r in c["rows"]:
            print(f"| {r['iter']} | {r['ref']:.6f} | {r['run']:.6f} | {fmt(r['rel_diff'])} |")
    print(json.dumps({k: {x: v[x] for x in ("steps", "max_rel_diff", "mean_rel_diff", "argmax_iter")}
                      for k, v in res.items()}))
    return 0


# ----------------------------------------------------------------------------- pretrain wrapper
def _replay_earlier_stages(build, cfg, vocab_size, kw) -> None:
    """On pipeline stage k > 0, build (and drop) the models of stages 0..k-1 first.

    With CPU initialisation every weight is drawn, in build order, from the one CPU generator: the
    1-GPU model draws embedding, layers 0..L-1, output layer. Stage k alone would draw its layers
    from a fresh generator, i.e. other weights. Replaying the earlier stages' draws (same shapes,
    same order; the recipes' after-build step skipped, as it runs after all layers on 1 GPU) puts
    the generator where the 1-GPU build is when it reaches stage k's first layer.
    """
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() <= 1:
        return
    stage = ps.get_pipeline_model_parallel_rank()
    if stage == 0:
        return
    import megatron.training.model as model_mod

    after = model_mod.recipes.after_model_build
    model_mod.recipes.after_model_build = lambda model, cfg: None
    try:
        for j in range(stage):
            build(cfg, vocab_size, pre_process=(j == 0), post_process=False, pp_rank=j,
                  use_cpu_initialization=True)
    finally:
        model_mod.recipes.after_model_build = after


def cmd_pretrain(a, rest: list[str]) -> int:
    sys.path.insert(0, REPO)
    if a.cpu_init:
        import functools

        import megatron.training.model as model_mod

        orig = model_mod.build_model

        @functools.wraps(orig)
        def build_model(cfg, vocab_size, **kw):
            kw.setdefault("use_cpu_initialization", True)
            if kw["use_cpu_initialization"] is None:
                kw["use_cpu_initialization"] = True
            _replay_earlier_stages(orig, cfg, vocab_size, kw)
            return orig(cfg, vocab_size, **kw)

        model_mod.build_model = build_model
        import megatron.training.trainer as trainer_mod

        trainer_mod.build_model = build_model
        # One seed for every pipeline stage (the trainer adds 100 x stage, like megatron-core), so
        # that with the replay below stage k draws exactly the weights the 1-GPU model draws for
        # its layers. Only the CPU generator matters here: every weight is drawn on the CPU.
        import megatron.training.initialize as init_mod

        orig_seed = init_mod.set_seed

        def set_seed(seed: int) -> None:
            from megatron.core import parallel_state as ps

            orig_seed(seed - 100 * ps.get_pipeline_model_parallel_rank())

        init_mod.set_seed = set_seed
    import pretrain_gpt

    return pretrain_gpt.main(rest)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    from megatron.training.errors import ArgumentParser  # one `error:` line, exit 2

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summary")
    s.add_argument("--manifest", required=True)
    s.add_argument("--md")
    s.add_argument("--json")
    s.add_argument("--earlier", action="append", metavar="SUMMARY_JSON",
                   help="a summary.json of an earlier call of the same commit: its runs join this one's")
    c = sub.add_parser("compare")
    c.add_argument("ref")
    c.add_argument("runs", nargs="+")
    t = sub.add_parser("pretrain")
    t.add_argument("--cpu-init", action="store_true")
    a = p.parse_args(argv)
    if a.cmd == "summary":
        return cmd_summary(a)
    if a.cmd == "compare":
        return cmd_compare(a)
    return cmd_pretrain(a, rest)


if __name__ == "__main__":
    sys.exit(main())
