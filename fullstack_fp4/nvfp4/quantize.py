"""``quantize``: the public entry point, dispatching to a Triton kernel or the reference.

``backend="auto"`` uses ``fullstack_fp4.nvfp4.kernels.quantize.quantize_triton`` for CUDA inputs
when that module imports, else the pure-PyTorch reference (the oracle, :mod:`.reference`);
``backend="reference"`` forces the reference, ``backend="triton"`` forces the kernel. Both must
return bit-identical ``NVFP4Tensor`` s (codes, block scales, tensor scale) for the same input,
``global_amax`` and (for stochastic rounding) the same ``rand``.

The kernel import is lazy and guarded: the package works on machines without Triton, and a
CPU tensor never pays for the import.
"""

from __future__ import annotations

from typing import Optional

import torch

from .reference import quantize_reference, quantize_reference_propagating
from .tensor import NVFP4Tensor

__all__ = ["quantize"]


def _triton_quantize():
    try:
        from .kernels.quantize import quantize_triton  # noqa: PLC0415 (optional dependency)
    except ImportError:
        return None
    return quantize_triton


def quantize(
    x: torch.Tensor,
    *,
    tile=(1, 16),
    rounding: str = "nearest",
    scale_rule: str = "6",
    global_amax=None,
    generator: Optional[torch.Generator] = None,
    rand: Optional[torch.Tensor] = None,
    backend: str = "auto",
    rht_signs=None,
    check_finite: bool = True,
) -> NVFP4Tensor:
    """Quantize ``x`` to NVFP4 along its last dimension (a multiple of 16).

    tile: (1, 16) or (16, 16) (2D, weights; rows must be a multiple of 16).
    rounding: "nearest" (ties to even) or "stochastic" (unbiased).
    scale_rule: "6" (block max -> 6) or "4over6" (per block the lower-error of max -> 4 / 6).
    global_amax: overrides the tensor amax used for the tensor scale (e.g. TP-reduced).
    generator / rand: the uniforms for stochastic rounding (``rand`` wins if given).
    rht_signs: 16 values ±1: quantize ``hadamard16(x, rht_signs)`` (RHT-16 along the last dim);
        the Triton kernel fuses the transform (bit-identical to the reference composition).
        ``global_amax`` must then be the amax of the transformed tensor.
    check_finite: True raises ValueError on NaN/Inf input (one host sync on the kernel path).
        False: no raise (no sync on the kernel path); a non-finite input makes the tensor scale
        NaN, so every product with the result is NaN (see ``quantize_triton``); the reference
        path does the same (``quantize_reference_propagating``). ``backend="reference"``
        always raises.
    Raises ValueError on NaN/Inf input, bad shapes or bad options.
    """
    kw = dict(tile=tile, rounding=rounding, scale_rule=scale_rule, global_amax=global_amax,
              generator=generator, rand=rand)
    if backend == "reference":
        return _reference(x, rht_signs, kw)
    if backend not in ("auto", "triton"):
        raise ValueError(f"backend must be 'auto', 'reference' or 'triton', got {backend!r}")
    kernel = _triton_quantize() if (x.is_cuda or backend == "triton") else None
    if kernel is None:
        if backend == "triton":
            raise ValueError("backend='triton' requested but fullstack_fp4.nvfp4.kernels.quantize "
                             "is not importable")
        return _reference(x, rht_signs, kw, propagate=not check_finite)
    return kernel(x, rht_signs=rht_signs, check_finite=check_finite, **kw)


def _reference(x, rht_signs, kw, propagate: bool = False):
    quant = quantize_reference_propagating if propagate else quantize_reference
    if rht_signs is None:
        return quant(x, **kw)
    from .hadamard import hadamard16  # noqa: PLC0415
    q = quant(hadamard16(x, rht_signs), **kw)
    q.dtype = x.dtype          # as the kernel: the source dtype, not the transform's FP32
    return q
