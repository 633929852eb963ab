#!/usr/bin/env python3
"""Learning-rate sweep: train optimizer arms over an lr grid side by side, tabulate, plot.

    python benchmarks/lr_sweep.py [--arms bf16,muon,root] [--lr-grid 1e-3,2e-3,4e-3,8e-3,1.6e-2,3.2e-2]
        [--matrix-lr-grid 2e-3,2e-2] [--seeds 1234] [--confirm-seeds 4321,777]
        [--data data/quickstart,data/large] [--iters 300] [--jobs 9] [--out runs/lr_sweep]
        [--config configs/ablation/base.yaml] [--time-budget SECONDS] [--report-only] [--dry]
        [--set key=value ...]

Every point is one training run of benchmarks/ablation.py's machinery (the same base config,
data order, subprocess per run, resume from its checkpoint, `--jobs` runs at once on one GPU,
`--time-budget`): arm (from benchmarks/bench_blocks.py's ARMS; its optimizer family from its
`optimizer.name`), corpus (each `--data` directory), lr and seed:

- the lr sets `optimizer.lr` and `optimizer.min_lr` (the config's min/peak ratio kept);
- for the orthogonal families (muon, root) `--matrix-lr-grid` sweeps the lr of the
  orthogonalised matrices separately (`optimizer.orthogonal.lr_scale = matrix lr / lr`) over
  every pair (lr, matrix lr); without it the matrices take the lr (lr_scale 1);
- `--seeds`: the seeds every grid point is trained at; the best point of an (arm, corpus) is the
  argmin of the mean validation loss at --iters over these seeds, chosen only once every point
  of that grid is complete (a failed or unrun point leaves it without one), and flagged when it
  is the grid's smallest or largest lr (the optimum may lie outside: widen the grid);
- `--confirm-seeds`: once the grid of an (arm, corpus) is complete, its best point is trained again
  at these seeds (queued behind the grid runs still waiting, so they fill the GPU's free
  slots); the table gives the mean and standard deviation over all its seeds.

Run directories: OUT/<corpus>/<arm>/lr<lr>[_m<matrix lr>]/s<seed>/ (metrics.jsonl, train.log).
Outputs: OUT/lr_sweep.md (a table per corpus: one row per point, best marked; then each arm at
its best point beside tuned AdamW's, with the gap's error bar over the seeds, and the lr per arm
that suits every corpus), OUT/lr_sweep.json in the benchmarks/results schema ({"table", "title",
"hardware", "software", "date", "commit", "command", "rows"}, plus "tuned": tuned()'s dict, whose
"family_lr" `benchmarks/ablation.py --family-lr-from OUT/lr_sweep.json` reads), OUT/lr_sweep.png (validation loss against lr, one panel per corpus, one
line per arm, best marked; needs matplotlib: `pip install -e .[plots]`). No held-out
evaluation: the validation loss is the training run's own (metrics.jsonl).

Bad grids, seeds, arms or data directories: one `error:` line, exit 2. Exit 1 if a run failed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, REPO)

import ablation as A  # noqa: E402  (the run machinery and the lr overrides)
from bench_blocks import ARMS  # noqa: E402

DEFAULT_GRID = "1e-3,2e-3,4e-3,8e-3,1.6e-2,3.2e-2"   # past Muon's best so far (BENCHMARKS.md, "Optimizer learning-rate sweep")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="bf16,muon,root", help=f"comma list from: {', '.join(ARMS)}")
    p.add_argument("--lr-grid", default=DEFAULT_GRID, help="peak lrs (optimizer.lr)")
    p.add_argument("--matrix-lr-grid", default="",
                   help="muon / root: lrs of the orthogonalised matrices, swept against every --lr-grid value")
    p.add_argument("--seeds", default="1234", help="seeds of every grid point")
    p.add_argument("--confirm-seeds", default="", help="extra seeds at each best point, after the grid")
    p.add_argument("--data", default="data/quickstart", help="comma list of data directories (corpora)")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--out", default="runs/lr_sweep")
    p.add_argument("--config", default=os.path.join(REPO, "configs", "ablation", "base.yaml"))
    p.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE", help="extra overrides for every run")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at the same time (one GPU: side by side)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="times a run stopped by a CUDA error resumes from its newest checkpoint (default 0)")
    p.add_argument("--time-budget", type=float, default=0, help="seconds of training for this invocation (0: none)")
    p.add_argument("--report-only", action="store_true", help="train nothing: tabulate the complete runs in --out")
    p.add_argument("--dry", action="store_true", help="print the training commands, run nothing")
    return p.parse_args(argv)


def _tag(x: float) -> str:
    return f"{x:.0e}" if float(f"{x:.0e}") == x else repr(x)


class Point:
    """One grid point: (corpus, arm, lr, matrix lr or None); run names per seed."""

    def __init__(self, corpus: str, data: str, arm: str, lr: float, matrix_lr: float | None):
        self.corpus, self.data, self.arm, self.lr, self.matrix_lr = corpus, data, arm, lr, matrix_lr
        self.family = A.family_of(ARMS[arm])

    @property
    def key(self) -> str:
        m = "" if self.matrix_lr is None else f"_m{_tag(self.matrix_lr)}"
        return f"{self.corpus}/{self.arm}/lr{_tag(self.lr)}{m}"

    def run(self, seed: int) -> str:
        return f"{self.key}/s{seed}"

    def switches(self, seed: int, min_ratio: float) -> list[str]:
        return (list(ARMS[self.arm]) + A.lr_overrides(self.family, self.lr, self.matrix_lr, min_ratio)
                + [f"train.seed={seed}"])


def build_points(args) -> list[Point]:
    """The grid, or A.UsageError."""
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise A.UsageError(f"unknown arm(s) {', '.join(bad) or '(none)'}; choose from {', '.join(ARMS)}")
    lrs = A.parse_floats(args.lr_grid, "--lr-grid")
    mlrs = A.parse_floats(args.matrix_lr_grid, "--matrix-lr-grid") if args.matrix_lr_grid else [None]
    corpora = A.parse_corpora(args.data, check_files=not args.report_only)
    pts = []
    for corpus, d in corpora.items():
        for arm in arms:
            ortho = A.family_of(ARMS[arm]) in A.ORTHOGONAL_FAMILIES
            for lr in lrs:
                for mlr in (mlrs if ortho else [None]):
                    pts.append(Point(corpus, d, arm, lr, mlr))
    return pts


def run_status(args, name: str) -> tuple[str, dict | None]:
    """('complete' | 'todo' | 'error: ...', checkpoint meta) of one run directory."""
    meta = A.checkpoint_state(os.path.join(args.out, name, "checkpoints"))
    if meta and meta["config"]["train"]["iters"] != args.iters:
        return (f"error: {args.out}/{name} holds a run with train.iters={meta['config']['train']['iters']}, "
                f"not {args.iters}: use another --out"), meta
    if (meta and meta["iteration"] >= args.iters) or (not meta and A.kept_result(args, name)):
        return "complete", meta
    return "todo", meta


def split_todo(names: list[str], args, status: dict) -> list:
    """``(name, meta)`` of the runs still to train; the others get their status."""
    todo = []
    for n in names:
        st, meta = run_status(args, n)
        if st == "todo" and not args.report_only:
            todo.append((n, meta))
        else:
            status[n] = st if st != "todo" else "not run (--report-only)"
    return todo


def val_at(args, name: str) -> float | None:
    _, val = A.read_metrics(os.path.join(args.out, name))
    return val.get(args.iters)


def summarize(points: list[Point], seeds, confirm, args, status) -> list[dict]:
    """One row per point: the validation loss at each seed, the mean over --seeds, the best of
    its (corpus, arm) marked (only where every point of that grid is complete; `at_edge` when it
    is the smallest or largest lr swept, i.e. the optimum may lie outside the grid), and at the
    best point the mean / std over every seed run."""
    rows = []
    for pt in points:
        vals = {s: (val_at(args, pt.run(s)) if status.get(pt.run(s)) == "complete" else None)
                for s in seeds + confirm}
        grid = [vals[s] for s in seeds]
        rows.append({"corpus": pt.corpus, "data": pt.data, "arm": pt.arm, "family": pt.family,
                     "lr": pt.lr, "matrix_lr": pt.matrix_lr if pt.matrix_lr is not None
                     else (pt.lr if pt.family in A.ORTHOGONAL_FAMILIES else None),
                     "val_loss_by_seed": {str(s): v for s, v in vals.items() if v is not None},
                     "val_loss": statistics.fmean(grid) if all(v is not None for v in grid) else None,
                     "best": False, "at_edge": False, "grid_complete": False,
                     "seeds_mean": None, "seeds_std": None, "seeds_n": 0})
    for key in {(r["corpus"], r["arm"]) for r in rows}:
        group = [r for r in rows if (r["corpus"], r["arm"]) == key]
        if any(r["val_loss"] is None for r in group):
            continue        # a grid with a point missing (failed, not run) has no best point
        for r in group:
            r["grid_complete"] = True
        best = min(group, key=lambda r: r["val_loss"])
        best["best"] = True
        best["at_edge"] = _edge(best, group)
        allv = list(best["val_loss_by_seed"].values())
        best["seeds_mean"], best["seeds_n"] = statistics.fmean(allv), len(allv)
        best["seeds_std"] = statistics.stdev(allv) if len(allv) > 1 else None
    return rows


def _edge(best: dict, group: list[dict]) -> bool:
    """Is ``best`` the smallest or largest lr (or matrix lr) of ``group``'s grid?"""
    lrs, mlrs = sorted({r["lr"] for r in group}), sorted({r["matrix_lr"] for r in group if r["matrix_lr"]})
    return ((len(lrs) > 1 and best["lr"] in (lrs[0], lrs[-1]))
            or (len(mlrs) > 1 and best["matrix_lr"] in (mlrs[0], mlrs[-1])))


