"""NVFP4 quantized views for attention, pure PyTorch (the oracle; uses ``fullstack_fp4.nvfp4``).

Two tensor-scale granularities, each argued:

* **Operands that live in memory (Q, K, V, dO): one FP32 tensor scale per (batch, head).**
  The tensor scale needs the amax of everything that shares it; per (batch, head) that is a
  local reduction the prologue does anyway, while a per-tensor amax needs a reduction over
  all heads — and, under tensor parallelism (heads split over ranks), an all-reduce, without
  which the numerics would depend on the TP degree. Per head they do not: a head quantizes the
  same on 1 or 8 ranks. It also keeps one outlier head from coarsening every other head's
  block scales (E4M3 block scales cover ~2¹⁷ of range below the tensor amax; per-head amax
  spends that range on the head's own values).
* **Operands born inside the kernel (dS; P and dP when their paths are switched to NVFP4):
  one FP32 tensor scale per aligned 64×64 tile** of the (queries × keys) matrix. A flash
  kernel holds one tile in registers and never sees the whole matrix, so a per-head amax of
  dS would need a second full backward pass. The tile amax is one in-register reduction; the
  per-tile scale is applied to the tile's partial product (``acc += dec_tile · dec_op ·
  (codes·scales)ᵀ(codes·scales)``), which is how a Blackwell block-scaled MMA would consume it
  too. The tile is fixed at 64×64 from (0, 0) so the reference and every kernel agree on it.

Quantized *views* are returned as ``(values, dec)``: ``values = e2m1(code) · fp32(block_scale)``
(exact in BF16: ≤ 2 + 4 significant bits) and ``dec`` the FP32 decode tensor scale, so
``values · dec`` is exactly ``NVFP4Tensor.dequantize()``. Kernels store ``values`` in BF16 and
apply ``dec`` to the FP32 accumulator.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from fullstack_fp4.nvfp4.e2m1 import e2m1_decode
# A NaN/Inf operand gives a NaN tensor scale instead of an exception (the training loop's
# divergence guard then skips the step on every rank; see quantize_reference_propagating).
from fullstack_fp4.nvfp4.reference import quantize_reference_propagating as quantize_reference

from .packed import empty_packed

DS_TILE = 64


def _values_and_dec(x2: torch.Tensor, amax, rounding: str, generator) -> tuple:
    """Quantize a 2D FP32 ``[R, K]`` (K multiple of 16) along K; return (code·scale, dec)."""
    t = quantize_reference(x2, global_amax=amax, rounding=rounding, generator=generator)
    return _decoded(t), t.tensor_scale


def _pad_to(x: torch.Tensor, dim: int, mult: int) -> torch.Tensor:
    n = x.shape[dim]
    pad = (-n) % mult
    if pad == 0:
        return x
    widths = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [0, pad]
    return F.pad(x, widths)


def _head_nvfp4(xij: torch.Tensor, along: str, rounding: str, generator):
    """NVFP4 quantization of one head ``xij [S, D]`` (FP32) with the head's own amax: along
    head_dim the tensor ``[S, D]`` itself, along seq its zero-padded transpose ``[D, Sp]``."""
    amax = xij.abs().amax()
    if along == "head_dim":
        x2 = xij
    elif along == "seq":
        x2 = _pad_to(xij, 0, 16).t().contiguous()        # [D, Sp]: seq last
    else:
        raise ValueError(f"along must be 'head_dim' or 'seq', got {along!r}")
    return quantize_reference(x2, global_amax=amax, rounding=rounding, generator=generator)


def _decoded(t) -> torch.Tensor:
    """``e2m1(code) · fp32(block_scale)`` of an NVFP4Tensor, FP32, its own shape."""
    vals = e2m1_decode(t.codes()).reshape(t.shape[0], -1, 16)
    return (vals * t.block_scale.to(torch.float32).unsqueeze(-1)).reshape(t.shape)


def per_head_view(x: torch.Tensor, along: str, rounding: str = "nearest",
                  generator: Optional[torch.Generator] = None) -> tuple:
    """NVFP4 view of ``x [B, H, S, D]`` in 1×16 blocks along ``"head_dim"`` or ``"seq"``.

    Tensor scale per (b, h) from that head's amax (same amax for both directions, so the two
    views of one tensor share ``dec``). Seq is zero-padded to a multiple of 16 for the blocks
    (zeros never raise a block amax) and cropped back. Returns ``(values fp32 [B,H,S,D], dec
    fp32 [B,H])``.
    """
    b, h, s, d = x.shape
    xf = x.to(torch.float32)
    vals = torch.empty_like(xf)
    dec = torch.empty(b, h, dtype=torch.float32, device=x.device)
    for i in range(b):
        for j in range(h):
            t = _head_nvfp4(xf[i, j], along, rounding, generator)
            v = _decoded(t)
            vals[i, j] = v if along == "head_dim" else v.t()[:s]
            dec[i, j] = t.tensor_scale
    return vals, dec


def per_head_packed(x: torch.Tensor, along: str) -> tuple:
    """The same quantization as :func:`per_head_view` (nearest), kept as codes and E4M3 scale
    bytes in ``packed.py``'s layout: ``(PackedView, dec fp32 [B, H])``. The seq view's codes are
    ``nvfp4``'s ``[D, Sp/2]`` per head, stored transposed (``[Sp/2, D]``)."""
    b, h, s, d = x.shape
    xf = x.to(torch.float32)
    out = empty_packed(b, h, s, d, along, x.device)
    dec = torch.empty(b, h, dtype=torch.float32, device=x.device)
    for i in range(b):
        for j in range(h):
            t = _head_nvfp4(xf[i, j], along, "nearest", None)
            sc = t.block_scale.view(torch.uint8)
            out.codes[i, j] = t.data if along == "head_dim" else t.data.t()
            out.scales[i, j] = sc if along == "head_dim" else sc.t()
            dec[i, j] = t.tensor_scale
    return out, dec


