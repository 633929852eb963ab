"""Fused NVFP4 operand for the emulated Newton–Schulz products (Hopper path).

On Hopper an NVFP4 product is emulated as a BF16 GEMM on the *decoded* operands
``e2m1(code) · fp32(block_scale)`` (exact in BF16, see ``fullstack_fp4.nvfp4.gemm``) with the two
FP32 tensor scales applied to the FP32 result. The NS never needs the packed codes, so
``quantize_decode`` goes straight from the FP32 matrix to that BF16 operand in ONE kernel:
block amax, E4M3 scale, E2M1 rounding and decode in registers, one read of the FP32 input and one
BF16 write — instead of quantize (read, write packed codes + scales) then decode (read both,
write BF16) as separate passes, plus the transpose copy for column-wise operands: the kernel
reads any strides, so ``X`` quantized along dim 0 (the operand of ``B'·X``) is read in place and
written directly in ``X``'s layout, ready for a plain NN GEMM.

Numerics are the project contract (docs/nvfp4-format.md, RTN, 1×16, 6-rule): the E4M3 and E2M1
rounding helpers are imported from ``fullstack_fp4.nvfp4.triton_quantize_jit`` (bit-exact with the
reference there), the tensor scale follows the reference's FP32 order. So
``decoded · tensor_scale == quantize(x).dequantize()`` bit for bit (tested under
TRITON_INTERPRET=1), and ``decoded_matmul`` equals ``nvfp4_matmul`` up to accumulation order.
The global amax is a separate torch reduction (one read); the kernel reads it from device memory,
so there is no host synchronisation anywhere in an NS step (hence no NaN/Inf ValueError
here: a non-finite input turns the whole result NaN instead).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fullstack_fp4.nvfp4.triton_launch import cdiv, launch
from fullstack_fp4.nvfp4.triton_quantize_jit import FP32_MAX, INV6, _e2m1_code, _e4m3_rne

__all__ = ["quantize_decode", "decoded_matmul", "decoded_matmul_unscaled", "abs_max"]


@triton.jit
def _qdq_kernel(x_ptr, out_ptr, amax_ptr, scale_ptr, ts_ptr, R, NBLK, sxr, sxk, sor, sok,
                BM: tl.constexpr, NB: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_b = tl.program_id(1)
    rows = pid_r * BM + tl.arange(0, BM)[:, None, None]
    blks = pid_b * NB + tl.arange(0, NB)[None, :, None]
    cols = blks * 16 + tl.arange(0, 16)[None, None, :]
    mask = (rows < R) & (blks < NBLK)
    x = tl.load(x_ptr + rows * sxr + cols * sxk, mask=mask, other=0.0).to(tl.float32)
    x = x * tl.load(scale_ptr)      # fused device scalar (the basin guard's sqrt(s)); 1 = none
    amax = tl.load(amax_ptr)
    # Tensor scale in the reference's FP32 order: enc = 2688 / amax, capped, 1 if that is 0.
    enc = tl.minimum(tl.math.div_rn(2688.0, amax), FP32_MAX)
    enc = tl.where(enc == 0.0, 1.0, enc)
    dec = tl.math.div_rn(1.0, enc)
    # The tensor scale, written by program (0, 0) (no 5 tiny torch launches per operand).
    if (pid_r == 0) & (pid_b == 0):
        tl.store(ts_ptr, dec)
    bamax = tl.max(tl.abs(x), 2)                                    # [BM, NB]
    s = tl.minimum(bamax * (enc * INV6), 448.0)
    s_val, _ = _e4m3_rne(s)
    f = tl.minimum(tl.math.div_rn(tl.full(s_val.shape, 1.0, tl.float32), s_val * dec), FP32_MAX)
    y = tl.minimum(tl.maximum(x * f[:, :, None], -6.0), 6.0)
    _, r = _e2m1_code(y, y, False)
    val = tl.where(y < 0.0, -r, r) * s_val[:, :, None]              # exact, fits BF16
    tl.store(out_ptr + rows * sor + cols * sok, val.to(tl.bfloat16), mask=mask)


_ONES: dict = {}


def _ones(device) -> torch.Tensor:
    t = _ONES.get(device)
    if t is None:
        t = _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return t


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 1-element FP32 tensor: ONE reduction pass (``x.abs().amax()`` writes and
    re-reads a full |x| copy)."""
    return torch.linalg.vector_norm(x.detach(), ord=float("inf")).to(torch.float32).reshape(1)


