"""sm_90 compile gate for every ``@triton.jit`` kernel in ``fullstack_fp4`` (no GPU needed).

The CPU suite runs the kernels under ``TRITON_INTERPRET=1``, which accepts code the real compiler
rejects (plain module globals inside kernels, interpreter-only ops, ...). This module closes that
gap without a GPU:

1. **Capture.** With the interpreter OFF (run this file as a script in a fresh process, so
   ``triton.jit`` builds real ``JITFunction`` objects and the host code picks its GPU tile configs
   and ``INTERP=False`` paths), ``JITFunction.run`` is replaced by a recorder, and the project's
   real host launch functions (``quantize_triton``, ``dequantize_triton``, ``quantize_both_views``,
   ``attention_forward/backward``, ``quantize_decode``, Q-AdamW ``launch``, test hooks) are called
   on small CPU tensors over every mode they support. Nothing executes; each launch is turned
   into exactly what ``JITFunction.run`` would hand the compiler — Triton's own binder
   (``create_function_from_signature``: dtype → ``*bf16``/``*u8``/``i32``/``fp32``..., ints == 1
   → constexpr, 16-byte alignment / divisibility attributes) and ``_pack_args`` (options:
   ``num_warps``, ``num_stages``, ``enable_fp_fusion``) — against ``GPUTarget("cuda", 90, 32)``.
2. **Compile.** Each distinct (kernel, signature, constexprs, attrs, options) goes through
   ``triton.compile`` down to a cubin (ptxas ships in the wheel). Registers and spills come from
   the ``ptxas -v`` log of that compile.
3. **Coverage.** Every ``JITFunction`` defined in ``fullstack_fp4`` must be launched or reachable
   by name from a launched kernel; a new kernel without a scenario below fails the gate.

``python tests/triton_compile_gate.py [--json PATH] [--jobs N]`` prints one line per compile
and exits 1 on any failure. ``tests/test_triton_compile_sm90.py`` runs it under pytest.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor

TARGET = ("cuda", 90, 32)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------- capture
_LAUNCHES: list = []      # (JITFunction, args tuple, kwargs dict, scenario label)
_LABEL = ["?"]


def _install_recorder():
    from triton.runtime.jit import JITFunction

    from fullstack_fp4.nvfp4.kernels import launch as triton_launch

    # every launch the plain way, through JITFunction.run (recorded below): the lean launcher
    # would look for a CUDA device and a compiled kernel
    triton_launch.set_mode("0")

    def run(self, *args, grid, warmup, **kwargs):
        _LAUNCHES.append((self, args, dict(kwargs), _LABEL[0]))
        return None

    JITFunction.run = run


def _scenario(label):
    _LABEL[0] = label


def pairwise(factors: dict) -> list:
    """Greedy all-pairs covering rows over ``factors`` (name -> values), deterministic."""
    import itertools
    names = list(factors)
    combos = [dict(zip(names, c)) for c in itertools.product(*factors.values())]
    need = {((a, repr(va)), (b, repr(vb))) for a, b in itertools.combinations(names, 2)
            for va in factors[a] for vb in factors[b]}

    def pairs(c):
        return {((a, repr(c[a])), (b, repr(c[b]))) for a, b in itertools.combinations(names, 2)}
    rows = []
    while need:
        best = max(combos, key=lambda c: len(pairs(c) & need))
        rows.append(best)
        need -= pairs(best)
    return rows


def full_sweep() -> bool:
    """``FP4_COMPILE_GATE=full``: full products instead of all-pairs (minutes; not for CI)."""
    return os.environ.get("FP4_COMPILE_GATE", "") == "full"


def run_scenarios():
    """Call the project's host launch code over every mode it supports (kernels only recorded).

    Default (CI, <= 3 min on 2 cores): quantize modes x input dtype as an all-pairs design;
    every (head_dim, causal, dS mode) of the attention backward; every Q-AdamW/NS variant.
    ``FP4_COMPILE_GATE=full``: full products everywhere.
    """
    import itertools

    import torch

    from fullstack_fp4.nvfp4.hadamard import DEFAULT_SIGNS
    from fullstack_fp4.nvfp4.kernels import quantize as tq
    from fullstack_fp4.nvfp4.kernels.decode import dequantize_triton

    assert not tq._is_interpreter(), "the gate must run with TRITON_INTERPRET unset / 0"
    full = full_sweep()

    def product(factors):
        names = list(factors)
        return [dict(zip(names, c)) for c in itertools.product(*factors.values())]
    design = product if full else pairwise

    # --- NVFP4 quantize: modes x input dtype; K = 256 (BLOCK_B = 8) --------------------------
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    rows = design(dict(dt=dtypes, tile=((1, 16), (16, 16)), rnd=("nearest", "sr_rand", "sr_philox"),
                       rule=("6", "4over6"), rht=(False, True), given=(False, True)))
    for r in rows:
        x = torch.randn(32, 256, dtype=r["dt"])
        kw = dict(tile=r["tile"], scale_rule=r["rule"], rht_signs=DEFAULT_SIGNS if r["rht"] else None)
        if r["rnd"] != "nearest":
            kw["rounding"] = "stochastic"
            if r["rnd"] == "sr_rand":
                kw["rand"] = torch.rand(32, 256)
            else:
                kw["seed"] = 7
        if r["given"]:
            kw["global_amax"] = torch.tensor(3.0)
        _scenario("quantize " + " ".join(f"{k}={v}" for k, v in r.items()))
        tq.quantize_triton(x, **kw)
    # small K -> BLOCK_B = 1, 2, 4 (next_power_of_2); 3-D input; empty input (host path only)
    ks = (16, 32, 48, 64) if full else (16, 32, 64)
    for i, k in enumerate(ks):
        tiles = ((1, 16), (16, 16)) if full else (((1, 16), (16, 16))[i % 2],)
        rules = ("6", "4over6") if full else (("4over6", "6")[i % 2],)
        for tile in tiles:
            for rule in rules:
                _scenario(f"quantize K={k} {tile} {rule}")
                tq.quantize_triton(torch.randn(2, 16, k, dtype=torch.bfloat16), tile=tile,
                                   scale_rule=rule, rht_signs=DEFAULT_SIGNS)
                tq.quantize_triton(torch.randn(16, k, dtype=torch.bfloat16), tile=tile,
                                   scale_rule=rule, rounding="stochastic", seed=1)
    # no-sync mode with a host-number amax (passed by value: AMAX_IMM), RHT amax pass alone
    for rht in (False, True):
        _scenario(f"quantize host amax, check_finite=False, rht={rht}")
        tq.quantize_triton(torch.randn(32, 256, dtype=torch.bfloat16), global_amax=3.0,
                           check_finite=False, rht_signs=DEFAULT_SIGNS if rht else None)
        tq.quantize_triton(torch.randn(32, 256, dtype=torch.bfloat16), global_amax=3.0,
                           rounding="stochastic", seed=3, check_finite=False,
                           rht_signs=DEFAULT_SIGNS if rht else None)
        _scenario(f"amax_triton rht={rht}")
        tq.amax_triton(torch.randn(32, 256, dtype=torch.bfloat16), DEFAULT_SIGNS if rht else None)
    _scenario("quantize empty")
    tq.quantize_triton(torch.empty(0, 64, dtype=torch.bfloat16))
    _scenario("philox_uniforms")
    tq.philox_uniforms((32, 64), seed=3)
    _scenario("e4m3_rne_triton")
    tq.e4m3_rne_triton(torch.randn(100))

    # --- NVFP4 dequantize: every output dtype, 1x16 and 16x16 -------------------------------
    for tile in ((1, 16), (16, 16)):
        t = tq.quantize_triton(torch.randn(32, 256, dtype=torch.bfloat16), tile=tile)
        for out in dtypes:
            _scenario(f"dequantize {tile} -> {out}")
            dequantize_triton(t, out)
        _scenario(f"decode_bf16_triton {tile} (emulated GEMM operand)")
        from fullstack_fp4.nvfp4.kernels.decode import decode_bf16_triton
        decode_bf16_triton(t)

    # --- NVFP4 linear: fused two-way operands (the launches the linear makes) + GEMM epilogue
    from fullstack_fp4.nvfp4.kernels import quantize_two_ways as tqd
    from fullstack_fp4.nvfp4.kernels.gemm_epilogue import scale_accumulate_triton, scale_cast_triton
    rw, cw = tqd.RowWay, tqd.ColWay
    sr = "stochastic"
    ways = (  # (label, input dtype, channels, row way, column way, int64 offsets, alphas)
        # The linear's three launches at the GPU tile (NB = 32), plus small-C tiles (NB < 32,
        # fewer warps) with per-element reads (FP32 / FP16 input) and the int64-offset /
        # tl.randint4x variant the host picks past 2^31 (forced here), one per way.
        # (The dY kernel is the gate's slowest compile, ~40-80 s: the other on/off
        # combinations of the same flags are left out.)
        # W's and dY's calls write the GEMM alphas, as in the linear
        ("fprop x + saved RHT(xT)", torch.bfloat16, 1024, rw(), cw(), False, False),
        ("W 16x16 decoded + saved codes", torch.bfloat16, 1024, rw(tile=(16, 16), codes=True), None,
         False, True),
        ("dY both ways SR", torch.bfloat16, 1024, rw(sr), cw(sr, decoded=True, codes=False), False,
         True),
        ("dY dgrad only, small C, int64", torch.float32, 64, rw(sr), None, True, False),
        ("wgrad operand codes SR, small C, int64", torch.float16, 32, None, cw(sr), True, False),
    )
    needs_i64 = tqd._needs_i64
    one = torch.ones(1)
    for label, dt, c, row, col, i64, alphas in ways:
        m = torch.randn(48, c, dtype=dt)
        _scenario(f"linear two-way operands: {label}")
        tqd._needs_i64 = (lambda *a: True) if i64 else needs_i64
        try:
            obs = tqd.amax_two_ways(m, row=row is not None, col=col is not None)
            peers = dict(row_peer_scale=one if row is not None else None,
                         col_peer_scale=one if col is not None else None) if alphas else {}
            tqd.quantize_two_ways(m, obs, row=row, col=col, seed_row=1, seed_col=2, **peers)
        finally:
            tqd._needs_i64 = needs_i64
    _scenario("linear forward: amax of x (both ways) and W (row way) in one launch")
    tqd.amax_two_ways_pair(torch.randn(48, 1024, dtype=torch.bfloat16),
                           torch.randn(64, 1024, dtype=torch.bfloat16))
    _scenario("linear backward: saved W and RHT(xT) decoded in one launch")
    from fullstack_fp4.nvfp4.kernels.decode import decode_bf16_pair
    decode_bf16_pair(tq.quantize_triton(torch.randn(64, 256, dtype=torch.bfloat16), tile=(16, 16)),
                     tq.quantize_triton(torch.randn(256, 64, dtype=torch.bfloat16)))
    for out in dtypes:
        _scenario(f"gemm epilogue scale_cast_triton -> {out}")
        scale_cast_triton(torch.randn(64, 96), torch.tensor(0.5), torch.tensor(3.0), out)
    for dst in (torch.float32, torch.bfloat16):   # the wgrad fused into main_grad
        _scenario(f"gemm epilogue scale_accumulate_triton -> {dst} main_grad")
        scale_accumulate_triton(torch.randn(64, 96), torch.tensor(0.5), torch.tensor(3.0),
                                torch.zeros(64, 96, dtype=dst))

    # --- Q-Attn: prologue, forward, backward -----------------------------------------------
    from fullstack_fp4.attention.prologue import make_views, prepare_views
    from fullstack_fp4.attention.triton_bwd import attention_backward
    from fullstack_fp4.attention.triton_fwd import attention_forward
    from fullstack_fp4.attention import triton_bwd, triton_fwd
    assert not triton_fwd.INTERPRET and not triton_bwd.INTERPRET

    # (qk_fp4, ds_fp4, ds stochastic); every constexpr combination (D, CAUSAL, DS_FP4, STOCH)
    # is launched; GQA (GROUPS 1 is specialised), ragged S and input dtype rotate over the rows.
    paths = ((True, True, False), (True, True, True), (True, False, False), (False, True, False),
             (False, False, False))
    rows = product(dict(d=(64, 128), causal=(False, True), path=paths))
    if full:
        rows = [dict(r, groups=g, s=s, in_dt=dt) for r in rows for g in (1, 2) for s in (128, 100)
                for dt in (torch.bfloat16, torch.float32)]
    else:
        rows = [dict(r, groups=(1, 2)[i % 2], s=(128, 100)[(i // 2) % 2],
                     in_dt=(torch.bfloat16, torch.float32)[(i // 4) % 2]) for i, r in enumerate(rows)]
    for r in rows:
        d, s, groups, causal = r["d"], r["s"], r["groups"], r["causal"]
        qk_fp4, ds_fp4, stoch = r["path"]
        b, h = 1, 4
        q = torch.randn(b, h, s, d, dtype=r["in_dt"])
        k = torch.randn(b, h // groups, s, d, dtype=r["in_dt"])
        v = torch.randn(b, h // groups, s, d, dtype=r["in_dt"])
        _scenario(f"attention d={d} {r['in_dt']} G={groups} causal={causal} S={s} "
                  f"qk_fp4={qk_fp4} ds_fp4={ds_fp4} stoch={stoch}")
        # the autograd function's path: prologue writing the packed (4-bit) saved views, forward,
        # decode of the saved views, backward with the input dtype's gradients
        fwd_views, saved = prepare_views(q, k, qk_fp4=qk_fp4, ds_fp4=ds_fp4, smooth=True,
                                         backend="triton")
        o, lse = attention_forward(fwd_views, v, causal=causal, scale=d ** -0.5)
        do = torch.randn(q.shape, dtype=r["in_dt"])
        attention_backward(do, o, lse, v, saved.unpack("triton"), causal=causal,
                           scale=d ** -0.5, ds_fp4=ds_fp4, ds_stochastic=stoch, seed=5,
                           out_dtypes=(r["in_dt"],) * 3)
    # the BF16-view path (make_views: tests, benchmark stage times) and the 64-row backward at
    # 8 warps (knobs.QATTN_BWD rn = rm = 1, a benchmark sweep option)
    from fullstack_fp4 import knobs
    for d in (64, 128):
        q, k, v = (torch.randn(1, 4, 128, d, dtype=torch.bfloat16) for _ in range(3))
        _scenario(f"attention make_views d={d}; backward knobs.QATTN_BWD=(8, 2, 8, 2, 1, 1)")
        views = make_views(q, k, qk_fp4=True, ds_fp4=True, smooth=True, backend="triton")
        o, lse = attention_forward(views, v, causal=True, scale=d ** -0.5)
        bwd_knob, knobs.QATTN_BWD = knobs.QATTN_BWD, (8, 2, 8, 2, 1, 1)
        try:
            attention_backward(torch.randn(q.shape, dtype=torch.bfloat16), o, lse, v, views,
                               causal=True, scale=d ** -0.5, out_dtypes=(torch.bfloat16,) * 3)
        finally:
            knobs.QATTN_BWD = bwd_knob
    # megatron's layout through the autograd function's host path: q, k as [s, b, h, d] views,
    # v a view into the fused QKV buffer, dO [s, b, h, d]; O, dQ, dK, dV stored [s, b, h, d]
    # (strides are runtime ints: the same compiles as above unless a stride specialises)
    from fullstack_fp4.attention.layout import dim_order
    for d, causal in ((64, True), (128, False)):
        s_, b_, hk_, g_ = 100, 2, 2, 2
        buf = torch.randn(s_, b_, hk_, (g_ + 2) * d, dtype=torch.bfloat16)
        q = buf[..., :g_ * d].reshape(s_, b_, hk_ * g_, d).permute(1, 2, 0, 3)
        k, v = (buf[..., i * d:(i + 1) * d].permute(1, 2, 0, 3) for i in (g_, g_ + 1))
        _scenario(f"attention megatron [s, b, h, d] layout d={d} causal={causal} G={g_}")
        fwd_views, saved = prepare_views(q, k, qk_fp4=True, ds_fp4=True, smooth=True,
                                         backend="triton")
        o, lse = attention_forward(fwd_views, v, causal=causal, scale=d ** -0.5,
                                   out_order=dim_order(q))
        do = torch.randn(s_, b_, hk_ * g_, d, dtype=torch.bfloat16).permute(1, 2, 0, 3)
        attention_backward(do, o, lse, v, saved.unpack("triton"), causal=causal, scale=d ** -0.5,
                           out_dtypes=(torch.bfloat16,) * 3,
                           out_orders=tuple(dim_order(x) for x in (q, k, v)))

    # --- Newton-Schulz fused NVFP4 operand --------------------------------------------------
    from fullstack_fp4.optim.triton_ns import quantize_decode
    for dt in (torch.float32, torch.bfloat16):
        for shape in (((64, 128), (96, 256)) if full else ((96, 256),)):
            x = torch.randn(*shape, dtype=dt)
            _scenario(f"ns quantize_decode {dt} {shape}")
            quantize_decode(x)
            _scenario(f"ns quantize_decode {dt} {shape} transposed view")
            quantize_decode(torch.randn(shape[1], shape[0], dtype=dt).t())

    # the lean two-term step's kernels (newton_schulz._step_nvfp4_two_term_lean): row-major X
    # and column-major X (a tall G's transposed view), the guard's scale on and off
    from fullstack_fp4.optim.triton_ns import abs_max, cross_two_term_axpy, split2, sym_two_term
    for colmajor in (False, True):
        X = torch.randn(256, 96).t() if colmajor else torch.randn(96, 256)
        for rs in (None, torch.tensor(0.9)):
            _scenario(f"ns lean two-term step, column-major X={colmajor}, guard scale={rs is not None}")
            A = sym_two_term(split2(X, amax=abs_max(X)))
            scale = None if rs is None else rs.reshape(1)
            xc = split2(X.t(), amax=abs_max(X) if rs is None else abs_max(X) * rs, scale=scale)
            cross_two_term_axpy(X, rs, torch.tensor(1.1), split2(A), xc)

    # --- Q-AdamW fused step ----------------------------------------------------------------
    from fullstack_fp4.optim.q_adamw.codecs import padded_numel
    from fullstack_fp4.optim.q_adamw.optimizer import kernel_hyper, kernel_views
    from fullstack_fp4.optim.q_adamw.state import init_state
    from fullstack_fp4.optim.q_adamw.triton_step import launch
    # model_out: the fused BF16 model-param write (megatron's Float16 / distributed optimizer)
    # fd: the approximate update division (launch(fast_div=), QAdamW(approx_division=))
    rows = (product(dict(n=(4096, 1000), gdt=(torch.float32, torch.bfloat16), rand=(False, True),
                         mo=(False, True), fd=(False, True)))
            if full else [dict(n=4096, gdt=torch.float32, rand=False, mo=False, fd=False),
                          dict(n=1000, gdt=torch.bfloat16, rand=True, mo=False, fd=False),
                          dict(n=4096, gdt=torch.float32, rand=False, mo=True, fd=True),
                          dict(n=4096, gdt=torch.bfloat16, rand=False, mo=True, fd=False)])
    for r in rows:
        n = r["n"]
        p = torch.randn(n)
        st = kernel_views(init_state(n, "cpu"))
        rand = torch.rand(padded_numel(n)) if r["rand"] else None
        mo = torch.empty(n, dtype=torch.bfloat16) if r["mo"] else None
        _scenario(f"q_adamw n={n} grad={r['gdt']} rand={r['rand']} model_out={r['mo']} "
                  f"fast_div={r['fd']}")
        launch(p, torch.randn(n, dtype=r["gdt"]), st, n, padded_numel(n), seed=11,
               rand=rand, model_out=mo, fast_div=r["fd"],
               **kernel_hyper(1e-3, 0.9, 0.95, 1e-8, 0.1, 3, "cpu"))
    # the model_out write with the integer RNE instead of the hardware cast (BF16_HW_CVT=False)
    import fullstack_fp4.optim.q_adamw.triton_step as q_step
    hw_cvt, q_step.BF16_HW_CVT = q_step.BF16_HW_CVT, False
    try:
        _scenario("q_adamw n=4096 model_out, integer BF16 RNE")
        launch(torch.randn(4096), torch.randn(4096), kernel_views(init_state(4096, "cpu")), 4096,
               4096, seed=11, model_out=torch.empty(4096, dtype=torch.bfloat16),
               **kernel_hyper(1e-3, 0.9, 0.95, 1e-8, 0.1, 3, "cpu"))
    finally:
        q_step.BF16_HW_CVT = hw_cvt
    # the multi-tensor launch (triton_multi.py): parameters found through a table
    from fullstack_fp4.optim.q_adamw.triton_multi import Item, launch_multi
    # (SUB 1, the default, without the loop; SUB 2 with it)
    for gdt, mo, fd, sub in ((torch.float32, False, False, 1), (torch.bfloat16, True, True, 2)):
        items = [Item(torch.randn(n), torch.randn(n, dtype=gdt),
                      kernel_views(init_state(n, "cpu")), n, padded_numel(n), 0, 0, 5 + n,
                      torch.empty(n, dtype=torch.bfloat16).view(torch.int16) if mo else None)
                 for n in (4096, 2048)]
        _scenario(f"q_adamw multi-tensor grad={gdt} model_out={mo} fast_div={fd} sub={sub}")
        launch_multi(items, t=3, fast_div=fd, sub=sub,
                     **kernel_hyper(1e-3, 0.9, 0.95, 1e-8, 0.1, 3, "cpu"))
    # superseded kernel variants kept for benchmarks/bench_q_adamw.py (same launch signature)
    import fullstack_fp4.optim.q_adamw as qa
    for mod in sorted(m.name for m in pkgutil.iter_modules(qa.__path__)):
        if mod.startswith("triton_step_") and hasattr(importlib.import_module(f"{qa.__name__}.{mod}"), "launch"):
            n = 4096
            _scenario(f"q_adamw {mod} (benchmark baseline)")
            importlib.import_module(f"{qa.__name__}.{mod}").launch(
                torch.randn(n), torch.randn(n), kernel_views(init_state(n, "cpu")), n,
                padded_numel(n), seed=11, **kernel_hyper(1e-3, 0.9, 0.95, 1e-8, 0.1, 3, "cpu"))


# ----------------------------------------------------------------------------- jobs
def build_jobs():
    """Distinct compile jobs from the recorded launches, exactly as ``JITFunction.run`` builds them."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget(*TARGET)
    backend = make_backend(target)
    binders = {}
    jobs, seen = [], {}
    for fn, args, kwargs, label in _LAUNCHES:
        kwargs = dict(kwargs)
        kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
        for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
            if hasattr(knobs.compilation, name):
                kwargs[name] = getattr(knobs.compilation, name)
        if id(fn) not in binders:
            binders[id(fn)] = create_function_from_signature(fn.signature, fn.params, backend)
        bound, spec, options = binders[id(fn)](*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
        key = (id(fn), repr(sorted(signature.items())), repr(sorted(constexprs.items())),
               repr(sorted(attrs.items())), repr(options))
        if key in seen:
            jobs[seen[key]]["labels"].append(label)
            continue
        seen[key] = len(jobs)
        consts = {fn.arg_names[p[0]]: v for p, v in constexprs.items() if len(p) == 1}
        jobs.append(dict(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs,
                         options=options.__dict__, labels=[label],
                         name=f"{fn.module}.{fn.__name__}",
                         desc=", ".join(f"{k}={v}" for k, v in consts.items()
                                        if k in fn.arg_names and fn.params[fn.arg_names.index(k)].is_constexpr),
                         sig=", ".join(f"{k}:{v}" for k, v in signature.items() if v != "constexpr"),
                         spec1=[k for k, v in consts.items()
                                if not fn.params[fn.arg_names.index(k)].is_constexpr],
                         num_warps=options.num_warps, num_stages=options.num_stages))
    return jobs


_PTXAS_LOG: list = []


def _install_ptxas_log_capture():
    """Keep the ``ptxas -v`` log of each compile (Triton writes it to a temp file and deletes it)."""
    import triton.backends.nvidia.compiler as nvc

    real_run = subprocess.run

    def run(cmd, *a, **kw):
        res = real_run(cmd, *a, **kw)
        err = kw.get("stderr")
        if isinstance(cmd, list) and "ptxas" in os.path.basename(str(cmd[0])) and hasattr(err, "name"):
            try:
                with open(err.name) as f:
                    _PTXAS_LOG.append(f.read())
            except OSError:
                pass
        return res

    nvc.subprocess = type(sys)("subprocess_proxy")
    nvc.subprocess.__dict__.update(subprocess.__dict__)
    nvc.subprocess.run = run


def _regs_spills(log: str):
    regs = re.findall(r"Used (\d+) registers", log)
    spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    r = int(regs[-1]) if regs else None
    s = (int(spill[-1][0]), int(spill[-1][1])) if spill else None
    return r, s


def _ptxas_verbose(ptx: str) -> str:
    import tempfile
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([get_ptxas(TARGET[1]).path, "-v", "--gpu-name=sm_90a", src, "-o",
                              os.path.join(d, "k.o")], capture_output=True, text=True)
        return out.stderr


_JOBS: list = []
_COST = {"q_adamw_kernel": 40, "q_adamw_multi_kernel": 45, "_quantize_two_ways_kernel": 30, "_quantize_kernel": 6,
         "_dkdv_kernel": 4, "_dq_kernel": 3}  # rough s


def compile_job(i: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    job = _JOBS[i]
    t0 = time.time()
    res = dict(name=job["name"], desc=job["desc"], sig=job["sig"], labels=job["labels"][:3],
               n_launches=len(job["labels"]), num_warps=job["num_warps"],
               num_stages=job["num_stages"], spec1=job["spec1"])
    try:
        del _PTXAS_LOG[:]
        src = ASTSource(fn=job["fn"], signature=job["signature"], constexprs=job["constexprs"],
                        attrs=job["attrs"])
        k = triton.compile(src, target=GPUTarget(*TARGET), options=job["options"])
        assert k.asm.get("cubin"), "no cubin produced"
        log = _PTXAS_LOG[-1] if _PTXAS_LOG else _ptxas_verbose(k.asm["ptx"])
        regs, spills = _regs_spills(log)
        res.update(ok=True, regs=regs, spill_stores=spills[0] if spills else None,
                   spill_loads=spills[1] if spills else None,
                   shared=k.metadata.shared)
    except Exception as e:  # noqa: BLE001 -- report every failure, not just the first
        msg = "".join(traceback.format_exception_only(type(e), e)).strip()
        res.update(ok=False, error=msg[-3000:])
    res["seconds"] = round(time.time() - t0, 2)
    return res


# ----------------------------------------------------------------------------- coverage
def jit_functions():
    """Every JITFunction defined in a fullstack_fp4 module that mentions ``triton.jit``."""
    from triton.runtime.jit import JITFunction
    import fullstack_fp4

    found = {}
    for mod in pkgutil.walk_packages(fullstack_fp4.__path__, "fullstack_fp4."):
        path = os.path.join(ROOT, *mod.name.split(".")) + ".py"
        if not os.path.exists(path) or "triton.jit" not in open(path).read():
            continue
        m = importlib.import_module(mod.name)
        for name, obj in vars(m).items():
            if isinstance(obj, JITFunction) and obj.module == mod.name:
                found[f"{mod.name}.{obj.__name__}"] = obj
    return found


def uncovered(launched_names):
    from triton.runtime.jit import JITFunction
    allfns = jit_functions()
    byid = {id(f): n for n, f in allfns.items()}
    covered = set(launched_names)
    todo = [allfns[n] for n in covered if n in allfns]
    while todo:
        fn = todo.pop()
        names = {n.id for n in ast.walk(ast.parse(fn.src)) if isinstance(n, ast.Name)}
        for nm in names:
            obj = fn.fn.__globals__.get(nm)
            if isinstance(obj, JITFunction) and byid.get(id(obj)) and byid[id(obj)] not in covered:
                covered.add(byid[id(obj)])
                todo.append(obj)
    return sorted(set(allfns) - covered)


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--only", default=None, help="substring filter on kernel name (debugging)")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("run with TRITON_INTERPRET unset (the gate needs real JITFunctions)", file=sys.stderr)
        return 2
    sys.path.insert(0, ROOT)
    t0 = time.time()
    _install_recorder()
    _install_ptxas_log_capture()
    scenario_error = None
    try:
        run_scenarios()
    except Exception:  # noqa: BLE001
        scenario_error = traceback.format_exc()
    _JOBS.extend(j for j in build_jobs() if a.only is None or any(s in j["name"] for s in a.only.split(",")))
    missing = uncovered({j["name"] for j in _JOBS}) if a.only is None else []
    t1 = time.time()
    order = sorted(range(len(_JOBS)), key=lambda i: -_COST.get(_JOBS[i]["fn"].__name__, 1))
    if a.jobs > 1:
        import multiprocessing as mp
        with ProcessPoolExecutor(a.jobs, mp_context=mp.get_context("fork")) as ex:
            results = list(ex.map(compile_job, order))
    else:
        results = [compile_job(i) for i in order]
    t2 = time.time()

    for r in results:
        if r["ok"]:
            sp = (f"spill {r['spill_stores']}/{r['spill_loads']} B" if r["spill_stores"] is not None
                  else "spill ?")
            print(f"OK   {r['name']:<58} regs {r['regs']!s:>4}  {sp:<16} w{r['num_warps']} "
                  f"{r['seconds']:5.1f}s  [{r['desc']}]")
        else:
            print(f"FAIL {r['name']} [{r['desc']}] sig({r['sig']})\n     e.g. {r['labels'][0]}\n"
                  f"     {r['error'].splitlines()[-1] if r['error'] else ''}")
    n_fail = sum(not r["ok"] for r in results)
    print(f"\n{len(_LAUNCHES)} launches -> {len(results)} distinct sm_90 compiles, "
          f"{n_fail} failed; capture {t1 - t0:.1f}s, compile {t2 - t1:.1f}s ({a.jobs} procs)")
    if missing:
        print("NOT COVERED (no scenario launches or reaches them):", ", ".join(missing))
    if scenario_error:
        print("SCENARIO ERROR (host launch code raised):\n" + scenario_error)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(results=results, missing=missing, scenario_error=scenario_error,
                           launches=len(_LAUNCHES), capture_s=t1 - t0, compile_s=t2 - t1), f,
                      indent=1)
    return 1 if (n_fail or missing or scenario_error) else 0


if __name__ == "__main__":
    sys.exit(main())
