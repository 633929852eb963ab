"""Which of Q-Attn's five GEMM paths run in NVFP4 and which in BF16.

The five GEMMs of attention (names used everywhere in this package):

    qk : S  = Q Kᵀ        forward, reduction over head_dim
    pv : O  = P V          forward, reduction over keys
    dv : dV = Pᵀ dO        backward, reduction over queries
    dp : dP = dO Vᵀ        backward, reduction over head_dim
    ds : dQ = dS K and dK = dSᵀ Q   backward, reduction over keys / queries

Default (the paper's attention recipe): ``qk`` and ``ds`` in NVFP4, the three
softmax-sensitive paths (``pv``, ``dv``, ``dp``: they multiply the probabilities or produce
``dP``, whose error is amplified by ``P ⊙ (dP − D)``) in BF16. ``paths`` overrides any subset,
e.g. ``{"ds": "bf16"}`` or ``{"pv": "nvfp4"}``; the error table switches one at a time.
"""

from __future__ import annotations

from typing import Mapping, Optional

PATH_NAMES = ("qk", "pv", "dv", "dp", "ds")
DEFAULT_PATHS = {"qk": "nvfp4", "pv": "bf16", "dv": "bf16", "dp": "bf16", "ds": "nvfp4"}
_FORMATS = ("nvfp4", "bf16")


def resolve_paths(paths: Optional[Mapping[str, str]]) -> dict:
    """Defaults overridden by ``paths``; unknown names or formats raise (no silent typo)."""
    out = dict(DEFAULT_PATHS)
    for name, fmt in (paths or {}).items():
        if name not in PATH_NAMES:
            raise ValueError(f"unknown attention GEMM path {name!r}; expected one of {PATH_NAMES}")
        if fmt not in _FORMATS:
            raise ValueError(f"path {name!r}: format must be 'nvfp4' or 'bf16', got {fmt!r}")
        out[name] = fmt
    return out


def quantized(paths: Mapping[str, str], name: str) -> bool:
    return paths[name] == "nvfp4"
