"""The NVFP4 linear with chosen operands kept unquantized: a measuring instrument.

Which of the linear's three operands costs the loss? ``keep = {"w"}`` runs the NVFP4 linear
with the weight unquantized and x and dY quantized exactly as the recipe quantizes them; its
loss gap to BF16 is the part of NVFP4's gap that removing W's quantization error (what
LoRA-SVD does for a subspace of W, kept in BF16) leaves. torchao's float8 training makes the same cut per tensor
(``Float8LinearConfig``: input, weight and grad_output cast or not, each on its own).

=========  ======================================  =============================================
operand    GEMMs it feeds                           quantized as (nvfp4_linear.py's table)
=========  ======================================  =============================================
``x``      fprop (x), wgrad (RHT(xᵀ))               1×16 nearest; RHT-16 over tokens, 1×16 nearest
``w``      fprop (W), dgrad (Wᵀ)                    16×16 nearest, one quantization for both
``dy``     dgrad (dY), wgrad (RHT(dYᵀ))             1×16 stochastic; RHT-16 over tokens, 1×16 SR
=========  ======================================  =============================================

A kept operand enters its GEMMs as it is. In wgrad it is still rotated by the same RHT-16
over tokens (exactly, in FP64), so the rotation cancels in ``RHT(dYᵀ) · RHT(xᵀ)ᵀ = dYᵀ x`` as
it does when both sides are quantized. A quantized operand goes through the very calls of the
NVFP4 linear's composed path, in its order and with its generator draws (dY's way, then
RHT(dYᵀ)'s), so with ``keep`` empty the codes are the NVFP4 linear's, bit for bit.

Arithmetic: each GEMM multiplies the decoded operands (``e2m1 · block scale``, exact in BF16;
a kept operand as is) in FP64 and applies the tensor scales after the sum, as the emulated
NVFP4 GEMM does with an FP32 accumulator. Products of these operands are exact in FP64 and the
sums carry 29 more bits than FP32's, so a result differs from the NVFP4 linear's (keep empty)
by the FP32 accumulation's rounding only, and FP64 does not depend on TF32 settings. It is a
diagnostic, not a speed path: FP64 GEMMs and no fused kernels. On an H200 an 8 × 512 ablation
arm with ``keep = {"w"}`` took 5.2 min against the NVFP4 arm's 4.0–4.3, both sharing the GPU
with ten other runs (BENCHMARKS.md, LoRA-SVD: loss against plain NVFP4); at wide shapes
FP64's lower GEMM rate costs more.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from fullstack_fp4.nvfp4 import DEFAULT_SIGNS, NVFP4Tensor, hadamard16
from fullstack_fp4.nvfp4.gemm import decode_to_bf16

from .nvfp4_linear import (AmaxReduce, ScaleRules, WgradAccumulator, _quantize, pad_tokens,
                           quantize_wgrad_operand, scale_rules)

__all__ = ["OPERANDS", "check_kept", "partial_nvfp4_linear", "PartialNVFP4LinearFunction"]

OPERANDS = ("x", "w", "dy")


def check_kept(names: Iterable[str]) -> frozenset:
    """The operands to keep unquantized, checked: a subset of :data:`OPERANDS`."""
    names = list(names)
    bad = [n for n in names if n not in OPERANDS]
    if bad:
        raise ValueError(f"unknown NVFP4 linear operand(s) {bad}: choose from {list(OPERANDS)}")
    return frozenset(names)


class _Operand:
    """One GEMM operand: a matrix (decoded BF16 values, or the kept tensor) and its tensor scale
    (1 for a kept operand)."""

    __slots__ = ("mat", "scale")

    def __init__(self, mat: torch.Tensor, scale: Optional[torch.Tensor]):
        self.mat, self.scale = mat, scale

    @classmethod
    def of(cls, q: NVFP4Tensor) -> "_Operand":
        return cls(decode_to_bf16(q), q.tensor_scale)


def _gemm(a: _Operand, b: _Operand, transpose_b: bool = True) -> torch.Tensor:
    """``a · bᵀ`` (or ``a · b``) in FP64, the tensor scales applied after the sum."""
    bm = b.mat.to(torch.float64)
    out = a.mat.to(torch.float64) @ (bm.t() if transpose_b else bm)
    for s in (a.scale, b.scale):
        if s is not None:
            out = out * s.to(torch.float64)
    return out


def _rotated_tokens(m: torch.Tensor) -> torch.Tensor:
    """``[T, C]`` -> ``RHT16(pad(m)ᵀ)`` ``[C, T_pad]`` in FP64, unquantized (the wgrad layout of
    ``quantize_wgrad_operand``: zero tokens pad T to a multiple of 16)."""
    return hadamard16(pad_tokens(m).t().to(torch.float64), DEFAULT_SIGNS)


class PartialNVFP4LinearFunction(torch.autograd.Function):
    """``y = x Wᵀ + b``: the NVFP4 linear's three GEMMs with the operands in ``keep`` unquantized
    (module docstring). Saved for backward: W's codes (or W) for dgrad, RHT(xᵀ)'s codes (or x)
    for wgrad."""

    @staticmethod
    def forward(ctx, x, weight, bias, keep: frozenset, generator=None, amax_reduce: AmaxReduce = None,
                wgrad_accumulator: Optional[WgradAccumulator] = None, rules: ScaleRules = ScaleRules()):
        in_f, out_f = weight.shape[1], weight.shape[0]
        if x.shape[-1] != in_f:
            raise ValueError(f"x last dim {x.shape[-1]} != in_features {in_f}")
        x2 = x.reshape(-1, in_f)
        need_dw = ctx.needs_input_grad[1]
        # the composed path's order: x, W, then RHT(xᵀ) (amax_reduce calls, no random draws)
        qx = None if "x" in keep else _quantize(x2, amax_reduce, tile=(1, 16), rounding="nearest",
                                                scale_rule=rules.x)
        qw = None if "w" in keep else _quantize(weight, amax_reduce, tile=(16, 16), rounding="nearest",
                                                scale_rule=rules.w)
        a = _Operand(x2, None) if qx is None else _Operand.of(qx)
        b = _Operand(weight, None) if qw is None else _Operand.of(qw)
        y = _gemm(a, b).to(x.dtype)
        qxt = None
        if need_dw and "x" not in keep:
            qxt = quantize_wgrad_operand(x2, rounding="nearest", amax_reduce=amax_reduce,
                                         scale_rule=rules.x)
        if bias is not None:
            y = y + bias.to(y.dtype)
        saved = []
        for q, raw in ((qw, weight), (qxt, x2 if need_dw else None)):
            saved += [raw] if q is None else [q.data, q.block_scale, q.tensor_scale]
        ctx.save_for_backward(*[t for t in saved if t is not None])
        ctx.w_meta = None if qw is None else (qw.shape, qw.dtype, qw.tile)
        ctx.xt_meta = None if qxt is None else (qxt.shape, qxt.dtype, qxt.tile)
        ctx.keep, ctx.need_dw = keep, need_dw
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.generator, ctx.amax_reduce, ctx.rule_dy = generator, amax_reduce, rules.dy
        ctx.wgrad_accumulator = wgrad_accumulator if need_dw else None
        return y.reshape(*x.shape[:-1], out_f)

    @staticmethod
    def backward(ctx, grad_out):
        dy2 = grad_out.reshape(-1, grad_out.shape[-1])
        saved = list(ctx.saved_tensors)
        if ctx.w_meta is None:
            w_op, saved = _Operand(saved[0], None), saved[1:]
        else:
            w_op, saved = _Operand.of(NVFP4Tensor(*saved[:3], *ctx.w_meta)), saved[3:]
        xt_op = None
        if ctx.need_dw:
            xt_op = (_Operand(_rotated_tokens(saved[0]), None) if ctx.xt_meta is None
                     else _Operand.of(NVFP4Tensor(*saved[:3], *ctx.xt_meta)))
        keep_dy, gen, reduce = "dy" in ctx.keep, ctx.generator, ctx.amax_reduce
        dx = dw = None
        if ctx.needs_input_grad[0]:   # dY's draw first, as the composed path
            a = (_Operand(dy2, None) if keep_dy else
                 _Operand.of(_quantize(dy2, reduce, tile=(1, 16), rounding="stochastic", generator=gen,
                                       scale_rule=ctx.rule_dy)))
            dx = _gemm(a, w_op, transpose_b=False).to(ctx.x_dtype).reshape(ctx.x_shape)
        if xt_op is not None:
            a = (_Operand(_rotated_tokens(dy2), None) if keep_dy else
                 _Operand.of(quantize_wgrad_operand(dy2, rounding="stochastic", generator=gen,
                                                    amax_reduce=reduce, scale_rule=ctx.rule_dy)))
            dw64 = _gemm(a, xt_op)
            acc = ctx.wgrad_accumulator
            if acc is not None:        # one rounding into the buffer, as the fused epilogue
                buf = acc.buffer()
                buf.copy_((buf.to(torch.float64) + dw64).to(buf.dtype))
                dw = acc.accumulated()
            else:
                dw = dw64.to(ctx.w_dtype)
        db = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2.to(torch.float32).sum(dim=0).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None


def partial_nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                         keep: Iterable[str] = (), generator: Optional[torch.Generator] = None,
                         amax_reduce: AmaxReduce = None,
                         wgrad_accumulator: Optional[WgradAccumulator] = None,
                         scale_rule="6") -> torch.Tensor:
    """The NVFP4 linear with the operands named in ``keep`` (of ``x``, ``w``, ``dy``) unquantized;
    the rest as :func:`fullstack_fp4.linear.nvfp4_linear` quantizes them (module docstring),
    with its ``scale_rule``."""
    return PartialNVFP4LinearFunction.apply(x, weight, bias, check_kept(keep), generator,
                                            amax_reduce, wgrad_accumulator, scale_rules(scale_rule))
