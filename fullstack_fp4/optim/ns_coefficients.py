"""Quintic Newton–Schulz coefficient tables and their lookup.

One NS step maps ``X ← a·X + (b·A + c·A²)·X`` with ``A = X·Xᵀ``; on the singular values it is
the odd quintic ``f(σ) = a·σ + b·σ³ + c·σ⁵``. A *schedule* is one ``(a, b, c)`` per step.

Tables (keyed by ``(min(rows, cols), max(rows, cols))``):

* ``MUON``: Keller Jordan's ``(3.4445, -4.7750, 2.0315)``, tuned for speed of growth of small
  singular values, not for convergence (it leaves them oscillating in roughly [0.7, 1.2]).
* ``ROOT_PUBLISHED``: the shape-dependent triples published with ROOT (arXiv 2511.20626);
  any other shape falls back to Muon's (as ROOT does).
* ``FP4_FITTED``: our per-step schedules for the preset shapes, fitted by
  ``benchmarks/studies/fit_ns_coefficients.py`` against NVFP4 NS (see that script for the method). A shape
  not in the table takes the entry with the nearest aspect ratio ``log(max/min)``: aspect ratio,
  not size, is what shapes the singular-value spectrum of a random-like matrix
  (Marchenko–Pastur), and the NVFP4 error of ``A = XXᵀ`` scales with ``sqrt(min/max)``.
"""

from __future__ import annotations

import math
from typing import Sequence, Union

__all__ = ["MUON", "ROOT_PUBLISHED", "FP4_FITTED", "Triple", "Schedule",
           "root_coefficients", "fp4_coefficients", "resolve_schedule"]

Triple = tuple[float, float, float]
Schedule = list[Triple]

MUON: Triple = (3.4445, -4.7750, 2.0315)

ROOT_PUBLISHED: dict[tuple[int, int], Triple] = {
    (2048, 2048): (3.4916, -4.8224, 2.1095),
    (2048, 3072): (3.4509, -4.5790, 1.9325),
    (2048, 8192): (2.9794, -3.6674, 1.6207),
    (2048, 16384): (3.1943, -3.8221, 1.5322),
}

# From benchmarks/studies/fit_ns_coefficients.py (configs/ns_coefficients/fp4_fitted.json, min dim 128,
# 100 Nelder–Mead evaluations per aspect group). Key: (min dim, max dim) of the full-size preset
# shape; value: 5 per-step triples (3 growth steps, 2 convergent finishing steps).
FP4_FITTED: dict[tuple[int, int], Schedule] = {
    (128, 128): [(3.4742, -4.8231, 2.0674)] * 3 + [(1.942, -1.3025, 0.3802)] * 2,
    (128, 384): [(3.8639, -5.8353, 2.4064)] * 3 + [(2.1593, -1.454, 0.285)] * 2,
    (128, 512): [(3.8132, -5.4338, 2.1681)] * 3 + [(2.0468, -1.3154, 0.2821)] * 2,
    (512, 2048): [(3.8132, -5.4338, 2.1681)] * 3 + [(2.0468, -1.3154, 0.2821)] * 2,
    (768, 768): [(3.4742, -4.8231, 2.0674)] * 3 + [(1.942, -1.3025, 0.3802)] * 2,
    (768, 2048): [(3.8639, -5.8353, 2.4064)] * 3 + [(2.1593, -1.454, 0.285)] * 2,
    (768, 2304): [(3.8639, -5.8353, 2.4064)] * 3 + [(2.1593, -1.454, 0.285)] * 2,
    (1024, 1024): [(3.4742, -4.8231, 2.0674)] * 3 + [(1.942, -1.3025, 0.3802)] * 2,
    (1024, 2816): [(3.8639, -5.8353, 2.4064)] * 3 + [(2.1593, -1.454, 0.285)] * 2,
    (1024, 3072): [(3.8639, -5.8353, 2.4064)] * 3 + [(2.1593, -1.454, 0.285)] * 2,
    (2048, 2048): [(3.4742, -4.8231, 2.0674)] * 3 + [(1.942, -1.3025, 0.3802)] * 2,
    (2048, 3072): [(3.7254, -5.0749, 1.9914)] * 3 + [(2.2393, -1.6557, 0.3925)] * 2,
    (2048, 5632): [(3.8639, -5.8353, 2.4064)] * 3 + [(2.1593, -1.454, 0.285)] * 2,
    (3072, 3072): [(3.4742, -4.8231, 2.0674)] * 3 + [(1.942, -1.3025, 0.3802)] * 2,
    (3072, 5120): [(3.7254, -5.0749, 1.9914)] * 3 + [(2.2393, -1.6557, 0.3925)] * 2,
    (3072, 8192): [(3.8639, -5.8353, 2.4064)] * 3 + [(2.1593, -1.454, 0.285)] * 2,
}


def _key(shape: Sequence[int]) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"NS coefficients are defined for 2-D matrices, got shape {tuple(shape)}")
    r, c = int(shape[0]), int(shape[1])
    return (min(r, c), max(r, c))


def root_coefficients(shape: Sequence[int]) -> Triple:
    """ROOT's published triple for this (min, max) shape, else Muon's (exact-key lookup only,
    as published: ROOT gives no rule for other shapes)."""
    return ROOT_PUBLISHED.get(_key(shape), MUON)


def fp4_coefficients(shape: Sequence[int]) -> Schedule:
    """Our fitted per-step schedule: exact key, else the nearest aspect ratio; if the table is
    empty, ROOT's triple repeated (so the call never silently changes meaning)."""
    if not FP4_FITTED:
        return [root_coefficients(shape)] * 5
    key = _key(shape)
    if key in FP4_FITTED:
        return list(FP4_FITTED[key])
    ratio = math.log(key[1] / max(key[0], 1))
    best = min(FP4_FITTED, key=lambda k: (abs(math.log(k[1] / k[0]) - ratio), -k[0]))
    return list(FP4_FITTED[best])


def resolve_schedule(coefficients: Union[str, Triple, Sequence[Triple]],
                     shape: Sequence[int], steps: int) -> Schedule:
    """Turn the user's ``coefficients`` into exactly ``steps`` triples.

    "muon" / "root" / "fp4" name a table; one triple is repeated for every step; a list of
    triples is a per-step schedule (Polar-Express style) and must have at least ``steps``
    entries (the first ``steps`` are used, so a 5-step table also serves 3-step runs).
    """
    if isinstance(coefficients, str):
        if coefficients == "muon":
            return [MUON] * steps
        if coefficients == "root":
            return [root_coefficients(shape)] * steps
        if coefficients == "fp4":
            sched = fp4_coefficients(shape)
            if len(sched) < steps:
                sched = sched + [sched[-1]] * (steps - len(sched))
            return sched[:steps]
        raise ValueError(f"unknown coefficient table {coefficients!r} (muon | root | fp4)")
    seq = list(coefficients)
    if len(seq) == 3 and all(isinstance(v, (int, float)) for v in seq):
        return [tuple(float(v) for v in seq)] * steps
    if len(seq) < steps or any(len(t) != 3 for t in seq):
        raise ValueError(f"need a triple or >= {steps} triples, got {coefficients!r}")
    return [tuple(float(v) for v in t) for t in seq[:steps]]
