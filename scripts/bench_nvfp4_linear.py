"""NVFP4 linear fwd+bwd vs BF16 ``F.linear`` fwd+bwd on one GPU (8192 tokens × 3072 → 3072 / 8192).

    python scripts/bench_nvfp4_linear.py        # prints a markdown table last
    OUT=/dir python scripts/bench_nvfp4_linear.py   # also writes $OUT/bench_nvfp4_linear.json

1. Correctness first (GPU vs the reference linear on CPU, 512 × 256 → 384): the forward output
   and dX/dW with stochastic rounding replaced by nothing random (dY's SR draws differ between
   the Philox kernel and the CPU generator, so dX/dW are compared by relative error against the
   FP64 unquantized gradient, and the forward bit for bit up to GEMM accumulation order).
   Quantized operands (codes, scales) are compared bit for bit: x, W (16×16), RHT(xᵀ).
2. Median CUDA-event time (``triton.testing.do_bench``, median) of fwd+bwd (y = f(x, W);
   y.backward(dY)) for BF16 F.linear and for nvfp4_linear; plus a breakdown of the NVFP4 pieces.
Target (issue 3): NVFP4 ≤ 1.3× BF16.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton.testing  # noqa: E402

from fullstack_fp4.linear import nvfp4_linear, quantize_wgrad_operand  # noqa: E402
from fullstack_fp4.nvfp4 import quantize  # noqa: E402
from fullstack_fp4.nvfp4.gemm import decode_to_bf16, nvfp4_matmul  # noqa: E402

T = 8192
SHAPES = [(3072, 3072), (3072, 8192)]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def same_q(a, b):
    return (torch.equal(a.data.cpu(), b.data.cpu())
            and torch.equal(a.block_scale.cpu().view(torch.uint8), b.block_scale.cpu().view(torch.uint8))
            and int(a.tensor_scale.cpu().view(torch.int32)) == int(b.tensor_scale.cpu().view(torch.int32)))


def rel(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


def correctness():
    g = torch.Generator().manual_seed(0)
    t, fin, fout = 512, 256, 384
    x = torch.randn(t, fin, generator=g).bfloat16()
    w = (torch.randn(fout, fin, generator=g) / fin ** 0.5).bfloat16()
    dy = torch.randn(t, fout, generator=g).bfloat16()
    res = {}
    res["q_x"] = same_q(quantize(x.cuda()), quantize(x))
    res["q_w16x16"] = same_q(quantize(w.cuda(), tile=(16, 16)), quantize(w, tile=(16, 16)))
    res["q_rht_xt"] = same_q(quantize_wgrad_operand(x.cuda(), rounding="nearest"),
                             quantize_wgrad_operand(x, rounding="nearest"))
    res["decode_bf16"] = torch.equal(decode_to_bf16(quantize(x.cuda())).cpu(), decode_to_bf16(quantize(x)))
    y_gpu = nvfp4_linear(x.cuda(), w.cuda())
    y_ref = nvfp4_matmul(quantize(x), quantize(w, tile=(16, 16)), out_dtype=torch.float32)
    res["fwd_rel"] = rel(y_gpu, y_ref)
    xx, ww = x.cuda().requires_grad_(), w.cuda().requires_grad_()
    nvfp4_linear(xx, ww).backward(dy.cuda())
    xd, wd, dyd = x.double(), w.double(), dy.double()
    res["dx_rel_vs_fp64"] = rel(xx.grad, dyd @ wd)
    res["dw_rel_vs_fp64"] = rel(ww.grad, dyd.t() @ xd)
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    nvfp4_linear(xc, wc).backward(dy)
    res["dx_rel_ref_vs_fp64"] = rel(xc.grad, dyd @ wd)
    res["dw_rel_ref_vs_fp64"] = rel(wc.grad, dyd.t() @ xd)
    ok = (res["q_x"] and res["q_w16x16"] and res["q_rht_xt"] and res["decode_bf16"]
          and res["fwd_rel"] < 1e-2   # BF16 output rounding only
          and res["dx_rel_vs_fp64"] < 1.5 * res["dx_rel_ref_vs_fp64"] + 0.02
          and res["dw_rel_vs_fp64"] < 1.5 * res["dw_rel_ref_vs_fp64"] + 0.02)
    # NaN propagates without a host sync on the GPU path
    xn = x.cuda().clone()
    xn[3, 3] = float("nan")
    res["nan_propagates"] = bool(torch.isnan(nvfp4_linear(xn, w.cuda())).all())
    return ok and res["nan_propagates"], res


def main():
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    ok, res = correctness()
    print("correctness:", json.dumps(res), "PASS" if ok else "FAIL")
    if not ok:
        return 1
    rows = []
    for fin, fout in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(T, fin, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(fout, fin, device="cuda", dtype=torch.bfloat16) / fin ** 0.5).requires_grad_()
        dy = torch.randn(T, fout, device="cuda", dtype=torch.bfloat16)

        def fb(f):
            def run():
                x.grad = w.grad = None
                f(x, w).backward(dy)
            return run

        t_bf16 = bench(fb(lambda a, b: F.linear(a, b)))
        t_fp4 = bench(fb(lambda a, b: nvfp4_linear(a, b)))
        t_fwd_bf16 = bench(lambda: F.linear(x, w))
        t_fwd_fp4 = bench(lambda: nvfp4_linear(x, w))
        xd, wd, dyd = x.detach(), w.detach(), dy
        parts = {
            "quantize x (1x16)": bench(lambda: quantize(xd, check_finite=False)),
            "quantize W (16x16)": bench(lambda: quantize(wd, tile=(16, 16), check_finite=False)),
            "quantize dY (SR)": bench(lambda: quantize(dyd, rounding="stochastic", check_finite=False)),
            "wgrad operand RHT(xT) (transpose + fused RHT)": bench(lambda: quantize_wgrad_operand(xd, rounding="nearest")),
            "wgrad operand RHT(dYT) SR": bench(lambda: quantize_wgrad_operand(dyd, rounding="stochastic")),
            "decode x -> bf16": bench(lambda q=quantize(xd): decode_to_bf16(q)),
            "bf16 mm fp32-out (fprop)": bench(lambda a=xd, b=wd: torch.mm(a, b.t(), out_dtype=torch.float32)),
        }
        rows.append(dict(shape=f"{T}x{fin}->{fout}", bf16_ms=t_bf16, nvfp4_ms=t_fp4,
                         ratio=t_fp4 / t_bf16, fwd_bf16_ms=t_fwd_bf16, fwd_nvfp4_ms=t_fwd_fp4,
                         parts_ms=parts))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_nvfp4_linear.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), correctness=res, rows=rows), f, indent=1)
    for r in rows:
        print(f"\n{r['shape']} parts (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in r["parts_ms"].items()))
    print("\n| shape | BF16 fwd+bwd ms | NVFP4 fwd+bwd ms | ratio (target ≤ 1.3) | BF16 fwd | NVFP4 fwd |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['shape']} | {r['bf16_ms']:.3f} | {r['nvfp4_ms']:.3f} | {r['ratio']:.2f} | "
              f"{r['fwd_bf16_ms']:.3f} | {r['fwd_nvfp4_ms']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
