#!/usr/bin/env python
"""Benchmark the Triton NVFP4 quantize kernels on one GPU (8192×8192 BF16), beside their peers.

    python scripts/bench_nvfp4_quantize.py            # prints a markdown table
    OUT=/some/dir python scripts/bench_nvfp4_quantize.py   # also writes $OUT/bench_nvfp4_quantize.json

What it does, in one run:
1. Bit-exactness gate: every mode of ``quantize_triton`` on a mid-size GPU tensor against the
   pure-PyTorch reference run on CPU (the oracle); the script exits non-zero on a mismatch
   before timing anything.
2. Copy bandwidth: ``dst.copy_(src)`` of the same tensor, bytes read + written.
3. Median time (``triton.testing.do_bench``, return_mode="median") of each quantize mode, both
   with the host NaN/Inf check (what callers get: one ``.item()`` sync) and without it (the
   kernels alone), and of the peers: a straightforward PyTorch fake-quant (quantize-dequantize),
   the reference quantizer on the GPU, and torchao's ``NVFP4Tensor.to_nvfp4`` if importable.

Bytes. "min bytes" is what any quantizer must move: read 2 B/elem (BF16) + write 0.5 B codes
+ 1/16 B scales = 2.5625 B/elem. "actual bytes" adds the second read of the input when the
global amax is computed by a separate pass (4.5625 B/elem); with ``global_amax`` given the
kernel reads the input once. GB/s = bytes / median time; "% copy" = that over the copy's.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
import triton.testing  # noqa: E402

from fullstack_fp4.nvfp4 import DEFAULT_SIGNS, hadamard16  # noqa: E402
from fullstack_fp4.nvfp4.reference import quantize_reference  # noqa: E402
from fullstack_fp4.nvfp4.triton_dequantize import dequantize_triton  # noqa: E402
from fullstack_fp4.nvfp4.triton_quantize import philox_uniforms, quantize_triton  # noqa: E402

M = N = 8192
MIN_B = 2.0 + 0.5 + 1.0 / 16      # bytes / element, single read
TWO_PASS_B = MIN_B + 2.0          # + amax pass read


def bench(fn, warmup=25, rep=200):
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def same(a, b):
    return (torch.equal(a.data.cpu(), b.data.cpu())
            and torch.equal(a.block_scale.cpu().view(torch.uint8), b.block_scale.cpu().view(torch.uint8))
            and int(a.tensor_scale.cpu().view(torch.int32)) == int(b.tensor_scale.cpu().view(torch.int32)))


def correctness_gate():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1024, 2048, generator=g) * torch.logspace(-3, 2, 2048)).to(torch.bfloat16)
    x[5, 7] = 4e3
    x[9, :16] = 0
    xd = x.cuda()
    rand = torch.rand(x.shape, generator=g)
    results = []
    for tile in [(1, 16), (16, 16)]:
        for rule in ["6", "4over6"]:
            for rnd in ["nearest", "stochastic"]:
                for rht in [False, True]:
                    signs = DEFAULT_SIGNS if rht else None
                    r = rand if rnd == "stochastic" else None
                    a = quantize_triton(xd, tile=tile, rounding=rnd, scale_rule=rule,
                                        rand=None if r is None else r.cuda(), rht_signs=signs)
                    xin = hadamard16(x, signs) if rht else x
                    b = quantize_reference(xin, tile=tile, rounding=rnd, scale_rule=rule, rand=r)
                    results.append((f"{tile[0]}x{tile[1]} {rnd} {rule} rht={rht}", same(a, b)))
    # in-kernel Philox against the reference fed the dumped uniforms
    a = quantize_triton(xd, rounding="stochastic", seed=77)
    u = philox_uniforms(x.shape, 77, device="cuda").cpu()
    results.append(("1x16 stochastic philox", same(a, quantize_reference(x, rounding="stochastic", rand=u))))
    # dequantize
    t = quantize_reference(x, scale_rule="4over6")
    from fullstack_fp4.nvfp4 import NVFP4Tensor
    td = NVFP4Tensor(t.data.cuda(), t.block_scale.cuda(), t.tensor_scale.cuda(), t.shape, t.dtype, t.tile)
    results.append(("dequantize bf16", torch.equal(dequantize_triton(td, torch.bfloat16).cpu(),
                                                   t.dequantize(torch.bfloat16))))
    return results


def torch_fake_quant(x):
    """Straightforward PyTorch NVFP4 quantize-dequantize (the 55 GB/s peer in DESIGN.md)."""
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


def main():
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    dev = torch.cuda.get_device_name()
    print(f"# NVFP4 quantize benchmark — {dev}, torch {torch.__version__}, triton {triton.__version__}\n")

    t0 = time.time()
    gate = correctness_gate()
    bad = [n for n, ok in gate if not ok]
    print(f"bit-exactness gate vs reference (1024×2048 BF16, {len(gate)} modes): "
          f"{'PASS' if not bad else 'FAIL: ' + ', '.join(bad)} ({time.time() - t0:.1f} s)\n")
    if bad:
        return 1

    torch.manual_seed(0)
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    dst = torch.empty_like(x)
    t_copy = bench(lambda: dst.copy_(x))
    copy_bw = 2 * x.numel() * x.element_size() / (t_copy * 1e-3) / 1e9
    amax_t = float(hadamard16(x[:1024], DEFAULT_SIGNS).abs().max())  # any value works for timing
    amax = float(x.float().abs().max())

    rows = []

    def add(name, fn, bytes_per_elem_actual, note=""):
        try:
            fn()
            torch.cuda.synchronize()
            ms = bench(fn)
        except Exception as e:  # a peer that fails should not sink the run
            rows.append(dict(name=name, ms=None, note=f"failed: {type(e).__name__}: {e}"[:120]))
            return
        gbs_min = MIN_B * n / (ms * 1e-3) / 1e9
        gbs_act = bytes_per_elem_actual * n / (ms * 1e-3) / 1e9
        rows.append(dict(name=name, ms=ms, gbs_min=gbs_min, gbs_actual=gbs_act,
                         frac_copy_min=gbs_min / copy_bw, frac_copy_actual=gbs_act / copy_bw,
                         note=note))

    q = quantize_triton
    modes = [
        ("1x16 nearest", dict()),
        ("16x16 nearest", dict(tile=(16, 16))),
        ("1x16 stochastic (Philox)", dict(rounding="stochastic", seed=1)),
        ("1x16 nearest 4/6", dict(scale_rule="4over6")),
        ("1x16 nearest RHT", dict(rht_signs=DEFAULT_SIGNS)),
        ("1x16 stochastic RHT (wgrad dY)", dict(rht_signs=DEFAULT_SIGNS, rounding="stochastic", seed=1)),
    ]
    for name, kw in modes:
        add(f"triton {name}, amax pass", lambda kw=kw: q(x, check_finite=False, **kw), TWO_PASS_B,
            "kernels only")
        add(f"triton {name}, amax pass + NaN check", lambda kw=kw: q(x, **kw), TWO_PASS_B,
            "what callers get (1 host sync)")
        ga = amax_t if "rht_signs" in kw else amax
        add(f"triton {name}, global_amax given", lambda kw=kw, ga=ga: q(x, global_amax=ga, check_finite=False, **kw),
            MIN_B, "single read")

    # block-shape sweep for the main mode (the lead can pick the best default from this)
    for cfg in [(16, 8, 4), (32, 8, 4), (64, 8, 4), (32, 16, 4), (64, 8, 8), (128, 4, 8), (32, 4, 2)]:
        add(f"sweep 1x16 nearest cfg={cfg}, amax pass",
            lambda cfg=cfg: q(x, check_finite=False, config=cfg), TWO_PASS_B, "kernels only")
        add(f"sweep 1x16 nearest cfg={cfg}, global_amax given",
            lambda cfg=cfg: q(x, global_amax=amax, check_finite=False, config=cfg), MIN_B, "")

    t = q(x)
    add("triton dequantize -> bf16", lambda: dequantize_triton(t, torch.bfloat16), 2.5625,
        "bytes: 0.5625 read + 2 written")
    add("PyTorch fake-quant (quant+dequant)", lambda: torch_fake_quant(x), 2 + 2.0,
        "peer; actual = read x + write x̂ (ignores its temporaries)")
    add("reference quantize (PyTorch, GPU)", lambda: quantize_reference(x), TWO_PASS_B, "oracle")
    try:
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor as AoNVFP4
        add("torchao NVFP4Tensor.to_nvfp4", lambda: AoNVFP4.to_nvfp4(x), MIN_B, "peer")
        add("torchao NVFP4Tensor.to_nvfp4 (per-tensor scale)",
            lambda: AoNVFP4.to_nvfp4(x, per_tensor_scale=torch.tensor(amax / (6 * 448), device="cuda")),
            MIN_B, "peer")
    except ImportError as e:
        rows.append(dict(name="torchao NVFP4Tensor.to_nvfp4", ms=None, note=f"skipped: {e}"[:100]))

    print(f"copy (dst.copy_(src), 8192×8192 BF16): {t_copy * 1e3:.1f} µs = {copy_bw:.0f} GB/s (read + write)\n")
    print("| kernel | median µs | GB/s (min bytes 2.5625 B/el) | % copy (min) | GB/s (actual bytes) | % copy (actual) | note |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        if r["ms"] is None:
            print(f"| {r['name']} | – | – | – | – | – | {r['note']} |")
        else:
            print(f"| {r['name']} | {r['ms'] * 1e3:.1f} | {r['gbs_min']:.0f} | {100 * r['frac_copy_min']:.0f}% | "
                  f"{r['gbs_actual']:.0f} | {100 * r['frac_copy_actual']:.0f}% | {r['note']} |")

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
