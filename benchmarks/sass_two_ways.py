"""Static SASS counts of the NVFP4 linear's two-way quantize kernel (sm_90 cubin, no GPU).

Compiles ``_quantize_two_ways_kernel`` for the three calls the linear makes (``x``: row decoded
+ column codes, nearest; ``W``: 16×16 decoded + codes; ``dY``: both ways stochastic, decoded
only — 1024 channels a program on 8 warps, ``_config(wide=True)``) as
``tests/triton_compile_gate.py`` records them, each under the register caps asked for, and
prints registers, spill bytes (stores / loads) and the instructions to the first EXIT per
thread (64 elements a thread). These are static counts, not timings (docs/perf/nvfp4.md).

``python benchmarks/sass_two_ways.py [--modes x,W,dY] [--maxnreg none,128,96] [--nibble]``;
``--nibble``: dY rounded through the nibble (``SR_DIRECT = False``) instead of straight to the
decoded value.
Run with the GPU image's triton first on PYTHONPATH to count for 3.6 (what the H200 runs).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _sass  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="x,W,dY")
    ap.add_argument("--maxnreg", default="none", help="register caps, 'none' = Triton's choice")
    ap.add_argument("--nibble", action="store_true")
    a = ap.parse_args(argv)
    gate = _sass.gate()
    import torch
    from fullstack_fp4.nvfp4.kernels import quantize_two_ways as tqd
    R, C = tqd.RowWay, tqd.ColWay
    ways = {"x": (R("nearest"), C("nearest")),
            "W": (R("nearest", (16, 16), codes=True), None),
            "dY": (R("stochastic"), C("stochastic", decoded=True, codes=False))}
    tqd.SR_DIRECT = not a.nibble
    tqd.WIDE_MAXNREG = None                       # every cap comes from --maxnreg here
    real_launch = tqd.launch
    rows = []
    for mode in a.modes.split(","):
        for cap in a.maxnreg.split(","):
            mr = None if cap == "none" else int(cap)

            def launch(fn, grid, *args, _mr=mr, **kw):
                if _mr is not None and fn.__name__ == "_quantize_two_ways_kernel":
                    kw["maxnreg"] = _mr
                return real_launch(fn, grid, *args, **kw)
            tqd.launch = launch
            del gate._LAUNCHES[:]
            row, col = ways[mode]
            m = torch.zeros(64, 1024, dtype=torch.bfloat16)
            tqd.quantize_two_ways(m, torch.zeros(2, dtype=torch.int32), row=row, col=col,
                                  seed_row=1, seed_col=2)
            (job,) = [j for j in gate.build_jobs() if j["name"].endswith("_quantize_two_ways_kernel")]
            r = _sass.count(job)
            rows.append((mode, cap, job["num_warps"], r))
            print(f"| {mode} | {cap} | {job['num_warps']} | {r['regs']} | {r['spills']} | "
                  f"{r['main']} | {r['main'] / 64:.1f} |", flush=True)
    print(f"(triton {rows[0][3]['triton'] if rows else '?'}; columns: call, maxnreg, warps, "
          "registers, spill bytes (stores, loads), SASS to the first EXIT a thread, per element)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