def quantize_decode(x: torch.Tensor, out: torch.Tensor | None = None, BM: int = 32, NB: int = 4,
                    amax: torch.Tensor | None = None, scale: torch.Tensor | None = None):
    """``(decoded BF16 [R, K], tensor_scale FP32 0-dim)`` for the 2-D ``x`` quantized along its
    last dim (K % 16 == 0). ``x`` may be any strided view (e.g. ``X.t()``); ``out`` (same
    logical shape, any strides) lets the caller pick the layout of the decoded operand — by
    default one laid out like ``x``'s storage, so a transposed view stays a transposed view.

    ``scale`` (1-element FP32 device tensor): quantize ``x · scale`` without materialising it
    (bit-identical: the kernel multiplies in FP32 as torch would). ``amax`` (1-element FP32):
    max |x · scale| when the caller already has it (``abs_max(x) · scale`` is exactly that:
    FP32 rounding is monotone), so one reduction serves several operands of the same matrix."""
    if x.ndim != 2 or x.shape[1] % 16:
        raise ValueError(f"need a 2-D tensor with last dim % 16 == 0, got {tuple(x.shape)}")
    R, K = x.shape
    if out is None:
        out = (torch.empty((K, R), dtype=torch.bfloat16, device=x.device).t()
               if x.stride(0) == 1 and x.stride(1) != 1
               else torch.empty((R, K), dtype=torch.bfloat16, device=x.device))
    # No NaN/Inf check here (it would cost a host sync per operand, 20 per NS): a non-finite
    # input makes amax, hence every output, NaN, which the optimizer cannot miss.
    if amax is None:
        amax = abs_max(x) if scale is None else abs_max(x) * scale.reshape(1)
    if scale is None:
        scale = _ones(x.device)
    ts = torch.empty(1, dtype=torch.float32, device=x.device)
    grid = (cdiv(R, BM), cdiv(K // 16, NB))
    launch(_qdq_kernel, grid, x, out, amax.reshape(1), scale.reshape(1), ts, R, K // 16,
           x.stride(0), x.stride(1), out.stride(0), out.stride(1), BM=BM, NB=NB)
    return out, ts.reshape(())  # = tensor_scales(amax)[1], the reference's FP32 order


def decoded_matmul_unscaled(p, q):
    """``(acc, ts_p · ts_q)``: the FP32 BF16-GEMM accumulator of ``p @ q.T`` and the product of
    the tensor scales, for callers that fold the scale into their next elementwise op."""
    (dp, tp), (dq, tq) = p, q
    if dp.is_cuda:
        acc = torch.mm(dp, dq.t(), out_dtype=torch.float32)
    else:
        acc = torch.mm(dp.float(), dq.float().t())
    return acc, tp * tq


def decoded_matmul(p, q) -> torch.Tensor:
    """``p @ q.T`` for two ``quantize_decode`` results: BF16 GEMM with FP32 accumulation and
    output, then ``· (ts_p · ts_q)`` (one FP32 product, as ``nvfp4_matmul``)."""
    (dp, tp), (dq, tq) = p, q
    if dp.is_cuda:
        acc = torch.mm(dp, dq.t(), out_dtype=torch.float32)
    else:
        acc = torch.mm(dp.float(), dq.float().t())
    return acc * (tp * tq)
