"""The random bits of NVFP4 stochastic rounding: 8 bits an element, from Philox4x32-10.

Every Triton quantize kernel that rounds stochastically without given uniforms draws them from
this stream, and :func:`sr_uniforms` computes the same stream in plain PyTorch (the oracle the
tests hand to ``quantize_reference(..., rand=...)``).

**Definition.** For an operand ``[R, K]`` quantized in 1×16 blocks along K (``NBLK = K / 16``
blocks a row) under ``seed``, element ``(r, 16·b + j)`` takes

    byte  = (W[p(r)] >> 8·s(j)) & 0xFF,   W = Philox4x32-10(counter, key = seed)
    counter = (g(r)·NBLK + b)·4 + q(j)
    u     = (byte + ½) / 256

with the row and element positions split the same way (``x`` = r or j):

    g(r) = (r >> 4)·4 + ((r & 7) >> 1)        q(j) = (j & 7) >> 1
    p(r) = ((r >> 3) & 1)·2 + (r & 1)         s(j) = ((j >> 3) & 1)·2 + (j & 1)

i.e. the 16 rows of a row tile and the 16 elements of a block are each split into 4 quads
``{2k, 2k+1, 8+2k, 9+2k}`` (the "eo" form of the kernels: even/odd elements of each 8-element
half), and one Philox call covers one row quad × one element quad: 4 words (the 4 rows) × 4
bytes (the 4 elements). The key is the seed's two 32-bit words, ``(seed & 0xFFFFFFFF,
seed >> 32)``, and the counter's 128 bits are ``(counter & 0xFFFFFFFF, counter >> 32, 0, 0)``
— what ``tl.randint4x(seed, counter)`` computes.

**Why 8 bits, and why this shape.**
* One Philox4x32-10 call (~70 integer instructions) serves 16 elements, where 32-bit uniforms
  would serve 4. In the NVFP4 linear's backward both quantizations of dY round
  stochastically, and with 32-bit uniforms the Philox calls dominate the fused quantize
  kernel's time on the H200 (docs/perf/nvfp4.md).
* 8 bits an element is what the hardware spends: Blackwell's ``cvt.rs.satfinite.e2m1x4.f32``
  (PTX) takes one 32-bit random operand for four FP4 conversions.
* Bias: rounding up iff ``u < frac`` with ``u = (k + ½)/256`` rounds up with probability
  ``round(256·frac)/256`` (ties down), so ``|E[q] − x| ≤ 2⁻⁹`` of one E2M1 step — 2⁻¹⁰ to 2⁻¹¹
  of the value for every nonzero E2M1 magnitude, below the BF16 rounding (2⁻⁹ relative) the
  input already carries. The ``½`` centres the grid: without it (``k/256``) every fraction
  would round up with probability ``ceil(256·frac)/256``, a one-sided bias of up to 2⁻⁸.
* The quad split makes the draws land where each kernel already holds its values: the fused
  two-ways kernel (kernels/quantize_two_ways.py) holds 4 channels × 16 tokens a thread, and the
  call above is exactly 4 of its values × 4 tokens (row way, rows = tokens) or 4 channels × 4
  tokens (column way, rows = channels): 4 calls a thread a way instead of 16. The tiled
  kernel (kernels/quantize.py) holds one row of a block a thread; it evaluates a call per
  (row, element quad) and keeps the row's word: one call per 4 elements, same stream.
"""

from __future__ import annotations

import torch

__all__ = ["philox4x32_10", "sr_uniforms", "row_group", "row_word", "PHILOX_ROUNDS"]

PHILOX_ROUNDS = 10
_M0, _M1 = 0xD2511F53, 0xCD9E8D57          # Philox4x32 round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85          # Weyl key increments
_MASK32 = 0xFFFFFFFF


def _mul_hi_lo(a: torch.Tensor, m: int):
    """``(hi, lo)`` 32-bit words of ``a · m`` (a: int64 tensor of uint32 values, m < 2³²), exact
    in int64 through 16-bit limbs (the full product can reach 2⁶⁴, past int64)."""
    ah, al = a >> 16, a & 0xFFFF
    mh, ml = m >> 16, m & 0xFFFF
    mid = ah * ml + al * mh                       # < 2^33
    low = al * ml + ((mid & 0xFFFF) << 16)        # < 2^33
    hi = ah * mh + (mid >> 16) + (low >> 32)
    return hi & _MASK32, low & _MASK32


def philox4x32_10(c0: torch.Tensor, c1: torch.Tensor, k0: int, k1: int, c2=None, c3=None,
                  rounds: int = PHILOX_ROUNDS):
    """Philox4x32 (Salmon et al., 2011) for counters ``(c0, c1, c2, c3)`` (int64 tensors of
    uint32 values; c2 = c3 = 0 unless given) and key ``(k0, k1)``: the four output words as
    int64 tensors — Random123's ``philox4x32_10`` and, with c2 = c3 = 0, Triton's
    ``tl.randint4x``."""
    c0 = c0.to(torch.int64) & _MASK32
    c1 = c1.to(torch.int64) & _MASK32
    c2 = torch.zeros_like(c0) if c2 is None else c2.to(torch.int64) & _MASK32
    c3 = torch.zeros_like(c0) if c3 is None else c3.to(torch.int64) & _MASK32
    for _ in range(rounds):
        hi0, lo0 = _mul_hi_lo(c0, _M0)
        hi2, lo2 = _mul_hi_lo(c2, _M1)
        c0, c1, c2, c3 = hi2 ^ c1 ^ k0, lo2, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def row_group(r: torch.Tensor) -> torch.Tensor:
    """``g(r)``: the quad of 4 rows (or 4 elements of a block, as ``q``) a Philox call covers."""
    return (r >> 4) * 4 + ((r & 7) >> 1)


def row_word(r: torch.Tensor) -> torch.Tensor:
    """``p(r)``: which of the call's 4 words (or, as ``s``, which byte of a word) is row r's."""
    return ((r >> 3) & 1) * 2 + (r & 1)


def sr_uniforms(shape, seed: int, device="cpu") -> torch.Tensor:
    """The FP32 uniforms ``(byte + ½)/256`` the Triton quantize kernels draw for an operand of
    ``shape`` (last dim K, a multiple of 16, split in 16-blocks; the leading dims flattened to
    rows) under ``seed``; see the module docstring."""
    shape = tuple(shape)
    k = shape[-1]
    if k % 16:
        raise ValueError(f"last dimension must be a multiple of 16, got shape {shape}")
    rows = 1
    for d in shape[:-1]:
        rows *= d
    nblk = k // 16
    r = torch.arange(rows, dtype=torch.int64, device=device)[:, None]
    col = torch.arange(k, dtype=torch.int64, device=device)[None, :]
    b, j = col >> 4, col & 15
    ctr = (row_group(r) * nblk + b) * 4 + row_group(j)          # q(j) = g(j) for j < 16
    seed = int(seed)
    words = philox4x32_10(ctr & _MASK32, ctr >> 32, seed & _MASK32, (seed >> 32) & _MASK32)
    stacked = torch.stack(words, 0)                             # [4, rows, K]
    w = torch.gather(stacked, 0, row_word(r).expand(rows, k)[None])[0]
    byte = (w >> (8 * row_word(j))) & 0xFF
    return ((byte.to(torch.float32) + 0.5) / 256.0).reshape(shape)
