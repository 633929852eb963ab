"""Quantization-error statistics, exact and sampled (no megatron imports).

Definitions, for a tensor ``x`` and its quantize-dequantize ``q(x)``, ``e = x - q(x)``:

    rel_err(x) = ||e||_F / ||x||_F            snr_db(x) = 10 log10(||x||² / ||e||²) = -20 log10(rel_err)

Sampling (``sampled_rel_err``). Split ``x`` (viewed as ``[R, K]``, ``K`` the last dim, a multiple of
16) into its ``N`` quantization blocks ``b_1..b_N`` (1×16 row-blocks, or 16×16 tiles for a
2-D-tiled weight). Let ``E_i = ||e(b_i)||²`` and ``X_i = ||b_i||²``, so the full ratio is
``ρ = Σ_i E_i / Σ_i X_i`` and ``rel_err = sqrt(ρ)``. Draw ``n`` block indices ``I_1..I_n`` i.i.d.
uniform on ``{1..N}`` (with replacement). Then

  * ``Ê = (N/n) Σ_j E_{I_j}`` is an **unbiased** estimator of ``Σ_i E_i``:
    ``E[Ê] = (N/n) · n · (1/N) Σ_i E_i``; likewise ``X̂ = (N/n) Σ_j X_{I_j}`` for ``Σ_i X_i``.
    Var(Ê) = (N²/n) Var_i(E_i), so the relative standard error is ``CV(E_i)/sqrt(n)``.
  * ``ρ̂ = Ê / X̂ = Σ_j E_{I_j} / Σ_j X_{I_j}`` (the ``N/n`` cancels) is the classical ratio
    estimator: **not unbiased** (E of a ratio ≠ ratio of E's), but **consistent** (``ρ̂ → ρ``
    almost surely as ``n → ∞``, strong law of large numbers on numerator and denominator, and
    continuity of the ratio at ``Σ X_i > 0``); its bias is ``O(1/n)`` and its standard error
    ``≈ sqrt(Var_i(E_i - ρ X_i) / n) / mean_i(X_i)`` (delta method), i.e. ``O(1/sqrt(n))``.
    ``sqrt(ρ̂)`` (rel_err) and ``snr_db`` inherit consistency, not unbiasedness.
  * The block-wise quantization is exact on a sample **only if the tensor-level scale is that
    of the full tensor**: NVFP4's block scale depends on the block's amax (under the 4over6
    rule also on the block's own values: its 4-or-6 choice compares two errors over the block,
    or over the 16×16 tile) and on the tensor scale (from the global amax and the rule),
    nothing else; so each sampled block is quantized exactly as it is inside the full tensor
    when ``global_amax`` is the full tensor's amax (``nvfp4_qdq(global_amax=x.abs().amax())``,
    one reduction over ``x``). With ``n >= N`` the function uses every block once and returns
    the exact full value.

Cost per call: one amax pass over ``x`` (if the quantizer needs it), a gather of ``n·16``
(1×16) or ``n·256`` (16×16) elements and a quantize-dequantize of that sample; no host sync
unless the caller converts the result (``float``): the indices are drawn on the (CPU) generator
and moved with one non-blocking copy from pinned memory (``to_device``).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

__all__ = ["rel_err", "snr_db", "sampled_sums", "sample_blocks", "sampled_rel_err", "nvfp4_qdq", "rel_err_from_sums",
           "snr_db_from_rel_err", "to_device", "rht_signs_on", "wht16", "inverse_rht16"]

QDQ = Callable[[torch.Tensor], torch.Tensor]


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A CPU tensor (e.g. sample indices drawn on the collector's CPU generator) on ``device``
    without a host sync: on CUDA one ``non_blocking`` copy from pinned memory (a copy from
    pageable memory would synchronise the stream, i.e. wait for all queued GPU work). The
    caching host allocator keeps the pinned buffer alive until the copy has run."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


_SIGNS: dict = {}


def rht_signs_on(device, signs=None) -> torch.Tensor:
    """The RHT-16 sign vector (default ``fullstack_fp4.nvfp4.DEFAULT_SIGNS``) as an FP32 tensor
    on ``device``, cached: one host-to-device copy per device and process, not one per call
    (``hadamard16`` builds and checks it on the device each call: a copy and a sync)."""
    from fullstack_fp4.nvfp4 import DEFAULT_SIGNS

    signs = tuple(float(v) for v in (DEFAULT_SIGNS if signs is None else signs))
    if len(signs) != 16 or any(v not in (1.0, -1.0) for v in signs):
        raise ValueError("signs must be 16 values of +-1")
    key = (str(torch.device(device)), signs)
    t = _SIGNS.get(key)
    if t is None:
        t = torch.tensor(signs, dtype=torch.float32).to(device)
        _SIGNS[key] = t
    return t


def wht16(y: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Unnormalised Walsh–Hadamard (Sylvester order) on ``y``'s dimension ``dim`` of size 16,
    with ``fullstack_fp4.nvfp4.hadamard.butterfly``'s arithmetic: pairs at strides 1, 2, 4, 8,
    ``(a + b, a - b)`` each. Elementwise the same FP operations in the same order, so the result
    is bit-identical to the butterfly along the last dim of the transposed tensor."""
    dim = dim % y.dim()
    if y.shape[dim] != 16:
        raise ValueError(f"dimension {dim} must have size 16, got {tuple(y.shape)}")
    shape, pre, post = y.shape, y.shape[:dim], y.shape[dim + 1:]
    h = 1
    while h < 16:
        y = y.reshape(*pre, 16 // (2 * h), 2, h, *post)
        a, b = y.select(dim + 1, 0), y.select(dim + 1, 1)
        y = torch.stack((a + b, a - b), dim=dim + 1)
        h *= 2
    return y.reshape(shape)


def inverse_rht16(y: torch.Tensor, signs=None) -> torch.Tensor:
    """``fullstack_fp4.nvfp4.inverse_hadamard16`` (same arithmetic, bit-identical) with the
    cached device sign vector: no per-call host-to-device copy or sync."""
    s = rht_signs_on(y.device, signs)
    z = wht16(y.float().reshape(*y.shape[:-1], -1, 16), -1) * 0.25
    return (z * s).reshape(y.shape)


def rel_err(x: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
    """||x - xq|| / ||x|| in FP32 (0-dim tensor; nan if x == 0)."""
    x, xq = x.detach().float(), xq.detach().float()
    return (x - xq).pow(2).sum().sqrt() / x.pow(2).sum().sqrt()


def snr_db_from_rel_err(r):
    """-20 log10(rel_err); +inf for an exact quantization."""
    if torch.is_tensor(r):
        return -20.0 * torch.log10(r)
    return math.inf if r == 0 else -20.0 * math.log10(r)


def snr_db(x: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
    """10 log10(||x||² / ||x - xq||²) in dB."""
    x, xq = x.detach().float(), xq.detach().float()
    return 10.0 * torch.log10(x.pow(2).sum() / (x - xq).pow(2).sum())


def rel_err_from_sums(err2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    return (err2 / x2).sqrt()


def nvfp4_qdq(*, global_amax: Optional[torch.Tensor] = None, tile=(1, 16), rounding: str = "nearest",
              generator: Optional[torch.Generator] = None, rht_signs=None, scale_rule: str = "6") -> QDQ:
    """Quantize-dequantize with fullstack_fp4.nvfp4 (the recipe's quantizer) at a fixed tensor amax,
    with the block-scale rule ``scale_rule`` (``"6"`` or ``"4over6"``: the operand's own rule;
    the 4/6 choice is made per block, or per 16×16 tile, so a sample of whole blocks is
    quantized as inside the full tensor under either rule)."""
    from fullstack_fp4.nvfp4 import dequantize, quantize

    def qdq(s: torch.Tensor) -> torch.Tensor:
        q = quantize(s, tile=tuple(tile), rounding=rounding, global_amax=global_amax,
                     generator=generator, rht_signs=rht_signs, check_finite=False,
                     scale_rule=scale_rule)
        out = dequantize(q)
        if rht_signs is not None:   # compare in the original basis (the RHT is orthogonal)
            out = inverse_rht16(out, rht_signs)
        return out.float()

    return qdq


def _gather_blocks(x2: torch.Tensor, idx: torch.Tensor, tile) -> torch.Tensor:
    """Sampled blocks of ``x2 [R, K]`` stacked as a ``[n·th, 16]`` matrix (tiles stay tiles)."""
    th, tw = tile
    nb_col = x2.shape[1] // tw
    r0 = (idx // nb_col) * th
    c0 = (idx % nb_col) * tw
    ar_r = torch.arange(th, device=x2.device)
    ar_c = torch.arange(tw, device=x2.device)
    rows = (r0[:, None, None] + ar_r[None, :, None])            # [n, th, 1]
    cols = (c0[:, None, None] + ar_c[None, None, :])            # [n, 1, tw]
    return x2[rows, cols].reshape(-1, tw)


def sampled_sums(x: torch.Tensor, xq_fn: QDQ, *, blocks: int = 64, generator=None, tile=(1, 16)):
    """(Σ_s ||e||², Σ_s ||b||², n_sampled, N) over ``blocks`` uniformly drawn blocks (see module doc).

    ``n >= N``: every block exactly once (exact sums). The sums are FP32 0-dim tensors.
    """
    s, n_total = sample_blocks(x, blocks=blocks, generator=generator, tile=tile)
    e = s - xq_fn(s)
    return e.pow(2).sum(), s.pow(2).sum(), s.shape[0] // tile[0], n_total


def sample_blocks(x: torch.Tensor, *, blocks: int = 64, generator=None, tile=(1, 16)):
    """(``[n·th, 16]`` FP32 sample, N): ``blocks`` uniformly drawn blocks of ``x`` (all N once
    if ``blocks >= N``), stacked as ``_gather_blocks`` does; the draws are ``sampled_sums``'s."""
    x2 = x.detach().reshape(-1, x.shape[-1])
    th, tw = tile
    if x2.shape[1] % tw or x2.shape[0] % th:
        raise ValueError(f"shape {tuple(x2.shape)} is not a multiple of the tile {tile}")
    n_total = (x2.shape[0] // th) * (x2.shape[1] // tw)
    if blocks >= n_total:
        idx = torch.arange(n_total, device=x2.device)
    else:
        idx = to_device(torch.randint(n_total, (blocks,), generator=generator, device="cpu"), x2.device)
    return _gather_blocks(x2, idx, tile).float(), n_total


def sampled_rel_err(x: torch.Tensor, xq_fn: QDQ, *, blocks: int = 64, generator=None,
                    tile=(1, 16)) -> torch.Tensor:
    """Ratio estimate of rel_err(x, q(x)) from ``blocks`` uniformly sampled blocks (module doc).

    ``xq_fn`` maps a ``[m, 16]`` FP32 sample (rows grouped in 16-row tiles for ``tile=(16, 16)``)
    to its quantize-dequantize; for NVFP4 build it with ``nvfp4_qdq(global_amax=<x's amax>)``.
    """
    err2, x2, _, _ = sampled_sums(x, xq_fn, blocks=blocks, generator=generator, tile=tile)
    return rel_err_from_sums(err2, x2)
