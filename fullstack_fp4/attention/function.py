"""``q_attention``: the autograd function and its CPU/GPU dispatch.

Dispatch: CUDA tensors with the default-format forward paths (pv, dv, dp in BF16) run the
Triton kernels (``triton_fwd.py``, ``triton_bwd.py``: flash-style, S never materialised);
anything else runs ``reference.py`` (materialises S: CPU tests and the error table; on CUDA
only when a softmax-sensitive path is switched *to* NVFP4, which is an experiment, not a
training configuration). ``backend=`` forces one.

Rounding per path (the decision):
  * Q, K views (qk and ds operands): nearest — see ``prologue.py``.
  * dS: nearest by default; ``ds_rounding="stochastic"`` available. Measured with
    ``benchmarks/studies/q_attn_error_table.py`` (see README.md): stochastic rounding of dS raises the
    per-step relative error of dQ/dK (it adds variance that nearest rounding does not) while
    the bias it removes is already small, because dS's rows sum to zero and its rounding
    errors largely cancel in the seq-long reductions of dQ = dS K and dK = dSᵀ Q.
  * P / dP / dO / V when switched to NVFP4 (experiments only): nearest.
K-smoothing default: on (measured: it cuts the error of O and dV by ~10 % and the ds-path dQ
error by ~20 %; it raised dK's error in one measurement — see README.md).

Layouts: the Triton path takes q, k, v, dO with any (batch, head, seq) strides and a unit
head_dim stride, and returns O, dQ, dK, dV stored in the dimension order of the input they
belong to (``layout.py``) — megatron's ``[s, b, h, d]`` views go in and come back without
layout copies. One copy is kept on purpose: a V that is a view into a larger buffer (megatron's
fused QKV output) is compacted before it is saved (:func:`_kernel_v`). The reference path makes
its inputs contiguous (CPU oracle; same numbers).
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from fullstack_fp4 import knobs

from . import reference
from .layout import dense_in_own_order, dim_order, owns_its_storage
from .paths import quantized, resolve_paths
from .prologue import prepare_views


def _kernel_v(v: torch.Tensor) -> torch.Tensor:
    """V as the Triton kernels read it and the backward keeps it: ``v`` itself when it owns its
    storage (dense in any dimension order), else a dense copy in ``v``'s own order.

    Why the copy: megatron's V is a view into the fused QKV projection output, and saving the
    view for the backward keeps that whole buffer alive — Q and K in BF16 too, which Q-Attn
    otherwise keeps only as 4-bit views (2×4096 tokens, 24 heads / 8 groups, d 128: 80 MiB
    pinned per layer for 16 MiB of V; the copy moves 2 × 16 MiB). ``knobs.QATTN_SAVE_V_VIEW``
    (``FP4_QATTN_SAVE_V_VIEW=1``) saves the view instead (no copy, the buffer stays alive until
    the backward)."""
    if owns_its_storage(v) or knobs.QATTN_SAVE_V_VIEW:
        return v
    return dense_in_own_order(v)


def _use_triton(q: torch.Tensor, paths: dict, backend: Optional[str]) -> bool:
    if backend is not None:
        if backend not in ("triton", "reference"):
            raise ValueError(f"backend must be 'triton' or 'reference', got {backend!r}")
        return backend == "triton"
    return q.is_cuda and not any(quantized(paths, p) for p in ("pv", "dv", "dp"))


class QAttnFunction(torch.autograd.Function):
    """Saved for backward: ``V`` (BF16 operand of ``dP = dO Vᵀ``, a BF16 path), ``O`` (for
    ``D = rowsum(dO ⊙ O)``; the output itself, no extra storage), the natural-log LSE (FP32, one
    per query: P is recomputed from it), and the views as ``prologue.SavedViews``: each NVFP4
    view as 4-bit codes + E4M3 block scales (``packed.py``) and the per-head decode scales."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, paths, smooth, ds_rounding, generator, use_triton):
        backend = "triton" if use_triton else "reference"
        # dQ, dK, dV are stored like q, k, v (the backward sees none of them: orders only)
        ctx.grad_orders = tuple(dim_order(x) for x in (q, k, v))
        views, saved = prepare_views(q, k, qk_fp4=quantized(paths, "qk"),
                                     ds_fp4=quantized(paths, "ds"), smooth=smooth, backend=backend)
        if use_triton:
            from .triton_fwd import attention_forward
            v = _kernel_v(v)
            o, lse = attention_forward(views, v, causal=causal, scale=scale,
                                       out_order=dim_order(q))
        else:
            o, lse = reference.forward(v, views, causal=causal, scale=scale, paths=paths)
        del views                 # the forward's BF16 head_dim operands are not kept
        tensors, ctx.rebuild_views = saved.flatten()
        ctx.save_for_backward(v, o, lse, *tensors)
        ctx.cfg = (causal, scale, paths, ds_rounding, generator, use_triton, q.dtype, k.dtype)
        ctx.mark_non_differentiable(lse)
        return o.to(q.dtype), lse

    @staticmethod
    def backward(ctx, do, _dlse):
        v, o, lse, *tensors = ctx.saved_tensors
        causal, scale, paths, ds_rounding, generator, use_triton, qdt, kdt = ctx.cfg
        views = ctx.rebuild_views(tensors).unpack("triton" if use_triton else "reference")
        if use_triton:
            from .triton_bwd import attention_backward
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator).item())
            dq, dk, dv = attention_backward(do, o, lse, v, views, causal=causal, scale=scale,
                                            ds_fp4=quantized(paths, "ds"),
                                            ds_stochastic=ds_rounding == "stochastic", seed=seed,
                                            out_dtypes=(qdt, kdt, v.dtype),
                                            out_orders=ctx.grad_orders)
        else:
            dq, dk, dv = reference.backward(do.contiguous(), o, v, views, causal=causal,
                                            scale=scale, paths=paths, ds_rounding=ds_rounding,
                                            generator=generator)
        return (dq.to(qdt), dk.to(kdt), dv.to(v.dtype)) + (None,) * 7


