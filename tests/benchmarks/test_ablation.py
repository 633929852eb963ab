"""benchmarks/ablation.py end to end on a toy corpus with a tiny model (CPU):

1. an arm interrupted after 2 of 4 steps (train.exit_interval) is reported as interrupted;
2. the next invocation resumes it from its checkpoint, runs the second arm from scratch, and
   evaluates both; the table's numbers are recomputed here from each arm's metrics.jsonl and
   eval.json (mean of the last k losses, validation loss at the last step, gap to bf16), and
   both arms saw the same first batch with the same initial weights (equal step-1 loss: the
   optimizers differ only from step 1 on);
3. a third invocation trains and evaluates nothing (complete arms are skipped, evals cached);
4. --report-only tabulates the complete arms and trains none, also an arm with no run yet.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from tests.scripts.test_evaluate import REPO, env, make_toy_data

ABLATION = os.path.join(REPO, "benchmarks", "ablation.py")
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.seq_length=64", "train.global_batch_size=4", "train.micro_batch_size=4",
        "train.precision=fp32", "train.eval_iters=1", "train.eval_interval=2", "train.log_interval=1",
        "logging.tensorboard=false", "optimizer.warmup_iters=1", "checkpoint.save_interval=2"]


def ablation(args, timeout=600):
    p = subprocess.run([sys.executable, ABLATION, *args], cwd=REPO, env=env(), capture_output=True, text=True,
                       timeout=timeout)
    return p


def ablation_module():
    """A fresh import of benchmarks/ablation.py (a script, not a package module): no state shared
    between tests."""
    spec = importlib.util.spec_from_file_location("ablation_script", ABLATION)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def metrics(rd):
    train, val = {}, {}
    for line in open(os.path.join(rd, "metrics.jsonl")):
        r = json.loads(line)
        (val if "val_loss" in r else train)[r["iter"]] = r.get("val_loss", r.get("loss"))
    return train, val


@pytest.mark.long   # several training runs end to end (make test-all)
def test_ablation_resumes_skips_and_tabulates(tmp_path):
    data = make_toy_data(str(tmp_path / "data"))
    out = str(tmp_path / "abl")
    common = ["--iters", "4", "--out", out, "--data", data, "--cloze-items", "8", "--last-k", "2"]

    p = ablation(common + ["--arms", "bf16", "--no-eval", "--set", *TINY, "train.exit_interval=2"])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "bf16: interrupted at step 2" in p.stdout

    p = ablation(common + ["--arms", "bf16,q_adamw", "--set", *TINY])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "bf16: resuming at step 2" in p.stdout and "q_adamw: starting" in p.stdout
    assert "resumed from" in open(os.path.join(out, "bf16", "train.log")).read()
    table = json.load(open(os.path.join(out, "ablation.json")))
    rows = {r["arm"]: r for r in table["rows"]}
    assert set(rows) == {"bf16", "q_adamw"}
    vals = {}
    for arm, r in rows.items():
        rd = os.path.join(out, arm)
        assert r["status"] == "complete"
        train, val = metrics(rd)
        assert sorted(train) == [1, 2, 3, 4] and 4 in val
        assert r["final_train_loss"] == pytest.approx((train[3] + train[4]) / 2)
        assert r["val_loss"] == pytest.approx(val[4])
        vals[arm] = val[4]
        ev = json.load(open(os.path.join(rd, "eval.json")))
        assert ev["iteration"] == 4
        assert r["heldout_perplexity"] == ev["heldout"]["perplexity"]
        assert r["cloze_greedy_accuracy"] == ev["cloze"]["greedy_accuracy"] and r["cloze_items"] == 8
        assert r["tokens"] == 4 * 4 * 64
        assert r["wall_s"] > 0
    assert rows["bf16"]["val_gap_pct"] == 0.0
    assert rows["q_adamw"]["val_gap_pct"] == pytest.approx(100 * (vals["q_adamw"] - vals["bf16"]) / vals["bf16"])
    assert metrics(os.path.join(out, "bf16"))[0][1] == metrics(os.path.join(out, "q_adamw"))[0][1]
    md = open(os.path.join(out, "ablation.md")).read()
    assert "| bf16 |" in md and "| q_adamw |" in md and "0 (baseline)" in md
    try:
        import matplotlib  # noqa: F401

        assert os.path.getsize(os.path.join(out, "ablation.png")) > 0
    except ImportError:
        assert "matplotlib is not installed" in p.stdout

    sessions = {a: len(json.load(open(os.path.join(out, a, "ablation_run.json")))["sessions"]) for a in rows}
    p = ablation(common + ["--arms", "bf16,q_adamw", "--set", *TINY])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "bf16: complete" in p.stdout and "q_adamw: complete" in p.stdout
    assert "evaluating" not in p.stdout
    assert sessions == {a: len(json.load(open(os.path.join(out, a, "ablation_run.json")))["sessions"]) for a in rows}
    assert json.load(open(os.path.join(out, "ablation.json")))["rows"][0]["val_loss"] == rows["bf16"]["val_loss"]

    # --report-only: tabulates what is there, trains nothing (root has no run in OUT)
    p = ablation(common + ["--arms", "bf16,q_adamw,root", "--report-only", "--set", *TINY])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "root: not run (--report-only)" in p.stdout and "evaluating" not in p.stdout
    assert not os.path.exists(os.path.join(out, "root"))
    rows2 = {r["arm"]: r for r in json.load(open(os.path.join(out, "ablation.json")))["rows"]}
    assert rows2["q_adamw"]["val_gap_pct"] == rows["q_adamw"]["val_gap_pct"] and rows2["root"]["val_loss"] is None


def test_ablation_dry_and_bad_arm(tmp_path):
    p = ablation(["--dry", "--arms", "bf16,full_stack", "--iters", "7", "--out", str(tmp_path)])
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.strip().splitlines()
    assert "train.iters=7" in lines[0] and f"checkpoint.save_dir={tmp_path}/bf16/checkpoints" in lines[0]
    assert "evaluate.py" in lines[-1]
    assert not os.listdir(tmp_path)
    p = ablation(["--dry", "--arms", "bf16,nope"])
    assert p.returncode == 2 and "unknown arm" in p.stderr
    p = ablation(["--dry", "--arms", "bf16", "--max-restarts", "-1"])
    assert p.returncode == 2 and p.stderr.strip().splitlines() == ["error: --max-restarts must be >= 0"], p.stderr
    p = ablation(["--dry", "--arms", "bf16", "--paired-with", "nope"])
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert p.stderr.startswith("error: --paired-with nope: not an arm"), p.stderr


@pytest.mark.long   # several tiny trainings (~20-40 s): make test-all
def test_ablation_jobs_side_by_side_and_kept_results(tmp_path):
    """--jobs 2 trains two arms at once with the numbers of a one-at-a-time run; a copy of the
    arms' folders without checkpoints is still tabulated by --report-only."""
    import shutil

    data = make_toy_data(str(tmp_path / "data"))
    common = ["--iters", "2", "--data", data, "--no-eval", "--last-k", "2", "--set", *TINY]
    side = str(tmp_path / "side")
    p = ablation(common + ["--out", side, "--arms", "bf16,q_adamw", "--jobs", "2"])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "bf16: complete" in p.stdout and "q_adamw: complete" in p.stdout
    for arm in ("bf16", "q_adamw"):
        st = json.load(open(os.path.join(side, arm, "ablation_run.json")))
        assert st["sessions"][-1]["jobs"] == 2 and st["completed"] == {"iteration": 2, "train_iters": 2}
    assert "(2 arms at once)" in open(os.path.join(side, "ablation.md")).read()

    alone = str(tmp_path / "alone")
    p = ablation(common + ["--out", alone, "--arms", "bf16"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert metrics(os.path.join(alone, "bf16")) == metrics(os.path.join(side, "bf16"))

    kept = str(tmp_path / "kept")
    for arm in ("bf16", "q_adamw"):
        shutil.copytree(os.path.join(side, arm), os.path.join(kept, arm), ignore=shutil.ignore_patterns("checkpoints"))
    p = ablation(common + ["--out", kept, "--arms", "bf16,q_adamw", "--report-only"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("complete (results kept, no checkpoint)") == 2
    rows = {r["arm"]: r for r in json.load(open(os.path.join(side, "ablation.json")))["rows"]}
    kept_rows = {r["arm"]: r for r in json.load(open(os.path.join(kept, "ablation.json")))["rows"]}
    for arm in rows:
        assert kept_rows[arm]["status"] == "complete"
        for key in ("final_train_loss", "val_loss", "val_gap_pct", "tokens"):
            assert kept_rows[arm][key] == rows[arm][key] and rows[arm][key] is not None

    p = ablation(common + ["--out", kept, "--arms", "bf16", "--jobs", "2", "--nproc", "2"])
    assert p.returncode == 2 and "--jobs" in p.stderr


def test_jobs_spread_over_visible_gpus(monkeypatch):
    """With several GPUs, each new arm goes to the GPU running the fewest arms (first on ties),
    named as CUDA_VISIBLE_DEVICES names it; one GPU or none: the environment is left alone."""
    import torch

    mod = ablation_module()
    assert mod.pick_gpu([], []) is None and mod.pick_gpu(["0"], ["0", "0"]) is None
    busy = []
    for _ in range(5):
        busy.append(mod.pick_gpu(["0", "1", "2"], busy))
    assert busy == ["0", "1", "2", "0", "1"]
    assert mod.pick_gpu(["0", "1"], ["1", None]) == "0"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert mod.visible_gpus() == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert mod.visible_gpus() == ["3", "5"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mod.visible_gpus() == []


@pytest.mark.long   # several tiny trainings (~20-40 s): make test-all
def test_ablation_over_corpora_and_seeds(tmp_path):
    """--data A,B --seeds s1,s2: every arm on each corpus at each seed, in one pool of --jobs;
    each run's gap is to the bf16 run of its own corpus and seed, and the summary's mean and
    standard deviation over seeds are recomputed here from the runs' metrics.jsonl; each run is
    evaluated on its own corpus; a seed changes the initial weights (step-1 loss) and arms of
    one seed start alike."""
    import statistics

    a = make_toy_data(str(tmp_path / "alpha"))
    b = make_toy_data(str(tmp_path / "beta"), seed=8)
    out = str(tmp_path / "grid")
    p = ablation(["--arms", "bf16,q_adamw", "--data", f"{a},{b}", "--seeds", "11,22", "--iters", "2",
                  "--jobs", "2", "--out", out, "--cloze-items", "4", "--last-k", "2", "--set", *TINY])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    doc = json.load(open(os.path.join(out, "ablation.json")))
    assert {(r["corpus"], r["seed"], r["arm"]) for r in doc["rows"]} == {
        (c, s, arm) for c in ("alpha", "beta") for s in (11, 22) for arm in ("bf16", "q_adamw")}
    val, first = {}, {}
    for c, data in (("alpha", a), ("beta", b)):
        held = {json.load(open(os.path.join(out, c, f"s{s}", arm, "eval.json")))["eval_meta"]["valid_prefix"]
                for s in (11, 22) for arm in ("bf16", "q_adamw")}
        assert held == {os.path.join(data, "valid_text_document")}, "evaluated on another corpus"
        for s in (11, 22):
            for arm in ("bf16", "q_adamw"):
                train, v = metrics(os.path.join(out, c, f"s{s}", arm))
                val[c, s, arm], first[c, s, arm] = v[2], train[1]
            assert first[c, s, "bf16"] == first[c, s, "q_adamw"]
        assert first[c, 11, "bf16"] != first[c, 22, "bf16"]
    summary = {(r["corpus"], r["arm"]): r for r in doc["summary"]}
    for c in ("alpha", "beta"):
        gaps = [100 * (val[c, s, "q_adamw"] - val[c, s, "bf16"]) / val[c, s, "bf16"] for s in (11, 22)]
        r = summary[c, "q_adamw"]
        assert r["complete"] == 2 and r["seeds"] == [11, 22]
        assert r["val_gap_pct_mean"] == pytest.approx(statistics.fmean(gaps))
        assert r["val_gap_pct_std"] == pytest.approx(statistics.stdev(gaps))
        assert r["val_gap_pct_by_seed"] == pytest.approx({"11": gaps[0], "22": gaps[1]})
        vals = [val[c, s, "bf16"] for s in (11, 22)]
        assert summary[c, "bf16"]["val_loss_mean"] == pytest.approx(statistics.fmean(vals))
        assert summary[c, "bf16"]["val_gap_pct_mean"] == 0.0
    md = open(os.path.join(out, "ablation.md")).read()
    assert "### alpha" in md and "### beta" in md and " ± " in md

    # runs copied on without their checkpoints (another machine's results) are tabulated alike
    import shutil

    kept = str(tmp_path / "kept")
    shutil.copytree(out, kept, ignore=shutil.ignore_patterns("checkpoints"))
    p = ablation(["--arms", "bf16,q_adamw", "--data", f"{a},{b}", "--seeds", "11,22", "--iters", "2",
                  "--out", kept, "--cloze-items", "4", "--last-k", "2", "--report-only", "--set", *TINY])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert p.stdout.count("complete (results kept, no checkpoint)") == 8 and "evaluating" not in p.stdout
    again = json.load(open(os.path.join(kept, "ablation.json")))["summary"]
    for key in ("val_loss_mean", "val_gap_pct_mean", "val_gap_pct_std", "heldout_perplexity_mean"):
        assert [r[key] for r in again] == [r[key] for r in doc["summary"]], key

    for bad, msg in ((["--seeds", "1,1"], "twice"), (["--seeds", "1", "--set", "train.seed=3"], "both set the seed"),
                     (["--data", f"{a},{a}"], "two directories named")):
        p = ablation(["--arms", "bf16", "--iters", "2", "--out", str(tmp_path / "bad"), "--data", a, *bad])
        assert p.returncode == 2 and msg in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_summary_share_of_the_nvfp4_gap():
    """aggregate(): per corpus and arm, the seed mean / sample std of the paired gaps, the
    incomplete seed left out of them, and each arm's mean gap over nvfp4_linear's (hand-computed
    values)."""
    mod = ablation_module()

    def row(arm, seed, gap, status="complete"):
        return {"corpus": "c", "arm": arm, "seed": seed, "status": status,
                "val_loss": None if gap is None else 4.0 + gap / 100,
                "val_gap_pct": gap, "final_train_loss": None, "heldout_perplexity": None,
                "cloze_greedy_accuracy": None, "cloze_choice_accuracy": None, "tokens": 10, "wall_s": 60.0,
                "jobs": 3}

    rows = ([row("bf16", s, 0.0) for s in (1, 2, 3)] + [row("nvfp4_linear", 1, 1.0), row("nvfp4_linear", 2, 0.6),
                                                         row("nvfp4_linear", 3, 0.8)]
            + [row("lever", 1, 0.5), row("lever", 2, 0.1), row("lever", 3, None, status="failed: x")])
    got = {a["arm"]: a for a in mod.aggregate(rows)}
    assert got["nvfp4_linear"]["val_gap_pct_mean"] == pytest.approx(0.8)
    assert got["nvfp4_linear"]["val_gap_pct_std"] == pytest.approx(0.2)          # sd of 1.0, 0.6, 0.8
    assert got["lever"]["complete"] == 2 and got["lever"]["runs"] == 3 and got["lever"]["seeds"] == [1, 2]
    assert got["lever"]["val_gap_pct_mean"] == pytest.approx(0.3)
    assert got["lever"]["share_of_nvfp4_gap"] == pytest.approx(0.3 / 0.8)
    assert got["nvfp4_linear"]["share_of_nvfp4_gap"] == pytest.approx(1.0)
    assert got["bf16"]["share_of_nvfp4_gap"] is None


def _summarized(mod, tmp_path, arms, val, failed=(), paired_with="nvfp4_linear"):
    """summarize() over arms x seeds 1, 2 of corpus "c" whose metrics.jsonl hold the validation
    losses ``val[seed, arm]`` at step 4; the runs named in ``failed`` are not complete."""
    import argparse

    runs = mod.plan_runs(arms, {"c": "data/c"}, [1, 2])
    args = argparse.Namespace(out=str(tmp_path), iters=4, last_k=1, family_lrs={}, paired_with=paired_with,
                              switches={r.name: list(mod.ARMS[r.arm]) for r in runs})
    for r in runs:
        os.makedirs(os.path.join(args.out, r.name))
        with open(os.path.join(args.out, r.name, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"iter": 4, "loss": 3.0}) + "\n")
            f.write(json.dumps({"iter": 4, "val_loss": val[r.seed, r.arm]}) + "\n")
    status = {r.name: "failed: x" if (r.seed, r.arm) in failed else "complete" for r in runs}
    return mod.summarize(runs, status, {}, args, {}), args


_GRID_HEADER = {"model": "m", "tokens_per_step": 1, "seeds": [1, 2], "device": "d", "git_commit": "0" * 10,
                "date": "x", "command": "c", "corpora": {"c": {"data": "data/c", "train_tokens": 1e6, "epochs": 1.0}}}


def _row(md: str, arm: str) -> list[str]:
    """The cells of ``arm``'s row of a markdown table, checked against the header's column count."""
    head = next(line for line in md.splitlines() if line.startswith("| arm |"))
    line = next(line for line in md.splitlines() if line.startswith(f"| {arm} |"))
    assert len(line.split("|")) == len(head.split("|")), (head, line)
    return [c.strip() for c in line.split("|")[1:-1]]


def test_every_arm_paired_with_nvfp4_linear_by_seed(tmp_path):
    """summarize() / aggregate() / markdown_grid(): each arm but bf16 and nvfp4_linear against the
    nvfp4_linear run of its seed (hand-computed from the written validation losses); a seed whose
    nvfp4_linear failed gives no pair; without nvfp4_linear the column is not in the table; with
    --paired-with lora_svd every arm but bf16 is set against lora_svd instead."""
    mod = ablation_module()
    val = {(1, "bf16"): 4.00, (1, "nvfp4_linear"): 4.04, (1, "nvfp4_linear_levers"): 4.0198, (1, "lora_svd"): 4.04,
           (2, "bf16"): 4.10, (2, "nvfp4_linear"): 4.10, (2, "nvfp4_linear_levers"): 4.059, (2, "lora_svd"): 4.141}
    rows, args = _summarized(mod, tmp_path / "a", ["bf16", "nvfp4_linear", "nvfp4_linear_levers", "lora_svd"], val)
    by = {(r["seed"], r["arm"]): r for r in rows}
    assert by[1, "nvfp4_linear_levers"]["val_vs_paired_pct"] == pytest.approx(-0.5)    # 4.0198 / 4.04 - 1
    assert by[2, "nvfp4_linear_levers"]["val_vs_paired_pct"] == pytest.approx(-1.0)    # 4.059 / 4.10 - 1
    assert by[2, "lora_svd"]["val_vs_paired_pct"] == pytest.approx(1.0)
    for arm in ("bf16", "nvfp4_linear"):
        assert by[1, arm]["val_vs_paired_pct"] is None
    summary = {a["arm"]: a for a in mod.aggregate(rows)}
    lev = summary["nvfp4_linear_levers"]
    assert lev["val_vs_paired_pct_mean"] == pytest.approx(-0.75)
    assert lev["val_vs_paired_pct_std"] == pytest.approx(0.5 / 2 ** 0.5)              # sd of -0.5, -1.0
    assert lev["val_vs_paired_pct_by_seed"] == pytest.approx({"1": -0.5, "2": -1.0})
    md = mod.markdown_grid(mod.aggregate(rows), args, _GRID_HEADER)
    col = next(line for line in md.splitlines() if line.startswith("| arm |")).split(" | ").index(
        "vs nvfp4_linear (val)")
    assert _row(md, "nvfp4_linear_levers")[col] == "-0.75% ± 0.35% (-0.50, -1.00)"
    assert _row(md, "bf16")[col] == "" and _row(md, "nvfp4_linear")[col] == ""

    rows, args = _summarized(mod, tmp_path / "b", ["bf16", "nvfp4_linear", "nvfp4_linear_levers"], val,
                             failed={(2, "nvfp4_linear")})
    lev = next(a for a in mod.aggregate(rows) if a["arm"] == "nvfp4_linear_levers")
    assert lev["val_vs_paired_pct_by_seed"] == pytest.approx({"1": -0.5}) and lev["val_vs_paired_pct_std"] is None

    rows, args = _summarized(mod, tmp_path / "c", ["bf16", "lora_svd"], val)
    md = mod.markdown_grid(mod.aggregate(rows), args, _GRID_HEADER)
    assert "vs nvfp4_linear" not in md and _row(md, "lora_svd")[0] == "lora_svd"

    rows, args = _summarized(mod, tmp_path / "d", ["bf16", "nvfp4_linear", "lora_svd"], val, paired_with="lora_svd")
    by = {(r["seed"], r["arm"]): r for r in rows}
    assert by[1, "nvfp4_linear"]["val_vs_paired_pct"] == pytest.approx(0.0)            # 4.04 / 4.04 - 1
    assert by[2, "nvfp4_linear"]["val_vs_paired_pct"] == pytest.approx(-100 * 0.041 / 4.141)
    assert by[1, "lora_svd"]["val_vs_paired_pct"] is None and by[1, "bf16"]["val_vs_paired_pct"] is None
    md = mod.markdown_grid(mod.aggregate(rows), args, _GRID_HEADER)
    head = next(line for line in md.splitlines() if line.startswith("| arm |")).split(" | ")
    assert "vs lora_svd (val)" in head and "vs nvfp4_linear (val)" not in head
    assert _row(md, "nvfp4_linear")[head.index("vs lora_svd (val)")] == "-0.50% ± 0.70% (+0.00, -0.99)"


def test_fp4_arms_of_an_orthogonal_optimizer_against_that_optimizer(tmp_path):
    """summarize() / aggregate() / markdown_grid(): q_muon and full_stack_muon are compared with
    muon of the same corpus and seed, q_root with root; AdamW-family arms get no such peer (their
    BF16 arm is the baseline). Validation losses written as metrics.jsonl, gaps worked by hand."""
    mod = ablation_module()
    val = {(1, "bf16"): 4.00, (1, "muon"): 3.80, (1, "q_muon"): 3.819, (1, "full_stack_muon"): 3.838,
           (1, "root"): 3.90, (1, "q_root"): 3.90, (1, "q_adamw"): 4.02,
           (2, "bf16"): 4.10, (2, "muon"): 3.90, (2, "q_muon"): 3.9039, (2, "full_stack_muon"): 3.939,
           (2, "root"): 4.00, (2, "q_root"): 4.02, (2, "q_adamw"): 4.10}
    arms = ["bf16", "muon", "q_muon", "full_stack_muon", "root", "q_root", "q_adamw"]
    rows, args = _summarized(mod, tmp_path, arms, val)
    by = {(r["seed"], r["arm"]): r for r in rows}
    assert by[1, "q_muon"]["optimizer_peer"] == "muon" and by[1, "q_root"]["optimizer_peer"] == "root"
    assert by[1, "full_stack_muon"]["optimizer_peer"] == "muon"
    for arm in ("bf16", "muon", "root", "q_adamw"):
        assert by[1, arm]["optimizer_peer"] is None and by[1, arm]["val_gap_vs_optimizer_pct"] is None
    assert by[1, "q_muon"]["val_gap_vs_optimizer_pct"] == pytest.approx(0.5)        # 3.819 / 3.80 - 1
    assert by[2, "q_muon"]["val_gap_vs_optimizer_pct"] == pytest.approx(0.1)        # 3.9039 / 3.90 - 1
    assert by[1, "full_stack_muon"]["val_gap_vs_optimizer_pct"] == pytest.approx(1.0)
    assert by[2, "q_root"]["val_gap_vs_optimizer_pct"] == pytest.approx(0.5)        # 4.02 / 4.00 - 1
    assert by[1, "q_muon"]["val_gap_pct"] == pytest.approx(-4.525)                  # 3.819 / 4.00 - 1
    summary = {a["arm"]: a for a in mod.aggregate(rows)}
    assert summary["q_muon"]["val_gap_vs_optimizer_pct_mean"] == pytest.approx(0.3)
    assert summary["q_muon"]["val_gap_vs_optimizer_pct_std"] == pytest.approx(0.4 / 2 ** 0.5)   # sd of 0.5, 0.1
    assert summary["q_root"]["val_gap_vs_optimizer_pct_mean"] == pytest.approx(0.25)
    assert summary["bf16"]["optimizer_peer"] is None
    md = mod.markdown_grid(mod.aggregate(rows), args, _GRID_HEADER)
    assert "+0.30% ± 0.28% vs muon" in _row(md, "q_muon")


def test_out_of_memory_beside_others_is_retried_with_fewer_at_once(tmp_path, monkeypatch, capsys):
    """A fake trainer: arm `a` fails once with PyTorch's out-of-memory message while `b` runs;
    run_arms queues `a` again, lowers the arms at once to 1 and so starts it only after `b` has
    ended; a second out-of-memory failure of an arm running alone is its own failure."""
    A = ablation_module()
    marker = tmp_path / "a_failed_once"
    fake = {"a": f"import os,sys\nif not os.path.exists({str(marker)!r}):\n"
                 f"    open({str(marker)!r},'w').close()\n"
                 "    print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB'); sys.exit(1)\n",
            "b": "import time; time.sleep(2)\n",
            "c": "print('torch.OutOfMemoryError: CUDA out of memory.'); raise SystemExit(1)\n"}
    monkeypatch.setattr(A, "train_cmd", lambda arm, args: [sys.executable, "-c", fake[arm]])

    class Args:
        jobs, iters, out, max_restarts = 2, 2, str(tmp_path / "out"), 0
    status = {}
    A.run_arms([("a", None), ("b", None)], Args, None, status)
    out = capsys.readouterr().out
    assert "a: out of GPU memory beside 1 other run(s); queued again, at most 1 at once" in out, out
    assert not status["a"].startswith("failed") and not status["b"].startswith("failed"), status
    sa, sb = (A.load_state(Args, arm)["sessions"] for arm in ("a", "b"))
    assert len(sa) == 2 and len(sb) == 1
    assert sa[1]["jobs"] == 1                                   # the retry ran alone ...
    b_end = time.mktime(time.strptime(sb[0]["start"], "%Y-%m-%d %H:%M:%S")) + sb[0]["wall_s"]
    assert time.mktime(time.strptime(sa[1]["start"], "%Y-%m-%d %H:%M:%S")) >= int(b_end) - 1   # ... after b

    status = {}
    A.run_arms([("c", None)], Args, None, status)              # alone: no retry
    assert status["c"].startswith("failed") and len(A.load_state(Args, "c")["sessions"]) == 1


def test_an_arm_stopped_by_a_cuda_error_restarts_up_to_max_restarts(tmp_path, monkeypatch, capsys):
    """--max-restarts 2 with fake trainers: `a` is stopped once by a CUDA error (printed, then
    SIGABRT, as the NCCL watchdog ends such a run) and runs again; `b` always is, so it fails
    after two restarts (three sessions); `c` fails with an error of its own, never retried."""
    A = ablation_module()
    marker = tmp_path / "a_failed_once"
    fault = ("print('torch.AcceleratorError: CUDA error: unspecified launch failure', flush=True)\n"
             "import os; os.abort()\n")
    fake = {"a": f"import os\nif not os.path.exists({str(marker)!r}):\n    open({str(marker)!r}, 'w').close()\n"
                 + "".join("    " + line + "\n" for line in fault.splitlines()),
            "b": fault,
            "c": "raise SystemExit('error: data.path: no such file')\n"}
    monkeypatch.setattr(A, "train_cmd", lambda arm, args: [sys.executable, "-c", fake[arm]])

    class Args:
        jobs, iters, out, max_restarts = 1, 2, str(tmp_path / "out"), 2
    status = {}
    A.run_arms([("a", None), ("b", None), ("c", None)], Args, None, status)
    out = capsys.readouterr().out
    assert "a: stopped by CUDA error: unspecified launch failure; restart 1 of 2, from step 0" in out, out
    assert "b: stopped by CUDA error: unspecified launch failure; restart 2 of 2" in out, out
    assert "c: stopped by" not in out and "restart 3" not in out, out
    assert {arm: len(A.load_state(Args, arm)["sessions"]) for arm in "abc"} == {"a": 2, "b": 3, "c": 1}
    assert not status["a"].startswith("failed"), status      # its second session exits 0
    assert status["b"].startswith("failed") and status["c"].startswith("failed"), status

    Args.max_restarts = 0                                      # the default: a CUDA error is final
    status = {}
    A.run_arms([("b", None)], Args, None, status)
    assert status["b"].startswith("failed") and len(A.load_state(Args, "b")["sessions"]) == 4


def test_table_names_the_hardware_that_trained_its_runs(tmp_path):
    """device_name() reads each run's run_info.json, not the machine that tabulates: one name when
    every run agrees, each name with its count (most runs first) when runs were trained on different
    machines, the torch device for a run that predates the recorded name, "?" without any."""
    import argparse

    mod = ablation_module()
    infos = {"a": {"device": "cuda:0", "device_name": "NVIDIA H200"},
             "b": {"device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3"},
             "c": {"device": "cuda:0", "device_name": "NVIDIA H200"},
             "old": {"device": "cuda:0"}}
    for name, info in infos.items():
        os.makedirs(tmp_path / name)
        (tmp_path / name / "run_info.json").write_text(json.dumps(info))
    os.makedirs(tmp_path / "no_info")
    args = argparse.Namespace(out=str(tmp_path))
    assert mod.device_name(args, ["a", "c"]) == "NVIDIA H200"
    assert mod.device_name(args, ["b", "a", "c", "no_info"]) == "NVIDIA H200 (2 runs), NVIDIA H100 80GB HBM3 (1 run)"
    assert mod.device_name(args, ["old"]) == "cuda:0"
    assert mod.device_name(args, ["no_info"]) == "?"
