"""scripts/quant_heatmap.py on a synthetic metrics.jsonl."""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import quant_heatmap  # noqa: E402


def _write(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_matrix_equals_records_and_png_written(tmp_path):
    mods = ["decoder.layers.0.mlp.linear_fc1", "decoder.layers.1.self_attention.linear_qkv"]
    recs, expect = [], {}
    for it in (2, 4, 6):
        rec = {"time": 0.0, "iter": it}
        for i, m in enumerate(mods):
            for j, t in enumerate(("x", "w", "dy")):
                if it == 6 and i == 1:
                    continue  # switched to BF16: no stats any more
                v = 0.01 * it + 0.1 * i + 0.001 * j
                rec[f"quant/{m}/{t}/rel_err"] = v
                expect[(f"{m}/{t}", it)] = v
        recs.append({"iter": it, "loss": 5.0})  # ordinary train records are ignored
        recs.append(rec)
    p = tmp_path / "metrics.jsonl"
    _write(p, recs)
    rows, iters, matrix = quant_heatmap.quant_matrix(str(p))
    assert iters == [2, 4, 6]
    assert rows == sorted(f"{m}/{t}" for m in mods for t in ("x", "w", "dy"))
    for i, r in enumerate(rows):
        for j, it in enumerate(iters):
            if (r, it) in expect:
                assert matrix[i][j] == expect[(r, it)]
            else:
                assert math.isnan(matrix[i][j])
    rows_w, _, m_w = quant_heatmap.quant_matrix(str(p), tensor="w")
    assert rows_w == [f"{m}/w" for m in mods] and m_w[0][0] == expect[(f"{mods[0]}/w", 2)]
    out = tmp_path / "h.png"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "quant_heatmap.py"), str(p), "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_quant_records_is_a_clear_error(tmp_path):
    p = tmp_path / "metrics.jsonl"
    _write(p, [{"iter": 1, "loss": 5.0}])
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "quant_heatmap.py"), str(p),
                        "-o", str(tmp_path / "h.png")], capture_output=True, text=True)
    assert r.returncode == 2 and "no quant/" in r.stderr and "quant_stats_interval" in r.stderr
    assert not (tmp_path / "h.png").exists()


@pytest.mark.long
def test_per_recipe_names_render_in_panels(tmp_path):
    # one record per telemetry interval with every per-recipe name of docs/telemetry.md
    lin, attn, opt = "decoder.layers.{}.mlp.linear_fc1", "decoder.layers.{}.self_attention.core_attention", \
        "optimizer/decoder.layers.{}.mlp.linear_fc1.weight"
    names = {}
    for i in range(11):  # 11 layers: natural order puts layers.10 last
        for t in ("x", "dy", "wgrad_x", "wgrad_dy", "w_res"):
            names[f"quant/{lin.format(i)}/{t}/rel_err"] = 0.1 + 0.001 * i
        names[f"quant/{lin.format(i)}/lora_energy/frac"] = 0.3
        for t in ("s", "ds"):
            names[f"quant/{attn.format(i)}/{t}/rel_err"] = 0.13
        for t in ("m", "v", "update"):
            names[f"quant/{opt.format(i)}/{t}/rel_err"] = 0.2
        names[f"quant/{opt.format(i)}/v_clamped/frac"] = 0.05
    names[f"quant/{opt.format(3)}/ns_step/rel_err"] = 0.02
    names[f"quant/{opt.format(3)}/ns_orth/rel_err"] = 0.25
    p = tmp_path / "metrics.jsonl"
    _write(p, [{"iter": it, **names} for it in (10, 20)])
    rows, iters, matrix = quant_heatmap.quant_matrix(str(p))
    assert len(rows) == len(names) and iters == [10, 20]
    lin_x = [r for r in rows if r.endswith("/x")]
    assert lin_x[-1] == f"{lin.format(10)}/x" and lin_x[2] == f"{lin.format(2)}/x"   # natural order
    got = {t: len(r) for t, _, r, _ in quant_heatmap.panels(rows, matrix)}
    assert got == {quant_heatmap.FAMILIES[0][0]: 55, quant_heatmap.FAMILIES[1][0]: 11,
                   quant_heatmap.FAMILIES[2][0]: 22, quant_heatmap.FAMILIES[3][0]: 33,
                   quant_heatmap.FAMILIES[4][0]: 11, quant_heatmap.FAMILIES[5][0]: 2}
    i = rows.index(f"{opt.format(3)}/v_clamped")
    assert matrix[i] == [0.05, 0.05]
    out = tmp_path / "h.png"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "quant_heatmap.py"), str(p), "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "6 panel(s)" in r.stdout, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows_e, _, _ = quant_heatmap.quant_matrix(str(p), tensor="lora_energy")
    assert rows_e == [f"{lin.format(i)}/lora_energy" for i in range(11)]
