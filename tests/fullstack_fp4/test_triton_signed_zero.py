"""No Triton kernel negates a float with ``tl.where(c, -x, x)``.

The GPU image's triton 3.6 lowers a float's unary minus to ``0 - x``, so ``-(+0)`` is ``+0``
there, while triton 3.9's compiler and the interpreter CI runs negate the sign bit. A decode
written ``tl.where(y < 0, -m, m)`` therefore gives ``-0`` under the interpreter and ``+0`` on the
H200 for a negative value that rounds to 0, and the GPU run of the bit-exact tests fails (as
test_quantize_two_ways.py does on the GPU with such a decode). Kernels negate with
``nvfp4.kernels.fp4_math.neg_where`` instead (``m * -1.0``, exact, which LLVM turns into a true
``fneg``). The interpreter cannot show the difference, so these tests read the kernel sources
for the pattern, and compile ``neg_where`` with the GPU image's triton and read its LLVM IR.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fullstack_fp4
from tests.test_triton_compile_sm90 import GPU_IMAGE_TRITON, _compiler_available

PKG = Path(fullstack_fp4.__file__).parent
# tl.where(<cond>, -name, name) with the same name on both sides
PATTERN = re.compile(r"tl\.where\([^,()]*(?:\([^()]*\))?[^,()]*,"
                     r"\s*-\s*([A-Za-z_]\w*)\s*,\s*\1\s*\)")


def _kernel_files():
    """Every module with Triton kernels: ``triton_*.py`` and the NVFP4 ``kernels/`` package."""
    return sorted(set(PKG.rglob("triton_*.py")) | set(PKG.rglob("kernels/*.py")))


def test_pattern_is_recognised():
    bad = "    return tl.where(y < 0.0, -r, r) * s\n    z = tl.where(neg, -m, m)\n"
    good = "    return neg_where(y < 0.0, r)\n    z = tl.where(neg, -m, n)\n"
    assert len(PATTERN.findall(bad)) == 2
    assert PATTERN.findall(good) == []


def test_no_kernel_negates_by_unary_minus_in_a_select():
    files = _kernel_files()
    assert len(files) >= 10, files   # the glob really reaches the kernel modules
    hits = []
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.lstrip().startswith("#") and PATTERN.search(line):
                hits.append(f"{path.relative_to(PKG)}:{n}: {line.strip()}")
    assert not hits, "use fp4_math.neg_where, not tl.where(c, -x, x):\n" \
        + "\n".join(hits)


# Compiles two one-line kernels for sm_90 (no GPU needed) and prints each one's LLVM IR
# negation: ``neg_where`` and the unary minus it replaces.
_PROBE = r"""
import os, re
os.environ.pop("TRITON_INTERPRET", None)
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fullstack_fp4.nvfp4.kernels.fp4_math import neg_where

@triton.jit
def helper(x_ptr, o_ptr, B: tl.constexpr):
    i = tl.arange(0, B)
    x = tl.load(x_ptr + i)
    tl.store(o_ptr + i, neg_where(x < 0.0, tl.abs(x)))

@triton.jit
def unary_minus(x_ptr, o_ptr, B: tl.constexpr):
    i = tl.arange(0, B)
    x = tl.load(x_ptr + i)
    m = tl.abs(x)
    tl.store(o_ptr + i, tl.where(x < 0.0, -m, m))

print("triton", triton.__version__)
for fn in (helper, unary_minus):
    src = ASTSource(fn=fn, signature={"x_ptr": "*fp32", "o_ptr": "*fp32", "B": "constexpr"},
                    constexprs={"B": 128})
    ir = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["llir"]
    print(fn.__name__, "fneg" if re.search(r"= fneg float", ir) else "",
          "fsub0" if re.search(r"= fsub float 0\.0+e\+00", ir) else "")
"""


@pytest.mark.skipif(not _compiler_available(), reason="triton's NVIDIA backend / ptxas missing")
def test_neg_where_is_a_true_negation_with_the_gpu_images_triton(tmp_path):
    if not os.path.isdir(os.path.join(GPU_IMAGE_TRITON, "triton")):
        pytest.skip(f"the GPU image's triton is not installed in {GPU_IMAGE_TRITON} (make install)")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([GPU_IMAGE_TRITON, str(PKG.parent),
                                         env.get("PYTHONPATH", "")])
    probe = tmp_path / "neg_probe.py"   # triton.jit reads a kernel's source from its file
    probe.write_text(_PROBE)
    proc = subprocess.run([sys.executable, str(probe)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    assert out["triton"] == "3.6.0"
    # the pitfall is still there (else this test no longer guards anything) ...
    assert out["unary_minus"].split() == ["fsub0"], out
    # ... and the helper avoids it
    assert out["helper"].split() == ["fneg"], out
