"""Pure-PyTorch NVFP4 quantizer: the oracle every kernel must match bit for bit.

Everything is FP32 (the input is upcast first); the order of operations is Transformer
Engine's (``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``,
``NVFP4QuantizerRef._quantize_blockwise_reference``), which docs/nvfp4-format.md transcribes:

    M    = 448 ("6") or 256 ("4over6")        # E4M3 bound used for the tensor scale
    enc  = min((M · 6) / global_amax, FP32_MAX);  enc = 1 if enc == 0
    dec  = 1 / enc                            # tensor_scale (decode)
    s6   = e4m3_rne(clamp(bamax · (enc · (1/6)), ≤ 448))
    f6   = min(1 / (fp32(s6) · dec), FP32_MAX)
    code = e2m1_round(clamp(x · f6, -6, 6))

Three points where we follow TE rather than the letter of docs/nvfp4-format.md (the decoded
values are identical in all three; only codes / the tensor scale of an all-zero tensor differ):

1. ``global_amax == 0``: TE computes ``6·448 / 0 = inf -> min(inf, FP32_MAX) = FP32_MAX`` and
   only replaces an encode scale that *is* 0 (which needs ``global_amax = inf``, rejected here),
   so ``dec = 1 / FP32_MAX`` (a subnormal, ≈ 2.9e-39), not 1.0 as the doc says.
2. A block whose scale rounds to 0 (``bamax / global_amax < ~2.2e-6``): TE's encode factor is
   ``min(1 / 0, FP32_MAX) = FP32_MAX``, so its non-zero elements saturate to ±6 (codes 7 / 15)
   and decode to ``±6 · 0 = 0``; the doc says factor 0 and code 0.
3. Negative values that round to 0 get code 8 (``-0``), as in TE and the hardware cvt (see
   ``e2m1.py``); the doc says code 0.

4/6 rule ("Four Over Six", arXiv 2512.02010): follows docs/nvfp4-format.md (TE's 4over6
reference differs in FP32 order: it computes ``(bamax / 6) · enc · 1.5`` for the map-to-4 scale
and sums the per-block error in FP32 in a fixed order; see README.md). Per block both
candidates are quantized with nearest rounding; ``err = Σ |x - q · fp32(s) · dec|`` with each
term in FP32 and the sum in FP64 (order-independent in practice, so a kernel can reduce in any
order); the map-to-4 candidate wins only if ``err4 < err6``. With stochastic rounding the choice
is made on the nearest-rounded candidates, then the chosen scale is used with SR.

2D tiles (16×16): the block amax is taken over the tile and the tile's scale is written on its
16 rows; everything else is elementwise, so 2D differs from 1×16 only in ``bamax`` (and the
4/6 error, summed over the 256 tile elements).
"""

from __future__ import annotations

from typing import Optional

import torch

from .e2m1 import E2M1_MAX, e2m1_decode, e2m1_round_nearest, e2m1_round_stochastic, pack_codes
from .tensor import NVFP4Tensor

__all__ = ["quantize_reference", "quantize_reference_propagating", "tensor_scales", "block_amax",
           "block_scales"]

FP32_MAX = torch.finfo(torch.float32).max
E4M3_MAX = 448.0
_SCALE_RULES = {"6": 448.0, "4over6": 256.0}


def _f32(v: float, device) -> torch.Tensor:
    # a fill on the device, not torch.tensor(v, device=...): that is a copy from pageable host
    # memory, which synchronises the stream on a GPU (several per call here)
    return torch.full((), v, dtype=torch.float32, device=device)


def tensor_scales(global_amax: torch.Tensor, scale_rule: str = "6"):
    """``(enc, dec)`` FP32 0-dim tensors from the global amax (TE's order, see docstring)."""
    m = _SCALE_RULES[scale_rule]
    dev = global_amax.device
    enc = torch.div(_f32(m * 6.0, dev), global_amax.to(torch.float32))  # M·6 is exact in FP32
    enc = torch.minimum(enc, _f32(FP32_MAX, dev))
    enc = torch.where(enc == 0, _f32(1.0, dev), enc)
    dec = torch.div(_f32(1.0, dev), enc)
    return enc, dec


