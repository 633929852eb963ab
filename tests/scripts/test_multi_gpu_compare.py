"""scripts/multi_gpu_compare.py: per-step comparison and the summary (pure python, no torch)."""
from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import multi_gpu_compare as mgc  # noqa: E402


def _metrics(d, losses: dict[int, float], val: dict[int, float] = None, junk: bool = False):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        for i, l in losses.items():
            f.write(json.dumps({"iter": i, "loss": l, "lr": 1e-3}) + "\n")
        for i, l in (val or {}).items():
            f.write(json.dumps({"iter": i, "val_loss": l}) + "\n")
        if junk:
            f.write('{"iter": 9, "lo')  # a line cut by a killed run
    return str(d)


def test_read_metrics_splits_train_val_and_skips_cut_line(tmp_path):
    d = _metrics(tmp_path / "a", {1: 5.0, 2: 4.0}, {2: 4.5}, junk=True)
    train, val = mgc.read_metrics(d)
    assert train == {1: 5.0, 2: 4.0} and val == {2: 4.5}
    assert mgc.read_metrics(str(tmp_path / "missing")) == ({}, {})


def test_compare_common_steps_max_and_mean():
    c = mgc.compare({1: 5.0, 2: 4.04, 3: 3.0}, {1: 5.0, 2: 4.0, 4: 1.0})
    assert c["steps"] == 2 and (c["first"], c["last"]) == (1, 2)
    assert math.isclose(c["max_rel_diff"], 0.01) and c["argmax_iter"] == 2
    assert math.isclose(c["mean_rel_diff"], 0.005)
    assert mgc.compare({}, {1: 1.0})["max_rel_diff"] is None
    assert math.isnan(mgc.rel_diff(float("nan"), 1.0)) and mgc.rel_diff(0.0, 0.0) == 0.0


def test_error_line_strips_torchrun_prefix(tmp_path):
    log = tmp_path / "out.txt"
    log.write_text("noise\n[rank0]: error: checkpoint x could not be read\nTraceback\n")
    assert mgc.error_line(str(log)) == "error: checkpoint x could not be read"
    assert mgc.error_line(str(tmp_path / "none")) is None


def test_summary_statuses_comparisons_bench(tmp_path):
    ref = _metrics(tmp_path / "ref", {1: 5.0, 2: 4.0, 3: 3.0, 4: 2.0}, {4: 2.5})
    tp = _metrics(tmp_path / "tp", {1: 5.0, 2: 4.002, 3: 3.0, 4: 2.0}, {4: 2.5})
    res = _metrics(tmp_path / "res", {3: 3.003, 4: 2.0})
    bad = tmp_path / "bad.txt"
    bad.write_text("[rank1]: error: optimizer layout differs\n")
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"rows": [
        {"arm": "bf16", "tp": 1, "world": 1, "step_ms": 10.0, "tokens_per_s": 1000.0, "tokens_per_s_per_gpu": 1000.0},
        {"arm": "bf16", "tp": 2, "world": 2, "step_ms": 6.0, "tokens_per_s": 1600.0, "tokens_per_s_per_gpu": 800.0}]}))
    man = tmp_path / "m.jsonl"
    recs = [
        {"name": "a_1gpu", "part": "1", "arm": "a", "layout": "1 GPU", "kind": "train", "rc": 0, "logdir": ref},
        {"name": "a_tp2", "part": "1", "arm": "a", "layout": "TP=2", "kind": "train", "rc": 0, "logdir": tp,
         "ref": "a_1gpu"},
        {"name": "a_res", "part": "2", "kind": "resume", "rc": 0, "logdir": res, "ref": "a_tp2", "ref2": "a_1gpu"},
        {"name": "q_res", "part": "2", "kind": "resume", "rc": 2, "logdir": str(tmp_path / "nolog"), "log": str(bad),
         "ref": "a_tp2"},
        {"name": "slow", "part": "4", "kind": "train", "rc": 124, "logdir": str(tmp_path / "nolog")},
        {"name": "late", "part": "5", "kind": "train", "note": "skipped: time budget"},
        {"name": "bench_tp", "part": "3", "kind": "bench", "rc": 0, "json": str(bench)},
    ]
    man.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    s = mgc.summarize(mgc.read_manifest(str(man)))
    st = {r["name"]: r["status"] for r in s["runs"]}
    assert st["a_1gpu"] == "ok" and st["q_res"] == "refused rc=2" and st["slow"] == "timeout rc=124"
    assert st["late"].startswith("skipped")
    comp = {(c["run"], c["ref"]): c for c in s["comparisons"]}
    assert set(comp) == {("a_tp2", "a_1gpu"), ("a_res", "a_tp2"), ("a_res", "a_1gpu")}
    assert math.isclose(comp[("a_tp2", "a_1gpu")]["max_rel_diff"], 0.0005)
    assert comp[("a_res", "a_tp2")]["steps"] == 2 and comp[("a_res", "a_tp2")]["first"] == 3
    assert comp[("a_tp2", "a_1gpu")]["val"]["max_rel_diff"] == 0.0
    md = mgc.to_markdown(s)
    assert "| a_tp2 | TP=2 | a_1gpu |" in md and "### a_res vs a_tp2" in md
    assert "error: optimizer layout differs" in md
    assert "0.80x the 1-GPU run" in md
    assert len(s["bench"]) == 2
    json.dumps(s)  # serialisable
    assert mgc.main(["summary", "--manifest", str(man), "--md", str(tmp_path / "s.md"),
                     "--json", str(tmp_path / "s.json")]) == 0
    assert json.load(open(tmp_path / "s.json"))["runs"][0]["name"] == "a_1gpu"


