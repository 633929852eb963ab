"""benchmarks/lr_sweep.py on the CPU with a tiny model: a 2-point grid for an AdamW arm and a
Root arm, then one confirmation seed at each best point.

Checked against the runs' own metrics.jsonl (read here, independently of the script): every
row's validation loss is the loss logged at the last step; the best point of each arm is the
argmin of those losses; the confirmation seed ran only at the best point and the mean over the
seeds is the mean of the logged losses; the JSON has the benchmarks/results schema; the plot
exists; bad grids are refused with one `error:` line (exit 2). ablation.py's --family-lr puts
each arm at its family's lr (q_root at root's, full_stack at adamw's). The 'tuned' summary (each
arm's gap to tuned AdamW with its error bar, one lr per arm for every corpus) is checked against
figures worked out by hand, and ablation.py's --family-lr-from against a sweep JSON.
"""
from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys

import pytest
import yaml

from tests.benchmarks.test_ablation import TINY, metrics
from tests.benchmarks.test_ablation import ablation_module as _ablation  # a fresh import each call
from tests.scripts.test_evaluate import REPO, env, make_toy_data

SWEEP = os.path.join(REPO, "benchmarks", "lr_sweep.py")


def sweep(args, timeout=900):
    return subprocess.run([sys.executable, SWEEP, *args], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.long   # multi-run or multi-process, ~25-50 s: make test-all
def test_sweep_table_best_and_plot(tmp_path):
    data = make_toy_data(str(tmp_path / "toy"))
    out = str(tmp_path / "sweep")
    p = sweep(["--arms", "bf16,root", "--lr-grid", "1e-3,3e-2", "--seeds", "1234", "--confirm-seeds", "7",
               "--iters", "2", "--jobs", "2", "--data", data, "--out", out, "--set", *TINY])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    doc = json.load(open(os.path.join(out, "lr_sweep.json")))
    assert set(doc) == {"table", "title", "hardware", "software", "date", "commit", "command", "rows", "tuned"}
    assert doc["table"] == "lr_sweep" and "lr_sweep.py" in doc["command"]
    rows = doc["rows"]
    assert sorted((r["arm"], r["lr"]) for r in rows) == [("bf16", 1e-3), ("bf16", 3e-2),
                                                         ("root", 1e-3), ("root", 3e-2)]
    for r in rows:
        tag = {1e-3: "1e-03", 3e-2: "3e-02"}[r["lr"]]
        rd = os.path.join(out, "toy", r["arm"], f"lr{tag}")
        _, val = metrics(os.path.join(rd, "s1234"))
        assert r["val_loss"] == pytest.approx(val[2])
        assert r["matrix_lr"] == (r["lr"] if r["arm"] == "root" else None)
        # the run trained at that lr (its resolved config)
        cfg = yaml.safe_load(open(os.path.join(rd, "s1234", "config.yaml")))
        assert cfg["optimizer"]["lr"] == pytest.approx(r["lr"])
        assert cfg["optimizer"]["min_lr"] == pytest.approx(r["lr"] * 0.1)
        assert cfg["train"]["seed"] == 1234
        r["_dir"] = rd
    for arm in ("bf16", "root"):
        mine = [r for r in rows if r["arm"] == arm]
        best = min(mine, key=lambda r: r["val_loss"])
        assert [r["best"] for r in mine] == [r is best for r in mine]
        seeds = {s: metrics(os.path.join(best["_dir"], s))[1][2] for s in ("s1234", "s7")}
        assert best["seeds_n"] == 2 and best["seeds_mean"] == pytest.approx(statistics.fmean(seeds.values()))
        other = next(r for r in mine if r is not best)
        assert not os.path.exists(os.path.join(other["_dir"], "s7")) and other["seeds_n"] == 0
    assert len({r["val_loss"] for r in rows}) == 4          # the lrs did change the runs
    # one corpus: the lr chosen for every corpus is the best point, and ablation.py's value names it
    best_lr = {r["arm"]: r["lr"] for r in rows if r["best"]}
    assert doc["tuned"]["family_lr"] == f"adamw={best_lr['bf16']:g},root={best_lr['root']:g}"
    md = open(os.path.join(out, "lr_sweep.md")).read()
    bold = [ln for ln in md.splitlines() if ln.startswith("|") and "**" in ln]
    assert len(bold) == 2 and {ln.split("|")[1].strip() for ln in bold} == {"bf16", "root"}
    assert any(ln.startswith("| root | 0.001 | 0.001 |") for ln in md.splitlines())
    assert os.path.getsize(os.path.join(out, "lr_sweep.png")) > 0

    # everything complete: a second call trains nothing and writes the same rows
    p = sweep(["--arms", "bf16,root", "--lr-grid", "1e-3,3e-2", "--seeds", "1234", "--confirm-seeds", "7",
               "--iters", "2", "--data", data, "--out", out, "--set", *TINY])
    assert p.returncode == 0 and "starting" not in p.stdout, p.stdout[-2000:]
    again = json.load(open(os.path.join(out, "lr_sweep.json")))["rows"]
    assert [(r["val_loss"], r["best"]) for r in again] == [(r["val_loss"], r["best"]) for r in rows]


@pytest.mark.parametrize("bad,msg", [
    (["--lr-grid", "1e-3,-2e-3"], "positive"),
    (["--lr-grid", "1e-3,x"], "not a number"),
    (["--lr-grid", "1e-3,1e-3"], "twice"),
    (["--lr-grid", ""], "not a number"),
    (["--matrix-lr-grid", "0"], "positive"),
    (["--seeds", "1,a"], "integer"),
    (["--seeds", "1", "--confirm-seeds", "1"], "repeats"),
    (["--arms", "bf16,nope"], "unknown arm"),
    (["--data", "/nonexistent/dir"], "missing"),
])
def test_bad_grids_one_error_line(bad, msg, tmp_path):
    p = sweep(["--dry", "--out", str(tmp_path), *bad])
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and msg in lines[0], p.stderr


def test_family_lr_puts_each_arm_at_its_family_lr():
    A = _ablation()
    fam = A.parse_family_lr("adamw=2e-3,root=4e-3/8e-3")

    class Args:
        family_lrs, min_lr_ratio = fam, 0.1

    def of(arm):
        sw = A.arm_switches(arm, Args)
        return {k: v for k, v in (s.split("=", 1) for s in sw)}
    assert of("q_root")["optimizer.lr"] == "0.004" and of("q_root")["optimizer.orthogonal.lr_scale"] == "2"
    assert of("full_stack_root")["optimizer.lr"] == "0.004" and of("root")["optimizer.min_lr"] == "0.0004"
    assert of("full_stack")["optimizer.lr"] == "0.002" and of("q_adamw")["optimizer.lr"] == "0.002"
    assert "optimizer.orthogonal.lr_scale" not in of("bf16")
    assert "optimizer.lr" not in of("muon") and "optimizer.lr" not in of("full_stack_muon")  # not listed
    for bad in ("adamw=2e-3/1e-2", "sgd=1e-3", "root=4e-3,root=1e-3", "muon=-1", "muon"):
        with pytest.raises(A.UsageError):
            A.parse_family_lr(bad)


def test_ablation_bad_family_lr_one_error_line(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "ablation.py"), "--dry",
                        "--family-lr", "root=fast", "--out", str(tmp_path)], cwd=REPO, env=env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().startswith("error: --family-lr root") \
        and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.parametrize("script", [SWEEP, os.path.join(REPO, "benchmarks", "ablation.py")])
