"""Static sm_90 SASS of one recorded kernel launch (no GPU), shared by the sass_*.py scripts.

A launch recorded by ``tests/triton_compile_gate.py``'s recorder (``build_jobs()``) is compiled
for ``GPUTarget("cuda", 90, 32)`` exactly as ``JITFunction.run`` would, the cubin disassembled
with Triton's bundled ``cuobjdump -sass``, and the instructions of the main path counted (up to the
first EXIT: the div_rn / sqrt_rn slow-path subroutines sit after it). These are static counts,
not timings. Run with the GPU image's triton first on PYTHONPATH to count for 3.6.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def gate():
    """tests/triton_compile_gate.py with its recorder installed (launches recorded, not run);
    set up once, however many kernels a script counts."""
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import triton_compile_gate as g
    g._install_recorder()
    return g


def count(job: dict) -> dict:
    """Compile one ``build_jobs()`` job: main-path and total instruction counts, registers,
    stack, spill bytes (stores, loads), the 16 commonest opcodes, the listing and its SHA-1."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    g = gate()
    src = ASTSource(fn=job["fn"], signature=job["signature"], constexprs=job["constexprs"],
                    attrs=job["attrs"])
    k = triton.compile(src, target=GPUTarget(*g.TARGET), options=job["options"])
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True).stdout
        res = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True,
                             text=True).stdout
    # addresses are 4 to 6 hex digits: a kernel past 64 KiB of code has 5
    ops = re.findall(r"/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    main_path = ops[:ops.index("EXIT") + 1] if "EXIT" in ops else ops
    # a kernel with two bodies behind one uniform branch (Q-AdamW's full-program and bounded
    # paths) ends each with a predicated EXIT and an EXIT: the second body runs from the
    # second EXIT to the third
    exits = [i for i, o in enumerate(ops) if o == "EXIT"]
    second = exits[2] - exits[1] if len(exits) >= 4 else None
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    _, spills = g._regs_spills(g._ptxas_verbose(k.asm["ptx"]))
    return dict(main=len(main_path), second=second, total=len(ops),
                regs=int(regs.group(1)) if regs else None,
                stack=int(stack.group(1)) if stack else None, spills=spills,
                top=collections.Counter(o.split(".")[0] for o in main_path).most_common(16),
                sass=sass, sha1=hashlib.sha1(sass.encode()).hexdigest()[:12],
                triton=triton.__version__)
