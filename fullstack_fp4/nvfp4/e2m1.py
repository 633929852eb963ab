"""E2M1 (FP4) element codes: the grid, rounding to it, and packing two codes per byte.

E2M1 has 1 sign bit, 2 exponent bits and 1 mantissa bit. Its eight magnitudes, indexed by the
3-bit code, are

    code   0    1    2    3    4    5    6    7
    value  0   0.5   1   1.5   2    3    4    6

and bit 3 is the sign (``code | 8`` is the negative value).

Rounding functions here take the *scaled* FP32 value ``y = x · f`` (f the element encode
factor) and return the 4-bit code. Both saturate: anything beyond 6 in magnitude becomes 6, so
the explicit ``clamp(y, -6, 6)`` of the contract changes no code (we still clamp in the
quantizer, because the contract says so and it keeps ``frac`` below bounded for SR).

Sign of zero. A negative ``y`` that rounds to magnitude 0 gets code 8 (``-0``). This follows
Transformer Engine's reference (``cast_to_fp4x2`` maps ``[-0.25, -0.0)`` to 8) and the hardware
``cvt.rn.satfinite.e2m1x2.f32`` instruction, which keep the sign; ``y == -0.0`` itself gets
code 0 (TE: ``-0.0 >= 0.0`` is true). docs/nvfp4-format.md says "-0 is never produced"; the
two differ only in the code, never in the decoded value (``-0 == 0``). See README.md.

Nearest rounding, ties to even, is a count of thresholds crossed. The midpoints between grid
values are 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5; at a tie the even code (mantissa bit 0) wins,
so the comparison is ``>`` when the lower neighbour is even (0, 1, 2, 4 have codes 0, 2, 4, 6)
and ``>=`` when the upper one is (0.75 -> 1, 1.75 -> 2, 3.5 -> 4):

    code = [a > 0.25] + [a >= 0.75] + [a > 1.25] + [a >= 1.75] + [a > 2.5] + [a >= 3.5] + [a > 5]

Stochastic rounding: ``lo`` = largest grid value <= a, ``hi`` the next one (``hi = lo = 6`` at
the top), ``frac = (a - lo) / (hi - lo)``, round up iff ``u < frac`` with ``u ~ U[0, 1)``. Then
``P(up) = frac`` exactly (for a continuous u), so ``E[q] = lo + frac · (hi - lo) = a``: unbiased,
with variance ``frac · (1 - frac) · (hi - lo)²``. ``frac`` is exact in FP32: ``a - lo`` is exact
(``lo = 0``: trivially; ``lo > 0``: ``lo <= a <= hi <= 2·lo``, Sterbenz) and the step
``hi - lo`` is 0.5, 1 or 2, a power of two (dividing by 2 cannot underflow: ``a - 4 >= ulp(4)``).
"""

from __future__ import annotations

import torch

__all__ = [
    "E2M1_VALUES",
    "E2M1_MAX",
    "e2m1_round_nearest",
    "e2m1_round_stochastic",
    "e2m1_decode",
    "pack_codes",
    "unpack_codes",
]

#: Magnitudes of codes 0..7 (code | 8 is the negative value).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0

# Tie thresholds: (threshold, True if ``>=`` i.e. the tie goes up to an even code).
_NEAREST_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                       (2.5, False), (3.5, True), (5.0, False))


_GRIDS: dict = {}


def _grid(device: torch.device) -> torch.Tensor:
    """The value of each 4-bit code, 0..15: the magnitudes, then their negatives."""
    # cached per device and only ever indexed: building it per call is a host-to-device copy
    # from pageable memory, i.e. a stream sync on every quantize/decode on a GPU
    key = str(torch.device(device))
    g = _GRIDS.get(key)
    if g is None:
        g = _GRIDS[key] = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES),
                                       dtype=torch.float32).to(device)
    return g


def _with_sign(mag_code: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Sign bit from y itself (not from x): y == -0.0 gives code 0, like TE's reference.
    return (mag_code | ((y < 0).to(torch.uint8) << 3)).to(torch.uint8)


def e2m1_round_nearest(y: torch.Tensor) -> torch.Tensor:
    """Round FP32 ``y`` (signed, any magnitude: saturates at 6) to E2M1, ties to even.

    Returns uint8 codes 0..15 (bit 3 = sign) with ``y``'s shape.
    """
    a = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for t, tie_up in _NEAREST_THRESHOLDS:
        code += (a >= t) if tie_up else (a > t)
    return _with_sign(code, y)


def e2m1_round_stochastic(y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Stochastically round FP32 ``y`` to E2M1 with uniforms ``u`` in [0, 1) (same shape).

    Rounds the magnitude up iff ``u < frac`` (see module docstring); unbiased. Saturates at 6.
    Returns uint8 codes 0..15 (bit 3 = sign).
    """
    if u.shape != y.shape:
        raise ValueError(f"rand shape {tuple(u.shape)} != input shape {tuple(y.shape)}")
    a = y.abs().to(torch.float32).clamp(max=E2M1_MAX)
    grid = _grid(y.device)
    # Index of the largest grid value <= a: the number of grid points 0.5..6 that are <= a.
    lo_idx = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for g in E2M1_VALUES[1:]:
        lo_idx += a >= g
    lo_idx = lo_idx.long()
    lo = grid[lo_idx]
    step = grid[(lo_idx + 1).clamp(max=7)] - lo
    # At the top (lo == hi == 6) there is nowhere to go: frac = 0 (avoids 0/0).
    frac = torch.where(step > 0, (a - lo) / torch.where(step > 0, step, 1.0), 0.0)
    up = u.to(torch.float32) < frac
    code = (lo_idx + up.to(lo_idx.dtype)).to(torch.uint8)
    return _with_sign(code, y)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """FP32 value of each 4-bit code (code 8 decodes to -0.0; bits above the 4th are ignored).

    One lookup in the 16 signed values (``torch.take``): on a CPU 5× faster than a lookup of
    the magnitude and a select of the sign, and the CPU reference paths decode often (the NVFP4
    Newton–Schulz decodes every operand of every product)."""
    return torch.take(_grid(codes.device), codes.to(torch.long) & 15)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes along the last dim (even length): element 2i low nibble, 2i+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError("last dimension must be even to pack two codes per byte")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_codes(data: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 ``[..., K/2]`` -> uint8 codes ``[..., K]``."""
    lo = data & 0xF
    hi = data >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*data.shape[:-1], data.shape[-1] * 2)
