"""Where the NVFP4 linear's quantize passes and Q-Attn's backward lose time on the H200.

Part 1 (CUDA events): ``_quantize_two_ways_kernel`` and ``_amax_two_ways_kernel`` at the
4-block 3b model's shapes (8192 tokens; x [T, 3072] and [T, 8192]; dY [T, 3072/5120/16384];
W 3072×3072 and 16384×3072 with 16×16 tiles), each mode the linear uses plus variants that
leave one way out, so the time of each way is a difference. GB/s = bytes read + written over
the kernel time, beside a device-to-device copy of the same input (the ceiling).

Part 2 (``--ncu-target``): one launch of each of those kernels and of Q-Attn's backward
kernels at 2×24×4096×128 (8 KV heads), for ``ncu -k regex:... --launch-skip`` runs: the
calling shell script picks the sections (speed of light, occupancy, warp stall reasons).

Usage (GPU): ``python scripts/gpu/diag_two_ways.py`` (events table) or
``ncu ... python scripts/gpu/diag_two_ways.py --ncu-target`` (one launch each, after warm-up);
``--ncu-linear``: the 8 operand launches of one linear fwd+bwd at 8192 × 3072 → 3072, twice.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _timing import median_ms  # noqa: E402
from fullstack_fp4.nvfp4 import triton_quantize_decode as tqd  # noqa: E402

T = 8192


def modes():
    """(label, tensor shape, row way, col way, bytes written per element) of each call."""
    R, C = tqd.RowWay, tqd.ColWay
    codes = 0.5 + 1 / 16          # packed codes + one E4M3 scale per 16
    return [
        ("x fwd: row dec + col codes", (T, 3072), R("nearest"), C("nearest"), 2 + codes),
        ("x fwd: row dec only", (T, 3072), R("nearest"), None, 2),
        ("x fwd: col codes only", (T, 3072), None, C("nearest"), codes),
        ("x fwd FC2: row dec + col codes", (T, 8192), R("nearest"), C("nearest"), 2 + codes),
        ("dY bwd: row dec SR + col dec SR", (T, 16384), R("stochastic"),
         C("stochastic", decoded=True, codes=False), 4),
        ("dY bwd: row dec SR only", (T, 16384), R("stochastic"), None, 2),
        ("dY bwd: col dec SR only", (T, 16384), None, C("stochastic", decoded=True, codes=False), 2),
        ("dY bwd: row+col nearest (no Philox)", (T, 16384), R("nearest"),
         C("nearest", decoded=True, codes=False), 4),
        ("dY bwd QKV: row dec SR + col dec SR", (T, 5120), R("stochastic"),
         C("stochastic", decoded=True, codes=False), 4),
        ("W 16x16: dec + codes", (3072, 3072), R("nearest", (16, 16), codes=True), None, 2 + codes),
        ("W FC1 16x16: dec + codes", (16384, 3072), R("nearest", (16, 16), codes=True), None,
         2 + codes),
    ]


def call(m, obs, row, col):
    seed_r = 1 if row is not None and row.rounding == "stochastic" else None
    seed_c = 2 if col is not None and col.rounding == "stochastic" else None
    return tqd.quantize_two_ways(m, obs, row=row, col=col, seed_row=seed_r, seed_col=seed_c)


def events_table():
    print("| call | shape | quantize ms | GB/s | amax ms | copy ms (same input) | quantize / copy |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for label, shape, row, col, wbytes in modes():
        torch.manual_seed(0)
        m = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        obs = tqd.amax_two_ways(m, row=row is not None, col=col is not None)
        t_q = median_ms(lambda: call(m, obs, row, col), iters=30)
        t_a = median_ms(lambda: tqd.amax_two_ways(m, row=row is not None, col=col is not None),
                        iters=30)
        dst = torch.empty_like(m)
        t_c = median_ms(lambda: dst.copy_(m), iters=30)
        gbs = m.numel() * (2 + wbytes) / t_q / 1e6
        print(f"| {label} | {shape[0]}x{shape[1]} | {t_q:.3f} | {gbs:.0f} | {t_a:.3f} | "
              f"{t_c:.3f} | {t_q / t_c:.2f} |")


def ncu_target():
    """One launch of each kernel after a warm-up (compile), for ncu's --launch-skip."""
    from fullstack_fp4.attention import q_attention
    torch.manual_seed(0)
    for label, shape, row, col, _ in modes():
        if "only" in label or "no Philox" in label:
            continue
        m = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        obs = tqd.amax_two_ways(m, row=row is not None, col=col is not None)
        call(m, obs, row, col)
    b, h, hkv, s, d = 2, 24, 8, 4096, 128
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
            for _ in range(2))
    q_attention(q, k, v, causal=True).backward(torch.randn(b, h, s, d, device="cuda",
                                                           dtype=torch.bfloat16))
    torch.cuda.synchronize()


def ncu_linear():
    """The operand kernels of one NVFP4 linear fwd+bwd at 8192 tokens × 3072 → 3072, in the
    linear's order, each launched once: amax x, x's two ways, amax W, W's, amax dY, dY's, then
    the decodes of the two saved operands (W's 16×16 codes, RHT(xᵀ)'s codes): 8 launches."""
    from fullstack_fp4.nvfp4.triton_dequantize import decode_bf16_triton
    R, C = tqd.RowWay, tqd.ColWay
    torch.manual_seed(0)
    x, w, dy = (torch.randn(s, device="cuda", dtype=torch.bfloat16)
                for s in ((T, 3072), (3072, 3072), (T, 3072)))
    qx = call(x, tqd.amax_two_ways(x), R("nearest"), C("nearest"))
    qw = call(w, tqd.amax_two_ways(w, col=False), R("nearest", (16, 16), codes=True), None)
    call(dy, tqd.amax_two_ways(dy), R("stochastic"), C("stochastic", decoded=True, codes=False))
    decode_bf16_triton(qw.row_q)
    decode_bf16_triton(qx.col_q)
    torch.cuda.synchronize()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ncu-target", action="store_true")
    ap.add_argument("--ncu-linear", action="store_true")
    ap.add_argument("--before", action="store_true",
                    help="x's call one token block a program (the form before session 24)")
    a = ap.parse_args()
    if a.before:
        tqd.COL_CODES_TBS = 1
    if a.ncu_linear:
        ncu_linear()   # the first pass compiles; ncu skips its 8 launches
        ncu_linear()
    elif a.ncu_target:
        ncu_target()   # first pass compiles; ncu skips the first launch of each kernel
        ncu_target()
    else:
        events_table()
