"""benchmarks/compare_compile_gate.py: the variants whose registers or spills differ (hand-built
reports)."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import compare_compile_gate as cmp  # noqa: E402


def _row(name, desc, regs, st=0, ld=0, warps=4):
    return dict(name=f"pkg.mod.{name}", desc=desc, sig="x:*fp32", num_warps=warps, num_stages=3,
                spec1=[], labels=["a"], regs=regs, spill_stores=st, spill_loads=ld)


def test_reports_changed_variants_only(tmp_path, capsys):
    old = [_row("k", "D=64", 168), _row("k", "D=128", 200), _row("k", "D=128", 90, warps=8),
           _row("gone", "", 10)]
    new = [_row("k", "D=64", 168, 4, 4), _row("k", "D=128", 200), _row("k", "D=128", 96, warps=8),
           _row("added", "", 10)]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"results": old}))
    b.write_text(json.dumps({"results": new}))
    assert cmp.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out.splitlines()
    # same kernel and constexprs, told apart by their warps: each compared with its own
    assert out[:2] == ["k [D=64]: regs/spills (168, 0, 0) -> (168, 4, 4)",
                       "k [D=128]: regs/spills (90, 0, 0) -> (96, 0, 0)"]
    assert out[2] == "4 variants, 2 differ; 1 only in the second, 1 only in the first"


def test_unreadable_report_is_one_clear_error(tmp_path, capsys):
    assert cmp.main([str(tmp_path / "missing.json"), str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.startswith("error: cannot read the compile-gate reports")
