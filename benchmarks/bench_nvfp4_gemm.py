"""The emulated NVFP4 GEMM on one GPU: cuBLAS + epilogue pass against one cuBLASLt call.

    python benchmarks/bench_nvfp4_gemm.py     # a markdown table; $OUT/bench_nvfp4_gemm.json

The six GEMMs of the NVFP4 linear at 8192 tokens × 3072 → 3072 / → 8192 (fprop, dgrad, and
wgrad added into an FP32 ``main_grad``), on decoded NVFP4 operands in the layouts the linear
passes them (``fullstack_fp4/linear/nvfp4_linear.py``). Per GEMM:

1. Correctness first (exit 1 on failure):
   a. operands whose exact product is representable in FP32 (small integers times powers of
      two): the cuBLASLt call's output must equal the two-pass path's bit for bit (every
      accumulation order gives the same sum, so only the epilogue could differ); the wgrad,
      added into a buffer, within one FP32 ulp of the product plus one of the sum (cuBLAS may
      round ``alpha·acc + C`` once where the two-pass path rounds twice);
   b. real decoded NVFP4 operands: both paths against an FP64 product, relative error
      reported (FP32 accumulation order only).
2. Median CUDA-event time (``triton.testing.do_bench``): cuBLAS BF16-out ``torch.mm`` (the
   BF16 linear's GEMM, no scaling: a floor), the two-pass path (``torch.mm`` FP32 out + the
   Triton epilogue pass, backend ``cublas``) and the cuBLASLt call (backend ``cublaslt``).

NVFP4 GEMMs are emulated on Hopper: BF16 tensor cores on decoded operands, FP32 accumulation.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton.testing  # noqa: E402

from fullstack_fp4.nvfp4 import quantize  # noqa: E402
from fullstack_fp4.nvfp4 import gemm  # noqa: E402
from fullstack_fp4.nvfp4.kernels.cublaslt import scaled_mm_cublaslt  # noqa: E402

T = 8192


def gemms(out_f: int, in_f: int):
    """(name, a [M, K], b [K, N] view, accumulate?) in the layouts of the NVFP4 linear."""
    dev = "cuda"

    def dec(shape, tile=(1, 16)):
        q = quantize(torch.randn(*shape, device=dev, dtype=torch.bfloat16), tile=tile)
        return gemm.decode_to_bf16(q), q.tensor_scale

    x, ts_x = dec((T, in_f))
    w, ts_w = dec((out_f, in_f), (16, 16))
    dy, ts_dy = dec((T, out_f))
    dyt, ts_dyt = dec((out_f, T))
    xt, ts_xt = dec((in_f, T))
    tag = f"{T}x{in_f}->{out_f}"
    return [(f"fprop {tag}", x, w.t(), ts_x, ts_w, False),
            (f"dgrad {tag}", dy, w, ts_dy, ts_w, False),
            (f"wgrad {tag} (+= FP32)", dyt, xt.t(), ts_dyt, ts_xt, True)]


def exact_operands(a: torch.Tensor, b: torch.Tensor):
    """Operands of a's and b's shapes and layouts whose products and sums are exact in FP32."""
    def ints(t):
        g = torch.randint(-6, 7, t.shape, device=t.device).float()
        v = (g * 2.0 ** torch.randint(-2, 2, t.shape, device=t.device).float()).to(torch.bfloat16)
        return v if t.is_contiguous() else v.t().contiguous().t()
    return ints(a), ints(b)


def run_path(name, a, b, ts_a, ts_b, acc, dst0=None):
    """One GEMM by one path; returns (output, callable for timing). With ``acc`` the product is
    added into a copy of ``dst0`` (zeros if None)."""
    dst = None
    if acc:
        dst = (torch.zeros(a.shape[0], b.shape[1], device=a.device, dtype=torch.float32)
               if dst0 is None else dst0.clone())
    if name == "cublas":
        def f():
            prev = gemm.set_gemm_backend("cublas")
            try:
                return gemm.decoded_matmul(a, b, ts_a, ts_b, torch.bfloat16, accumulate_into=dst)
            finally:
                gemm.set_gemm_backend(prev)
    elif name == "bf16":
        def f():
            return torch.mm(a, b)
    else:
        def f():
            return scaled_mm_cublaslt(a, b, ts_a, ts_b, torch.bfloat16, accumulate_into=dst)
    out = f()
    return (dst.clone() if acc else out), f


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    torch.manual_seed(0)
    rows, ok = [], True
    for out_f in (3072, 8192):
        for name, a, b, ts_a, ts_b, acc in gemms(out_f, 3072):
            m, k, n = a.shape[0], a.shape[1], b.shape[1]
            # 1a: exact operands (and, accumulating, an exact starting buffer), bit for bit
            ea, eb = exact_operands(a, b)
            d0 = (torch.randint(-64, 64, (m, n), device=a.device).float() * 0.25) if acc else None
            o_c, _ = run_path("cublas", ea, eb, ts_a, ts_b, acc, d0)
            o_l, _ = run_path("cublaslt", ea, eb, ts_a, ts_b, acc, d0)
            if acc:   # cuBLAS may round alpha·acc + C once where the two-pass path rounds twice
                prod, _ = run_path("cublas", ea, eb, ts_a, ts_b, False)
                eps = torch.finfo(torch.float32).eps
                same = bool(((o_l - o_c).abs() <= eps * (prod.float().abs() + o_c.abs())).all())
            else:
                same = torch.equal(bits(o_c), bits(o_l))
            # 1b: real operands against FP64
            ref = (a.double() @ b.double()) * (ts_a.double() * ts_b.double())
            o_c, t_c = run_path("cublas", a, b, ts_a, ts_b, acc)
            o_l, t_l = run_path("cublaslt", a, b, ts_a, ts_b, acc)
            err_c = ((o_c.double() - ref).norm() / ref.norm()).item()
            err_l = ((o_l.double() - ref).norm() / ref.norm()).item()
            ok &= same and err_l <= 1.01 * err_c + 1e-7
            _, t_bf = run_path("bf16", a, b, ts_a, ts_b, acc)
            row = dict(gemm=name, m=m, n=n, k=k, exact_equal=same, rel_err_cublas=err_c,
                       rel_err_cublaslt=err_l, ms_bf16_mm=bench(t_bf), ms_cublas_path=bench(t_c),
                       ms_cublaslt=bench(t_l))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| GEMM | M×N×K | exact operands: cuBLASLt == two-pass | rel. err two-pass / cuBLASLt "
          "| BF16 mm ms | torch.mm FP32 + epilogue ms | cuBLASLt ms | cuBLASLt / two-pass |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['gemm']} | {r['m']}×{r['n']}×{r['k']} | {'PASS' if r['exact_equal'] else 'FAIL'} "
              f"| {r['rel_err_cublas']:.2e} / {r['rel_err_cublaslt']:.2e} | {r['ms_bf16_mm']:.3f} "
              f"| {r['ms_cublas_path']:.3f} | {r['ms_cublaslt']:.3f} "
              f"| {r['ms_cublaslt'] / r['ms_cublas_path']:.2f} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_nvfp4_gemm.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print("\ncorrectness:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
