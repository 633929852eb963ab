"""NVFP4 codecs for Adam's two moments, on flat 1-D tensors of any length (pure PyTorch oracle).

Layout shared by both moments (``n`` real entries, padded with zeros to ``npad``):

* ``codes``        uint8 ``[npad/2]``        E2M1 codes, element 2i low nibble (fullstack_fp4.nvfp4)
* ``block_scale``  float8_e4m3fn ``[npad/16]`` one E4M3 scale per 16 elements (NVFP4 1×16)
* ``chunk_scale``  float32 ``[ceil(npad/CHUNK)]`` the second-level (FP32 decode) scale of each
  chunk of ``CHUNK = 1024`` elements — NVFP4's "tensor scale", taken per chunk (decode scale
  first: ``chunk_scales``).

Second moment only: ``tile_mean``, BF16 ``[npad/TILE]``, ``TILE = 64``.

First moment ``m`` (``encode_exp_avg``)::

    y = RHT16(m)                       # Hadamard-16 with TE's fixed signs: spreads an outlier
                                       # over its 16-block so one E4M3 scale fits all of it
    NVFP4(y, scale_rule="4over6", rounding="stochastic", second-level scale per chunk)
    decode: m̂ = RHT16⁻¹(q · s · d)

m changes sign and is averaged by the EMA, so unbiased stochastic rounding (E[m̂] = m) matters
more than the per-step error; 4/6 picks, per block, the scale that maps the block max to 4 or 6,
whichever reconstructs the block better (nearest-rounded candidates; then SR with the winner).

Second moment ``v`` (``encode_exp_avg_sq``)::

    s    = sqrt(max(v, 0))                  # halves the dynamic range (in log2) of v
    μ_t  = bf16_rne(mean of s over a tile)  # per tile of TILE=64 real entries, kept in BF16
    r    = s − μ_t  (0 at padding)          # zero-mean residual
    NVFP4(RHT16(r), scale_rule="4", rounding="nearest", second-level scale per chunk)
    decode: ŝ = max(RHT16⁻¹(q · s · d) + μ_t, μ_t / 4);  v̂ = min(ŝ², FP32_MAX)

``v̂ >= 0`` always (``μ_t >= 0``) and is never NaN for finite input; zeros, 1e-30 and 1e30 are
fine (BF16 has FP32's exponent range, the chunk scale follows each chunk's own amax).

Guard. An entry far below its tile mean has ``r ≈ −μ_t``; the residual's quantization error is
a fraction of the block amax (and the Hadamard spreads it over the block), so ``ŝ`` can come out
≈ 0 or negative and ``m / (ŝ + eps)`` explodes (the "no guard" row of README.md's table:
update error ~1e4). We floor ``ŝ`` at ``REL_FLOOR · μ_t`` with ``REL_FLOOR = 1/4``:
the update of every entry is then bounded by ``|m| / (μ_t / 4)``; an entry whose true ``s`` is
below ``μ_t / 4`` gets a *smaller* update than exact Adam (a locally larger eps), never a larger
one. Measured against the alternatives (benchmarks/studies/q_adamw_error_table.py --variants, README.md):
no guard (update error 1e4×), a floor at the tile minimum (BF16 rounded
toward zero; bounded but entries between min and mean still reconstruct near the min: update
relL2 6–13, max error 185–495× the largest update, and 2 more bytes per tile), and relative
floors 1/2, 1/4, 1/8, 1/16: 1/4 had the lowest update relL2 on both synthetic sets
(0.46 / 0.37, max error ~2×), needs no storage, and costs nothing in a kernel.

Why these sizes (bytes per parameter, B/param):

* Hadamard 16 = the NVFP4 block: mixing inside the block is what the block's single E4M3 scale
  needs, costs 4 butterfly stages in a kernel, and never crosses a block/chunk boundary, so a
  chunk is self-contained. Bigger Hadamards (e.g. 128) mix outliers across
  blocks, which only spreads one block's large scale over its neighbours.
* ``TILE = 64`` for the mean: one BF16 per 64 entries = 0.031 B/param. Measured with the
  "4" rule on v (√v error against direct NVFP4 on the same v, mean of eight draws,
  ``python benchmarks/studies/q_adamw_iid_floor.py --seeds 8``, ``BENCHMARKS.md#q-adamw``): TILE 64 −51.8% (iid)
  / −65.4% (structured), TILE 32 −48.6% / −65.2%, TILE 128 −51.4% / −65.6% (but −45.5% in its
  worst iid draw against TILE 64's −48.9%). TILE 16 would cost 0.125 B/param and take the state
  over the 1.2 budget. With the 6-rule TILE 64 was barely better than 32 (−45.7% / −62.3%
  against −43.8% / −63.8%): a longer tile leaves more spread in the residual, which the "4"
  rule's finer grid near zero quantizes better. ``CODEC_VERSION`` 1 used TILE 32 with the
  6-rule; a state of that codec is refused at load (state.py).
* ``CHUNK = 1024``: one Triton program owns one chunk — loads it, takes its amax in registers,
  computes its scales, quantizes and stores — so the fused optimizer step is a *single pass*
  over memory with no global-amax reduction (a per-tensor scale would need a second pass, or
  last step's amax). Per-chunk scales also adapt to local dynamic range: E4M3 block scales span
  only ~2^17 (with subnormals), and a heavy-tailed v over a 1e9-entry shard would flush whole
  blocks to zero under one tensor scale. In the kernel a 1024-chunk is 64 threads owning one
  16-block each (2 warps), so its amax is one cross-warp reduction; the scale costs
  4 B / 1024 = 0.004 B/param per moment.
* v's residual maps every block max to 4 (the "4" rule: ``SCALE_RULES``), nearest rounding.
  After the RHT the residual's blocks are near-Gaussian: most of their entries are small, and
  the block max at 4 puts the E2M1 grid's fine steps (0.5 below 2) under more of them than the
  max at 6 does, at the price of the code 6, which only clamped values reach. Measured (eight
  draws, tile 64): iid −51.8% / structured −65.4% against −45.7% / −62.3% for the 6-rule and
  −52.7% / −66.7% for 4/6, which keeps the better of 4 and 6 per block. 4/6 costs a second
  candidate's block error per entry: +338 SASS instructions per 16 entries (+14.7%, 2636
  against 2298; ``benchmarks/sass_q_adamw.py --v-rule 4over6``), and the kernel is
  instruction-issue-bound, so it would cost the step ~15% for one more point of √v error; the
  "4" rule costs what the 6-rule cost (docs/perf/q-adamw.md). Block-max targets 3, 4.5 and 5 measured worse (−42.5%, −47.4%,
  −35.3% iid). A bias-free SR buys little for v, an average that changes slowly (β2 = 0.999).

Total: m 0.5 + 0.0625 + 0.0039; v 0.5 + 0.0625 + 0.0313 + 0.0039 → **1.164 B/param**
(:func:`state_bytes_per_param` counts a given length exactly, padding included).

Bit-exactness with the fused kernel (``triton_step.py``): every reduction whose result is
rounded (tile sum → mean) is a fixed pairwise tree written out here and mirrored in the kernel;
the Hadamard is fullstack_fp4.nvfp4's butterfly (stages 1, 2, 4, 8); amax/min are exact in any
order; the 4/6 error sums are FP32 halving trees too (``_code_error32``; nvfp4's reference sums
them in FP64, which cost the kernel FP64 converts and adds for no accuracy that matters).

Where this oracle departs from nvfp4.reference's order, and why (each cut an instruction count
of the kernel; docs/perf/q-adamw.md), all bit-identical to nvfp4's order outside FP32's
subnormal range unless said otherwise:

* the second-level scales are ``dec = fl(amax · fl(1/M))``, ``enc = fl(1/dec)``
  (``chunk_scales``) where nvfp4's are ``enc = fl(M / amax)``, ``dec = fl(1/enc)``, and the
  element factor is ``fl(fl(0.25 / s) · enc)`` where nvfp4's is ``fl(0.25 / fl(s · dec))``:
  the same two roundings each, a last bit apart at times, and 5 of a row's 7 divisions gone
  from the kernel (the chunk's largest block still gets the scale ``M / 6`` exactly);
* the v tile mean is ``fl(sum · fl(1/cnt))``: ``sum / 64`` exactly for every full tile, one
  rounding away from the division at a tensor's partial last tile;
* the RHT's ``× 1/4`` is not applied to the 16 entries: the encoder gets the unscaled butterfly
  and takes its block amax × 1/4 (exactly nvfp4's amax: rounding is monotone) and the element
  factor for ``0.25 / (s · dec)``; the decoder takes the block scale × 1/4 (``_quantize_chunked``,
  ``_decode_chunked``). In the subnormal range this order rounds once where nvfp4's
  rounds two or three times;
* the decoder applies the chunk scale after the inverse RHT, which is then exact, fused into
  the consumer's multiply-add (``_decode_chunked``): a decoded value is one rounding of the
  exact ``H(q) · s · dec / 4`` where nvfp4's order rounds five times (each ``q · s · dec``,
  then every butterfly stage), and it does not overflow when ``q · s · dec`` exceeds
  FP32_MAX (it can: 6 · 448 · FP32_MAX / 1536 > FP32_MAX) while the result does not;
* the 4/6 criterion is measured in the code domain (``_code_error32``): it can choose
  differently only between candidates whose block errors agree to a few ulps;
* the stochastic rounding of m reads its fraction off the FP32 bits, which rounds magnitudes
  below 1 (in units of the block scale) to 2^-23 first (``sr_codes``): its bias bound becomes
  (2^-9 + 2^-23) of an E2M1 step with the kernel's 8-bit centred uniforms
  (``optimizer.kernel_uniforms``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from fullstack_fp4.nvfp4.e2m1 import (E2M1_MAX, e2m1_decode, e2m1_round_nearest,
                                      e2m1_round_stochastic, pack_codes, unpack_codes)
from fullstack_fp4.nvfp4.hadamard import DEFAULT_SIGNS, butterfly
# The reference's per-block helpers take broadcastable enc/dec, so per-chunk scales reuse them.
from fullstack_fp4.nvfp4.reference import scale_candidate, tensor_scales

__all__ = [
    "BLOCK", "CHUNK", "TILE", "REL_FLOOR", "FP32_MAX", "MomentState",
    "encode_exp_avg", "decode_exp_avg", "encode_exp_avg_sq", "decode_exp_avg_sq",
    "padded_numel", "num_chunks", "state_bytes_per_param", "chunk_scales", "CODEC_VERSION",
]

BLOCK = 16        # NVFP4 block = Hadamard size
CHUNK = 1024      # elements per second-level scale = elements per kernel program
TILE = 64         # v: elements per BF16 tile mean
REL_FLOOR = 0.25  # v: decode floor, as a fraction of the tile mean (the guard)
FP32_MAX = torch.finfo(torch.float32).max
M_SCALE_RULE = "4over6"
V_SCALE_RULE = "4"
# Block-scale rules of the codec: E4M3 bound of the second-level scale (M = 6 · bound, as
# NVFP4's tensor scale) and the block-max targets tried per block (the one with the smaller
# block error is kept). "6" and "4over6" are fullstack_fp4.nvfp4's rules; "4" maps every block
# max to 4 (one candidate, M = 1536 as "4over6"): v's rule since CODEC_VERSION 2.
SCALE_RULES = {"6": (448.0, (6.0,)), "4over6": (256.0, (6.0, 4.0)), "4": (256.0, (4.0,))}
# The state layout's version, saved with every QAdamW state dict: 1 = v with the 6-rule and
# 32-entry tiles, 2 = v with the "4" rule and 64-entry tiles (this code). The m
# codec is the same in both; v's bytes mean something else, so a state of another version is
# refused at load (state.check_codec_version) rather than decoded wrongly.
CODEC_VERSION = 2


@dataclass
class MomentState:
    """One encoded moment of ``numel`` entries (see the module docstring for the layout)."""

    codes: torch.Tensor                   # uint8 [npad/2]
    block_scale: torch.Tensor             # float8_e4m3fn [npad/16]
    chunk_scale: torch.Tensor             # float32 [nchunks], decode scale
    numel: int
    tile_mean: Optional[torch.Tensor] = None   # bfloat16 [npad/tile] (v only)
    tile_floor: Optional[torch.Tensor] = None  # bfloat16 [npad/tile], measurement only
    tile: int = TILE
    phase: int = 0                        # chunk-grid phase (see ``num_chunks``)

    def nbytes(self) -> int:
        ts = [self.codes, self.block_scale, self.chunk_scale, self.tile_mean, self.tile_floor]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def padded_numel(n: int, tile: int = TILE) -> int:
    """Storage length: ``n`` rounded up to the tile (itself a multiple of the 16-block)."""
    unit = max(BLOCK, tile)
    return -(-n // unit) * unit


def num_chunks(npad: int, phase: int = 0) -> int:
    """Second-level scales of a flat tensor stored from element ``phase`` of its chunk grid.

    ``phase`` (a multiple of 16 in ``[0, CHUNK)``) shifts the grid: chunk ``j`` covers local
    entries ``[j·CHUNK − phase, (j+1)·CHUNK − phase)`` (clipped). A shard of a larger tensor
    that starts at a chunk boundary of the *whole* tensor's grid then encodes each chunk exactly
    as the whole tensor would (the distributed optimizer: optimizer.py, "placement")."""
    return -(-(phase + npad) // CHUNK)


def _check_phase(phase: int) -> None:
    if not (0 <= phase < CHUNK and phase % BLOCK == 0):
        raise ValueError(f"chunk phase {phase} must be a multiple of {BLOCK} in [0, {CHUNK})")


def state_bytes_per_param(n: int, tile: int = TILE) -> float:
    """Bytes of both encoded moments per real parameter for a flat tensor of ``n`` entries."""
    npad = padded_numel(n, tile)
    nch = -(-npad // CHUNK)
    m = npad // 2 + npad // BLOCK + 4 * nch
    v = m + 2 * (npad // tile)
    return (m + v) / n


# ----------------------------------------------------------------------------- NVFP4, chunked
def _halving_sum(x: torch.Tensor) -> torch.Tensor:
    """FP32 sum over the last dim (a power of 2) by halving: ``x[..., :h] + x[..., h:]``.

    A fixed tree the kernel repeats term for term, so the rounded sums agree bit for bit."""
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def _code_error32(y3, f, s, dec) -> torch.Tensor:
    """The 4/6 criterion of one candidate: ``Σ|t − rtn(min(t, 6))| · (s · dec)`` per 16-block,
    ``t = |y| · f``, the sum an FP32 halving tree (the kernel's, term for term).

    The block error Σ|y − q · s · dec| measured in the code domain (|y| / (s · dec) ≈ t) and
    scaled back once per block: per entry one FMUL for t, which the rounding needs anyway, and
    one subtraction, instead of two more products and a subtraction in the element domain.
    ``t − rtn(·)`` is exact (both multiples of ulp(t), and |t − r| <= t as 0 is on the grid),
    so the two forms differ only by the rounding of f = 1 / (s · dec), of t and of the sums —
    a few ulps, relative: the choice can differ only between candidates whose block errors
    agree to ~1e-6, where neither is the better one. (nvfp4.reference sums element-domain
    errors in FP64; the fused kernel's instruction budget is why this is FP32 and code-domain.)
    A candidate with ``s · dec == 0`` (its E4M3 scale, or the product, underflowed) has an
    error of 0 or NaN here: the caller makes it lose (it would reconstruct only zeros)."""
    t = y3.abs() * f
    r = e2m1_decode(e2m1_round_nearest(torch.clamp(t, max=E2M1_MAX)))
    return _halving_sum((t - r).abs())[..., None] * (s.to(torch.float32) * dec)


def sr_codes(yq: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Stochastic E2M1 codes of ``yq`` (already clamped to [-6, 6]) with uniforms ``u``.

    nvfp4.e2m1's rule — magnitude rounded up iff ``u < frac``, ``frac = (|yq| − lo) / step`` —
    applied to ``|yq|`` after rounding magnitudes below 1 to nearest-even on 2^-23 (the grid of
    ``fl(|yq| / 2 + 1/2)``: the kernel maps [0, 1) there to read the fraction off the FP32 bits,
    triton_rows._sr_code). Sign bit from ``yq < 0`` itself, as nvfp4's ``_with_sign`` (so a
    magnitude that rounds to 0 keeps the sign of a negative ``yq``; ``-0.0`` gives code 0).

    Bias: the pre-rounding moves ``|yq|`` by at most 2^-24 = 2^-23 of the 0.5 step there (RNE,
    so it is also zero on average over the values), and nothing at all for ``|yq| >= 1`` or for
    values already on 2^-23 (every FP32 >= 0.5 but those in [0.5, 1) with the last bit set).
    With exact uniforms the rounding of the pre-rounded value is unbiased; with the kernel's
    8-bit centred Philox uniforms (k + ½) / 2^8, P(up) = round(frac · 2^8) / 2^8 (ties down),
    so the bias of one rounding is at most (2^-9 + 2^-23) of one E2M1 step (2^-16 + 2^-23
    with the 16-bit option, ``launch(u8=False)``)."""
    a = yq.abs()
    x = torch.maximum(a, a * 0.5 + 0.5)      # a * 0.5 + 0.5: the kernel's FFMA (a * 0.5 is exact
    # unless a < 2^-125, where the sum rounds to 0.5 either way)
    a = torch.where(a < 1.0, (x - 0.5) * 2.0, a)          # exact: Sterbenz, then a power of 2
    mag = e2m1_round_stochastic(a, u)                       # a >= 0: sign bit clear
    return mag | ((yq < 0).to(torch.uint8) << 3)


_SIGNS: dict = {}


def _signs_on(device) -> torch.Tensor:
    t = _SIGNS.get(str(device))
    if t is None:
        t = _SIGNS[str(device)] = torch.tensor(DEFAULT_SIGNS, dtype=torch.float32, device=device)
    return t


def _rht16_unscaled(x: torch.Tensor) -> torch.Tensor:
    """``4 · hadamard16(x)`` on a flat FP32 length-16k ``x``: the butterfly of ``x · signs``
    without nvfp4's final ``× 1/4``, which ``_quantize_chunked`` folds into its scales."""
    return butterfly(x.view(-1, BLOCK) * _signs_on(x.device), BLOCK).reshape(-1)


def _irht16_unscaled(y: torch.Tensor) -> torch.Tensor:
    """``inverse_hadamard16`` without its ``× 1/4`` (``_decode_chunked`` has it)."""
    return (butterfly(y.view(-1, BLOCK), BLOCK) * _signs_on(y.device)).reshape(-1)


def chunk_scales(amax: torch.Tensor, scale_rule: str):
    """Second-level scales ``(enc, dec)`` (FP32, shaped like ``amax``), decode scale first:
    ``dec = fl(amax · fl(1/M))`` clamped to ``[2^-126, 2^126]``, ``enc = fl(1 / dec)``, with
    ``M = 6 · 256`` ("4over6", m; "4", v) or ``6 · 448`` ("6").

    NVFP4's tensor scale is ``enc = fl(M / amax)``, ``dec = fl(1 / enc)`` (nvfp4.reference.
    tensor_scales): two divisions, which the fused kernel computes for each of its rows (the
    chunk amax reaches every thread). Here ``dec`` is a product with a constant, so one division
    is left. ``enc`` is within 1.5 ulp of ``M / amax``, so the chunk's largest block still gets
    the E4M3 scale ``M / 6`` exactly (its product rounds to that grid point), as with NVFP4's
    rule: the reason this is the rule and not a power of two (``_pow2_chunk_scales``, no
    division at all), which leaves the largest block a rounded scale and measured 2–6% more m
    error and 1–3% more √v error (benchmarks/studies/q_adamw_error_table.py --seeds 8; README.md). The
    clamp keeps both scales normal: a chunk of zeros or of amax below ``M · 2^-126`` gets
    ``enc = 2^126``; the upper end is out of reach of a finite amax (``FP32_MAX / M < 2^118``).
    The element factor is then ``f = min(fl(0.25 / s) · enc, FP32_MAX / 4)`` (``_quantize_chunked``:
    two roundings, as NVFP4's ``0.25 / fl(s · dec)``), ``fl(0.25 / s)`` from the E4M3 entries
    of a table in the kernel (triton_step.recip_table). docs/perf/q-adamw.md."""
    dev = amax.device
    inv_m = torch.div(torch.tensor(1.0), torch.tensor(SCALE_RULES[scale_rule][0] * 6.0)).to(dev)
    dec = torch.clamp(amax.to(torch.float32) * inv_m, min=2.0 ** -126, max=2.0 ** 126)
    return torch.div(torch.tensor(1.0, device=dev), dec), dec


def _pow2_chunk_scales(amax: torch.Tensor, scale_rule: str):
    """The division-free alternative (measured, not used: ``chunk_scales``): ``enc = 2^k``,
    ``k = floor(log2(M / amax))`` from the bits (``M / amax = 2^(E_M − E_a) · (1 + F_M) /
    (1 + F_a)``, so ``k = E_M − E_a − [F_a > F_M]``) clamped to ``[-126, 126]``, ``dec = 2^-k``;
    the largest block's E4M3 scale lands anywhere in ``(M/12, M/6]``."""
    m6 = torch.tensor(SCALE_RULES[scale_rule][0] * 6.0, dtype=torch.float32).view(torch.int32)
    a = amax.to(torch.float32).contiguous().view(torch.int32)
    k = (m6 >> 23) - (a >> 23) - ((a & 0x7FFFFF) > (m6 & 0x7FFFFF)).to(torch.int32)
    k = torch.clamp(k, -126, 126)
    return ((k + 127) << 23).view(torch.float32), ((127 - k) << 23).view(torch.float32)


def _quantize_chunked(y: torch.Tensor, scale_rule: str, rand: Optional[torch.Tensor],
                      phase: int = 0, chunk_rule: str = "reciprocal"):
    """NVFP4 of ``y / 4`` (flat FP32 ``y``, length a multiple of 16) with one FP32 scale per
    CHUNK; ``y`` is the *unscaled* RHT-16 output (``_rht16_unscaled``).

    Same FP32 order of operations as fullstack_fp4.nvfp4.reference (TE's), with the tensor amax
    replaced by each chunk's amax, and the RHT's ``× 1/4`` moved from the 16 entries of a block
    to its amax and element factor: ``amax = max|y| · 1/4`` is exactly the amax of ``fl(y/4)``
    (rounding is monotone). The block scales are nvfp4's rule with the chunk's ``enc``
    (``chunk_scales``) for its tensor scale; the element factor is
    ``f = min(fl(0.25 / s) · enc, FP32_MAX / 4)`` and the scaled value
    ``t = y · f``. Outside FP32's subnormal range that is ``fl(fl(y/4) · f_nvfp4)`` exactly
    (scaling by 2^-2 commutes with rounding); when ``y/4`` or ``f / 4`` would be subnormal,
    ``t`` here is the single correctly rounded ``y / (4 · s · dec)`` where nvfp4's order rounds
    two or three times — never a larger error. ``rand`` given -> stochastic rounding with
    those uniforms (``sr_codes``). ``phase``: the chunk grid's offset (``num_chunks``); zeros
    fill the grid around ``y``. ``chunk_rule``: "reciprocal" (``chunk_scales``, what the
    optimizer and the kernel use) or, to measure against it, "nvfp4" (NVFP4's ``M / amax``
    tensor-scale rule per chunk with ``f = min(0.25 / (s · dec), FP32_MAX / 4)``: the
    alternative to the decode-scale-first rule) or "pow2" (``_pow2_chunk_scales``;
    benchmarks/studies/q_adamw_error_table.py --variants, --seeds).
    """
    _check_phase(phase)
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {sorted(SCALE_RULES)}, got {scale_rule!r}")
    npad = y.numel()
    nb = npad // BLOCK
    nch = num_chunks(npad, phase)
    yc = torch.zeros(nch * CHUNK, dtype=torch.float32, device=y.device)
    yc[phase:phase + npad] = y
    y3 = yc.view(nch, CHUNK // BLOCK, BLOCK)
    bamax = y3.abs().amax(dim=-1, keepdim=True) * 0.25      # exact in any order
    amax = bamax.amax(dim=(1, 2))                           # [nch]
    if chunk_rule == "reciprocal":
        enc, dec = chunk_scales(amax, scale_rule)
    elif chunk_rule == "nvfp4":
        enc, dec = tensor_scales(amax, "4over6" if scale_rule == "4" else scale_rule)
    elif chunk_rule == "pow2":
        enc, dec = _pow2_chunk_scales(amax, scale_rule)
    else:
        raise ValueError(f"unknown chunk_rule {chunk_rule!r}")
    enc3, dec3 = enc.view(nch, 1, 1), dec.view(nch, 1, 1)

    def candidate(target):
        s, _ = scale_candidate(y3, bamax, enc3, dec3, target)
        if chunk_rule == "nvfp4":
            return s, torch.clamp(0.25 / (s.to(torch.float32) * dec3), max=FP32_MAX * 0.25)
        r = torch.div(torch.tensor(0.25, dtype=torch.float32), s.to(torch.float32))
        return s, torch.clamp(r * enc3, max=FP32_MAX * 0.25)

    s, f = candidate(SCALE_RULES[scale_rule][1][0])     # 6 ("6", "4over6") or 4 ("4")
    if scale_rule == "4over6":
        s4, f4 = candidate(4.0)
        use4 = ((_code_error32(y3, f4, s4, dec3) < _code_error32(y3, f, s, dec3))
                | (s.to(torch.float32) * dec3 == 0))
        s = torch.where(use4, s4.to(torch.float32), s.to(torch.float32)).to(torch.float8_e4m3fn)
        f = torch.where(use4, f4, f)
    yq = torch.clamp(y3 * f, -E2M1_MAX, E2M1_MAX)
    if rand is None:
        codes = e2m1_round_nearest(yq)
    else:
        u = torch.zeros(nch * CHUNK, dtype=torch.float32, device=y.device)
        u[phase:phase + npad] = rand.reshape(-1)[:npad]
        codes = sr_codes(yq, u.view_as(yq))
    codes = codes.reshape(-1)[phase:phase + npad]
    b0 = phase // BLOCK
    return pack_codes(codes), s.reshape(-1)[b0:b0 + nb].contiguous(), dec.contiguous()


def _decode_chunked(codes: torch.Tensor, block_scale: torch.Tensor,
                    chunk_scale: torch.Tensor, phase: int = 0):
    """``(x, d)``: the decoded values are ``x · d``, rounded once. ``x`` is the inverse RHT
    (``_irht16_unscaled``) of ``q · (fp32(s) / 4)``, **exact**: each partial butterfly sum is a
    partial Hadamard sum of the q's (a multiple of 1/2 below 97: <= 8 bits) times the block's
    one E4M3 scale over 4 (<= 4 significant bits), so <= 12 bits and far from FP32's limits;
    ``d`` is each entry's chunk decode scale. The consumer multiplies by ``d`` last, fused with
    what follows (``decode_exp_avg``: ``x · d``; ``decode_exp_avg_sq``: ``fma(x, d, μ)``; the
    step: ``fma(x, d · β1, (1 − β1) · g)``, optimizer.q_adamw_step_reference), so a decoded
    value is one rounding of the exact ``H(q) · s · d / 4``: nvfp4's order rounds each
    ``q · s · d`` and then every butterfly stage (4 more roundings), and it overflowed when
    ``q · s · d`` exceeded FP32_MAX (possible: 6 · 448 · FP32_MAX / 1536) while the result did
    not. The kernel does the same (triton_rows._decode_rows): 16 FMULs per moment and block
    fewer."""
    q = e2m1_decode(unpack_codes(codes)).view(-1, BLOCK)
    nb = q.shape[0]
    b0 = phase // BLOCK
    d = chunk_scale.repeat_interleave(CHUNK // BLOCK)[b0:b0 + nb]
    x = _irht16_unscaled((q * (block_scale.to(torch.float32) * 0.25)[:, None]).reshape(-1))
    return x, d.repeat_interleave(BLOCK)


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded FP32 sqrt (the kernel's ``sqrt_rn``). torch's vectorized CPU sqrt is
    off by an ulp at times; sqrt in FP64 then one rounding is exact-to-nearest (53 >= 2·24+2)."""
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


def _fma_rn(a: torch.Tensor, b, c) -> torch.Tensor:
    """Correctly rounded FP32 ``a · b + c`` (one rounding: the kernel's ``tl.fma``, FFMA).

    In FP64 the product of two FP32 values is exact (48 <= 53 bits), so only the sum rounds;
    rounding it *to odd* (TwoSum gives the sum's exact error e; if e != 0 and the FP64 result
    is even, step one ulp toward the exact value) and then to FP32 is the correctly rounded
    result, as 53 >= 24 + 2 (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums:
    proved algorithms using rounding to odd", IEEE TC 2008) — subnormal FP32 results included
    (they keep fewer bits). Plain FP64 rounding then FP32 rounding could round twice. A
    non-finite sum (inf or NaN in, or an FP64 overflow, impossible from FP32 inputs) is
    returned as FP64 computed it.

    Only a sum that lands *exactly* on an FP32 rounding midpoint can round twice: any other
    midpoint is itself an FP64 number (it has at most 25 significant bits), so it cannot lie
    between the exact sum and its FP64 rounding, and both round to the same FP32 value. Such a
    sum has its 28 lowest mantissa bits zero; only those entries (rare: also exact FP32 values,
    zeros and infinities) go through the round-to-odd step, which keeps the CPU path's cost
    near one FP64 multiply-add (the round-to-odd step on every entry took 40% of the reference
    optimizer step)."""
    a64 = a.to(torch.float64)
    p = a64 * torch.as_tensor(b, dtype=torch.float64, device=a.device)
    c64 = torch.as_tensor(c, dtype=torch.float64, device=a.device).expand_as(p)
    s = p + c64
    maybe = (s.view(torch.int64) & 0x0FFFFFFF) == 0
    if bool(maybe.any()):
        s[maybe] = _round_to_odd(p[maybe], c64[maybe])
    return s.to(torch.float32)


def _round_to_odd(p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``p + c`` in FP64 rounded to odd (see :func:`_fma_rn`)."""
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)                    # s + e == p + c exactly (TwoSum)
    bits = s.view(torch.int64)
    even = (bits & 1) == 0
    # e != 0 -> s != 0; toward the exact value: one ulp up in magnitude iff e has s's sign
    step = torch.where((e > 0) == (s > 0), 1, -1)
    odd = torch.where(even & (e != 0) & torch.isfinite(s), bits + step, bits)
    return odd.view(torch.float64)


def _pad(x: torch.Tensor, npad: int) -> torch.Tensor:
    out = torch.zeros(npad, dtype=torch.float32, device=x.device)
    out[: x.numel()] = x.reshape(-1).to(torch.float32)
    return out


# ----------------------------------------------------------------------------- first moment
def encode_exp_avg(m: torch.Tensor, *, rand: Optional[torch.Tensor] = None,
                   generator: Optional[torch.Generator] = None,
                   tile: int = TILE, phase: int = 0, chunk_rule: str = "reciprocal") -> MomentState:
    """Encode Adam's first moment (any shape, read flat): RHT-16, 4/6, stochastic rounding.

    ``rand``: FP32 uniforms in [0, 1) of length >= ``padded_numel(m.numel())``, one per stored
    (Hadamard-domain) element; else drawn from ``generator``. Padding is zero on every encode,
    so it never carries anything into the real entries' blocks.
    """
    n = m.numel()
    npad = padded_numel(n, tile)
    y = _rht16_unscaled(_pad(m, npad))
    if rand is None:
        rand = torch.rand(npad, generator=generator, dtype=torch.float32, device=m.device)
    codes, bs, cs = _quantize_chunked(y, M_SCALE_RULE, rand, phase, chunk_rule)
    return MomentState(codes, bs, cs, n, tile=tile, phase=phase)


def decode_exp_avg(state: MomentState) -> torch.Tensor:
    """Flat FP32 first moment of ``state.numel`` entries: ``x · d`` (``_decode_chunked``)."""
    x, d = decode_exp_avg_parts(state)
    return x * d


def decode_exp_avg_parts(state: MomentState):
    """``(x, d)`` of ``_decode_chunked`` for the first ``state.numel`` entries: the step fuses
    ``· d`` into its own multiply-add (optimizer.q_adamw_step_reference, the kernel's _adam)."""
    x, d = _decode_chunked(state.codes, state.block_scale, state.chunk_scale, state.phase)
    return x[: state.numel], d[: state.numel]


# ----------------------------------------------------------------------------- second moment
def _pairwise_tile_sum(x2: torch.Tensor) -> torch.Tensor:
    """Sum of each row (a tile): each 16-block by halving, then the block sums by halving.

    A fixed tree the kernel repeats (a kernel thread owns one 16-block: the in-block tree is
    register adds, only the block sums cross threads), so the FP32 sums agree bit for bit."""
    r, t = x2.shape
    if t < BLOCK:
        return _halving_sum(x2)
    return _halving_sum(_halving_sum(x2.reshape(r, t // BLOCK, BLOCK)))


def bf16_toward_zero(x: torch.Tensor) -> torch.Tensor:
    """FP32 -> BF16 by truncating the low 16 bits: rounds |x| down, so the result is <= x >= 0."""
    bits = x.to(torch.float32).contiguous().view(torch.int32) & ~0xFFFF
    return bits.view(torch.float32).to(torch.bfloat16)  # exact: already representable


def encode_exp_avg_sq(v: torch.Tensor, *, tile: int = TILE,
                      scale_rule: str = V_SCALE_RULE, subtract_mean: bool = True,
                      with_floor: bool = False, phase: int = 0,
                      chunk_rule: str = "reciprocal") -> MomentState:
    """Encode Adam's second moment: sqrt, BF16 tile mean, RHT-16 residual, NVFP4 RTN.

    ``tile``/``scale_rule``/``subtract_mean``/``with_floor`` (also store the tile minimum, for
    the "tile_min" guard)/``chunk_rule`` (``_quantize_chunked``) exist to measure the
    alternatives (the error table); the optimizer and the kernel use the defaults.
    """
    n = v.numel()
    npad = padded_numel(n, tile)
    s = _pad(_sqrt_rn(torch.clamp(v.reshape(-1).to(torch.float32), min=0.0)), npad)
    valid = torch.arange(npad, device=v.device) < n
    s2 = s.view(-1, tile)
    cnt = valid.view(-1, tile).sum(dim=1).clamp(min=1).to(torch.float32)
    # · fl(1/cnt), not / cnt: the kernel reads the reciprocal from its table (recip_table);
    # the same for the full tiles (cnt = 64: a power of two, exact either way), one rounding
    # apart at the tail
    mean = (_pairwise_tile_sum(s2) * torch.div(1.0, cnt)).to(torch.bfloat16)     # RNE
    if not subtract_mean:
        mean = torch.zeros_like(mean)
    floor = None
    if with_floor:
        floor = bf16_toward_zero(torch.where(valid.view(-1, tile), s2, torch.inf).amin(dim=1))
    r = torch.where(valid.view(-1, tile), s2 - mean.to(torch.float32)[:, None], 0.0)
    y = _rht16_unscaled(r.reshape(-1))
    codes, bs, cs = _quantize_chunked(y, scale_rule, None, phase, chunk_rule)
    return MomentState(codes, bs, cs, n, tile_mean=mean, tile_floor=floor, tile=tile,
                       phase=phase)


def decode_exp_avg_sq(state: MomentState, *, guard: str = "relative",
                      rel_floor: float = REL_FLOOR) -> torch.Tensor:
    """Flat FP32 second moment, ``>= 0`` and finite: ``max(r̂ + μ, μ/4)²`` clamped to FP32_MAX.

    ``guard``: "relative" (default, ``rel_floor · μ``), and for the measurement only
    "tile_min" (needs ``with_floor=True`` at encode) or "none" (``max(ŝ, 0)``).
    """
    x, d = _decode_chunked(state.codes, state.block_scale, state.chunk_scale, state.phase)
    mean = state.tile_mean.to(torch.float32)[:, None]
    # r̂ + μ as one rounding of the exact x · d + μ (the kernel's FFMA, triton_rows._vhat)
    sh = _fma_rn(x.view(-1, state.tile), d.view(-1, state.tile), mean)
    if guard == "relative":
        sh = torch.maximum(sh, mean * rel_floor)
    elif guard == "tile_min":
        sh = torch.maximum(sh, state.tile_floor.to(torch.float32)[:, None])
    elif guard == "none":
        sh = torch.clamp(sh, min=0.0)
    else:
        raise ValueError(f"unknown guard {guard!r}")
    return torch.clamp(sh * sh, max=FP32_MAX).reshape(-1)[: state.numel]
