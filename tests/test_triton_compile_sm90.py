"""Every Triton kernel in fullstack_fp4 compiles for sm_90 (H200) with the real compiler, no GPU.

The CPU suite runs kernels under TRITON_INTERPRET=1, which accepts code the compiler rejects
(e.g. a plain float global inside a kernel: ``NameError: Cannot access global variable``).
``tests/triton_compile_gate.py`` (see its docstring) records the launches the real host code makes
with the interpreter off and compiles each distinct one with ``triton.compile`` for
``GPUTarget("cuda", 90, 32)`` down to a cubin. It needs a fresh process (``triton.jit`` decides
interpreter vs compiler at import time), so this test runs it as a subprocess.
``FP4_COMPILE_GATE=full`` widens the all-pairs mode design to full products (minutes).
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compiler_available() -> bool:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import get_ptxas
        return os.path.exists(get_ptxas(90).path)
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.skipif(not _compiler_available(), reason="triton's NVIDIA backend / ptxas missing")
def test_all_triton_kernels_compile_for_sm90(tmp_path):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / "gate.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "triton_compile_gate.py"),
                           "--json", str(out), "--jobs", str(min(4, os.cpu_count() or 1))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    print(proc.stdout[-20000:])
    assert out.exists(), f"gate crashed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    rep = json.loads(out.read_text())
    assert not rep["scenario_error"], "host launch code raised:\n" + rep["scenario_error"]
    assert not rep["missing"], f"kernels no scenario launches: {rep['missing']}"
    fails = [r for r in rep["results"] if not r["ok"]]
    assert not fails, "sm_90 compile failures:\n\n" + "\n\n".join(
        f"{r['name']} [{r['desc']}] ({r['sig']})\n  launched by: {r['labels'][0]}\n{r['error']}"
        for r in fails)
    assert proc.returncode == 0, proc.stdout[-4000:]
