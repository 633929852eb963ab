"""Does the order of the NVFP4 linear's operand launches let a quantize read from L2? (issue 3)

Each operand of the linear is read twice: once by its amax pass, once by its quantize kernel.
Both kernels walk their tiles channel strip by channel strip, so after an amax pass over x
(8192 × 3072 BF16: 50 MB, about the H200's L2) the L2 holds x's *last* strips while the
quantize starts on its *first*: with LRU-like eviction it finds none of them. Reversing the
amax pass (``triton_quantize_decode.AMAX_REVERSE``; same bits, a max has no order) ends it on
the first strips. Between the two reads of x the forward also reads W (19 MB) for its amax,
so the launch order of the four forward operand kernels decides what is still in L2 too.

What this times, device time from CUDA-graph replays with the L2 flushed before each replay
(``triton.testing.do_bench``, median), at 8192 tokens × 3072 → 3072 and → 8192:

1. the forward's four operand launches (Ax, Aw: the amax passes of x and W; Qx, Qw: their
   quantize calls) in several orders, the amax passes forward or reversed;
2. the backward's dY launches (amax, then quantize both ways) with the amax forward or reversed;
3. the whole linear fwd+bwd (``nvfp4_linear``, as ``scripts/bench_nvfp4_linear.py`` times it)
   with each forward order swapped in, beside BF16 ``F.linear``; every variant's y, dX and dW
   first checked bit for bit against the landed order's.

Rounds alternate the variants (3 rounds, the median of the rounds' medians) so that drift of
the machine falls on all of them. Every NVFP4 GEMM is emulated exactly (decoded BF16 operands,
FP32 accumulation): only the operand kernels move here.

Usage (GPU): ``python scripts/gpu/l2_order.py``.
"""

import importlib
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from fullstack_fp4.linear import nvfp4_linear  # noqa: E402
from fullstack_fp4.nvfp4 import triton_quantize_decode as tqd  # noqa: E402
from fullstack_fp4.nvfp4.gemm import decoded_matmul  # noqa: E402

lin = importlib.import_module("fullstack_fp4.linear.nvfp4_linear")
T = 8192
SHAPES = [(3072, 3072), (3072, 8192)]
ORDERS = ["Ax Aw Qx Qw", "Aw Ax Qx Qw", "Ax Aw Qw Qx", "Aw Qw Ax Qx", "Ax Qx Aw Qw"]
ROUNDS = 3


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def graph_of(fn):
    """A CUDA graph of one call of ``fn`` (after eager and side-stream warm-ups)."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def forward_ops(x2, weight, order, reverse, need_dw=True):
    """The forward's operand launches in ``order``: (qx, qw)."""
    obs, q = {}, {}
    for op in order.split():
        if op == "Ax":
            obs["x"] = tqd.amax_two_ways(x2, row=True, col=need_dw, reverse=reverse)
        elif op == "Aw":
            obs["w"] = tqd.amax_two_ways(weight, row=True, col=False, reverse=reverse)
        elif op == "Qx":
            q["x"] = tqd.quantize_two_ways(x2, obs["x"], row=tqd.RowWay("nearest"),
                                           col=tqd.ColWay("nearest") if need_dw else None)
        else:
            q["w"] = tqd.quantize_two_ways(weight, obs["w"],
                                           row=tqd.RowWay("nearest", (16, 16), codes=True))
    return q["x"], q["w"]


def make_forward(order, reverse):
    """``nvfp4_linear``'s GPU forward with the operand launches in ``order`` (amax_reduce None)."""
    def fwd(x2, weight, out_dtype, need_dx, need_dw, amax_reduce):
        assert amax_reduce is None
        qx, qw = forward_ops(x2, weight, order, reverse, need_dw)
        y = decoded_matmul(qx.row_decoded, qw.row_decoded.t(), qx.row_scale, qw.row_scale,
                           out_dtype)
        return y, qw.row_q if need_dx else None, qx.col_q
    return fwd