def tuned(rows: list[dict]) -> dict:
    """What the sweep chose, from summarize()'s rows (arms in --arms order).

    - ``by_corpus``: each arm at its best point on each corpus (mean, std and count over every
      seed run there) and, where the sweep has an AdamW arm (the first listed), its gap to that
      arm's best on the same corpus: ``gap_pct = 100 (mean - mean_adamw) / mean_adamw`` and
      ``gap_2se_pct``, twice its standard error (``sqrt(sd^2/n + sd_adamw^2/n_adamw)``, in % of
      mean_adamw; None unless both have >= 2 seeds). Each corpus's own best is used: a gap at a
      point tuned on that corpus.
    - ``across_corpora``: one lr (and matrix lr) per arm for every corpus: the point whose
      validation loss exceeds each corpus's best by the least on average (the relative excess
      ``val / best - 1`` is scale-free, so a corpus with higher losses does not dominate). Only
      for an arm whose grid is complete on every corpus; flagged at the grid's edge.
    - ``family_lr``: ``benchmarks/ablation.py --family-lr``'s value, from the first arm of each
      optimizer family that has an across-corpora point (``FAMILY=LR`` or ``FAMILY=LR/MATRIX_LR``
      when an orthogonal family's matrices were swept apart).
    """
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    corpora = list(dict.fromkeys(r["corpus"] for r in rows))
    fam = {r["arm"]: r["family"] for r in rows}
    best = {(r["corpus"], r["arm"]): r for r in rows if r["best"]}
    ref = next((a for a in arms if fam[a] == "adamw"), None)
    by_corpus = []
    for c in corpora:
        a_row = best.get((c, ref))
        for arm in arms:
            r = best.get((c, arm))
            if r is None:
                continue
            e = {"corpus": c, "arm": arm, "family": fam[arm], "lr": r["lr"], "matrix_lr": r["matrix_lr"],
                 "mean": r["seeds_mean"], "std": r["seeds_std"], "n": r["seeds_n"], "at_edge": r["at_edge"],
                 "vs": ref if a_row is not None and arm != ref else None, "gap_pct": None, "gap_2se_pct": None}
            if e["vs"]:
                ma = a_row["seeds_mean"]
                e["gap_pct"] = 100.0 * (r["seeds_mean"] - ma) / ma
                if r["seeds_n"] > 1 and a_row["seeds_n"] > 1:
                    se = (r["seeds_std"] ** 2 / r["seeds_n"] + a_row["seeds_std"] ** 2 / a_row["seeds_n"]) ** 0.5
                    e["gap_2se_pct"] = 200.0 * se / ma
            by_corpus.append(e)
    across = []
    for arm in arms:
        groups = [[r for r in rows if r["arm"] == arm and r["corpus"] == c] for c in corpora]
        if not all(g and all(r["grid_complete"] for r in g) for g in groups):
            continue
        excess: dict = {}
        for g in groups:
            low = min(r["val_loss"] for r in g)
            for r in g:
                excess.setdefault((r["lr"], r["matrix_lr"]), []).append(r["val_loss"] / low - 1.0)
        full = {k: statistics.fmean(v) for k, v in excess.items() if len(v) == len(corpora)}
        if not full:
            continue
        (lr, mlr) = min(full, key=full.get)
        across.append({"arm": arm, "family": fam[arm], "lr": lr, "matrix_lr": mlr,
                       "mean_excess_pct": 100.0 * full[(lr, mlr)],
                       "at_edge": _edge({"lr": lr, "matrix_lr": mlr}, groups[0])})
    family_lr = {}
    for e in across:
        if e["family"] in family_lr:
            continue
        split = e["matrix_lr"] is not None and e["matrix_lr"] != e["lr"]
        family_lr[e["family"]] = f"{e['family']}={e['lr']:g}" + (f"/{e['matrix_lr']:g}" if split else "")
    return {"by_corpus": by_corpus, "across_corpora": across, "family_lr": ",".join(family_lr.values())}


