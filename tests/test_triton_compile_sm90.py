"""Every Triton kernel in fullstack_fp4 compiles for sm_90 (H200) with the real compiler, no GPU.

The CPU suite runs kernels under TRITON_INTERPRET=1, which accepts code the compiler rejects
(e.g. a plain float global inside a kernel: ``NameError: Cannot access global variable``).
``tests/triton_compile_gate.py`` (see its docstring) records the launches the real host code makes
with the interpreter off and compiles each distinct one with ``triton.compile`` for
``GPUTarget("cuda", 90, 32)`` down to a cubin. It needs a fresh process (``triton.jit`` decides
interpreter vs compiler at import time), so this test runs it as a subprocess.
``FP4_COMPILE_GATE=full`` widens the all-pairs mode design to full products (minutes).

It runs twice: with the triton this venv has (pip's newest) and with the triton of the GPU
image (3.6.0, what the H200 runs; `make install` puts it in ``.venv/triton-gpu-image``). The two
differ in what ``triton.language`` exports: ``tl.to_tensor`` compiles with 3.9 and fails with
3.6, which otherwise only a GPU run would show.
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


GPU_IMAGE_TRITON = os.path.join(ROOT, ".venv", "triton-gpu-image")  # Makefile: GPU_TRITON

# Minutes on two cores (every kernel variant compiled twice): `make test-all` runs it, `make test`
# leaves it out.
pytestmark = pytest.mark.long


@pytest.mark.skipif(not _compiler_available(), reason="triton's NVIDIA backend / ptxas missing")
@pytest.mark.parametrize("triton_of", ["venv", "gpu_image"])
def test_all_triton_kernels_compile_for_sm90(tmp_path, triton_of):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if triton_of == "gpu_image":
        if not os.path.isdir(os.path.join(GPU_IMAGE_TRITON, "triton")):
            pytest.skip(f"the GPU image's triton is not installed in {GPU_IMAGE_TRITON} (make install does it)")
        env["PYTHONPATH"] = GPU_IMAGE_TRITON + os.pathsep + env["PYTHONPATH"]
        ver = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"], env=env,
                             capture_output=True, text=True, timeout=120).stdout.strip()
        assert ver == "3.6.0", f"{GPU_IMAGE_TRITON} holds triton {ver!r}, not the GPU image's 3.6.0"
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
