"""The emulated NVFP4 GEMM's epilogue in one pass: ``out = (acc · (ts_a · ts_b)).to(out_dtype)``.

The emulated GEMM (``gemm.py``) leaves an FP32 accumulator ``acc [M, N]``; the two FP32 tensor
scales are applied after it. In PyTorch that is ``(acc * alpha).to(bf16)``: two passes over
``acc``, one of which writes a full FP32 temporary (read 4 + write 4, then read 4 + write 2 =
14 bytes per output element). This kernel reads ``acc`` once and writes the output once
(4 + 2 bytes per element for BF16 out), with the same FP32 arithmetic:

* ``alpha = fp32(ts_a) · fp32(ts_b)`` (one RNE product, as ``gemm.py``), read on the device;
* ``v = acc · alpha`` (RNE, no FMA: ``enable_fp_fusion=False``, no flush of subnormals);
* BF16: round to nearest even on the FP32 bits (``(bits + 0x7FFF + lsb) >> 16``: exact RNE for
  finite values, overflow to ±Inf as the hardware cast does), NaN kept NaN (``0x7FC0``; only
  the NaN payload can differ from ``Tensor.to``, never a value). Integer arithmetic because
  the Triton interpreter's FP32→BF16 cast truncates; the compiled kernel is the same code.
  FP16: Triton's cast (RNE on the GPU and in the interpreter). FP32: ``v`` itself.

So the output is bit-identical to ``(acc * (ts_a * ts_b)).to(out_dtype)`` for every finite
and infinite value (tested under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["scale_cast_triton"]

_OUT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _scale_cast_kernel(acc_ptr, ts_a_ptr, ts_b_ptr, out_ptr, n, OUT: tl.constexpr,
                       BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    alpha = tl.load(ts_a_ptr) * tl.load(ts_b_ptr)
    v = tl.load(acc_ptr + offs, mask=m, other=0.0, eviction_policy="evict_first") * alpha
    if OUT == 1:
        bits = v.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(v != v, 0x7FC0, r)
        tl.store(out_ptr + offs, r.to(tl.int16), mask=m)
    elif OUT == 2:
        tl.store(out_ptr + offs, v.to(tl.float16), mask=m)
    else:
        tl.store(out_ptr + offs, v, mask=m)


def scale_cast_triton(acc: torch.Tensor, ts_a: torch.Tensor, ts_b: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """``(acc · (ts_a · ts_b)).to(out_dtype)`` for a contiguous FP32 ``acc`` and 1-element FP32
    tensor scales, in one pass (no host sync: the scales are read on the device)."""
    if acc.dtype != torch.float32 or not acc.is_contiguous():
        raise ValueError("scale_cast_triton needs a contiguous FP32 accumulator")
    if out_dtype not in _OUT:
        raise ValueError(f"out_dtype must be fp32, bf16 or fp16, got {out_dtype}")
    out = torch.empty(acc.shape, dtype=out_dtype, device=acc.device)
    n = acc.numel()
    if n == 0:
        return out
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    block = 1024 if interp else 4096
    a = ts_a.detach().to(torch.float32).reshape(1)
    b = ts_b.detach().to(torch.float32).reshape(1)
    _scale_cast_kernel[(triton.cdiv(n, block),)](
        acc, a, b, out.view(torch.int16) if out_dtype == torch.bfloat16 else out, n,
        OUT=_OUT[out_dtype], BLOCK=block, num_warps=4, enable_fp_fusion=False)
    return out