def best_points(points, rows) -> list[Point]:
    by = {(r["corpus"], r["arm"], r["lr"], r["matrix_lr"]): r for r in rows}
    out = []
    for pt in points:
        r = by[(pt.corpus, pt.arm, pt.lr, rows_matrix_lr(pt))]
        if r["best"]:
            out.append(pt)
    return out


def rows_matrix_lr(pt: Point):
    return pt.matrix_lr if pt.matrix_lr is not None else (pt.lr if pt.family in A.ORTHOGONAL_FAMILIES else None)


def _f(x, fmt):
    return "—" if x is None else format(x, fmt)


def markdown(rows, seeds, confirm, header) -> str:
    out = [f"# {header['title']}", "",
           f"Device: {header['hardware']}; commit {str(header['commit'])[:10]}; {header['date']}; "
           f"command `{header['command']}`.",
           f"Validation loss at step {header['iters']} (mean over seeds {', '.join(map(str, seeds))}); "
           "**bold**: the best point of the arm on that corpus"
           + (f", trained again at seeds {', '.join(map(str, confirm))} (mean ± std over all its seeds)."
              if confirm else ".")]
    for corpus in dict.fromkeys(r["corpus"] for r in rows):
        out += ["", f"## {corpus} (`{next(r['data'] for r in rows if r['corpus'] == corpus)}`)", "",
                "| arm | lr | matrix lr | val loss | all seeds at the best point |", "|---|---|---|---|---|"]
        for r in (r for r in rows if r["corpus"] == corpus):
            v = _f(r["val_loss"], ".4f")
            if r["best"]:
                v = f"**{v}**"
            seeds_col = ""
            if r["best"] and r["seeds_n"] > 1:
                seeds_col = f"{r['seeds_mean']:.4f} ± {r['seeds_std']:.4f} (n={r['seeds_n']})"
            if r["at_edge"]:
                seeds_col = (seeds_col + "; " if seeds_col else "") + "edge of the grid: widen it"
            out.append(f"| {r['arm']} | {r['lr']:g} | {_f(r['matrix_lr'], 'g')} | {v} | {seeds_col} |")
        partial = list(dict.fromkeys(r["arm"] for r in rows if r["corpus"] == corpus and not r["grid_complete"]))
        if partial:
            out += ["", f"Grid incomplete (a point failed or was not run), so no best point: {', '.join(partial)}."]
    return "\n".join(out + tuned_markdown(tuned(rows))) + "\n"