def block_amax(x2: torch.Tensor, tile) -> torch.Tensor:
    """``[R, K/16, 1]`` FP32 block amax of a 2D FP32 ``[R, K]`` (2D tiles: tile amax on its rows)."""
    r, k = x2.shape
    if tuple(tile) == (1, 16):
        return x2.abs().reshape(r, k // 16, 16).amax(dim=-1, keepdim=True)
    t = x2.abs().reshape(r // 16, 16, k // 16, 16).amax(dim=(1, 3))   # [R/16, K/16]
    return t.repeat_interleave(16, dim=0).unsqueeze(-1)


def scale_candidate(x3: torch.Tensor, bamax: torch.Tensor, enc: torch.Tensor, dec: torch.Tensor,
                    target: float):
    """Block scale and element factor for the candidate mapping the block max to ``target``."""
    dev = x3.device
    # enc · (1/6) first (one FP32 product, as TE's global_encode_scale_multiplier), then × bamax;
    # 1/6 is FP32's correctly rounded reciprocal (torch.reciprocal in FP32, as TE).
    s = bamax * (enc * torch.reciprocal(_f32(target, dev)))
    s = torch.clamp(s, max=E4M3_MAX).to(torch.float8_e4m3fn)  # RNE to E4M3
    f = torch.minimum(torch.div(_f32(1.0, dev), s.to(torch.float32) * dec), _f32(FP32_MAX, dev))
    return s, f


def _block_error(x3, codes, s, dec, rows_per_tile: int) -> torch.Tensor:
    """Σ|x - q·s·dec| per block (FP32 terms, FP64 sum); 2D: summed over each tile's 16 rows."""
    xhat = (e2m1_decode(codes) * s.to(torch.float32)) * dec
    err = (x3 - xhat).abs().to(torch.float64).sum(dim=-1, keepdim=True)   # [R, K/16, 1]
    if rows_per_tile == 1:
        return err
    r = err.shape[0]
    tiles = err.reshape(r // 16, 16, *err.shape[1:]).sum(dim=1)
    return tiles.repeat_interleave(16, dim=0)


def block_scales(x3: torch.Tensor, bamax: torch.Tensor, enc: torch.Tensor, dec: torch.Tensor,
                 scale_rule: str = "6", rows_per_tile: int = 1):
    """Block scale ``s`` (E4M3, ``[R, K/16, 1]``) and element factor ``f`` of every block of
    ``x3 [R, K/16, 16]`` under ``scale_rule`` (``enc`` / ``dec`` from ``tensor_scales`` with the
    same rule; a 0-dim pair, or one per row broadcast as ``[R, 1, 1]``). ``"6"``: the map-to-6
    candidate. ``"4over6"``: both candidates, each rounded to nearest, and the map-to-4 one
    wherever its error (``_block_error``, over the tile for ``rows_per_tile=16``) is strictly
    lower: a tie keeps 6. The choice does not depend on the rounding the caller then applies."""
    s, f = scale_candidate(x3, bamax, enc, dec, 6.0)
    if scale_rule == "4over6":
        s4, f4 = scale_candidate(x3, bamax, enc, dec, 4.0)
        c6 = e2m1_round_nearest(torch.clamp(x3 * f, -E2M1_MAX, E2M1_MAX))
        c4 = e2m1_round_nearest(torch.clamp(x3 * f4, -E2M1_MAX, E2M1_MAX))
        rpt = rows_per_tile
        use4 = _block_error(x3, c4, s4, dec, rpt) < _block_error(x3, c6, s, dec, rpt)  # ties: 6
        s = torch.where(use4, s4.to(torch.float32), s.to(torch.float32)).to(torch.float8_e4m3fn)
        f = torch.where(use4, f4, f)
    return s, f


def quantize_reference(
    x: torch.Tensor,
    *,
    tile=(1, 16),
    rounding: str = "nearest",
    scale_rule: str = "6",
    global_amax=None,
    generator: Optional[torch.Generator] = None,
    rand: Optional[torch.Tensor] = None,
) -> NVFP4Tensor:
    """Quantize ``x`` along its last dimension to NVFP4 (see module docstring for the math).

    ``global_amax`` (float or tensor) overrides the tensor's own amax (e.g. an amax reduced over
    a tensor-parallel group); ``rand`` supplies the FP32 uniforms in [0, 1) for stochastic
    rounding (shape of ``x``), else they are drawn with ``torch.rand(generator=generator)``.
    """
    tile = tuple(tile)
    if tile not in ((1, 16), (16, 16)):
        raise ValueError(f"tile must be (1, 16) or (16, 16), got {tile}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if scale_rule not in _SCALE_RULES:
        raise ValueError(f"scale_rule must be '6' or '4over6', got {scale_rule!r}")
    if x.dim() == 0 or x.shape[-1] % 16:
        raise ValueError(f"last dimension must be a multiple of 16, got shape {tuple(x.shape)}")
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if tile == (16, 16) and rows % 16:
        raise ValueError(f"16x16 tiles need the rows ({rows}) to be a multiple of 16")

    x2 = x.detach().reshape(rows, k).to(torch.float32)
    local_amax = x2.abs().amax() if x2.numel() else _f32(0.0, x.device)
    # amax is NaN/Inf exactly when the input holds one: one check, no silent garbage.
    if not torch.isfinite(local_amax):
        raise ValueError("quantize: input holds NaN or Inf")
    if global_amax is None:
        gamax = local_amax
    else:
        gamax = torch.as_tensor(global_amax, dtype=torch.float32, device=x.device).reshape(())
        if not torch.isfinite(gamax) or gamax < 0:
            raise ValueError(f"global_amax must be finite and >= 0, got {float(gamax)}")
    enc, dec = tensor_scales(gamax, scale_rule)

    bamax = block_amax(x2, tile)                    # [R, K/16, 1]
    x3 = x2.reshape(rows, k // 16, 16)
    s, f = block_scales(x3, bamax, enc, dec, scale_rule, tile[0])

    y = torch.clamp(x3 * f, -E2M1_MAX, E2M1_MAX)
    if rounding == "nearest":
        codes = e2m1_round_nearest(y)
    else:
        if rand is None:
            rand = torch.rand(x.shape, generator=generator, dtype=torch.float32, device=x.device)
        if tuple(rand.shape) != tuple(x.shape):
            raise ValueError(f"rand shape {tuple(rand.shape)} != input shape {tuple(x.shape)}")
        codes = e2m1_round_stochastic(y, rand.reshape(rows, k // 16, 16))

    lead = tuple(x.shape[:-1])
    return NVFP4Tensor(
        data=pack_codes(codes.reshape(rows, k)).reshape(*lead, k // 2),
        block_scale=s.reshape(*lead, k // 16),
        tensor_scale=dec.reshape(()),
        shape=x.shape,
        dtype=x.dtype,
        tile=tile,
    )


def quantize_reference_propagating(x: torch.Tensor, *, global_amax=None, **kw) -> NVFP4Tensor:
    """``quantize_reference`` that does not raise on a non-finite input or ``global_amax``: the
    result then has a NaN tensor scale, so every product with it is NaN — what the kernels do
    with ``check_finite=False``. A training step with a NaN/Inf activation or gradient inside a
    recipe thus ends in a non-finite loss / grad norm that the training loop's divergence guard
    skips, on the CPU as on the GPU, instead of an exception in the middle of a step (which
    would stop only the rank that saw it). Finite inputs give exactly ``quantize_reference``."""
    g_ok = global_amax is None or bool(torch.isfinite(torch.as_tensor(global_amax)).all())
    if g_ok and bool(torch.isfinite(x).all()):
        return quantize_reference(x, global_amax=global_amax, **kw)
    clean = torch.nan_to_num(x.detach(), nan=0.0, posinf=0.0, neginf=0.0)
    q = quantize_reference(clean, **kw)
    return NVFP4Tensor(q.data, q.block_scale, torch.full_like(q.tensor_scale, float("nan")),
                       q.shape, q.dtype, q.tile)