def test_summary_joins_an_earlier_calls_runs(tmp_path):
    # call 1 ran the TP=2 run but its 1-GPU reference timed out; call 2 ran the reference only
    tp = _metrics(tmp_path / "tp", {1: 5.0, 2: 4.004}, {2: 4.5})
    m1 = tmp_path / "m1.jsonl"
    m1.write_text("\n".join(json.dumps(r) for r in [
        {"name": "a_1gpu", "part": "1", "arm": "a", "layout": "1 GPU", "kind": "train", "rc": 137,
         "logdir": str(tmp_path / "nolog")},
        {"name": "a_tp2", "part": "1", "arm": "a", "layout": "TP=2", "kind": "train", "rc": 0, "logdir": tp,
         "ref": "a_1gpu"}]) + "\n")
    assert mgc.main(["summary", "--manifest", str(m1), "--json", str(tmp_path / "s1.json")]) == 0
    ref = _metrics(tmp_path / "ref", {1: 5.0, 2: 4.0}, {2: 4.5})
    m2 = tmp_path / "m2.jsonl"
    m2.write_text(json.dumps({"name": "a_1gpu", "part": "1", "arm": "a", "layout": "1 GPU", "kind": "train",
                              "rc": 0, "logdir": ref}) + "\n")
    assert mgc.main(["summary", "--manifest", str(m2), "--json", str(tmp_path / "s2.json"),
                     "--md", str(tmp_path / "s2.md"), "--earlier", str(tmp_path / "s1.json")]) == 0
    s = json.load(open(tmp_path / "s2.json"))
    rows = {r["name"]: r for r in s["runs"]}
    assert rows["a_1gpu"]["status"] == "ok" and not rows["a_1gpu"].get("from_earlier")  # this call's wins
    assert rows["a_tp2"]["from_earlier"] and rows["a_tp2"]["train"] == {"1": 5.0, "2": 4.004}
    (c,) = s["comparisons"]
    assert (c["run"], c["ref"], c["steps"]) == ("a_tp2", "a_1gpu", 2)
    assert math.isclose(c["max_rel_diff"], 0.001)
    assert "(earlier call)" in open(tmp_path / "s2.md").read()
    assert mgc.main(["summary", "--manifest", str(m2), "--earlier", str(tmp_path / "missing.json")]) == 2


def test_a_skipped_run_does_not_hide_the_earlier_run_of_that_name(tmp_path):
    # call 1 measured the reference; call 2 skipped it (MG_SKIP) and ran the TP=2 run; the summary
    # of call 2, and one rebuilt from both summaries alone, compare TP=2 with call 1's reference
    ref = _metrics(tmp_path / "ref", {1: 5.0, 2: 4.0}, {2: 4.5})
    m1 = tmp_path / "m1.jsonl"
    m1.write_text(json.dumps({"name": "a_1gpu", "part": "1", "arm": "a", "layout": "1 GPU", "kind": "train",
                              "rc": 0, "logdir": ref}) + "\n")
    assert mgc.main(["summary", "--manifest", str(m1), "--json", str(tmp_path / "s1.json")]) == 0
    tp = _metrics(tmp_path / "tp", {1: 5.0, 2: 4.008}, {2: 4.5})
    m2 = tmp_path / "m2.jsonl"
    m2.write_text("\n".join(json.dumps(r) for r in [
        {"name": "a_1gpu", "part": "1", "arm": "a", "layout": "1 GPU", "kind": "train", "note": "skipped: MG_SKIP"},
        {"name": "a_tp2", "part": "1", "arm": "a", "layout": "TP=2", "kind": "train", "rc": 0, "logdir": tp,
         "ref": "a_1gpu"}]) + "\n")
    assert mgc.main(["summary", "--manifest", str(m2), "--json", str(tmp_path / "s2.json"),
                     "--earlier", str(tmp_path / "s1.json")]) == 0
    for s in (json.load(open(tmp_path / "s2.json")),):
        rows = {r["name"]: r for r in s["runs"]}
        assert rows["a_1gpu"]["from_earlier"] and rows["a_1gpu"]["status"] == "ok"
        (c,) = s["comparisons"]
        assert (c["run"], c["ref"], c["steps"]) == ("a_tp2", "a_1gpu", 2) and math.isclose(c["max_rel_diff"], 0.002)
    # rebuilt from the two summaries only (empty manifest): call 2's summary first; its skipped
    # row must not hide call 1's measured one
    assert mgc.main(["summary", "--manifest", str(tmp_path / "none.jsonl"), "--json", str(tmp_path / "s3.json"),
                     "--earlier", str(tmp_path / "s2.json"), "--earlier", str(tmp_path / "s1.json")]) == 0
    s3 = json.load(open(tmp_path / "s3.json"))
    assert [r["name"] for r in s3["runs"]].count("a_1gpu") == 1
    (c,) = s3["comparisons"]
    assert (c["run"], c["ref"], c["steps"]) == ("a_tp2", "a_1gpu", 2)
