"""fwd+bwd of the NVFP4 linear against BF16 ``F.linear`` as CUDA graphs (device time, no host
cost), at 8192 tokens × 3072 → 3072 and → 8192: ``scripts/bench_nvfp4_linear.py``'s graph
figure alone, repeated ``--reps`` times with the two arms alternating, so that one call can set
forms of the linear (another checkout on PYTHONPATH, ``FP4_TWO_WAYS_RCP``) side by side.
Each replay's L2 is flushed first (``triton.testing.do_bench``). The NVFP4 GEMMs are emulated
(decoded BF16 operands, FP32 accumulation).

Usage (GPU): ``python scripts/gpu/linear_graph_ab.py [--reps 3] [--label NAME]``.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _timing import capture_graph  # noqa: E402

from fullstack_fp4.linear import nvfp4_linear  # noqa: E402


def graph_ms(run):
    return triton.testing.do_bench(capture_graph(run).replay, warmup=25, rep=200,
                                   return_mode="median")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    import fullstack_fp4
    print(f"{a.label}: fullstack_fp4 from {os.path.dirname(fullstack_fp4.__file__)}, "
          f"FP4_TWO_WAYS_RCP={os.environ.get('FP4_TWO_WAYS_RCP', '(default)')}")
    for fout in (3072, 8192):
        torch.manual_seed(0)
        x = torch.randn(8192, 3072, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(fout, 3072, device="cuda", dtype=torch.bfloat16) / 3072 ** 0.5).requires_grad_()
        dy = torch.randn(8192, fout, device="cuda", dtype=torch.bfloat16)

        def fb(f):
            def run():
                x.grad = w.grad = None
                f(x, w).backward(dy)
            return run
        for r in range(a.reps):
            b = graph_ms(fb(F.linear))
            n = graph_ms(fb(nvfp4_linear))
            print(f"| {a.label} | 3072->{fout} | {r} | {b:.3f} | {n:.3f} | {n / b:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
