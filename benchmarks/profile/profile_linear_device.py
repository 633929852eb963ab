"""Where the NVFP4 linear's fwd+bwd spends *device* time: a per-kernel table from torch.profiler.

For 8192 tokens × 3072 → 3072 and → 8192 it runs ``ITERS`` fwd+bwd of ``nvfp4_linear`` (the GEMM
backend in use, ``gemm.gemm_backend()``) and of BF16 ``F.linear`` under torch.profiler and prints
each CUDA kernel's device time per fwd+bwd, largest first, with the sum. Against the CUDA-graph
time of ``benchmarks/bench_nvfp4_linear.py`` the sum says which kernels a faster linear must cut.
(The NVFP4 GEMMs are emulated on the H200: BF16 tensor cores on decoded operands.)

Usage (GPU): ``python benchmarks/profile/profile_linear_device.py``.
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from fullstack_fp4.linear import nvfp4_linear  # noqa: E402
from fullstack_fp4.nvfp4.gemm import gemm_backend  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from profile_q_attn import kernel_table  # noqa: E402


def main():
    print("GEMM backend:", gemm_backend())
    for fout in (3072, 8192):
        torch.manual_seed(0)
        x = torch.randn(8192, 3072, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(fout, 3072, device="cuda", dtype=torch.bfloat16) / 3072 ** 0.5).requires_grad_()
        dy = torch.randn(8192, fout, device="cuda", dtype=torch.bfloat16)
        for name, f in (("nvfp4_linear", nvfp4_linear), ("BF16 F.linear", F.linear)):
            def run():
                x.grad = w.grad = None
                f(x, w).backward(dy)
            rows = kernel_table(run)
            total = sum(t for _, t, _ in rows)
            print(f"\n8192x3072->{fout}, {name}: kernels per fwd+bwd, sum {total:.3f} ms")
            print("| kernel | launches | ms | share |")
            print("| --- | ---: | ---: | ---: |")
            for n, t, c in rows:
                print(f"| {n[:90]} | {c} | {t:.4f} | {t / total:.1%} |")


if __name__ == "__main__":
    main()
