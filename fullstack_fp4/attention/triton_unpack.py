"""Triton decode of the saved 4-bit views back to the BF16 MMA operands of the backward kernels.

One program per (b·h, 64 rows of seq) decodes both views of one tensor (``packed.py`` layout):

    value = e2m1(code) · fp32(e4m3 scale)       (exact in FP32 and in BF16)

which is, bit for bit, the BF16 value the prologue would have written (``triton_prologue.py``),
so the backward is identical to one run on BF16-saved views. Bytes: 0.5625 read and 2 written
per element and view — a memory-bound pre-pass (≈ 0.1 GB at 1×24×4096×128 for Q and K's four
views, a few tens of µs), chosen over decoding inside the backward kernels: there every
Q/K tile is re-read by S/64 programs and would be decoded that many times in an already
ALU-bound loop (docs/perf/q-attn.md).
"""

import torch
import triton
import triton.language as tl

from fullstack_fp4.nvfp4.kernels.launch import cdiv, launch
from fullstack_fp4.nvfp4.kernels.fp4_math import e2m1_value, e4m3_value

from .packed import PackedView, padded_seq

BLOCK_S = 64


@triton.jit
def _decode_pairs(byte):
    """uint8 bytes ``[R, N]`` -> FP32 E2M1 values ``[R, N, 2]`` (low nibble first)."""
    b = byte.to(tl.int32)
    return tl.join(e2m1_value(b & 15), e2m1_value(b >> 4))


@triton.jit
def _unpack_kernel(hdc_ptr, hds_ptr, sqc_ptr, sqs_ptr, hd_ptr, sq_ptr, S, SP,
                   D: tl.constexpr, BLOCK: tl.constexpr, HD: tl.constexpr, SQ: tl.constexpr):
    bh = tl.program_id(0)
    sb = tl.program_id(1)
    rows = sb * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    ok = rows[:, None] < S
    offs = bh * S * D + rows[:, None] * D + cols[None, :]
    if HD:
        hcols = tl.arange(0, D // 2)
        byte = tl.load(hdc_ptr + bh * S * (D // 2) + rows[:, None] * (D // 2) + hcols[None, :],
                       mask=ok, other=0)
        scols = tl.arange(0, D // 16)
        s = e4m3_value(tl.load(hds_ptr + bh * S * (D // 16) + rows[:, None] * (D // 16)
                                + scols[None, :], mask=ok, other=0).to(tl.int32))
        v = tl.reshape(_decode_pairs(byte), [BLOCK, D // 16, 16]) * s[:, :, None]
        tl.store(hd_ptr + offs, tl.reshape(v, [BLOCK, D]).to(tl.bfloat16), mask=ok)
    if SQ:
        r2 = sb * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
        byte = tl.load(sqc_ptr + bh * (SP // 2) * D + r2[:, None] * D + cols[None, :],
                       mask=r2[:, None] < SP // 2, other=0)
        # [BLOCK/2, D, 2] -> [BLOCK/2, 2, D]: byte row i holds seq rows 2i (low), 2i+1 (high)
        v = tl.reshape(tl.permute(_decode_pairs(byte), (0, 2, 1)), [BLOCK // 16, 16, D])
        r16 = sb * (BLOCK // 16) + tl.arange(0, BLOCK // 16)
        s = e4m3_value(tl.load(sqs_ptr + bh * (SP // 16) * D + r16[:, None] * D + cols[None, :],
                                mask=r16[:, None] < SP // 16, other=0).to(tl.int32))
        v = v * s[:, None, :]
        tl.store(sq_ptr + offs, tl.reshape(v, [BLOCK, D]).to(tl.bfloat16), mask=ok)


def unpack_views(hd: PackedView = None, sq: PackedView = None) -> tuple:
    """``(hd values, sq values)`` BF16 ``[B, H, S, D]`` (None where not given); one launch."""
    ref = hd if hd is not None else sq
    if ref is None:
        return None, None
    b, h, s, d = ref.shape
    dev = ref.codes.device
    out_hd = torch.empty(b, h, s, d, dtype=torch.bfloat16, device=dev) if hd is not None else None
    out_sq = torch.empty(b, h, s, d, dtype=torch.bfloat16, device=dev) if sq is not None else None
    dummy = ref.codes
    launch(_unpack_kernel, (b * h, cdiv(s, BLOCK_S)),
        hd.codes if hd is not None else dummy, hd.scales if hd is not None else dummy,
        sq.codes if sq is not None else dummy, sq.scales if sq is not None else dummy,
        out_hd if hd is not None else out_sq, out_sq if sq is not None else out_hd,
        s, padded_seq(s), D=d, BLOCK=BLOCK_S, HD=hd is not None, SQ=sq is not None,
        num_warps=8 if d >= 128 else 4)
    return out_hd, out_sq
