"""Which form of the flat NVFP4 decode is exact on the GPU (run36's first flat kernel was not).

Layouts of the same arithmetic, each compared bit for bit with the PyTorch decode on quantized
random tensors and timed at 8192×8192 and 3072×16384, all at 128 blocks a program: A = the
committed ``_dequantize_flat_kernel`` (since session 24 a lane a half-block; before, a block's
halves in turn; in run36's first calls A was an earlier form, one [NBP, 2, 4] load and one
store); B = the same half-block walk written here;
C = no join: the even and odd elements stored separately at stride 2; D = the tiled kernel the
flat one replaced. Prints mismatch counts and the first mismatches.

    python scripts/gpu/diag_decode.py
"""
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _timing import median_ms  # noqa: E402
from bench_decode import torch_decode  # noqa: E402
from fullstack_fp4.nvfp4.quantize import quantize  # noqa: E402
from fullstack_fp4.nvfp4.triton_dequantize import (_dequantize_flat_kernel, _e2m1_value,  # noqa: E402
                                                   _e4m3_value)


@triton.jit
def _rne16(v):
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def _kernel_b(data_ptr, scale_ptr, out_ptr, NBLK_ALL, NBP: tl.constexpr):
    blk = tl.program_id(0) * NBP + tl.arange(0, NBP)
    bmask = blk < NBLK_ALL
    q = tl.arange(0, 4)
    j = tl.arange(0, 8)
    s = _e4m3_value(tl.load(scale_ptr + blk, mask=bmask, other=0).to(tl.int32))
    for h in tl.static_range(2):
        byte = tl.load(data_ptr + blk[:, None] * 8 + 4 * h + q[None, :], mask=bmask[:, None],
                       other=0).to(tl.int32)
        ve = _e2m1_value(byte & 15) * s[:, None]
        vo = _e2m1_value(byte >> 4) * s[:, None]
        v = tl.reshape(tl.join(ve, vo), (NBP, 8))
        tl.store(out_ptr + blk[:, None] * 16 + 8 * h + j[None, :], _rne16(v), mask=bmask[:, None])


@triton.jit
def _kernel_c(data_ptr, scale_ptr, out_ptr, NBLK_ALL, NBP: tl.constexpr):
    blk = tl.program_id(0) * NBP + tl.arange(0, NBP)
    bmask = blk < NBLK_ALL
    i = tl.arange(0, 8)
    s = _e4m3_value(tl.load(scale_ptr + blk, mask=bmask, other=0).to(tl.int32))
    byte = tl.load(data_ptr + blk[:, None] * 8 + i[None, :], mask=bmask[:, None],
                   other=0).to(tl.int32)
    base = out_ptr + blk[:, None] * 16 + 2 * i[None, :]
    tl.store(base, _rne16(_e2m1_value(byte & 15) * s[:, None]), mask=bmask[:, None])
    tl.store(base + 1, _rne16(_e2m1_value(byte >> 4) * s[:, None]), mask=bmask[:, None])


@triton.jit
def _kernel_d(data_ptr, scale_ptr, dec_ptr, out_ptr, M, NBLK,
                       OUT_BF16: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr,
                       APPLY_DEC: tl.constexpr = True):
    nbk = tl.cdiv(NBLK, NB)
    pid = tl.program_id(0)
    rows = (pid // nbk) * BM + tl.arange(0, BM)
    blks = (pid % nbk) * NB + tl.arange(0, NB)
    mask2 = (rows < M)[:, None] & (blks < NBLK)[None, :]
    m3 = mask2[:, :, None]
    r64 = rows.to(tl.int64)
    dec = tl.load(dec_ptr)
    s = _e4m3_value(tl.load(scale_ptr + r64[:, None] * NBLK + blks[None, :], mask=mask2,
                            other=0).to(tl.int32))
    q = tl.arange(0, 4)
    boff = (r64 * (NBLK * 8))[:, None, None] + (blks * 8)[None, :, None] + q[None, None, :]
    ooff = (r64 * (NBLK * 16))[:, None, None] + (blks * 16)[None, :, None]
    j = tl.arange(0, 8)
    for h in tl.static_range(2):
        byte = tl.load(data_ptr + boff + 4 * h, mask=m3, other=0).to(tl.int32)
        v_even = _e2m1_value(byte & 15) * s[:, :, None]
        v_odd = _e2m1_value(byte >> 4) * s[:, :, None]
        if APPLY_DEC:
            v_even = v_even * dec
            v_odd = v_odd * dec
        v = tl.reshape(tl.join(v_even, v_odd), (BM, NB, 8))   # element 2i low nibble, 2i+1 high
        if OUT_BF16:
            # FP32 -> BF16 RNE in integer arithmetic (finite values only): the Triton
            # interpreter's FP32 -> BF16 cast truncates, the GPU's rounds; this is exact on both.
            bits = v.to(tl.int32, bitcast=True)
            v = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)
        else:
            v = v.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + ooff + 8 * h + j[None, None, :], v, mask=m3)



def launch(variant, t):
    k = t.shape[-1]
    rows = t.data.numel() * 2 // k
    out = torch.empty((rows, k), dtype=torch.bfloat16, device="cuda")
    data = t.data.reshape(rows, k // 2).contiguous()
    scale = t.block_scale.reshape(rows, k // 16).contiguous().view(torch.uint8)
    n = rows * (k // 16)
    o16 = out.view(torch.int16)
    if variant == "A":
        dec = t.tensor_scale.to(torch.float32).reshape(1)
        _dequantize_flat_kernel[(triton.cdiv(n, 128),)](data, scale, dec, o16, n, OUT_BF16=True,
                                                        NBP=128, APPLY_DEC=False, I64=False,
                                                        num_warps=8, enable_fp_fusion=False)
    elif variant == "B":
        _kernel_b[(triton.cdiv(n, 128),)](data, scale, o16, n, NBP=128, num_warps=8,
                                          enable_fp_fusion=False)
    elif variant == "D":     # the tiled kernel this file replaced (32 rows x 8 blocks, 4 warps)
        dec = t.tensor_scale.to(torch.float32).reshape(1)
        _kernel_d[(triton.cdiv(rows, 32) * triton.cdiv(k // 16, 8),)](
            data, scale, dec, o16, rows, k // 16, OUT_BF16=True, BM=32, NB=8, APPLY_DEC=False,
            num_warps=4, enable_fp_fusion=False)
    else:
        _kernel_c[(triton.cdiv(n, 128),)](data, scale, o16, n, NBP=128, num_warps=8,
                                          enable_fp_fusion=False)
    return out


def main():
    torch.manual_seed(0)
    for m, k in ((64, 160), (8192, 8192), (3072, 16384)):
        t = quantize(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        ref = torch_decode(t).view(torch.int16)
        for var in "ABCD":
            got = launch(var, t).view(torch.int16)
            bad = (got != ref).nonzero()
            line = f"{m}x{k} {var}: {bad.shape[0]} mismatches"
            if bad.shape[0]:
                r, c = bad[0].tolist()
                line += (f"; first at ({r},{c}): got {got[r, c].item():#06x} want {ref[r, c].item():#06x};"
                         f" cols of the first 8: {bad[:8, 1].tolist()}")
            elif m > 64:
                ms = median_ms(lambda: launch(var, t), warmup=3)
                line += f"; {ms:.4f} ms, {m * k * 2.5625 / 1e9 / ms * 1e3:.0f} GB/s"
            print(line, flush=True)


if __name__ == "__main__":
    main()