def _lrs(e: dict) -> str:
    split = e["matrix_lr"] is not None and e["matrix_lr"] != e["lr"]
    return f"{e['lr']:g}" + (f" (matrices {e['matrix_lr']:g})" if split else "")


def tuned_markdown(t: dict) -> list[str]:
    """The 'Tuned' section of lr_sweep.md: each arm at its best point beside the AdamW arm's, and
    the lrs to train at (empty when no grid is complete)."""
    if not t["by_corpus"]:
        return []
    out = ["", "## Tuned: each arm at its best point", "",
           "| corpus | arm | lr | val loss (mean ± std over its seeds) | vs tuned AdamW |", "|---|---|---|---|---|"]
    for e in t["by_corpus"]:
        v = f"{e['mean']:.4f}" + (f" ± {e['std']:.4f}" if e["std"] is not None else "") + f" (n={e['n']})"
        gap = "" if e["gap_pct"] is None else f"{e['gap_pct']:+.2f}%"
        if gap and e["gap_2se_pct"] is not None:
            gap += f" ± {e['gap_2se_pct']:.2f} (2 s.e.)"
        elif gap:
            gap += " (a side at one seed: no error bar)"
        out.append(f"| {e['corpus']} | {e['arm']} | {_lrs(e)}{' (edge)' if e['at_edge'] else ''} | {v} | {gap} |")
    if t["across_corpora"]:
        out += ["", "One lr per arm for every corpus (least mean excess over each corpus's best): "
                + "; ".join(f"{e['arm']} {_lrs(e)} (+{e['mean_excess_pct']:.2f}%"
                            + (", edge of the grid" if e["at_edge"] else "") + ")" for e in t["across_corpora"])
                + "."]
    if t["family_lr"]:
        out += ["", f"Train every arm at its family's lr: `python benchmarks/ablation.py --family-lr {t['family_lr']}` "
                "(or `--family-lr-from` this sweep's lr_sweep.json)."]
    return out