def tile_dequant(x: torch.Tensor, along: str, rounding: str = "nearest",
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Quantize-dequantize ``x [B, H, M, N]`` (an in-kernel matrix: dS, P or dP) in FP32.

    Tensor scale per aligned 64×64 tile (module docstring), 1×16 blocks along ``"keys"`` (N)
    or ``"queries"`` (M). An all-zero tile (e.g. above the causal diagonal) stays zero.
    """
    b, h, m, n = x.shape
    xp = _pad_to(_pad_to(x.to(torch.float32), 2, DS_TILE), 3, DS_TILE)
    out = torch.zeros_like(xp)
    T = DS_TILE
    for i in range(b):
        for j in range(h):
            for tm in range(0, xp.shape[2], T):
                for tn in range(0, xp.shape[3], T):
                    tile = xp[i, j, tm:tm + T, tn:tn + T]
                    amax = tile.abs().amax()
                    if amax == 0:
                        continue
                    if along == "keys":
                        v, dec = _values_and_dec(tile, amax, rounding, generator)
                        out[i, j, tm:tm + T, tn:tn + T] = v * dec
                    elif along == "queries":
                        v, dec = _values_and_dec(tile.t().contiguous(), amax, rounding, generator)
                        out[i, j, tm:tm + T, tn:tn + T] = v.t() * dec
                    else:
                        raise ValueError(f"along must be 'keys' or 'queries', got {along!r}")
    return out[:, :, :m, :n]


def smooth_k(k: torch.Tensor) -> tuple:
    """K-smoothing: ``K − mean_seq(K)`` per (b, kv-head, channel), in FP32; returns (Ks, mean).

    Softmax is unchanged: ``q_i·(k_j − m) = q_i·k_j − q_i·m`` shifts row i of S by a constant
    over the keys j (also under the causal mask, which keeps whole prefixes of each row).
    """
    mean = seq_mean(k)
    return k.to(torch.float32) - mean, mean


def seq_mean(k: torch.Tensor) -> torch.Tensor:
    """K-smoothing's mean ``[B, Hkv, 1, D]`` FP32: the seq-mean of ``k`` accumulated in FP32,
    the one torch reduction both backends share (its summation order is torch's; the Triton
    prologue subtracts it per element exactly as ``smooth_k`` does). ``dtype=`` reads the BF16
    input directly: one kernel and 2 bytes per element instead of ``k.float().mean``'s two
    kernels and 10 (the FP32 copy written and read back); the accumulation is FP32 in both."""
    return k.mean(dim=2, keepdim=True, dtype=torch.float32)
