#!/usr/bin/env python
"""Benchmark the Triton NVFP4 quantize kernels on one GPU (8192×8192 BF16), beside their peers.

    python benchmarks/bench_nvfp4_quantize.py            # gate + table (markdown)
    python benchmarks/bench_nvfp4_quantize.py --sweep    # + tile-config sweep of the kernels
    OUT=/some/dir python benchmarks/bench_nvfp4_quantize.py   # also writes $OUT/bench_nvfp4_quantize.json
    python benchmarks/bench_nvfp4_quantize.py --sass     # no GPU: SASS instructions per element
    ncu ... python benchmarks/bench_nvfp4_quantize.py --once  # each 1x16-nearest kernel form once

What it does, in one run:
1. Bit-exactness gate: every mode of ``quantize_triton`` (the tiled kernel, and the flat
   kernels where they apply) on a mid-size GPU tensor against the pure-PyTorch reference run on
   CPU (the oracle), plus flat == tiled on the full 8192² tensor. The script exits non-zero on a
   mismatch before timing anything.
2. Copy bandwidth: ``dst.copy_(src)`` of the same tensor, bytes read + written.
3. For each quantize mode, the median time of: the call as callers make it ("eager":
   ``triton.testing.do_bench``, L2 flushed before each call, host launch overhead included when
   it exceeds the flush), the same call replayed from a CUDA graph ("graph": device time of the
   kernels, L2 flushed before each replay), the tiled kernel for 1x16 nearest (graph), the amax pass alone
   (graph), and the call with the NaN check callers get by default (one host sync, eager).
   Then the peers: a straightforward PyTorch fake-quant, the reference on the GPU, torchao.
4. ``--sweep``: graph time of each mode over tile configs (BLOCK_M rows, BLOCK_B blocks,
   warps) of the quantize kernel and of the amax pass, and of the flat kernels' configs (blocks
   a program, warps), to pick the defaults from one GPU call.
5. ``--once``: no timing; the 1x16-nearest call once per kernel form (flat, tiled; amax pass
   and amax given), for a profiler (``ncu``) to read their counters.

Bytes. "min bytes" is what any quantizer must move: read 2 B/elem (BF16) + write 0.5 B codes
+ 1/16 B scales = 2.5625 B/elem. "actual bytes" adds the second read of the input when the
global amax is computed by a separate pass (4.5625 B/elem; part of that second read may hit L2,
which the number does not credit); with ``global_amax`` given the kernel reads the input once.
GB/s = bytes / median time; "% copy" = that over the copy's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import capture_graph  # noqa: E402

M = N = 8192
MIN_B = 2.0 + 0.5 + 1.0 / 16      # bytes / element, single read
TWO_PASS_B = MIN_B + 2.0          # + amax pass read

# name -> quantize_triton keyword arguments (seeded: the Philox stream is part of the contract)
MODES = {
    "1x16 nearest": dict(),
    "16x16 nearest": dict(tile=(16, 16)),
    "1x16 stochastic (Philox)": dict(rounding="stochastic", seed=1),
    "1x16 nearest 4/6": dict(scale_rule="4over6"),
    "1x16 nearest RHT": dict(rht="default"),
    "1x16 stochastic RHT (wgrad dY)": dict(rht="default", rounding="stochastic", seed=1),
}
# tile configs (BLOCK_M rows, BLOCK_B blocks, warps) timed by --sweep: blocks a thread = BM·NB/32/warps
SWEEP = [(16, 8, 4), (32, 8, 4), (64, 8, 4), (32, 8, 8), (4, 64, 4), (8, 64, 4)]
SWEEP_HEAVY = [(16, 8, 4), (32, 8, 4), (16, 8, 2), (32, 8, 8)]       # SR, 4/6: more registers
SWEEP_MODES = ["1x16 nearest", "16x16 nearest", "1x16 stochastic (Philox)", "1x16 nearest RHT",
               "1x16 stochastic RHT (wgrad dY)"]
AMAX_SWEEP = [(32, 8, 4), (64, 8, 4), (128, 8, 4), (64, 8, 8)]
# flat kernels (1x16 nearest, contiguous BF16): (blocks a program, warps); amax: (words, warps)
FLAT_SWEEP = [(64, 2), (128, 4), (256, 4), (512, 4), (256, 8), (512, 8), (1024, 8)]
FLAT_AMAX_SWEEP = [(1024, 4), (2048, 4), (4096, 8), (8192, 8), (16384, 16)]


def _kw(kw):
    from fullstack_fp4.nvfp4 import DEFAULT_SIGNS
    kw = dict(kw)
    if kw.pop("rht", None):
        kw["rht_signs"] = DEFAULT_SIGNS
    return kw


# ----------------------------------------------------------------------------- SASS counts
def sass_counts(configs=None):
    """Compile every mode (tiled kernel) for sm_90 with the real compiler, no GPU, and count
    the SASS instructions on the kernel's main path (up to the first EXIT; the ``div_rn`` slow
    path is a subroutine after it) per thread and per element. Issue-bound time at 8192² on an
    H200 ≈ T · 2.0 µs for T instructions an element (67.1e6 · T / 32 / 1.05e12 warp-instr/s)."""
    import collections
    import re
    import subprocess
    import tempfile

    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import triton
    import triton_compile_gate as gate
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    gate._install_recorder()                 # record launches instead of running them
    from fullstack_fp4.nvfp4.kernels import quantize as tq
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "cuobjdump")
    print("| mode | kernel | config (BM, NB, warps) | SASS / thread | el / thread | "
          "instr / el | regs | top opcodes |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | --- |")
    x = torch.randn(64, N, dtype=torch.bfloat16)
    runs = [(name, kw, None) for name, kw in list(MODES.items())
            + [("1x16 nearest, amax given", dict(global_amax=3.0))]]
    runs += [("1x16 nearest", dict(), c) for c in (configs or [])]
    for name, kw, cfg in runs:
        gate._LAUNCHES.clear()
        tq.quantize_triton(x, check_finite=False, flat=False, config=cfg, **_kw(kw))
        for job in gate.build_jobs():
            if cfg is not None and job["fn"].__name__ != "_quantize_kernel":
                continue                     # config rows: the amax pass has its own config
            src = ASTSource(fn=job["fn"], signature=job["signature"], constexprs=job["constexprs"],
                            attrs=job["attrs"])
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=job["options"])
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "k.cubin")
                with open(path, "wb") as f:
                    f.write(k.asm["cubin"])
                sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True,
                                      text=True).stdout
                res = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True,
                                     text=True).stdout
            ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
            main_path = ops[:ops.index("EXIT") + 1] if "EXIT" in ops else ops
            consts = {job["fn"].arg_names[p[0]]: v for p, v in job["constexprs"].items() if len(p) == 1}
            el = consts["BM"] * consts["NB"] * 16 / (32 * job["num_warps"])
            regs = re.search(r"REG:(\d+)", res)
            top = collections.Counter(o.split(".")[0] for o in main_path).most_common(6)
            print(f"| {name} | {job['fn'].__name__} | "
                  f"{consts['BM']}, {consts['NB']}, {job['num_warps']} | {len(main_path)} | "
                  f"{el:.0f} | {len(main_path) / el:.1f} | {regs.group(1) if regs else '?'} | "
                  f"{' '.join(f'{a}:{b}' for a, b in top)} |")
    return 0


# ----------------------------------------------------------------------------- GPU benchmark
def bench(fn, warmup=25, rep=200):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def bench_graph(fn):
    """Median device time of ``fn``'s kernels: captured once in a CUDA graph, each replay timed
    with CUDA events after do_bench's L2 flush (no host launch overhead in the number)."""
    return bench(capture_graph(fn).replay)


