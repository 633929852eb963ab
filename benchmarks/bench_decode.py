"""NVFP4 decode to BF16 (the emulated GEMM's operand) on the GPU: exactness, then GB/s.

    python benchmarks/bench_decode.py [--sweep]

For the shapes the 4-block 3b model decodes in its backward (saved weights and the RHT'd
activation transposes: 3072×5120 … 8192×8192), ``decode_bf16_triton`` is first compared bit for
bit with the PyTorch decode (``e2m1(code) · fp32(scale)`` → BF16, gemm.py's CPU formula run on
the GPU), then timed (median of CUDA-event timings of 20 calls, each on a tensor larger than L2)
beside a device-to-device copy of the same output bytes. Bytes moved: 0.5625 B per element
read, 2 written. ``--sweep`` also times every ``knobs.DEQUANT_NBP`` × ``knobs.DEQUANT_WARPS``
pair of SWEEP (the flat kernel's blocks per program and warps; ``FP4_DEQUANT_NBP`` /
``FP4_DEQUANT_WARPS`` in the environment), each checked bit for bit first.
Writes ``bench_decode.json`` into ``$OUT`` if set.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _timing import median_ms  # noqa: E402
from fullstack_fp4 import knobs  # noqa: E402
from fullstack_fp4.nvfp4.e2m1 import e2m1_decode  # noqa: E402
from fullstack_fp4.nvfp4.quantize import quantize  # noqa: E402
from fullstack_fp4.nvfp4.kernels.decode import decode_bf16_triton  # noqa: E402

SHAPES = ((3072, 5120), (3072, 16384), (8192, 3072), (8192, 8192))
SWEEP = ((256, 8), (512, 8), (1024, 8), (2048, 8), (1024, 4), (512, 4), (2048, 16))


def torch_decode(t):
    k = t.shape[-1]
    vals = e2m1_decode(t.codes()).reshape(-1, k // 16, 16)
    return (vals * t.block_scale.reshape(-1, k // 16, 1).to(torch.float32)).reshape(-1, k).to(
        torch.bfloat16)


def run(cfg, qs):
    saved = knobs.DEQUANT_NBP, knobs.DEQUANT_WARPS
    if cfg is not None:
        knobs.DEQUANT_NBP, knobs.DEQUANT_WARPS = cfg
    try:
        rows = []
        for (m, k), q in qs.items():
            exact = torch.equal(decode_bf16_triton(q).view(torch.int16),
                                torch_decode(q).view(torch.int16))
            ms = median_ms(lambda: decode_bf16_triton(q), warmup=3) if exact else float("nan")
            gb = m * k * (0.5625 + 2) / 1e9
            rows.append({"shape": f"{m}x{k}", "exact": exact, "ms": ms, "GB/s": gb / ms * 1e3})
        return rows
    finally:
        knobs.DEQUANT_NBP, knobs.DEQUANT_WARPS = saved


def main():
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    torch.manual_seed(0)
    qs = {(m, k): quantize(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
          for m, k in SHAPES}
    big = torch.empty(8192 * 8192, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(big)
    copy_ms = median_ms(lambda: dst.copy_(big), warmup=3)
    copy_gbs = 2 * big.numel() * 2 / 1e9 / copy_ms * 1e3
    out = {"device": torch.cuda.get_device_name(), "copy_GB/s": copy_gbs, "configs": {}}
    print(f"device-to-device copy of 8192x8192 BF16: {copy_ms:.4f} ms, {copy_gbs:.0f} GB/s\n")
    print("| config (blocks/program, warps) | shape | exact | ms | GB/s | % of copy |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    cfgs = [None] + (list(SWEEP) if "--sweep" in sys.argv else [])
    for cfg in cfgs:
        name = "default" if cfg is None else f"{cfg[0]},{cfg[1]}"
        rows = run(cfg, qs)
        out["configs"][name] = rows
        for r in rows:
            print(f"| {name} | {r['shape']} | {r['exact']} | {r['ms']:.4f} | {r['GB/s']:.0f} | "
                  f"{100 * r['GB/s'] / copy_gbs:.0f}% |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_decode.json"), "w") as f:
            json.dump(out, f, indent=1)
    if not all(r["exact"] for rows in out["configs"].values() for r in rows):
        raise SystemExit("a decode differs from the PyTorch decode")


if __name__ == "__main__":
    main()
