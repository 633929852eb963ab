"""Triton prologue: both NVFP4 views of a ``[B, H, S, D]`` tensor in one pass.

One program per (b·h, 64-row block of seq). It loads the ``[64, D]`` tile once (FP32) and
writes two BF16 value tensors (``code · block_scale``, exact; see ``quant.py``):
  * along head_dim: blocks are ``[1, 16]`` of each row   (view for S = Q Kᵀ),
  * along seq:      blocks are ``[16, 1]`` of each column (view for dQ, dK).
The per-(b, h) tensor scale comes from an amax computed beforehand (one ``amax`` over the
head; it must be known before any block is encoded). Rows past S load as 0: zeros never
raise a block amax, so a partial last block quantizes as the zero-padded reference does.
"""

import torch
import triton
import triton.language as tl

from .triton_nvfp4 import encode_scales, block_scales, qdq_apply  # values are exact in BF16: plain cast

BLOCK_S = 64


@triton.jit
def _prologue_kernel(x_ptr, amax_ptr, hd_ptr, sq_ptr, S, D: tl.constexpr, BLOCK: tl.constexpr):
    bh = tl.program_id(0)
    sb = tl.program_id(1)
    rows = sb * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    offs = bh * S * D + rows[:, None] * D + cols[None, :]
    mask = rows[:, None] < S
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.load(amax_ptr + bh)
    enc6, dec = encode_scales(amax)
    ax = tl.abs(x)
    # along head_dim: [BLOCK, D/16, 16]; scales once per block (block_scales), then broadcast
    x3 = tl.reshape(x, [BLOCK, D // 16, 16])
    s_h, f_h = block_scales(tl.max(tl.reshape(ax, [BLOCK, D // 16, 16]), axis=2), enc6, dec)
    vh = tl.reshape(qdq_apply(x3, s_h[:, :, None], f_h[:, :, None], x3, False), [BLOCK, D])
    tl.store(hd_ptr + offs, vh.to(tl.bfloat16), mask=mask)
    # along seq: [BLOCK/16, 16, D]
    x3s = tl.reshape(x, [BLOCK // 16, 16, D])
    s_s, f_s = block_scales(tl.max(tl.reshape(ax, [BLOCK // 16, 16, D]), axis=1), enc6, dec)
    vs = tl.reshape(qdq_apply(x3s, s_s[:, None, :], f_s[:, None, :], x3s, False), [BLOCK, D])
    tl.store(sq_ptr + offs, vs.to(tl.bfloat16), mask=mask)


def quantize_both_views(x: torch.Tensor, amax: torch.Tensor):
    """``(values_head_dim bf16, values_seq bf16, dec fp32 [B, H])`` for ``x [B, H, S, D]``."""
    x = x.contiguous()
    b, h, s, d = x.shape
    amax = amax.to(torch.float32).contiguous()
    hd = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    sq = torch.empty_like(hd)
    _prologue_kernel[(b * h, triton.cdiv(s, BLOCK_S))](x, amax, hd, sq, s, D=d, BLOCK=BLOCK_S)
    # dec exactly as the reference computes it (fullstack_fp4.nvfp4.reference.tensor_scales)
    from fullstack_fp4.nvfp4.reference import tensor_scales
    _, dec = tensor_scales(amax)
    return hd, sq, dec.reshape(b, h)
