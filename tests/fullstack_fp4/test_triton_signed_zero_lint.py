"""No Triton kernel negates a float with ``tl.where(c, -x, x)``.

The GPU image's triton 3.6 lowers a float's unary minus to ``0 - x``, so ``-(+0)`` is ``+0``
there, while triton 3.9's compiler and the interpreter CI runs negate the sign bit. A decode
written ``tl.where(y < 0, -m, m)`` therefore gives ``-0`` under the interpreter and ``+0`` on the
H200 for a negative value that rounds to 0, and the GPU run of the bit-exact tests fails
(found in session 15's GPU run of test_quantize_two_ways.py: four tests). Kernels flip the sign
bit instead (``triton_quantize_jit._neg_where``). The interpreter cannot show the difference,
so this test reads the kernel sources; it fails on the pattern that caused it.
"""
import re
from pathlib import Path

import fullstack_fp4

PKG = Path(fullstack_fp4.__file__).parent
# tl.where(<cond>, -name, name) with the same name on both sides
PATTERN = re.compile(r"tl\.where\([^,()]*(?:\([^()]*\))?[^,()]*,\s*-\s*([A-Za-z_]\w*)\s*,\s*\1\s*\)")


def _kernel_files():
    return sorted(p for p in PKG.rglob("triton_*.py"))


def test_pattern_is_recognised():
    bad = "    return tl.where(y < 0.0, -r, r) * s\n    z = tl.where(neg, -m, m)\n"
    good = "    return _neg_where(y < 0.0, r)\n    z = tl.where(neg, -m, n)\n"
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
    assert not hits, "use triton_quantize_jit._neg_where (sign bit), not tl.where(c, -x, x):\n" \
        + "\n".join(hits)