def q_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                softmax_scale: Optional[float] = None, paths: Optional[Mapping[str, str]] = None,
                generator: Optional[torch.Generator] = None, k_smoothing: bool = True,
                ds_rounding: str = "nearest", return_lse: bool = False,
                backend: Optional[str] = None):
    """Q-Attn: attention with NVFP4 ``QKᵀ`` and ``dS`` GEMMs (see README.md for the math).

    ``q [B, H, Sq, D]``, ``k, v [B, Hkv, Sk, D]`` (H a multiple of Hkv: grouped-query
    attention), BF16 (FP32 accepted; operands of BF16 paths are rounded to BF16 anyway).
    ``D`` a multiple of 16 (64 and 128 on the GPU kernels). ``causal`` needs ``Sq == Sk``
    (top-left aligned mask). ``softmax_scale`` defaults to ``1/sqrt(D)``. ``paths`` maps GEMM
    path names (qk, pv, dv, dp, ds) to "nvfp4" | "bf16" (``paths.py``). ``generator`` seeds the
    stochastic rounding of dS when ``ds_rounding="stochastic"``. Returns ``O`` (and the natural
    log-sum-exp ``[B, H, Sq]`` FP32 with ``return_lse``).

    Layout: any strides with a contiguous head_dim (else copied). On the Triton path the
    inputs are read in place and O (and dQ, dK, dV) are stored in the dimension order of q (k,
    v): pass megatron's ``[s, b, h, d]`` tensors as ``x.permute(1, 2, 0, 3)`` and
    ``O.permute(2, 0, 1, 3).reshape(s, b, h·d)`` is a view (``layout.py``). Results are
    bit-identical to contiguous inputs.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [batch, heads, seq, head_dim]")
    b, h, sq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k/v shape {tuple(k.shape)}/{tuple(v.shape)} incompatible with q {tuple(q.shape)}")
    if h % k.shape[1]:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({k.shape[1]})")
    if d % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (NVFP4 blocks), got {d}")
    if causal and sq != k.shape[2]:
        raise ValueError("causal attention needs seq_q == seq_k")
    if ds_rounding not in ("nearest", "stochastic"):
        raise ValueError(f"ds_rounding must be 'nearest' or 'stochastic', got {ds_rounding!r}")
    resolved = resolve_paths(paths)
    scale = float(softmax_scale) if softmax_scale is not None else d ** -0.5
    use_triton = _use_triton(q, resolved, backend)
    if not use_triton:     # the reference (CPU oracle) works on contiguous tensors
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o, lse = QAttnFunction.apply(q, k, v, causal, scale, resolved, k_smoothing, ds_rounding,
                                 generator, use_triton)
    return (o, lse) if return_lse else o