def test_repeated_set_keeps_every_override(tmp_path, script):
    """`--set a --set b` and `--set a b` both reach every run (a repeated flag used to keep only
    its last occurrence, silently dropping the earlier overrides)."""
    data = make_toy_data(str(tmp_path / "toy"))
    p = subprocess.run([sys.executable, script, "--arms", "bf16", "--iters", "2", "--data", data, "--dry",
                        "--out", str(tmp_path / "o"), "--set", *TINY[:2], "--set", "train.log_interval=3"],
                       cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    cmds = [ln for ln in p.stdout.splitlines() if "pretrain_gpt.py" in ln]
    assert cmds and all(all(o in c for o in (*TINY[:2], "train.log_interval=3")) for c in cmds)


def _sweep_module():
    spec = importlib.util.spec_from_file_location("lr_sweep_script", SWEEP)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_best_point_only_on_a_complete_grid_and_edges_flagged(tmp_path):
    """summarize() on hand-written metrics: a grid with a failed point gets no best point (its
    best among the survivors would be a guess); a complete grid whose argmin is its largest lr is
    flagged as at the edge; one whose argmin is inside is not."""
    S = _sweep_module()
    out = str(tmp_path)

    class Args:
        iters = 2
    Args.out = out
    pts = [S.Point("c", "d", arm, lr, None) for arm in ("bf16", "root") for lr in (1e-3, 2e-3, 4e-3)]
    losses = {("bf16", 1e-3): 3.9, ("bf16", 2e-3): 3.8, ("bf16", 4e-3): 3.7,       # best at the edge
              ("root", 1e-3): 3.9, ("root", 2e-3): None, ("root", 4e-3): 3.5}      # 2e-3 failed
    status = {}
    for pt in pts:
        name, v = pt.run(1), losses[(pt.arm, pt.lr)]
        os.makedirs(os.path.join(out, name))
        if v is None:
            status[name] = "failed: exit code 1"
            continue
        with open(os.path.join(out, name, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"iter": 2, "val_loss": v}) + "\n")
        status[name] = "complete"
    rows = S.summarize(pts, [1], [], Args, status)
    by = {(r["arm"], r["lr"]): r for r in rows}
    assert [k for k, r in by.items() if r["best"]] == [("bf16", 4e-3)]
    assert by[("bf16", 4e-3)]["at_edge"] and by[("bf16", 4e-3)]["grid_complete"]
    assert not any(r["best"] or r["grid_complete"] for (arm, _), r in by.items() if arm == "root")
    md = S.markdown(rows, [1], [], {"title": "t", "hardware": "cpu", "commit": "x", "date": "d",
                                    "command": "c", "iters": 2})
    assert "edge of the grid" in md and "no best point: root" in md and "**3.5000**" not in md

    with open(os.path.join(out, pts[2].run(1), "metrics.jsonl"), "w") as f:   # 4e-3 worse: an interior best
        f.write(json.dumps({"iter": 2, "val_loss": 4.0}) + "\n")
    rows = S.summarize(pts, [1], [], Args, status)
    best = [r for r in rows if r["best"]]
    assert [(r["arm"], r["lr"], r["at_edge"]) for r in best] == [("bf16", 2e-3, False)]


