#!/usr/bin/env python3
"""A few seconds on the GPU before a long call: the NVFP4 quantize kernels against the CPU
reference, bit for bit (codes, block scales, tensor scale), for every mode the recipes use,
and the kernels' in-kernel stochastic rounding (the tiled quantize and the fused two-ways
kernel, row and column ways) against the reference fed ``sr_stream.sr_uniforms``.
Prints one line per case and exits 1 on any mismatch (the caller decides whether to go on).

    python benchmarks/profile/check_kernels_exact.py
"""
from __future__ import annotations

import sys

import torch

from fullstack_fp4.nvfp4.hadamard import DEFAULT_SIGNS, hadamard16
from fullstack_fp4.nvfp4.reference import quantize_reference
from fullstack_fp4.nvfp4.sr_stream import sr_uniforms
from fullstack_fp4.nvfp4.kernels.quantize import quantize_triton
from fullstack_fp4.nvfp4.kernels import quantize_two_ways as tqd


def _same(a, b) -> bool:
    return (torch.equal(a.data.cpu(), b.data.cpu())
            and torch.equal(a.block_scale.cpu().view(torch.uint8), b.block_scale.cpu().view(torch.uint8))
            and torch.equal(a.tensor_scale.cpu().float(), b.tensor_scale.cpu().float()))


def _check_in_kernel_sr(x: torch.Tensor, dev: str) -> int:
    """In-kernel Philox draws: quantize_triton(seed) and quantize_two_ways (dY's row and column
    ways) against the reference with the PyTorch stream's uniforms. Returns the mismatches."""
    rows, k = x.shape
    xt = hadamard16(torch.nn.functional.pad(x.float(), (0, 0, 0, (-rows) % 16)).t(), DEFAULT_SIGNS)
    ref_row = quantize_reference(x, rounding="stochastic", rand=sr_uniforms(x.shape, 1234))
    ref_col = quantize_reference(xt, rounding="stochastic", rand=sr_uniforms(xt.shape, 98765))
    xd = x.to(dev)
    two = tqd.quantize_two_ways(xd, tqd.amax_two_ways(xd), row=tqd.RowWay("stochastic", codes=True),
                                col=tqd.ColWay("stochastic", decoded=True, codes=True),
                                seed_row=1234, seed_col=98765)
    results = {"tiled SR, in-kernel Philox": _same(quantize_triton(xd, rounding="stochastic", seed=1234,
                                                                   check_finite=False), ref_row),
               "two-ways row SR, in-kernel Philox": _same(two.row_q, ref_row),
               "two-ways col SR, in-kernel Philox": _same(two.col_q, ref_col)}
    for name, ok in results.items():
        print(f"{'ok      ' if ok else 'MISMATCH'} {rows}x{k} {name}")
    return sum(not ok for ok in results.values())


def main() -> int:
    # on a machine without a GPU: TRITON_INTERPRET=1, small shapes only (a self-test of this script)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = ((64, 256), (1000, 4096), (4096, 3072)) if dev == "cuda" else ((32, 64),)
    g = torch.Generator().manual_seed(0)
    bad = 0
    for rows, k in shapes:
        x = (torch.randn(rows, k, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))).bfloat16()
        x[0, :16] = 0  # a zero block
        x[1, :16] = 1e-30  # tiny values: subnormal scales
        u = torch.rand(rows, k, generator=g)
        cases = {
            "1x16 nearest": (dict(), dict(), x),
            "16x16 nearest": (dict(tile=(16, 16)), dict(tile=(16, 16)), x),
            "1x16 stochastic": (dict(rounding="stochastic", rand=u.to(dev)),
                                dict(rounding="stochastic", rand=u), x),
            "1x16 4over6": (dict(scale_rule="4over6"), dict(scale_rule="4over6"), x),
            "1x16 RHT nearest": (dict(rht_signs=DEFAULT_SIGNS), dict(), hadamard16(x, DEFAULT_SIGNS)),
        }
        if rows % 16:
            cases.pop("16x16 nearest")
        for name, (kw_gpu, kw_ref, x_ref) in cases.items():
            try:
                got = quantize_triton(x.to(dev), check_finite=False, **kw_gpu)
                ok = _same(got, quantize_reference(x_ref, **kw_ref))
            except Exception as e:  # report and go on: this is a pre-flight check
                ok = False
                print(f"  {rows}x{k} {name}: {type(e).__name__}: {e}")
            bad += not ok
            print(f"{'ok      ' if ok else 'MISMATCH'} {rows}x{k} {name}")
        bad += _check_in_kernel_sr(x, dev)
    print("kernels exact" if not bad else f"{bad} case(s) differ from the reference")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
