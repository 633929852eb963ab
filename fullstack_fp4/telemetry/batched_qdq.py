"""NVFP4 quantize-dequantize of many samples in one call, each row with its own tensor scale.

Why: a telemetry step quantizes a few sampled blocks of every operand of every layer (x, W,
dY, the two wgrad operands; Q-Attn's 64×64 dS tiles, each with its own tensor scale). Done one
``quantize`` + ``dequantize`` per sample, that is ~100 small kernel launches each, ~10⁴ per
step on a 4-block model: the host, not the GPU, set the telemetry step's cost
(`BENCHMARKS.md#telemetry`). The samples are independent once their tensor scale is fixed (stats.py docstring), so
the collector gathers them during the step and quantizes all samples of one kind together
here, with a per-row global amax.

Arithmetic: ``fullstack_fp4.nvfp4.reference.quantize_reference`` followed by
``NVFP4Tensor.dequantize``, operation for operation, with the tensor scales ``(enc, dec)``
broadcast per row instead of one scalar (``tensor_scales`` and ``block_scales`` are elementwise
per block, or per 16×16 tile, so they are called as they are). Row ``i`` therefore gets exactly
the numbers that ``dequantize(quantize(x_i, global_amax=g_i, scale_rule=..., ...))`` gives, bit
for bit (tested), and that the Triton kernel gives (bit-identical to the reference). The finite
check of the reference is left out (it is a host sync; telemetry reports a non-finite error as
NaN instead).

``scale_rule``: the block-scale rule of the operand the samples come from (``"6"`` or
``"4over6"``, the NVFP4 linear's ``ScaleRules``). With ``"4over6"`` the tensor scale uses the
E4M3 bound 256 instead of 448 and each block (16×16: each tile) keeps the map-to-4 candidate
where its nearest-rounded error is strictly below the map-to-6 one, before any stochastic
rounding: the reference's ``block_scales``. The samples of one call share one rule.

``rht_signs``: the sample is quantized as ``hadamard16(x)`` (the wgrad operands' RHT-16) and
the dequantized result is transformed back, so the error is measured in the original basis
(equal to the transformed one: the RHT is orthogonal).
"""
from __future__ import annotations

from typing import Optional

import torch

from fullstack_fp4.nvfp4.e2m1 import E2M1_MAX, e2m1_decode, e2m1_round_nearest, e2m1_round_stochastic
from fullstack_fp4.nvfp4.reference import block_amax, block_scales, tensor_scales

from .stats import inverse_rht16

__all__ = ["qdq_rows"]


def qdq_rows(x: torch.Tensor, global_amax: torch.Tensor, *, tile=(1, 16), rounding: str = "nearest",
             rand: Optional[torch.Tensor] = None, rht_signs=None, scale_rule: str = "6") -> torch.Tensor:
    """FP32 quantize-dequantize of ``x [R, K]`` (K a multiple of 16), row ``i`` with tensor amax
    ``global_amax[i]`` (shape ``[R]``; FP32). ``tile=(16, 16)``: R a multiple of 16, each
    16-row group one stack of tiles (its rows must share one amax). ``rand [R, K]``: the
    uniforms of stochastic rounding (required for ``rounding="stochastic"``). ``scale_rule``:
    ``"6"`` or ``"4over6"`` (module docstring)."""
    tile = tuple(tile)
    if tile not in ((1, 16), (16, 16)):
        raise ValueError(f"tile must be (1, 16) or (16, 16), got {tile}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if scale_rule not in ("6", "4over6"):
        raise ValueError(f"scale_rule must be '6' or '4over6', got {scale_rule!r}")
    if x.dim() != 2 or x.shape[1] % 16 or (tile[0] == 16 and x.shape[0] % 16):
        raise ValueError(f"x must be [R, K] with K % 16 == 0 (and R % 16 == 0 for 16×16 tiles), "
                         f"got {tuple(x.shape)}")
    if global_amax.shape != (x.shape[0],):
        raise ValueError(f"global_amax must have shape [{x.shape[0]}], got {tuple(global_amax.shape)}")
    if rounding == "stochastic" and (rand is None or rand.shape != x.shape):
        raise ValueError("stochastic rounding needs rand with the shape of x")
    r, k = x.shape
    x2 = x.detach().to(torch.float32)
    if rht_signs is not None:
        from fullstack_fp4.nvfp4 import hadamard16

        x2 = hadamard16(x2, rht_signs)
    enc, dec = tensor_scales(global_amax.to(torch.float32).reshape(r, 1, 1), scale_rule)
    x3 = x2.reshape(r, k // 16, 16)
    s, f = block_scales(x3, block_amax(x2, tile), enc, dec, scale_rule, tile[0])
    y = torch.clamp(x3 * f, -E2M1_MAX, E2M1_MAX)
    if rounding == "nearest":
        codes = e2m1_round_nearest(y)
    else:
        codes = e2m1_round_stochastic(y, rand.to(torch.float32).reshape(r, k // 16, 16))
    out = ((e2m1_decode(codes) * s.to(torch.float32)) * dec).reshape(r, k)
    if rht_signs is not None:
        out = inverse_rht16(out, rht_signs)
    return out