def test_incomplete_grid_queues_no_confirmation_seed(tmp_path, monkeypatch, capsys):
    """main() with a fake trainer: of a 2-point grid, 1e-3 completes and 3e-2 fails. No point is
    marked best and the confirmation seed is not queued (it would retrain 1e-3, chosen from half
    the grid); a complete grid (second call, 3e-2 now completing) gets its seed."""
    S = _sweep_module()
    data = make_toy_data(str(tmp_path / "toy"))
    out = str(tmp_path / "sweep")
    trained, done, failing = [], set(), {"toy/bf16/lr3e-02/s1234"}

    def fake_run_arms(todo, args, deadline, status, more=None):
        queue = list(todo)
        while queue:
            name, _ = queue.pop(0)
            trained.append(name)
            if name in failing:
                status[name] = "failed: exit code 1"
            else:
                with open(os.path.join(args.out, name, "metrics.jsonl"), "w") as f:
                    f.write(json.dumps({"iter": args.iters, "val_loss": 4.0 if "3e-02" in name else 3.0}) + "\n")
                status[name] = "complete"
                done.add(name)
            queue += more(name) if more else []
    monkeypatch.setattr(S.A, "run_arms", fake_run_arms)
    monkeypatch.setattr(S.A, "kept_result", lambda args, name: name in done)
    for name in ("toy/bf16/lr1e-03/s1234", "toy/bf16/lr3e-02/s1234", "toy/bf16/lr1e-03/s7"):
        os.makedirs(os.path.join(out, name))
    argv = ["--arms", "bf16", "--lr-grid", "1e-3,3e-2", "--seeds", "1234", "--confirm-seeds", "7",
            "--iters", "2", "--data", data, "--out", out, "--set", *TINY]

    assert S.main(argv) == 1                                   # a run failed
    assert "toy/bf16: grid incomplete, no best point to confirm" in capsys.readouterr().out
    assert trained == ["toy/bf16/lr1e-03/s1234", "toy/bf16/lr3e-02/s1234"]
    rows = json.load(open(os.path.join(out, "lr_sweep.json")))["rows"]
    assert not any(r["best"] for r in rows)

    failing.clear()                                            # the failed point, run again
    assert S.main(argv) == 0
    assert trained[2:] == ["toy/bf16/lr3e-02/s1234", "toy/bf16/lr1e-03/s7"]
    rows = json.load(open(os.path.join(out, "lr_sweep.json")))["rows"]
    assert [(r["lr"], r["best"], r["seeds_n"]) for r in rows] == [(1e-3, True, 2), (3e-2, False, 0)]


