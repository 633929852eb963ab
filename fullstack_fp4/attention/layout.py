"""The layouts of the tensors Q-Attn's Triton kernels read and write: any strides, no copies.

Megatron hands core attention q, k, v as ``[s, b, h, d]`` views of the QKV projection output
and wants ``[s, b, h·d]`` back; ``QAttnCoreAttention`` permutes them to the logical
``[B, H, S, D]`` of ``q_attention`` without copying. Every tensor crossing that boundary (Q, K
and V read; O written by the forward; dO and O read by the backward; dQ, dK, dV written) is
addressed by the kernels through its (batch, head, seq) strides, passed as runtime ints, and a
head_dim stride of 1 (one row of D elements is one contiguous vector load/store). Internal
tensors (the NVFP4 views, LSE, delta, the dS scratch) keep their own contiguous layouts.

* :func:`kernel_operand` — the tensor itself when its head_dim is contiguous, else a copy (the
  only layout a kernel cannot address);
* :func:`bhs_strides` — the three strides a kernel takes, with the int32-offset check (the
  kernels form offsets in int32, as they always did for contiguous tensors);
* :func:`dim_order` / :func:`empty_in_order` — outputs (O, dQ, dK, dV) are allocated dense in
  the dimension order of the input they belong to: ``[s, b, h, d]`` storage for megatron's
  views, so ``O.permute(2, 0, 1, 3).reshape(s, b, h·d)`` is a view and the QKV split's backward
  gets dQ, dK, dV as contiguous ``[s, b, h, d]`` tensors;
* :func:`owns_its_storage` — whether saving a tensor for the backward keeps only its own bytes
  alive (``function.py``: V as a view into the fused QKV buffer would keep all of Q, K, V).

The numbers do not depend on the layout: each kernel computes the same values and only the
addresses change (bit-identical results for contiguous and ``[s, b, h, d]`` inputs: tests).
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

CONTIGUOUS = (0, 1, 2, 3)     # dim_order of a contiguous [B, H, S, D] tensor
INT32_LIMIT = 2 ** 31


def kernel_operand(x: torch.Tensor) -> torch.Tensor:
    """``x`` when its head_dim (last) stride is 1 — any batch/head/seq strides, including 0
    (expanded) — else a contiguous copy."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def bhs_strides(x: torch.Tensor) -> Tuple[int, int, int]:
    """(batch, head, seq) element strides of a ``[B, H, S, D]`` kernel operand.

    Raises if the head_dim stride is not 1 (pass it through :func:`kernel_operand` first) or if
    an element's offset does not fit int32 (the kernels' offset arithmetic)."""
    if x.dim() != 4 or (x.stride(3) != 1 and x.shape[3] > 1):
        raise ValueError(f"kernel operand must be [B, H, S, D] with head_dim stride 1, "
                         f"got shape {tuple(x.shape)} strides {x.stride()}")
    last = sum((n - 1) * s for n, s in zip(x.shape, x.stride()) if n > 0)
    if last >= INT32_LIMIT:
        raise ValueError(f"Q-Attn kernels use int32 offsets; this tensor spans {last + 1} elements")
    return x.stride(0), x.stride(1), x.stride(2)


def dim_order(x: torch.Tensor) -> Tuple[int, int, int, int]:
    """The dims of ``x [B, H, S, D]`` from outermost to innermost stride, head_dim last: the
    order an output "like ``x``" is stored in. Contiguous: ``(0, 1, 2, 3)``; megatron's
    ``[s, b, h, d]`` permuted to ``[b, h, s, d]``: ``(2, 0, 1, 3)``. Ties (size-1 dims) keep
    the logical order; they do not change the memory a dense tensor occupies."""
    return tuple(sorted(range(3), key=lambda i: -x.stride(i))) + (3,)


def empty_in_order(shape: Sequence[int], order: Sequence[int], dtype: torch.dtype,
                   device) -> torch.Tensor:
    """A dense tensor of logical ``shape`` whose storage runs in ``order`` (outermost first):
    ``order = (2, 0, 1, 3)`` is ``torch.empty(s, b, h, d).permute(1, 2, 0, 3)``."""
    storage = torch.empty([shape[i] for i in order], dtype=dtype, device=device)
    return storage.permute([list(order).index(i) for i in range(len(order))])


def owns_its_storage(x: torch.Tensor) -> bool:
    """Whether ``x``'s storage holds nothing but ``x`` (dense, any dimension order): saving it
    for the backward keeps alive only its own bytes."""
    return x.untyped_storage().nbytes() <= x.numel() * x.element_size()


def dense_in_own_order(x: torch.Tensor) -> torch.Tensor:
    """A dense copy of ``x`` stored in ``x``'s own dimension order (:func:`dim_order`)."""
    out = empty_in_order(x.shape, dim_order(x), x.dtype, x.device)
    out.copy_(x)
    return out
