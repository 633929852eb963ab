"""Static SASS count of the fused Q-AdamW kernel (sm_90 cubin, no GPU): PERF.md's yardstick.

Compiles the default launch (``triton_step.launch`` on a 4096-entry FP32 parameter: HAS_U=False,
CPP_C=1, FAST_DEC, divisibility-16 args, maxnreg = ``triton_step.MAXNREG``) exactly as
``tests/triton_compile_gate.py`` records it, disassembles the cubin with the wheel's
``cuobjdump -sass`` and counts the instructions of the main path (up to the first EXIT: the
div_rn / sqrt_rn slow-path subroutines sit after it) = per thread = per 16 entries.
These are static counts, not timings.

``python scripts/sass_q_adamw.py [--sass PATH] [--model-out] [--rand]``; run with the GPU
image's triton first on PYTHONPATH to count for 3.6.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", default=None, help="write the SASS listing here")
    ap.add_argument("--model-out", action="store_true")
    ap.add_argument("--rand", action="store_true", help="the HAS_U variant (uniforms given)")
    ap.add_argument("--u8", action="store_true")
    ap.add_argument("--rounds", type=int, default=10)
    a = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import torch
    import triton
    import triton_compile_gate as gate
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    gate._install_recorder()
    from fullstack_fp4.optim.q_adamw.codecs import padded_numel
    from fullstack_fp4.optim.q_adamw.optimizer import _hyper, _init_state, _kernel_views
    from fullstack_fp4.optim.q_adamw.triton_step import launch

    n = 4096
    launch(torch.randn(n), torch.randn(n), _kernel_views(_init_state(n, "cpu")), n,
           padded_numel(n), seed=11, rand=torch.rand(n) if a.rand else None,
           model_out=torch.empty(n, dtype=torch.bfloat16) if a.model_out else None,
           u8=a.u8, rounds=a.rounds, **_hyper(1e-3, 0.9, 0.95, 1e-8, 0.1, 3, "cpu"))
    (job,) = gate.build_jobs()
    src = ASTSource(fn=job["fn"], signature=job["signature"], constexprs=job["constexprs"],
                    attrs=job["attrs"])
    k = triton.compile(src, target=GPUTarget(*gate.TARGET), options=job["options"])
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True).stdout
        res = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True,
                             text=True).stdout
    if a.sass:
        with open(a.sass, "w") as f:
            f.write(sass)
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    main_path = ops[:ops.index("EXIT") + 1] if "EXIT" in ops else ops
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    log = gate._ptxas_verbose(k.asm["ptx"])
    _, spills = gate._regs_spills(log)
    top = collections.Counter(o.split(".")[0] for o in main_path).most_common(16)
    print(f"triton {triton.__version__}: SASS main path {len(main_path)} per 16 entries "
          f"({len(main_path) / 16:.1f}/entry), total {len(ops)}, regs "
          f"{regs.group(1) if regs else '?'}, stack {stack.group(1) if stack else '?'}, "
          f"spills {spills}, sha1 {hashlib.sha1(sass.encode()).hexdigest()[:12]}")
    print("  " + " ".join(f"{o}:{c}" for o, c in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
