"""``quantize``: the public entry point, dispatching to a Triton kernel or the reference.

``backend="auto"`` uses ``fullstack_fp4.nvfp4.triton_quantize.quantize_triton`` for CUDA inputs
when that module imports, else the pure-PyTorch reference (the oracle, :mod:`.reference`);
``backend="reference"`` forces the reference, ``backend="triton"`` forces the kernel. Both must
return bit-identical ``NVFP4Tensor`` s (codes, block scales, tensor scale) for the same input,
``global_amax`` and (for stochastic rounding) the same ``rand``.

The kernel import is lazy and guarded: the package works on machines without Triton or before
the kernel module exists, and a CPU tensor never pays for the import.
"""

from __future__ import annotations

from typing import Optional

import torch

from .reference import quantize_reference
from .tensor import NVFP4Tensor

__all__ = ["quantize"]


def _triton_quantize():
    try:
        from .triton_quantize import quantize_triton  # noqa: PLC0415 (optional dependency)
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
) -> NVFP4Tensor:
    """Quantize ``x`` to NVFP4 along its last dimension (a multiple of 16).

    tile: (1, 16) or (16, 16) (2D, weights; rows must be a multiple of 16).
    rounding: "nearest" (ties to even) or "stochastic" (unbiased).
    scale_rule: "6" (block max -> 6) or "4over6" (per block the lower-error of max -> 4 / 6).
    global_amax: overrides the tensor amax used for the tensor scale (e.g. TP-reduced).
    generator / rand: the uniforms for stochastic rounding (``rand`` wins if given).
    Raises ValueError on NaN/Inf input, bad shapes or bad options.
    """
    kw = dict(tile=tile, rounding=rounding, scale_rule=scale_rule, global_amax=global_amax,
              generator=generator, rand=rand)
    if backend == "reference":
        return quantize_reference(x, **kw)
    if backend not in ("auto", "triton"):
        raise ValueError(f"backend must be 'auto', 'reference' or 'triton', got {backend!r}")
    kernel = _triton_quantize() if (x.is_cuda or backend == "triton") else None
    if kernel is None:
        if backend == "triton":
            raise ValueError("backend='triton' requested but fullstack_fp4.nvfp4.triton_quantize "
                             "is not importable")
        return quantize_reference(x, **kw)
    return kernel(x, **kw)