def same(a, b):
    return (torch.equal(a.data.cpu(), b.data.cpu())
            and torch.equal(a.block_scale.cpu().view(torch.uint8), b.block_scale.cpu().view(torch.uint8))
            and int(a.tensor_scale.cpu().view(torch.int32)) == int(b.tensor_scale.cpu().view(torch.int32)))


def correctness_gate(x_full):
    from fullstack_fp4.nvfp4 import DEFAULT_SIGNS, NVFP4Tensor, hadamard16
    from fullstack_fp4.nvfp4.reference import quantize_reference
    from fullstack_fp4.nvfp4.kernels.decode import dequantize_triton
    from fullstack_fp4.nvfp4.kernels.quantize import philox_uniforms, quantize_triton

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1024, 2048, generator=g) * torch.logspace(-3, 2, 2048)).to(torch.bfloat16)
    x[5, 7] = 4e3
    x[9, :16] = 0
    x[11, 16:32] = 1e-7 * torch.randn(16, generator=g)        # subnormal E4M3 scales
    xd = x.cuda()
    rand = torch.rand(x.shape, generator=g)
    results = []
    for tile in [(1, 16), (16, 16)]:
        for rule in ["6", "4over6"]:
            for rnd in ["nearest", "stochastic"]:
                for rht in [False, True]:
                    signs = DEFAULT_SIGNS if rht else None
                    r = rand if rnd == "stochastic" else None
                    xin = hadamard16(x, signs) if rht else x
                    b = quantize_reference(xin, tile=tile, rounding=rnd, scale_rule=rule, rand=r)
                    a = quantize_triton(xd, tile=tile, rounding=rnd, scale_rule=rule,
                                        rand=None if r is None else r.cuda(), rht_signs=signs,
                                        flat=False)
                    results.append((f"{tile[0]}x{tile[1]} {rnd} {rule} rht={rht}", same(a, b)))
                    if tile == (1, 16) and rule == "6" and rnd == "nearest" and not rht:
                        for ga in (None, 7.5):
                            bb = b if ga is None else quantize_reference(x, global_amax=torch.tensor(ga))
                            results.append((f"1x16 nearest 6 flat{' amax given' if ga else ''}",
                                            same(quantize_triton(xd, flat=True, global_amax=ga), bb)))
    # in-kernel Philox against the reference fed the dumped uniforms
    for rht in (False, True):
        signs = DEFAULT_SIGNS if rht else None
        a = quantize_triton(xd, rounding="stochastic", seed=77, rht_signs=signs)
        u = philox_uniforms(x.shape, 77, device="cuda").cpu()
        xin = hadamard16(x, signs) if rht else x
        results.append((f"1x16 stochastic philox rht={rht}",
                        same(a, quantize_reference(xin, rounding="stochastic", rand=u))))
    # the full benchmark tensor: flat kernels == tiled kernel, both amax paths
    for ga in (None, 7.5):
        a = quantize_triton(x_full, global_amax=ga, flat=True)
        b = quantize_triton(x_full, global_amax=ga, flat=False)
        results.append((f"8192² flat == tiled{', amax given' if ga else ''}", same(a, b)))
    # dequantize
    t = quantize_reference(x, scale_rule="4over6")
    td = NVFP4Tensor(t.data.cuda(), t.block_scale.cuda(), t.tensor_scale.cuda(), t.shape, t.dtype, t.tile)
    results.append(("dequantize bf16", torch.equal(dequantize_triton(td, torch.bfloat16).cpu(),
                                                   t.dequantize(torch.bfloat16))))
    return results