def plot(rows, path: str, title: str) -> bool:
    plt = A.pyplot("[lr_sweep] matplotlib is not installed: no plot (pip install -e .[plots])")
    if plt is None:
        return False
    corpora = list(dict.fromkeys(r["corpus"] for r in rows))
    fig, axes = plt.subplots(1, len(corpora), figsize=(6 * len(corpora), 4.5), squeeze=False)
    for ax, corpus in zip(axes[0], corpora):
        mine = [r for r in rows if r["corpus"] == corpus and r["val_loss"] is not None]
        # one line per arm (per arm and rest-of-model lr when the matrices' lr was swept apart);
        # x: the matrices' lr (= the lr for adamw arms)
        split = {r["arm"] for r in mine if r["matrix_lr"] not in (None, r["lr"])}
        lines = {}
        for r in mine:
            label = f"{r['arm']} (rest lr {r['lr']:g})" if r["arm"] in split else r["arm"]
            lines.setdefault(label, []).append(r)
        for label, rs in lines.items():
            rs = sorted(rs, key=lambda r: r["matrix_lr"] or r["lr"])
            xs = [r["matrix_lr"] or r["lr"] for r in rs]
            line, = ax.plot(xs, [r["val_loss"] for r in rs], "o-", ms=4, label=label)
            for r, x in zip(rs, xs):
                if r["best"]:
                    ax.plot([x], [r["val_loss"]], "*", ms=16, color=line.get_color(),
                            markeredgecolor="k", zorder=5)
        ax.set_xscale("log")
        ax.set_xlabel("learning rate (of the matrices for muon / root)")
        ax.set_ylabel("validation loss")
        ax.set_title(corpus)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    return A.save_figure(plt, fig, title + "  (★ best)", path)