def _row(corpus, arm, family, lr, val, matrix_lr=None, best=None):
    """A summarize() row by hand; ``best``: (mean, std, n) over the seeds at the best point."""
    r = {"corpus": corpus, "data": f"data/{corpus}", "arm": arm, "family": family, "lr": lr,
         "matrix_lr": matrix_lr if matrix_lr is not None else (lr if family != "adamw" else None),
         "val_loss": val, "best": best is not None, "at_edge": False, "grid_complete": True,
         "seeds_mean": None, "seeds_std": None, "seeds_n": 0}
    if best:
        r["seeds_mean"], r["seeds_std"], r["seeds_n"] = best
    return r


def test_tuned_gaps_and_one_lr_for_every_corpus():
    """tuned() on hand-written rows, every figure worked out by hand.

    Corpus A's losses (~8) are four times corpus B's (~1.9). For root, the point with the lowest
    mean *absolute* loss over the corpora is 8e-3 ((7.98 + 1.95) / 2 = 4.965 against 5.05 and
    4.975), but the one with the lowest mean *relative* excess over each corpus's best is 2e-3:
    (8.30/7.98 - 1 + 0) / 2 = 2.005% against (8.10/7.98 - 1 + 1.85/1.80 - 1) / 2 = 2.141% and
    (0 + 1.95/1.80 - 1) / 2 = 4.167%. The scale-free choice must win. Muon's matrices were swept
    apart (lr 2e-3; matrix lr 8e-3 / 1.6e-2): 8e-3 (mean excess (8.05/8 - 1 + 0)/2 = 0.3125%)."""
    S = _sweep_module()
    rows = []
    for c, vals in (("A", {2e-3: 8.30, 4e-3: 8.20, 8e-3: 8.40}), ("B", {2e-3: 1.95, 4e-3: 1.90, 8e-3: 2.00})):
        for lr, v in vals.items():
            rows.append(_row(c, "bf16", "adamw", lr, v,
                             best={("A", 4e-3): (8.20, 0.02, 3), ("B", 4e-3): (1.90, None, 1)}.get((c, lr))))
    for c, vals in (("A", {2e-3: 8.30, 4e-3: 8.10, 8e-3: 7.98}), ("B", {2e-3: 1.80, 4e-3: 1.85, 8e-3: 1.95})):
        for lr, v in vals.items():
            rows.append(_row(c, "root", "root", lr, v,
                             best={("A", 8e-3): (7.99, 0.03, 3), ("B", 2e-3): (1.81, 0.01, 3)}.get((c, lr))))
    for c, vals in (("A", {8e-3: 8.05, 1.6e-2: 8.00}), ("B", {8e-3: 1.84, 1.6e-2: 1.86})):
        for mlr, v in vals.items():
            rows.append(_row(c, "muon", "muon", 2e-3, v, matrix_lr=mlr,
                             best={("A", 1.6e-2): (8.00, 0.02, 2), ("B", 8e-3): (1.84, 0.02, 2)}.get((c, mlr))))
    rows.append(_row("B", "q_root", "root", 2e-3, None))          # a grid with a point missing
    rows[-1]["grid_complete"] = False
    rows.append(_row("A", "q_root", "root", 2e-3, 8.0, best=(8.0, None, 1)))
    rows[-1]["at_edge"] = True
    t = S.tuned(rows)

    by = {(e["corpus"], e["arm"]): e for e in t["by_corpus"]}
    assert by[("A", "bf16")]["vs"] is None and by[("A", "bf16")]["gap_pct"] is None
    root_a = by[("A", "root")]
    assert root_a["lr"] == 8e-3 and root_a["vs"] == "bf16"
    assert root_a["gap_pct"] == pytest.approx(100 * (7.99 - 8.20) / 8.20)            # -2.5610%
    assert root_a["gap_2se_pct"] == pytest.approx(200 * ((0.03**2 + 0.02**2) / 3) ** 0.5 / 8.20)  # 0.5077
    root_b = by[("B", "root")]
    assert root_b["gap_pct"] == pytest.approx(100 * (1.81 - 1.90) / 1.90)            # -4.7368%
    assert root_b["gap_2se_pct"] is None                                                # bf16 at one seed
    assert by[("A", "q_root")]["at_edge"] and ("B", "q_root") not in by

    across = {e["arm"]: e for e in t["across_corpora"]}
    assert set(across) == {"bf16", "root", "muon"}                      # q_root: incomplete on B
    assert (across["bf16"]["lr"], across["bf16"]["mean_excess_pct"]) == (4e-3, pytest.approx(0.0))
    assert across["root"]["lr"] == 2e-3 and across["root"]["at_edge"]
    assert across["root"]["mean_excess_pct"] == pytest.approx(100 * (8.30 / 7.98 - 1) / 2)   # 2.005%
    assert (across["muon"]["lr"], across["muon"]["matrix_lr"]) == (2e-3, 8e-3)
    assert across["muon"]["mean_excess_pct"] == pytest.approx(100 * (8.05 / 8.00 - 1) / 2)   # 0.3125%
    assert t["family_lr"] == "adamw=0.004,root=0.002,muon=0.002/0.008"   # root's, not q_root's

    md = "\n".join(S.tuned_markdown(t))
    assert "| A | root | 0.008 | 7.9900 ± 0.0300 (n=3) | -2.56% ± 0.51 (2 s.e.) |" in md
    assert "| B | root | 0.002 | 1.8100 ± 0.0100 (n=3) | -4.74% (a side at one seed: no error bar) |" in md
    assert "--family-lr adamw=0.004,root=0.002,muon=0.002/0.008" in md
    incomplete = _row("A", "bf16", "adamw", 1e-3, None)
    incomplete["grid_complete"] = False
    assert S.tuned_markdown(S.tuned([incomplete])) == []          # nothing chosen: no section


