"""benchmarks/lr_sweep.py on the CPU with a tiny model: a 2-point grid for an AdamW arm and a
Root arm, then one confirmation seed at each best point.

Checked against the runs' own metrics.jsonl (read here, independently of the script): every
row's validation loss is the loss logged at the last step; the best point of each arm is the
argmin of those losses; the confirmation seed ran only at the best point and the mean over the
seeds is the mean of the logged losses; the JSON has the benchmarks/results schema; the plot
exists; bad grids are refused with one `error:` line (exit 2). ablation.py's --family-lr puts
each arm at its family's lr (q_root at root's, full_stack at adamw's).
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
    assert set(doc) == {"table", "title", "hardware", "software", "date", "commit", "command", "rows"}
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


def _ablation():
    spec = importlib.util.spec_from_file_location("ablation_script", os.path.join(REPO, "benchmarks", "ablation.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