def header_of(args, argv, cfg_iters_tokens: int, hardware: str) -> dict:
    """The table's provenance; `hardware` is what trained the runs (ablation.device_name)."""
    from run_all import commit, software  # noqa: PLC0415 (one schema for every results JSON)

    return {"title": f"Learning-rate sweep, {args.iters} steps x {cfg_iters_tokens:,} tokens",
            "hardware": hardware, "software": software(), "commit": os.environ.get("FULLSTACK_COMMIT") or commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "command": shlex.join(["python", "benchmarks/lr_sweep.py",
                                   *(argv if argv is not None else sys.argv[1:])]),
            "iters": args.iters}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.iters <= 0:
            raise A.UsageError("--iters must be positive")
        if args.jobs < 1:
            raise A.UsageError("--jobs must be >= 1")
        if args.max_restarts < 0:
            raise A.UsageError("--max-restarts must be >= 0")
        seeds = A.parse_seeds(args.seeds, "--seeds")
        if not seeds:
            raise A.UsageError("--seeds is empty")
        confirm = A.parse_seeds(args.confirm_seeds, "--confirm-seeds")
        if set(confirm) & set(seeds):
            raise A.UsageError("--confirm-seeds repeats a seed of --seeds")
        points = build_points(args)   # grids, arms, and the data directories last
    except A.UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from megatron.training.config import load_config
    from megatron.training.errors import UserError

    args.min_lr_ratio = A.min_lr_ratio(args.config)
    args.nproc, args.family_lrs = 1, {}
    args.switches = {pt.run(s): pt.switches(s, args.min_lr_ratio) for pt in points for s in seeds + confirm}
    args.data_of = {pt.run(s): pt.data for pt in points for s in seeds + confirm}
    grid_runs = [pt.run(s) for pt in points for s in seeds]
    try:   # one config per arm and corpus is enough to reject a bad --set or recipe up front
        for pt in {(p.arm, p.data): p for p in points}.values():
            cfg = load_config(args.config, A.arm_overrides(pt.run(seeds[0]), args))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry:
        for n in grid_runs:
            print(shlex.join(A.train_cmd(n, args)))
        if confirm:
            print(f"# then, at each (corpus, arm)'s best point: seeds {', '.join(map(str, confirm))}")
        return 0
    os.makedirs(args.out, exist_ok=True)
    deadline = time.time() + args.time_budget if args.time_budget > 0 else None
    status: dict = {}
    todo = split_todo(grid_runs, args, status)
    groups: dict = {}
    for pt in points:
        groups.setdefault((pt.corpus, pt.arm), []).append(pt)
    confirmed: set = set()

    def confirm_runs(_finished=None) -> list:
        """The extra seeds of every group whose grid runs have all ended, not yet queued."""
        out = []
        for key, pts in groups.items():
            if key in confirmed or not all(pt.run(s) in status for pt in pts for s in seeds):
                continue
            confirmed.add(key)
            if not all(status[pt.run(s)] == "complete" for pt in pts for s in seeds):
                print(f"[lr_sweep] {'/'.join(key)}: grid incomplete, no best point to confirm", flush=True)
                continue
            best = best_points(pts, summarize(pts, seeds, [], args, status))
            out += split_todo([pt.run(s) for pt in best for s in confirm], args, status)
        return out

    if confirm:
        todo += confirm_runs()
    A.run_arms(todo, args, deadline, status, more=confirm_runs if confirm else None)
    rows = summarize(points, seeds, confirm, args, status)

    header = header_of(args, argv, cfg.train.global_batch_size * cfg.model.seq_length,
                       A.device_name(args, [n for n, st in status.items() if st == "complete"]))
    md = markdown(rows, seeds, confirm, header)
    with open(os.path.join(args.out, "lr_sweep.md"), "w") as f:
        f.write(md)
    doc = {"table": "lr_sweep", "title": header["title"], "hardware": header["hardware"],
           "software": header["software"], "date": header["date"], "commit": header["commit"],
           "command": header["command"], "rows": rows, "tuned": tuned(rows)}
    with open(os.path.join(args.out, "lr_sweep.json"), "w") as f:
        json.dump(doc, f, indent=1)
    plot(rows, os.path.join(args.out, "lr_sweep.png"), header["title"])
    print(md)
    failed = [n for n, st in status.items() if st.startswith(("failed", "error"))]
    for n in failed:
        print(f"[lr_sweep] {n}: {status[n]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