def test_ablation_family_lr_from_a_sweep(tmp_path, capsys):
    """ablation.py --family-lr-from trains each arm at the lr the sweep chose (its JSON's
    tuned.family_lr), says which families it has no lr for (with no --family-lr at all: every
    family but AdamW's, whose tuned lr the config holds), and refuses a file that is not a
    sweep, a sweep that chose nothing, or both flags, with one `error:` line."""
    A = _ablation()
    data = make_toy_data(str(tmp_path / "toy"))
    sweep_json = tmp_path / "lr_sweep.json"
    sweep_json.write_text(json.dumps({"table": "lr_sweep", "rows": [],
                                      "tuned": {"family_lr": "adamw=0.004,root=0.002/0.008"}}))
    base = ["--dry", "--data", data, "--out", str(tmp_path / "o"), "--iters", "2"]
    assert A.main([*base, "--arms", "q_adamw,q_root,muon", "--family-lr-from", str(sweep_json)]) == 0
    out = capsys.readouterr().out
    cmds = {ln.split("logging.dir=")[1].split()[0].rsplit("/", 1)[1]: ln
            for ln in out.splitlines() if "pretrain_gpt.py" in ln}
    assert "optimizer.lr=0.004" in cmds["q_adamw"] and "optimizer.lr=0.002" in cmds["q_root"]
    assert "optimizer.orthogonal.lr_scale=4" in cmds["q_root"] and "optimizer.lr=" not in cmds["muon"]
    assert "no lr given for the muon family" in out
    # no --family-lr: a note for the orthogonal families, none for AdamW (the config's lr is its tuned one)
    assert A.main([*base, "--arms", "bf16,muon,q_root"]) == 0
    notes = [ln for ln in capsys.readouterr().out.splitlines() if "no lr given" in ln]
    assert len(notes) == 1 and "the muon, root family" in notes[0], notes
    assert A.main([*base, "--arms", "bf16,q_adamw"]) == 0
    assert "no lr given" not in capsys.readouterr().out

    sweep_json.write_text(json.dumps({"table": "lr_sweep", "rows": [], "tuned": {"family_lr": ""}}))
    not_a_sweep = tmp_path / "ablation.json"
    not_a_sweep.write_text(json.dumps({"meta": {}, "rows": []}))
    older = tmp_path / "older_sweep.json"
    older.write_text(json.dumps({"table": "lr_sweep", "rows": []}))
    for extra, msg in ((["--family-lr-from", str(sweep_json)], "the sweep chose no lr yet"),
                       (["--family-lr-from", str(not_a_sweep)], "not the lr_sweep.json"),
                       (["--family-lr-from", str(older)], "--report-only"),
                       (["--family-lr-from", str(tmp_path / "missing.json")], "cannot read it as JSON"),
                       (["--family-lr-from", str(not_a_sweep), "--family-lr", "adamw=1e-3"], "not both")):
        assert A.main([*base, "--arms", "bf16", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and msg in err and len(err.splitlines()) == 1, err