def fwd_bwd(x, w, dy):
    x.grad = w.grad = None
    nvfp4_linear(x, w).backward(dy)


def bf16_fwd_bwd(x, w, dy):
    x.grad = w.grad = None
    F.linear(x, w).backward(dy)


def outputs(x, w, dy):
    torch.manual_seed(1)                       # dY's SR seeds come from the default generator
    fwd_bwd(x, w, dy)
    y = nvfp4_linear(x, w).detach()
    return y, x.grad.clone(), w.grad.clone()


def med(v):
    return sorted(v)[len(v) // 2]


def main():
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    landed = lin._fused_forward
    print(f"AMAX_REVERSE (this commit's default): {tqd.AMAX_REVERSE}")
    for fin, fout in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(T, fin, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(fout, fin, device="cuda", dtype=torch.bfloat16) / fin ** 0.5).requires_grad_()
        dy = torch.randn(T, fout, device="cuda", dtype=torch.bfloat16)
        x2, wd = x.detach(), w.detach()
        print(f"\n## 8192 × {fin} → {fout}")

        # 1. the forward's operand launches
        phases = {(o, r): graph_of(lambda o=o, r=r: forward_ops(x2, wd, o, r))
                  for o in ORDERS for r in (False, True)}
        # 2. dY's launches
        def dy_ops(r):
            obs = tqd.amax_two_ways(dy, row=True, col=True, reverse=r)
            tqd.quantize_two_ways(dy, obs, row=tqd.RowWay("stochastic"),
                                  col=tqd.ColWay("stochastic", decoded=True, codes=False),
                                  seed_row=11, seed_col=12)
        dys = {r: graph_of(lambda r=r: dy_ops(r)) for r in (False, True)}

        # 3. the linear, every variant bit for bit against the landed forward first
        ref = outputs(x, w, dy)
        variants = {"BF16 F.linear": None}
        for o in ORDERS:
            for r in (False, True):
                variants[f"NVFP4, {o}, amax {'reversed' if r else 'forward'}"] = (o, r)
        lin_graphs, same = {}, {}
        for name, v in variants.items():
            if v is None:
                lin_graphs[name] = graph_of(lambda: bf16_fwd_bwd(x, w, dy))
                continue
            lin._fused_forward = make_forward(*v)
            try:
                got = outputs(x, w, dy)
                same[name] = all(torch.equal(a, b) for a, b in zip(got, ref))
                lin_graphs[name] = graph_of(lambda: fwd_bwd(x, w, dy))
            finally:
                lin._fused_forward = landed

        t_phase = {k: [] for k in phases}
        t_dy = {k: [] for k in dys}
        t_lin = {k: [] for k in lin_graphs}
        for _ in range(ROUNDS):
            for k, g in phases.items():
                t_phase[k].append(bench(g.replay))
            for k, g in dys.items():
                t_dy[k].append(bench(g.replay))
            for k, g in lin_graphs.items():
                t_lin[k].append(bench(g.replay))

        print("\n| forward operand launches | amax forward (ms) | amax reversed (ms) |")
        print("| --- | ---: | ---: |")
        for o in ORDERS:
            print(f"| {o} | {med(t_phase[(o, False)]):.4f} | {med(t_phase[(o, True)]):.4f} |")
        print(f"\n| dY: amax, then both ways (SR, decoded) | {med(t_dy[False]):.4f} | "
              f"{med(t_dy[True]):.4f} |")
        bf = med(t_lin["BF16 F.linear"])
        print("\n| fwd+bwd, CUDA graph, L2 flushed before each replay | ms | ratio to BF16 | "
              "y, dX, dW equal to the landed order's |")
        print("| --- | ---: | ---: | --- |")
        for k in lin_graphs:
            t = med(t_lin[k])
            print(f"| {k} | {t:.4f} | {t / bf:.3f} | {same.get(k, '')} |")
        if not all(same.values()):
            print("FAIL: a launch order changed the bits")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
