"""scripts/quant_heatmap.py on a synthetic metrics.jsonl."""
import json
import math
import os
import subprocess
import sys

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
