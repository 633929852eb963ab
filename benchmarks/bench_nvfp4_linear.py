"""NVFP4 linear fwd+bwd vs BF16 ``F.linear`` fwd+bwd on one GPU (8192 tokens × 3072 → 3072 / 8192).

    python benchmarks/bench_nvfp4_linear.py        # prints a markdown table last
    OUT=/dir python benchmarks/bench_nvfp4_linear.py   # also writes $OUT/bench_nvfp4_linear.json

1. Correctness first.
   a. The GPU path against the reference linear on CPU (512 × 256 → 384): quantized operands
      (codes, scales) bit for bit (x, W 16×16, RHT(xᵀ)), the BF16 decode bit for bit, the
      forward up to GEMM accumulation order, dX/dW by relative error against the FP64
      unquantized gradient (dY's SR draws differ between Philox on the GPU and the CPU
      generator), NaN propagation without a host sync.
   b. The fused GPU path (``_fused_forward/_backward``: two-way operand kernels, Triton
      epilogue) against the same linear written out step by step here (quantize_triton →
      Triton decode → the GEMM backend's call on the decoded operands), same Philox seeds:
      y, dX, dW must be bit-identical.
2. Median CUDA-event time (``triton.testing.do_bench``) of fwd+bwd (y = f(x, W); y.backward(dY))
   for BF16 F.linear, for nvfp4_linear (fused path) and for its composed path; the
   same fwd+bwd replayed as a CUDA graph (device time without the host's launch cost); the
   forward alone; and each piece of the fused path with its bytes and GB/s.
Target: NVFP4 ≤ 1.3× BF16 (current figures: ``BENCHMARKS.md#nvfp4-quantize-and-linear``).

The emulated GEMM's backend is the one in use (``gemm.gemm_backend()``: ``cublaslt``, one call
with the tensor scales read on the device, the default; ``cublas`` after
``gemm.set_gemm_backend("cublas")``: ``torch.mm`` FP32 out + the epilogue pass); the JSON
records it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton.testing  # noqa: E402
from _timing import capture_graph  # noqa: E402

from fullstack_fp4.linear import nvfp4_linear, quantize_wgrad_operand  # noqa: E402
from fullstack_fp4.nvfp4 import quantize  # noqa: E402
from fullstack_fp4.nvfp4.kernels import quantize_two_ways as tqd  # noqa: E402
from fullstack_fp4.nvfp4.gemm import decode_to_bf16, gemm_backend, nvfp4_matmul  # noqa: E402
from fullstack_fp4.nvfp4.kernels.cublaslt import scaled_mm_cublaslt  # noqa: E402
from fullstack_fp4.nvfp4.kernels.gemm_epilogue import scale_cast_triton  # noqa: E402

lin = importlib.import_module("fullstack_fp4.linear.nvfp4_linear")  # the function shadows the name

T = 8192
SHAPES = [(3072, 3072), (3072, 8192)]
DEV = "cuda"


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def graph_bench(run):
    """Median time of ``run`` replayed as one CUDA graph: device time without the host's
    Python / launch cost (the eager number minus this is that cost). NaN if capture fails."""
    try:
        return bench(capture_graph(run).replay)
    except Exception as e:  # noqa: BLE001 -- a timing extra, never a failure of the benchmark
        print(f"(CUDA-graph timing unavailable: {type(e).__name__}: {e})")
        return float("nan")


def same_q(a, b):
    return (torch.equal(a.data.cpu(), b.data.cpu())
            and torch.equal(a.block_scale.cpu().view(torch.uint8), b.block_scale.cpu().view(torch.uint8))
            and int(a.tensor_scale.cpu().view(torch.int32)) == int(b.tensor_scale.cpu().view(torch.int32)))


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def rel(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


def stepwise_matmul(a, b, transposed_b=False, out_dtype=torch.bfloat16):
    """The emulated GEMM step by step: decode, then the GEMM of the backend in use. With the
    cuBLAS backend that is ``torch.mm`` FP32 out and the epilogue in PyTorch; with the cuBLASLt
    backend its one call on the same decoded operands."""
    a2, b2 = decode_to_bf16(a), decode_to_bf16(b)
    b2 = b2 if transposed_b else b2.t()
    if gemm_backend() == "cublaslt":
        return scaled_mm_cublaslt(a2, b2, a.tensor_scale, b.tensor_scale, out_dtype)
    acc = torch.mm(a2, b2, out_dtype=torch.float32)
    return (acc * (a.tensor_scale.float() * b.tensor_scale.float())).to(out_dtype)


def stepwise_wgrad_operand(m, rounding, gen=None):
    """quantize_wgrad_operand step by step: zero-pad the tokens to 16, BF16 transposed copy, fused RHT."""
    from fullstack_fp4.nvfp4 import DEFAULT_SIGNS
    pad = (-m.shape[0]) % 16
    if pad:
        m = F.pad(m, (0, 0, 0, pad))
    return quantize(m.t().contiguous(), rht_signs=DEFAULT_SIGNS, rounding=rounding, generator=gen,
                    check_finite=False, backend="triton")


def stepwise_path(x, w, dy, seed_gen):
    """The GPU path of the linear, step by step (quantize_triton draws its seeds from
    ``seed_gen``: dY's, then RHT(dYᵀ)'s). ``backend="triton"`` is what "auto" picks on CUDA."""
    qx = quantize(x, check_finite=False, backend="triton")
    qw = quantize(w, tile=(16, 16), check_finite=False, backend="triton")
    y = stepwise_matmul(qx, qw, out_dtype=x.dtype)
    qxt = stepwise_wgrad_operand(x, "nearest")
    qdy = quantize(dy, rounding="stochastic", generator=seed_gen, check_finite=False, backend="triton")
    dx = stepwise_matmul(qdy, qw, transposed_b=True, out_dtype=x.dtype)
    dw = stepwise_matmul(stepwise_wgrad_operand(dy, "stochastic", seed_gen), qxt, out_dtype=w.dtype)
    return y, dx, dw


def correctness():
    g = torch.Generator().manual_seed(0)
    t, fin, fout = 512, 256, 384
    x = torch.randn(t, fin, generator=g).bfloat16()
    w = (torch.randn(fout, fin, generator=g) / fin ** 0.5).bfloat16()
    dy = torch.randn(t, fout, generator=g).bfloat16()
    res = {}
    res["q_x"] = same_q(quantize(x.to(DEV)), quantize(x))
    res["q_w16x16"] = same_q(quantize(w.to(DEV), tile=(16, 16)), quantize(w, tile=(16, 16)))
    res["q_rht_xt"] = same_q(quantize_wgrad_operand(x.to(DEV), rounding="nearest"),
                             quantize_wgrad_operand(x, rounding="nearest"))
    res["decode_bf16"] = torch.equal(decode_to_bf16(quantize(x.to(DEV))).cpu(), decode_to_bf16(quantize(x)))
    y_gpu = nvfp4_linear(x.to(DEV), w.to(DEV))
    y_ref = nvfp4_matmul(quantize(x), quantize(w, tile=(16, 16)), out_dtype=torch.float32)
    res["fwd_rel"] = rel(y_gpu, y_ref)
    xx, ww = x.to(DEV, copy=True).requires_grad_(), w.to(DEV, copy=True).requires_grad_()
    nvfp4_linear(xx, ww).backward(dy.to(DEV))
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
    # fused path == the step-by-step GPU path, bit for bit (T = 500: padded wgrad token blocks), and
    # at one benchmark shape
    for name, (tt, fi, fo) in (("small", (500, 256, 384)), ("bench", (T, *SHAPES[0]))):
        gg = torch.Generator().manual_seed(1)
        xs = torch.randn(tt, fi, generator=gg).bfloat16().to(DEV)
        ws = (torch.randn(fo, fi, generator=gg) / fi ** 0.5).bfloat16().to(DEV)
        dys = torch.randn(tt, fo, generator=gg).bfloat16().to(DEV)
        y_f, qw, qxt = lin._fused_forward(xs, ws, xs.dtype, True, True, None)
        dx_f, dw_f = lin._fused_backward(dys, qw, qxt, xs.dtype, ws.dtype,
                                         torch.Generator().manual_seed(5), None)
        y_p, dx_p, dw_p = stepwise_path(xs, ws, dys, torch.Generator().manual_seed(5))
        for k, (a, b) in dict(y=(y_f, y_p), dx=(dx_f, dx_p), dw=(dw_f, dw_p)).items():
            res[f"fused_vs_stepwise_{name}_{k}_bits"] = same_bits(a, b)
            ok = ok and res[f"fused_vs_stepwise_{name}_{k}_bits"]
    # NaN propagates without a host sync on the GPU path
    xn = x.to(DEV).clone()
    xn[3, 3] = float("nan")
    res["nan_propagates"] = bool(torch.isnan(nvfp4_linear(xn, w.to(DEV))).all())
    return ok and res["nan_propagates"], res


def pieces(x, w, dy):
    """Each kernel of the fused path on its own: {name: (ms, bytes moved)}."""
    tk, nk, tn = x.numel(), w.numel(), dy.numel()
    rw, cw = tqd.RowWay, tqd.ColWay
    obs_x, obs_w, obs_dy = tqd.amax_two_ways(x), tqd.amax_two_ways(w, col=False), tqd.amax_two_ways(dy)
    qx = tqd.quantize_two_ways(x, obs_x, row=rw(), col=cw())
    qw = tqd.quantize_two_ways(w, obs_w, row=rw(tile=(16, 16), codes=True))
    dyw = dict(row=rw("stochastic"), col=cw("stochastic", decoded=True, codes=False), seed_row=1,
               seed_col=2)
    qdy = tqd.quantize_two_ways(dy, obs_dy, **dyw)
    wd, xtd = decode_to_bf16(qw.row_q), decode_to_bf16(qx.col_q)
    f32 = torch.float32
    acc_y = torch.mm(qx.row_decoded, qw.row_decoded.t(), out_dtype=f32)
    acc_dx = torch.mm(qdy.row_decoded, wd, out_dtype=f32)
    acc_dw = torch.mm(qdy.col_decoded, xtd.t(), out_dtype=f32)
    one = torch.ones((), device=x.device)
    run = {
        "amax x, both ways": (lambda: tqd.amax_two_ways(x), 2 * tk),
        "amax W": (lambda: tqd.amax_two_ways(w, col=False), 2 * nk),
        "x -> decoded x + RHT(xT) codes": (
            lambda: tqd.quantize_two_ways(x, obs_x, row=rw(), col=cw()), (2 + 2 + 0.5625) * tk),
        "W -> decoded W + 16x16 codes": (
            lambda: tqd.quantize_two_ways(w, obs_w, row=rw(tile=(16, 16), codes=True)),
            (2 + 2 + 0.5625) * nk),
        "mm fprop fp32-out": (lambda: torch.mm(qx.row_decoded, qw.row_decoded.t(), out_dtype=f32), None),
        "epilogue y": (lambda: scale_cast_triton(acc_y, one, one, torch.bfloat16), 6 * tn),
        "amax dY, both ways": (lambda: tqd.amax_two_ways(dy), 2 * tn),
        "dY -> decoded dY + decoded RHT(dYT), SR": (
            lambda: tqd.quantize_two_ways(dy, obs_dy, **dyw), (2 + 2 + 2) * tn),
        "decode saved W": (lambda: decode_to_bf16(qw.row_q), 2.5625 * nk),
        "decode saved RHT(xT)": (lambda: decode_to_bf16(qx.col_q), 2.5625 * tk),
        "mm dgrad fp32-out": (lambda: torch.mm(qdy.row_decoded, wd, out_dtype=f32), None),
        "epilogue dX": (lambda: scale_cast_triton(acc_dx, one, one, torch.bfloat16), 6 * tk),
        "mm wgrad fp32-out": (lambda: torch.mm(qdy.col_decoded, xtd.t(), out_dtype=f32), None),
        "epilogue dW": (lambda: scale_cast_triton(acc_dw, one, one, torch.bfloat16), 6 * nk),
        "cuBLASLt GEMM fprop": (
            lambda: scaled_mm_cublaslt(qx.row_decoded, qw.row_decoded.t(), one, one), None),
        "cuBLASLt GEMM dgrad": (lambda: scaled_mm_cublaslt(qdy.row_decoded, wd, one, one), None),
        "cuBLASLt GEMM wgrad": (lambda: scaled_mm_cublaslt(qdy.col_decoded, xtd.t(), one, one),
                                None),
    }
    return {k: (bench(fn), nbytes) for k, (fn, nbytes) in run.items()}


def in_path(piece: str) -> bool:
    """Whether a piece of :func:`pieces` runs in the linear with the GEMM backend in use (the
    table times both backends' GEMMs)."""
    lt = piece.startswith("cuBLASLt GEMM")
    cublas = piece.startswith("mm ") or piece.startswith("epilogue ")
    return not (lt if gemm_backend() == "cublas" else cublas)


def main():
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    ok, res = correctness()
    print("GEMM backend:", gemm_backend())
    print("correctness:", json.dumps(res), "PASS" if ok else "FAIL")
    if not ok:
        return 1
    rows = []
    for fin, fout in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(T, fin, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(fout, fin, device=DEV, dtype=torch.bfloat16) / fin ** 0.5).requires_grad_()
        dy = torch.randn(T, fout, device=DEV, dtype=torch.bfloat16)

        def fb(f):
            def run():
                x.grad = w.grad = None
                f(x, w).backward(dy)
            return run

        t_bf16 = bench(fb(lambda a, b: F.linear(a, b)))
        t_fp4 = bench(fb(lambda a, b: nvfp4_linear(a, b)))
        g_bf16 = graph_bench(fb(lambda a, b: F.linear(a, b)))
        g_fp4 = graph_bench(fb(lambda a, b: nvfp4_linear(a, b)))
        t_fwd_bf16 = bench(lambda: F.linear(x, w))
        t_fwd_fp4 = bench(lambda: nvfp4_linear(x, w))
        fused = lin._use_fused
        lin._use_fused = lambda t: False        # the composed path: quantize, decode, nvfp4_matmul
        try:
            t_composed = bench(fb(lambda a, b: nvfp4_linear(a, b)))
        finally:
            lin._use_fused = fused
        parts = pieces(x.detach(), w.detach(), dy)
        rows.append(dict(shape=f"{T}x{fin}->{fout}", bf16_ms=t_bf16, nvfp4_ms=t_fp4,
                         ratio=t_fp4 / t_bf16, fwd_bf16_ms=t_fwd_bf16, fwd_nvfp4_ms=t_fwd_fp4,
                         graph_bf16_ms=g_bf16, graph_nvfp4_ms=g_fp4, graph_ratio=g_fp4 / g_bf16,
                         composed_ms=t_composed, parts_ms={k: v[0] for k, v in parts.items()},
                         parts_bytes={k: v[1] for k, v in parts.items()}))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_nvfp4_linear.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), gemm_backend=gemm_backend(),
                           correctness=res, rows=rows), f, indent=1)
    for r in rows:
        print(f"\n{r['shape']}: fused-path pieces")
        print("| piece | ms | MB moved | GB/s |")
        print("| --- | ---: | ---: | ---: |")
        for k, ms in r["parts_ms"].items():
            nb = r["parts_bytes"][k]
            mb, gbs = (f"{nb / 1e6:.0f}", f"{nb / ms / 1e6:.0f}") if nb else ("", "")
            print(f"| {k} | {ms:.3f} | {mb} | {gbs} |")
        print(f"| sum of the pieces of the {gemm_backend()} GEMM path | "
              f"{sum(ms for k, ms in r['parts_ms'].items() if in_path(k)):.3f} | | |")
        print(f"| measured fwd+bwd (gaps: launches, allocations, host) | {r['nvfp4_ms']:.3f} | | |")
        print(f"| measured fwd+bwd as one CUDA graph (device time) | {r['graph_nvfp4_ms']:.3f} | | |")
    print("\n| shape | BF16 fwd+bwd ms | NVFP4 fwd+bwd ms | ratio (target ≤ 1.3) | graph: BF16 / NVFP4 ms "
          "(ratio) | composed path ms | BF16 fwd | NVFP4 fwd |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['shape']} | {r['bf16_ms']:.3f} | {r['nvfp4_ms']:.3f} | {r['ratio']:.2f} | "
              f"{r['graph_bf16_ms']:.3f} / {r['graph_nvfp4_ms']:.3f} ({r['graph_ratio']:.2f}) | "
              f"{r['composed_ms']:.3f} | {r['fwd_bf16_ms']:.3f} | {r['fwd_nvfp4_ms']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
