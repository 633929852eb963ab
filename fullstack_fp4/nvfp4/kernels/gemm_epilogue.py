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

Accumulate variant, ``scale_accumulate_triton(acc, ts_a, ts_b, dst)``: ``dst ← dst + acc·alpha``
in place, for the wgrad under gradient-accumulation fusion (the NVFP4 linear adds dW straight
into megatron's ``main_grad`` instead of returning it for DDP's hook to add: one pass that reads
``acc`` 4 B + ``dst`` 4 (2) B and writes ``dst`` 4 (2) B per element, instead of the epilogue's
4 + 2 and then the hook's ``main_grad.add_(dW)``, 2 + 4 + 4). Arithmetic, every step one FP32
IEEE operation:

* ``alpha = fp32(ts_a) · fp32(ts_b)`` and ``v = acc · alpha`` exactly as above;
* ``s = fp32(dst) + v`` (RNE). ``enable_fp_fusion=False`` matters twice here: an FMA would
  compute ``acc·alpha + dst`` with one rounding instead of two and no longer equal the torch
  oracle (``(dst.float() + acc * alpha)``, two separate ops);
* ``s`` stored in ``dst``'s dtype, rounded once: FP32 as is; BF16 by the integer RNE above
  (NaN stays NaN, ±Inf stays ±Inf, a finite sum past BF16's range rounds to ±Inf). A BF16
  ``dst`` is widened exactly (``bits << 16``).

So ``dst`` ends bit-identical to ``(dst.float() + acc * (ts_a * ts_b)).to(dst.dtype)``. For a
BF16 ``dst`` this is **more precise** than the unfused path, which rounds ``v`` to BF16 (dW)
before the hook adds it, i.e. rounds twice (``bf16(dst + bf16(v))``); here ``v`` enters the
sum unrounded, as Transformer Engine's ``fuse_wgrad_accumulation`` (an FP32 GEMM accumulating
into ``main_grad``) does. For an FP32 ``dst`` both paths are the same bits (dW in FP32 is ``v``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch

__all__ = ["scale_cast_triton", "scale_accumulate_triton"]

_OUT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_DST = {torch.float32: 0, torch.bfloat16: 1}


@triton.jit
def _bf16_rne_bits(v):
    """FP32 -> BF16 bits (int16), round to nearest even in integer arithmetic; NaN -> 0x7FC0."""
    bits = v.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    r = tl.where(v != v, 0x7FC0, r)
    return r.to(tl.int16)


@triton.jit
def _scaled_acc_block(acc_ptr, ts_a_ptr, ts_b_ptr, n, BLOCK: tl.constexpr):
    """This program's ``BLOCK`` accumulator entries times ``alpha = ts_a · ts_b`` (both FP32
    RNE products): ``(offsets, mask, acc · alpha)``, the common start of both epilogues."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    alpha = tl.load(ts_a_ptr) * tl.load(ts_b_ptr)
    v = tl.load(acc_ptr + offs, mask=m, other=0.0, eviction_policy="evict_first") * alpha
    return offs, m, v


@triton.jit
def _scale_cast_kernel(acc_ptr, ts_a_ptr, ts_b_ptr, out_ptr, n, OUT: tl.constexpr,
                       BLOCK: tl.constexpr):
    offs, m, v = _scaled_acc_block(acc_ptr, ts_a_ptr, ts_b_ptr, n, BLOCK)
    if OUT == 1:
        tl.store(out_ptr + offs, _bf16_rne_bits(v), mask=m)
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
    block = _block()
    a, b = _scale_operand(ts_a), _scale_operand(ts_b)
    launch(_scale_cast_kernel, (cdiv(n, block),),
        acc, a, b, out.view(torch.int16) if out_dtype == torch.bfloat16 else out, n,
        OUT=_OUT[out_dtype], BLOCK=block, num_warps=4, enable_fp_fusion=False)
    return out


@triton.jit
def _scale_accumulate_kernel(acc_ptr, ts_a_ptr, ts_b_ptr, dst_ptr, n, DST: tl.constexpr,
                             BLOCK: tl.constexpr):
    offs, m, v = _scaled_acc_block(acc_ptr, ts_a_ptr, ts_b_ptr, n, BLOCK)
    if DST == 1:
        # BF16 bits widened exactly: the high half of the FP32 pattern (the shift drops the
        # sign extension of the int16 -> int32 conversion)
        old = tl.load(dst_ptr + offs, mask=m, other=0).to(tl.int32) << 16
        s = old.to(tl.float32, bitcast=True) + v
        tl.store(dst_ptr + offs, _bf16_rne_bits(s), mask=m)
    else:
        s = tl.load(dst_ptr + offs, mask=m, other=0.0) + v
        tl.store(dst_ptr + offs, s, mask=m)


def scale_accumulate_triton(acc: torch.Tensor, ts_a: torch.Tensor, ts_b: torch.Tensor,
                            dst: torch.Tensor) -> None:
    """``dst ← dst + acc · (ts_a · ts_b)`` in place, rounded once to ``dst``'s dtype (FP32 or
    BF16), for a contiguous FP32 ``acc`` and a contiguous ``dst`` of the same shape (module
    docstring: bit-identical to ``(dst.float() + acc * (ts_a * ts_b)).to(dst.dtype)``). One pass,
    no host sync."""
    if acc.dtype != torch.float32 or not acc.is_contiguous():
        raise ValueError("scale_accumulate_triton needs a contiguous FP32 accumulator")
    if dst.dtype not in _DST:
        raise ValueError(f"dst must be fp32 or bf16, got {dst.dtype}")
    if not dst.is_contiguous() or dst.shape != acc.shape or dst.device != acc.device:
        raise ValueError(f"dst must be contiguous with acc's shape {tuple(acc.shape)} and device; "
                         f"got {tuple(dst.shape)} on {dst.device}")
    n = acc.numel()
    if n == 0:
        return
    block = _block()
    launch(_scale_accumulate_kernel, (cdiv(n, block),),
        acc, _scale_operand(ts_a), _scale_operand(ts_b),
        dst.view(torch.int16) if dst.dtype == torch.bfloat16 else dst, n,
        DST=_DST[dst.dtype], BLOCK=block, num_warps=4, enable_fp_fusion=False)


_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")   # read once, as Triton does


def _block() -> int:
    """Elements per program: small under the interpreter (tests), 4096 on the GPU."""
    return 1024 if _INTERPRET else 4096


def _scale_operand(ts: torch.Tensor) -> torch.Tensor:
    """A tensor scale as the 1-element FP32 tensor the kernels read on the device (an FP32 one,
    0-dim or not, is passed as it is: the kernel reads its one element through the pointer, and
    three view ops a call are host time on the linear's critical path)."""
    if ts.dtype == torch.float32 and ts.numel() == 1:
        return ts
    return ts.detach().to(torch.float32).reshape(1)
