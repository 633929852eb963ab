#!/usr/bin/env python3
"""The lean Triton launcher on the GPU: same kernels, same bits, less host time.

1. **Exactness.** The NVFP4 linear (forward + backward, stochastic dY, wgrad added into an FP32
   buffer), Q-Attn (causal, GQA, head_dim 128 and 64, forward + backward) and a Q-AdamW step,
   each run with ``FULLSTACK_FP4_LEAN_LAUNCH=0`` (every launch through ``JITFunction.run``) and
   then twice with ``=verify`` (the second run goes through the lean path, each lean launch
   also asks ``JITFunction.run`` which kernel it would launch and raises if it is not the same
   object). Outputs and gradients must be equal bit for bit. Shapes are chosen so that the
   second shape of a piece reuses the first one's kernels (same specialisation, other sizes).
2. **Host time.** Per forward+backward of the NVFP4 linear and of Q-Attn, and per Q-AdamW
   step: host microseconds of a launch loop the GPU does not wait on, with the lean launcher
   off and on, beside ``F.linear`` / SDPA / ``torch.optim.AdamW(fused=True)``. Then the
   functions that still cost host time in the linear (cProfile, lean launcher on).

    python scripts/gpu/check_lean_launch.py     # exits 1 on any mismatch
"""
from __future__ import annotations

import cProfile
import pstats
import sys

import torch
import torch.nn.functional as F

from fullstack_fp4.attention import q_attention
from fullstack_fp4.linear import BufferAccumulator, nvfp4_linear
from fullstack_fp4.nvfp4 import triton_launch
from fullstack_fp4.optim.q_adamw.optimizer import QAdamW
from profile_linear_host import host_us   # this script's folder is on sys.path


def linear_case(t, cin, cout):
    g = torch.Generator().manual_seed(t + cin)
    x = torch.randn(t, cin, generator=g).bfloat16().cuda()
    w = (torch.randn(cout, cin, generator=g) / cin ** 0.5).bfloat16().cuda()
    dy = torch.randn(t, cout, generator=g).bfloat16().cuda()

    def run():
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        main_grad = torch.full((cout, cin), 0.5, device="cuda")
        gen = torch.Generator().manual_seed(7)
        y = nvfp4_linear(xr, wr, generator=gen)
        y.backward(dy)
        y2 = nvfp4_linear(xr.detach().requires_grad_(), wr, generator=gen,
                          wgrad_accumulator=BufferAccumulator(main_grad))
        y2.backward(dy)
        return [y, xr.grad, wr.grad, main_grad]
    return run


def attn_case(b, h, hk, s, d):
    g = torch.Generator().manual_seed(s + d)
    q = torch.randn(b, h, s, d, generator=g).bfloat16().cuda()
    k = torch.randn(b, hk, s, d, generator=g).bfloat16().cuda()
    v = torch.randn(b, hk, s, d, generator=g).bfloat16().cuda()
    do = torch.randn(b, h, s, d, generator=g).bfloat16().cuda()

    def run():
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        o = q_attention(qr, kr, vr, causal=True, generator=torch.Generator().manual_seed(3),
                        ds_rounding="stochastic")
        o.backward(do)
        return [o, qr.grad, kr.grad, vr.grad]
    return run


def adamw_case(shapes):
    g = torch.Generator().manual_seed(len(shapes))
    p0 = [torch.randn(s, generator=g).cuda() for s in shapes]
    grads = [[torch.randn(s, generator=g).cuda() for s in shapes] for _ in range(3)]

    def run():
        ps = [p.clone().requires_grad_() for p in p0]
        opt = QAdamW(ps, lr=1e-3, min_numel=1, seed=11)
        for gs in grads:
            for p, gr in zip(ps, gs):
                p.grad = gr.clone()
            opt.step()
        return [p.detach() for p in ps]
    return run


def same(a, b) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
               for x, y in zip(a, b)) and len(a) == len(b)


def check(cases) -> int:
    bad = 0
    for name, run in cases.items():
        triton_launch.set_mode("0")
        plain = run()
        triton_launch.set_mode("verify")
        before = triton_launch.VERIFIED["launches"]
        try:
            run()                   # first launches of new specialisations go the plain way
            lean = run()
            torch.cuda.synchronize()
            ok = same(plain, lean)
            verified = triton_launch.VERIFIED["launches"] - before
        except RuntimeError as e:
            ok, verified = False, 0
            print(f"  {name}: {e}")
        print(f"{'ok      ' if ok and verified else 'MISMATCH'} {name}: outputs "
              f"{'equal' if ok else 'DIFFER'}, {verified} lean launches verified")
        bad += not (ok and verified)
    triton_launch.set_mode("1")
    return bad


def host_table():
    t, c = 8192, 3072
    x = torch.randn(t, c, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(c, c, device="cuda", dtype=torch.bfloat16) / c ** 0.5).requires_grad_()
    dy = torch.randn(t, c, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(2, 24, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(2, 8, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn_like(q)
    params = [torch.randn(3072, 3072, device="cuda", requires_grad=True) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    q_opt = QAdamW(params, lr=1e-4, min_numel=1)
    t_opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def lin(f):
        def go():
            x.grad = w.grad = None
            f(x, w).backward(dy)
        return go

    def attn(f):
        def go():
            q.grad = kv.grad = None
            f(q, kv, kv).backward(do)
        return go

    sdpa = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)
    qattn = lambda a, b, c: q_attention(a, b, c, causal=True)
    rows = [("NVFP4 linear fwd+bwd, 8192x3072->3072", lin(nvfp4_linear), lin(F.linear), "F.linear"),
            ("Q-Attn fwd+bwd, 2x24(8)x4096x128", attn(qattn), attn(sdpa), "SDPA"),
            ("Q-AdamW step, 8 x 3072^2", q_opt.step, t_opt.step, "torch AdamW fused")]
    print("\n| host us per call (GPU not waited on) | lean off | lean on | peer | peer us |")
    print("| --- | ---: | ---: | --- | ---: |")
    for name, fn, peer, peer_name in rows:
        triton_launch.set_mode("0")
        off = host_us(fn, 100)
        triton_launch.set_mode("1")
        on = host_us(fn, 100)
        print(f"| {name} | {off:.0f} | {on:.0f} | {peer_name} | {host_us(peer, 100):.0f} |")
    prof = cProfile.Profile()
    go = lin(nvfp4_linear)
    prof.enable()
    for _ in range(100):
        go()
    prof.disable()
    torch.cuda.synchronize()
    print("\ncProfile of 100 NVFP4 linear fwd+bwd (lean launcher on), by own time:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 1
    cases = {
        "NVFP4 linear 4096x3072->1024": linear_case(4096, 3072, 1024),
        "NVFP4 linear 2048x1024->3072 (same kernels)": linear_case(2048, 1024, 3072),
        "NVFP4 linear 1000x512->256 (ragged tokens)": linear_case(1000, 512, 256),
        "Q-Attn 1x8(2)x512x128 causal, SR dS": attn_case(1, 8, 2, 512, 128),
        "Q-Attn 2x4(4)x384x128 (same kernels)": attn_case(2, 4, 4, 384, 128),
        "Q-Attn 1x4(2)x256x64": attn_case(1, 4, 2, 256, 64),
        "Q-AdamW 3 steps": adamw_case([(512, 256), (4096,), (1024, 1024)]),
    }
    bad = check(cases)
    print("lean launches exact" if not bad else f"{bad} case(s) differ")
    host_table()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
