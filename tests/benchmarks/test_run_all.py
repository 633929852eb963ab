"""benchmarks/run_all.py on the CPU: what it lists, the curated results it must match, its converters.

The converters are checked on trimmed copies of real recorded outputs (run_all_fixtures/: the
NVFP4 linear bench of 2026-12-04, the 4-block 3b table and the ablation of 2026-12-02, the
Q-AdamW bench of 2026-12-03, the Q-Attn bench and profile of 2026-12-01, the quantize bench of
2026-12-02); each expected value is recomputed here from the fixture's raw fields by hand.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RUN_ALL = os.path.join(REPO, "benchmarks", "run_all.py")
RESULTS = os.path.join(REPO, "benchmarks", "results")
FIX = os.path.join(HERE, "run_all_fixtures")
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import run_all  # noqa: E402

SCHEMA = ["table", "title", "hardware", "software", "date", "commit", "command", "rows"]
SOFTWARE = ["torch", "triton", "cuda", "megatron_core", "python"]


def fixture(*names):
    return {n: json.load(open(os.path.join(FIX, n))) for n in names}


def run(*args):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, RUN_ALL, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_list_names_every_group_and_table():
    p = run("--list")
    assert p.returncode == 0, p.stderr
    listed = {}
    for line in p.stdout.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        listed[cells[2]] = cells[0].split(" ")[0]
    assert listed == {t.name: t.group for t in run_all.TABLES}
    assert set(listed.values()) == set(run_all.GROUPS) == set(run_all.ESTIMATE_MIN)
    # every group but multi_gpu fits one 10-minute call, by its estimate and by its scripts' limits
    for g, tables in run_all.GROUPS.items():
        assert run_all.ESTIMATE_MIN[g] < 10
        assert sum(s.timeout_s for t in tables for s in t.steps) <= 600, g


def test_every_table_has_a_curated_json_and_every_file_a_table():
    files = sorted(os.listdir(RESULTS))
    assert len(files) <= 40
    names = {t.name for t in run_all.TABLES}
    jsons = {f[:-5] for f in files if f.endswith(".json")}
    pngs = {f[:-4] for f in files if f.endswith(".png")}
    assert jsons == names
    assert pngs <= names and len(jsons) + len(pngs) == len(files)
    for name in names:
        doc = json.load(open(os.path.join(RESULTS, name + ".json")))
        t = run_all.BY_NAME[name]
        assert list(doc) == SCHEMA, name
        assert list(doc["software"]) == SOFTWARE, name
        assert (doc["table"], doc["title"], doc["command"]) == (name, t.title, t.command())
        assert len(doc["date"]) == 10 and doc["date"][4] == doc["date"][7] == "-"
        assert doc["rows"] and all(isinstance(r, dict) for r in doc["rows"])


def test_without_cuda_one_error_line_and_exit_2(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    p = run("--out", str(tmp_path), "--group", "kernels")
    assert p.returncode == 2
    lines = (p.stdout + p.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    p = run("--out", str(tmp_path), "--group", "no_such_group")
    assert p.returncode == 2 and p.stdout.startswith("error: unknown group no_such_group")


def test_summary_composes_the_curated_headline_and_refuses_missing_inputs(tmp_path):
    import shutil
    for name in ("blocks_3b", "ablation"):
        shutil.copy(os.path.join(RESULTS, name + ".json"), tmp_path)
    p = run("--group", "summary", "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    made = json.load(open(tmp_path / "headline.json"))
    curated = json.load(open(os.path.join(RESULTS, "headline.json")))
    assert made["rows"] == curated["rows"] and made["commit"] == curated["commit"]
    p = run("--group", "summary", "--out", str(tmp_path / "empty"))
    assert p.returncode == 2 and p.stdout.startswith("error: ") and len(p.stdout.splitlines()) == 1


def test_linear_rows():
    raw = fixture("bench_nvfp4_linear.json")
    rows = run_all.conv_nvfp4_linear(raw)
    assert [r["shape"] for r in rows] == ["8192x3072->3072", "8192x3072->8192"]
    r = rows[0]
    # recorded: BF16 0.6510720 / NVFP4 1.4603680 ms eager, 0.6490560 / 0.8088000 ms as a graph
    assert (r["bf16_eager_ms"], r["nvfp4_eager_ms"], r["eager_ratio"]) == (0.651, 1.46, round(1.460368 / 0.651072, 2))
    assert (r["bf16_graph_ms"], r["nvfp4_graph_ms"], r["graph_ratio"]) == (0.649, 0.809, 1.25)


def test_blocks_rows_are_relative_to_the_bf16_arm_of_the_same_run():
    rows = {r["arm"]: r for r in run_all.conv_blocks(fixture("bench_blocks.json"))}
    raw = {r["arm"]: r for r in fixture("bench_blocks.json")["bench_blocks.json"]["rows"]}
    assert rows["bf16"]["step_vs_bf16"] == 1.0 and rows["bf16"]["opt_phase_mem_vs_bf16_pct"] == 0.0
    fs, b = raw["full_stack"], raw["bf16"]
    assert rows["full_stack"]["step_vs_bf16"] == round(fs["step_ms"] / b["step_ms"], 2) == 1.35
    assert rows["q_adamw"]["opt_phase_mem_vs_bf16_pct"] == -36.2
    assert rows["full_stack"]["mfu_989_pct"] == 30.0 and rows["full_stack"]["tokens_per_s"] == 87872
    # the headline joins the same arm's ablation row; muon-like arms without one keep None
    abl = run_all.conv_ablation(fixture("ablation.json"))
    head = {r["arm"]: r for r in run_all.conv_headline(
        {"blocks_3b.json": {"rows": list(rows.values())}, "ablation.json": {"rows": abl}})}
    assert head["full_stack"] == {"arm": "full_stack", "step_ms": 93.2, "step_vs_bf16": 1.35,
                                  "opt_phase_mem_vs_bf16_pct": -35.5, "val_loss": 3.9378, "val_gap_pct": 0.39}
    assert head["root"]["step_ms"] is None and head["root"]["val_gap_pct"] == 6.67


def test_ablation_rows():
    rows = {r["arm"]: r for r in run_all.conv_ablation(fixture("ablation.json"))}
    assert list(rows) == ["bf16", "q_adamw", "root", "full_stack"]
    bf16 = 3.9225383202234902
    assert rows["full_stack"]["val_loss"] == 3.9378
    assert rows["full_stack"]["val_gap_pct"] == round(100 * (3.9377987384796143 / bf16 - 1), 2) == 0.39
    assert rows["bf16"]["wall_min"] == round(71.04354429244995 / 60, 1)
    assert rows["q_adamw"]["tokens"] == 300 * 32768


def test_q_adamw_rows_are_relative_to_torch_fused_and_nan_is_null():
    rows = run_all.conv_q_adamw_step(fixture("bench_q_adamw.json"))
    assert [r["optimizer"] for r in rows][1:] == ["QAdamW (fused Triton)", "torch AdamW(fused=True)"]
    assert rows[0]["state_bytes_per_param"] is None        # NaN in the bench's JSON
    q = rows[1]
    assert (q["ms_per_step"], q["state_bytes_per_param"]) == (6.3, 1.164)
    assert q["x_torch_fused"] == round(6.300928115844727 / 8.48633623123169, 2) == 0.74
    assert rows[2]["x_torch_fused"] == 1.0
    json.dumps(rows, allow_nan=False)


def test_q_attn_rows_sum_the_profiled_kernels():
    raw = fixture("q_attn_bench.json", "q_attn_profile.json")
    (r,) = run_all.conv_q_attn(raw)
    prof = raw["q_attn_profile.json"]["1x24x4096x128"]
    q = sum(ms for _, ms, _ in prof["kernels"])
    s = sum(ms for _, ms, _ in prof["sdpa_kernels"])
    assert (r["q_attn_kernels_ms"], r["sdpa_kernels_ms"]) == (round(q, 3), round(s, 3)) == (2.224, 0.839)
    assert r["device_ratio"] == 2.65
    assert (r["sdpa_saved_mib"], r["q_attn_saved_mib"]) == (96.4, 75.4)     # 101056528 and 79036608 bytes


def test_quantize_rows_keep_the_default_kernels_and_the_peers():
    rows = run_all.conv_nvfp4_quantize(fixture("bench_nvfp4_quantize.json"))
    assert [(r["kernel"], r["timing"]) for r in rows] == [
        ("device-to-device copy (peer)", "graph"), ("1x16 nearest, amax pass", "graph"),
        ("1x16 nearest, amax pass", "eager"), ("torchao NVFP4Tensor.to_nvfp4", "eager")]   # no legacy row
    assert rows[0]["us"] == 67.5 and rows[1]["us"] == 92.5
    assert rows[1]["pct_of_copy"] == round(100 * 0.8321987665389666, 1) == 83.2


def test_document_has_the_schema():
    t = run_all.BY_NAME["nvfp4_linear"]
    doc = run_all.document(t, [{"a": 1}], "NVIDIA H200", {k: None for k in SOFTWARE}, None)
    assert list(doc) == SCHEMA and doc["command"] == "python benchmarks/bench_nvfp4_linear.py"
    assert doc["commit"] is None and len(doc["date"]) == 10


def test_run_table_runs_each_script_with_out_and_reports_failures(tmp_path):
    script = tmp_path / "fake_bench.py"
    script.write_text("import json, os, sys\n"
                      "if sys.argv[1] == 'fail': sys.exit(3)\n"
                      "if sys.argv[1] == 'hang': import time; time.sleep(30)\n"
                      "json.dump({'rows': [{'a': 1.5}], 'argv': sys.argv[1:]},"
                      " open(os.path.join(os.environ['OUT'], 'fake.json'), 'w'))\n")
    meta = {"gpu": "NVIDIA H200", "software": {k: None for k in SOFTWARE}, "commit": "abc"}

    def table(arg, timeout=60):
        return run_all.Table("fake", "g", "a fake table", (run_all.Step((str(script), arg), "fake.json", timeout),),
                             lambda raw: [dict(r, argv=raw["fake.json"]["argv"]) for r in raw["fake.json"]["rows"]])

    out = tmp_path / "out"
    out.mkdir()
    assert run_all.run_table(table("ok"), str(out), meta) is None
    doc = json.load(open(out / "fake.json"))
    assert list(doc) == SCHEMA and doc["rows"] == [{"a": 1.5, "argv": ["ok"]}]
    assert doc["hardware"] == "NVIDIA H200" and doc["commit"] == "abc"
    assert os.path.isfile(out / "raw" / "fake" / "fake_bench" / "fake.json")
    err = run_all.run_table(table("fail"), str(out), meta)
    assert "exited 3" in err and "run.log" in err
    err = run_all.run_table(table("hang", timeout=2), str(out), meta)
    assert "ran past 2 s" in err