def torch_fake_quant(x):
    """Straightforward PyTorch NVFP4 quantize-dequantize."""
    xf = x.float()
    amax = xf.abs().amax()
    enc = (448.0 * 6.0) / amax
    xb = xf.reshape(x.shape[0], -1, 16)
    bamax = xb.abs().amax(-1, keepdim=True)
    s = torch.clamp(bamax * (enc / 6.0), max=448.0).to(torch.float8_e4m3fn).float()
    dec = 1.0 / enc
    f = torch.where(s == 0, torch.zeros_like(s), 1.0 / (s * dec))
    y = torch.clamp(xb * f, -6.0, 6.0)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=x.device)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=x.device)
    idx = torch.bucketize(y.abs(), mids)
    q = torch.sign(y) * grid[idx]
    return (q * s * dec).reshape(x.shape).to(x.dtype)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="time the tile configs of each mode")
    ap.add_argument("--sass", action="store_true", help="SASS instruction counts (no GPU)")
    ap.add_argument("--no-peers", action="store_true", help="skip the PyTorch / torchao peers")
    ap.add_argument("--once", action="store_true", help="each 1x16-nearest kernel form once (ncu)")
    a = ap.parse_args(argv)
    if a.sass:
        return sass_counts(SWEEP)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (or --sass)")
        return 2
    if a.once:
        from fullstack_fp4.nvfp4.kernels.quantize import quantize_triton
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        amax = float(x.float().abs().max())
        for form in (dict(flat=True), dict(flat=False)):
            for ga in (None, amax):
                quantize_triton(x, global_amax=ga, check_finite=False, **form)
        torch.cuda.synchronize()
        print("once: flat, tiled x (amax pass, amax given)")
        return 0

    import triton

    from fullstack_fp4.nvfp4 import DEFAULT_SIGNS, hadamard16
    from fullstack_fp4.nvfp4.reference import quantize_reference
    from fullstack_fp4.nvfp4.kernels.decode import dequantize_triton
    from fullstack_fp4.nvfp4.kernels.quantize import amax_triton, quantize_triton

    dev = torch.cuda.get_device_name()
    print(f"# NVFP4 quantize benchmark — {dev}, torch {torch.__version__}, triton {triton.__version__}\n")

    torch.manual_seed(0)
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    t0 = time.time()
    gate = correctness_gate(x)
    bad = [name for name, ok in gate if not ok]
    print(f"bit-exactness gate ({len(gate)} checks: every mode vs the reference on 1024×2048, "
          f"flat == tiled on 8192²): {'PASS' if not bad else 'FAIL: ' + ', '.join(bad)} "
          f"({time.time() - t0:.1f} s)\n")
    if bad:
        return 1

    dst = torch.empty_like(x)
    t_copy = bench(lambda: dst.copy_(x))
    copy_bw = 2 * x.numel() * x.element_size() / (t_copy * 1e-3) / 1e9
    amax_t = float(hadamard16(x[:1024], DEFAULT_SIGNS).abs().max())  # any value works for timing
    amax = float(x.float().abs().max())

    rows = []
    print(f"copy (dst.copy_(src), 8192×8192 BF16): {t_copy * 1e3:.1f} µs = {copy_bw:.0f} GB/s (read + write)\n")
    print("| kernel | timing | median µs | GB/s (min bytes 2.5625 B/el) | % copy (min) | "
          "GB/s (actual bytes) | % copy (actual) | note |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |", flush=True)

    def show(r):
        if r["ms"] is None:
            print(f"| {r['name']} | – | – | – | – | – | – | {r['note']} |", flush=True)
        else:
            print(f"| {r['name']} | {r['timing']} | {r['ms'] * 1e3:.1f} | {r['gbs_min']:.0f} | "
                  f"{100 * r['frac_copy_min']:.0f}% | {r['gbs_actual']:.0f} | "
                  f"{100 * r['frac_copy_actual']:.0f}% | {r['note']} |", flush=True)

    def add(name, fn, bytes_actual, note="", graph=False):
        """Time ``fn`` and print its row at once (a run cut short keeps what it measured)."""
        try:
            fn()
            torch.cuda.synchronize()
            ms = bench_graph(fn) if graph else bench(fn)
        except Exception as e:  # a peer that fails should not sink the run
            rows.append(dict(name=name, ms=None, note=f"failed: {type(e).__name__}: {e}"[:120]))
            show(rows[-1])
            return None
        gbs_min = MIN_B * n / (ms * 1e-3) / 1e9
        gbs_act = bytes_actual * n / (ms * 1e-3) / 1e9
        rows.append(dict(name=name, timing="graph" if graph else "eager", ms=ms, gbs_min=gbs_min,
                         gbs_actual=gbs_act, frac_copy_min=gbs_min / copy_bw,
                         frac_copy_actual=gbs_act / copy_bw, note=note))
        show(rows[-1])
        return ms

    q = quantize_triton
    for name, kw in MODES.items():
        kw = _kw(kw)
        ga = amax_t if "rht_signs" in kw else amax
        add(f"{name}, amax pass", lambda kw=kw: q(x, check_finite=False, **kw), TWO_PASS_B,
            "kernels only, the default kernel", graph=True)
        add(f"{name}, amax pass", lambda kw=kw: q(x, check_finite=False, **kw), TWO_PASS_B,
            "as called, no NaN check")
        if name == "1x16 nearest":
            add(f"{name}, amax pass, tiled default", lambda kw=kw: q(x, check_finite=False, flat=False, **kw),
                TWO_PASS_B, "the tiled kernel (flat=False)", graph=True)
        add(f"{name}, amax pass + NaN check", lambda kw=kw: q(x, **kw), TWO_PASS_B,
            "what callers get by default (1 host sync)")
        add(f"{name}, global_amax given", lambda kw=kw, ga=ga: q(x, global_amax=ga, check_finite=False, **kw),
            MIN_B, "single read, the default kernel", graph=True)
    add("amax pass alone (amax_triton)", lambda: amax_triton(x), 2.0, "bytes: 2 read", graph=True)
    import fullstack_fp4.nvfp4.kernels.quantize as tq
    add("amax pass alone, flat kernel", lambda: tq._launch_amax_flat(x, torch.zeros(1, dtype=torch.int32,
                                                                                   device="cuda")),
        2.0, "bytes: 2 read (+ a 4-byte zero fill)", graph=True)
    add("amax pass alone, RHT", lambda: amax_triton(x, DEFAULT_SIGNS), 2.0, "bytes: 2 read", graph=True)

    if a.sweep:
        for name in SWEEP_MODES:
            kw = _kw(MODES[name])
            ga = amax_t if "rht_signs" in kw else amax
            heavy = kw.get("rounding") == "stochastic" or kw.get("scale_rule") == "4over6"
            for cfg in (SWEEP_HEAVY if heavy else SWEEP):
                if kw.get("tile") == (16, 16) and cfg[0] % 16:
                    continue
                add(f"sweep {name}, quantize cfg={cfg}, global_amax given",
                    lambda kw=kw, ga=ga, cfg=cfg: q(x, global_amax=ga, check_finite=False, config=cfg, **kw),
                    MIN_B, "", graph=True)
        import fullstack_fp4.nvfp4.kernels.quantize as tq
        for tail_mb in (0, 16, 32, 48):
            tq.AMAX_L2_TAIL_BYTES = tail_mb << 20
            for name in ("1x16 nearest", "1x16 stochastic RHT (wgrad dY)"):
                kw = _kw(MODES[name])
                add(f"sweep {name}, amax pass, amax L2 tail evict_last {tail_mb} MB",
                    lambda kw=kw: q(x, check_finite=False, **kw), TWO_PASS_B, "AMAX_L2_TAIL_BYTES",
                    graph=True)
        tq.AMAX_L2_TAIL_BYTES = 0
        for cfg in FLAT_SWEEP:
            add(f"sweep 1x16 nearest flat, cfg={cfg}, global_amax given",
                lambda cfg=cfg: q(x, global_amax=amax, check_finite=False, flat=True, config=cfg),
                MIN_B, "", graph=True)
            add(f"sweep 1x16 nearest flat, cfg={cfg}, amax pass",
                lambda cfg=cfg: q(x, check_finite=False, flat=True, config=cfg), TWO_PASS_B, "",
                graph=True)
        for cfg in FLAT_AMAX_SWEEP:
            tq.FLAT_AMAX_CONFIG = cfg
            add(f"sweep flat amax pass cfg={cfg}",
                lambda: tq._launch_amax_flat(x, torch.zeros(1, dtype=torch.int32, device="cuda")),
                2.0, "bytes: 2 read", graph=True)
            add(f"sweep 1x16 nearest flat, amax cfg={cfg}, amax pass",
                lambda: q(x, check_finite=False, flat=True), TWO_PASS_B, "", graph=True)
        tq.FLAT_AMAX_CONFIG = None
        for cfg in AMAX_SWEEP:
            for rht in (None, DEFAULT_SIGNS):
                add(f"sweep amax pass cfg={cfg}{' RHT' if rht else ''}",
                    lambda cfg=cfg, rht=rht: amax_triton(x, rht, config=cfg), 2.0, "bytes: 2 read",
                    graph=True)

    t = q(x)
    add("triton dequantize -> bf16", lambda: dequantize_triton(t, torch.bfloat16), 2.5625,
        "bytes: 0.5625 read + 2 written")
    if not a.no_peers:
        add("PyTorch fake-quant (quant+dequant)", lambda: torch_fake_quant(x), 2 + 2.0,
            "peer; actual = read x + write x̂ (ignores its temporaries)")
        add("reference quantize (PyTorch, GPU)", lambda: quantize_reference(x), TWO_PASS_B, "oracle")
        try:
            from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor as AoNVFP4
            add("torchao NVFP4Tensor.to_nvfp4", lambda: AoNVFP4.to_nvfp4(x), MIN_B, "peer")
            add("torchao NVFP4Tensor.to_nvfp4 (per-tensor scale)",
                lambda: AoNVFP4.to_nvfp4(x, per_tensor_scale=torch.tensor(amax / (6 * 448), device="cuda")),
                MIN_B, "peer")
        except Exception as e:  # noqa: BLE001 - not importable, or failing on this torch: no row
            rows.append(dict(name="torchao NVFP4Tensor.to_nvfp4", ms=None,
                             note=f"skipped: {type(e).__name__}: {e}"[:100]))
            show(rows[-1])

    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "bench_nvfp4_quantize.json"), "w") as fh:
            json.dump(dict(device=dev, torch=torch.__version__, triton=triton.__version__,
                           shape=[M, N], dtype="bfloat16", copy_us=t_copy * 1e3,
                           copy_gbs=copy_bw, gate=gate, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
