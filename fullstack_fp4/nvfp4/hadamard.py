"""Random Hadamard transform (RHT-16) for the wgrad operands, and a general Hadamard transform.

RHT-16 acts on each 16-element block of the last dimension:

    hadamard16(x)_blk         = (x_blk ⊙ s) · H16 / 4
    inverse_hadamard16(y)_blk = (y_blk · H16 / 4) ⊙ s

with ``H16[i, j] = (-1)^popcount(i & j)`` (Sylvester) and ``s`` a fixed ±1 vector. Since
``H16 · H16ᵀ = 16 I`` and ``H16`` is symmetric, ``R = diag(s) · H16 / 4`` is orthogonal, and
``(y · H16/4) ⊙ s = x · R · Rᵀ = x``. This is exactly Transformer Engine's ``_apply_rht``
(``x @ (diag(s) · H) / sqrt(16)``). Applied blockwise along the reduction dimension of a GEMM it
cancels: ``(A R)(B R)ᵀ = A R Rᵀ Bᵀ = A Bᵀ``, while spreading outliers across the 16 elements of
each block, which is what makes the 1×16 block scale fit the block better.

Arithmetic, fixed for bit-exactness with fused kernels: FP32 (FP64 if the input is FP64);
multiply by the signs (exact), then the fast Walsh–Hadamard butterfly with strides 1, 2, 4, 8
(each stage ``(a + b, a - b)`` on element pairs ``i, i + stride``), then × 0.25 (exact: a power
of two). The result of a dense ``x @ H`` can differ in the last bit depending on the
accumulation order; the butterfly pins the order down.
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_SIGNS", "hadamard16", "inverse_hadamard16", "hadamard_transform",
           "hadamard_matrix"]

#: Transformer Engine's fixed wgrad sign vector (``get_wgrad_sign_vector``).
DEFAULT_SIGNS = (1.0, 1.0, 1.0, -1.0, 1.0, -1.0, -1.0, -1.0,
                 -1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0)


def hadamard_matrix(size: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """Unnormalised Sylvester Hadamard matrix, ``H[i, j] = (-1)^popcount(i & j)``."""
    _check_pow2(size)
    idx = torch.arange(size, device=device)
    bits = torch.bitwise_and(idx[:, None], idx[None, :])
    parity = torch.zeros_like(bits)
    while bool((bits > 0).any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(dtype)


def _check_pow2(size: int) -> None:
    if size < 1 or size & (size - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {size}")


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def butterfly(x: torch.Tensor, size: int) -> torch.Tensor:
    """Unnormalised Walsh–Hadamard along the last dim in blocks of ``size`` (Sylvester order)."""
    lead = x.shape[:-1]
    y = x.reshape(-1, x.shape[-1] // size, size)
    h = 1
    while h < size:
        # Pairs (i, i + h) inside each 2h group: [..., groups, 2, h].
        y = y.reshape(*y.shape[:2], size // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(y.shape[0], y.shape[1], size)
        h *= 2
    return y.reshape(*lead, x.shape[-1])


_SIGNS_CACHE: dict = {}


def _signs(signs, n: int, dtype, device) -> torch.Tensor:
    """The sign vector as a ``dtype`` tensor on ``device``, validated on the host and cached per
    (values, dtype, device): checking it on the device, or building a fresh device tensor, would
    cost a host sync on every call (the Q-AdamW codecs and the telemetry call this per chunk)."""
    if isinstance(signs, torch.Tensor):
        signs = signs.detach().to("cpu", torch.float64).reshape(-1).tolist()
    vals = tuple(float(v) for v in signs)
    if len(vals) != n or any(v not in (1.0, -1.0) for v in vals):
        raise ValueError(f"signs must be {n} values of +-1")
    key = (vals, dtype, str(device))
    t = _SIGNS_CACHE.get(key)
    if t is None:
        t = _SIGNS_CACHE[key] = torch.tensor(vals, dtype=dtype).to(device)
    return t


def hadamard16(x: torch.Tensor, signs=DEFAULT_SIGNS) -> torch.Tensor:
    """RHT-16 along the last dim (a multiple of 16). Returns FP32 (FP64 for FP64 input)."""
    if x.shape[-1] % 16:
        raise ValueError(f"last dimension must be a multiple of 16, got {x.shape[-1]}")
    dt = _work_dtype(x)
    s = _signs(signs, 16, dt, x.device)
    xs = (x.to(dt).reshape(*x.shape[:-1], -1, 16) * s).reshape(x.shape)
    return butterfly(xs, 16) * 0.25


def inverse_hadamard16(y: torch.Tensor, signs=DEFAULT_SIGNS) -> torch.Tensor:
    """Inverse of :func:`hadamard16`: ``(y_blk · H16 / 4) ⊙ s``."""
    if y.shape[-1] % 16:
        raise ValueError(f"last dimension must be a multiple of 16, got {y.shape[-1]}")
    dt = _work_dtype(y)
    s = _signs(signs, 16, dt, y.device)
    z = butterfly(y.to(dt), 16) * 0.25
    return (z.reshape(*y.shape[:-1], -1, 16) * s).reshape(y.shape)


def hadamard_transform(x: torch.Tensor, size: int) -> torch.Tensor:
    """Normalised Sylvester Hadamard ``x_blk · H_size / sqrt(size)`` on blocks of the last dim.

    Orthogonal and symmetric, hence its own inverse. No signs (compose with a sign flip if a
    randomised transform is wanted). FP32 (FP64 for FP64 input).
    """
    _check_pow2(size)
    if x.shape[-1] % size:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of {size}")
    dt = _work_dtype(x)
    # 1/sqrt(size) is exact for even powers of two and correctly rounded otherwise.
    return butterfly(x.to(dt), size) * (1.0 / size ** 0.5)
