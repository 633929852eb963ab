"""Fit per-shape NVFP4 Newton–Schulz coefficient schedules (our "fp4" table).

Method. A schedule is 5 quintic steps; we fit two triples, T₁ for steps 1–3 (the growth phase:
small singular values must be lifted ~30×, so large a) and T₂ for steps 4–5 (the finishing
phase: converge to 1 with a small slope so quantization noise in A = X·Xᵀ is damped instead of
amplified — the dominant NVFP4 error, see newton_schulz.py). Six parameters, not fifteen: a
per-step fit overfits the handful of sample matrices and costs 2.5× the evaluations.

Objective, per shape: the mean over sample matrices of the relative Frobenius error of the
*NVFP4* NS (shifted form, RTN, the exact quantizer the optimizer uses) against the exact polar
factor U·Vᵀ (FP64 SVD) — i.e. what the optimizer actually receives vs what it wants, noise and
approximation together (fitting against FP32 NS with the same coefficients would be minimised by
a do-nothing schedule). Samples: a full-rank Gaussian (flat spectrum, the divergence case), a
rank-8-plus-noise matrix (gradient-like) and a heavy-tailed one (log-normal row and column
scales, momentum-like outliers). A result with spectral norm > 1.5 or non-finite entries costs
10 (a hard barrier: no divergent schedule can win on average). Minimiser: Nelder–Mead
(implemented below, no scipy), started at Muon's triple + the convergent quintic
(15/8, −10/8, 3/8).

Shapes (min dim, max dim) at full size, from our presets (h, ffn, heads, kv groups; head
dim h/heads): proj (h, h), fc1 / fc2 and each gate / up block (h, ffn), fused QKV
(h, h + 2·kv·hd), split K / V blocks (kv·hd, h). They are fitted at a reduced size (min dim ``--min-dim``, default 128, aspect ratio kept, max
dim rounded to 16) to keep the CPU time to a few minutes: aspect ratio, not size, is what shapes
a random matrix's spectrum (Marchenko–Pastur), and shapes whose aspect ratios round to the same half octave share one fit.

Usage: python benchmarks/studies/fit_ns_coefficients.py [--min-dim 128] [--evals 200]
           [--out configs/ns_coefficients/fp4_fitted.json]
"""

import argparse
import json
import math
import time

import torch

from fullstack_fp4.optim.newton_schulz import newton_schulz
from fullstack_fp4.optim.ns_coefficients import MUON

# name: (hidden, ffn, heads, kv_groups)
PRESETS = {"tiny": (128, 512, 4, 4), "125m": (768, 2048, 12, 12), "350m": (1024, 2816, 16, 16),
           "1b": (2048, 5632, 16, 4), "3b": (3072, 8192, 24, 8)}
FINISH = (1.875, -1.25, 0.375)


def preset_shapes():
    shapes = set()
    for h, ffn, heads, kv in PRESETS.values():
        kvd = kv * (h // heads)
        shapes |= {(h, h), (h, ffn), (h, h + 2 * kvd)}
        if kvd < h:
            shapes.add((kvd, h))
    return sorted(shapes)


def reduced(shape, min_dim):
    """Same aspect ratio, min dim ``min_dim`` (max dim rounded to 16)."""
    lo, hi = shape
    if lo <= min_dim:
        return shape
    return (min_dim, max(min_dim, int(round(hi * min_dim / lo / 16)) * 16))


def samples(shape, seed=0):
    m, n = shape
    g = torch.Generator().manual_seed(seed)
    gauss = torch.randn(m, n, generator=g)
    lowrank = 3 * torch.randn(m, 8, generator=g) @ torch.randn(8, n, generator=g) \
        + 0.3 * torch.randn(m, n, generator=g)
    heavy = torch.randn(m, n, generator=g) * torch.exp(torch.randn(m, 1, generator=g)) \
        * torch.exp(torch.randn(1, n, generator=g))
    return [gauss, lowrank, heavy]


def polar(G):
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U @ Vh


def schedule(theta):
    t1, t2 = tuple(theta[:3]), tuple(theta[3:])
    return [t1] * 3 + [t2] * 2


def objective(theta, mats, polars, terms=1):
    total = 0.0
    for G, P in zip(mats, polars):
        X = newton_schulz(G, coefficients=schedule(theta), precision="nvfp4",
                          backend="reference", nvfp4_terms=terms).double()
        if not torch.isfinite(X).all() or torch.linalg.matrix_norm(X, ord=2) > 1.5:
            return 10.0
        total += ((X - P).norm() / P.norm()).item()
    return total / len(mats)


def nelder_mead(f, x0, step=0.15, evals=200):
    n = len(x0)
    pts = [list(x0)] + [[x + (step * max(abs(x), 0.5) if i == j else 0) for j, x in enumerate(x0)]
                        for i in range(n)]
    vals = [f(p) for p in pts]
    used = n + 1
    while used < evals:
        order = sorted(range(n + 1), key=lambda i: vals[i])
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        cen = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        refl = [c + (c - w) for c, w in zip(cen, pts[-1])]
        fr = f(refl); used += 1
        if fr < vals[0]:
            exp = [c + 2 * (c - w) for c, w in zip(cen, pts[-1])]
            fe = f(exp); used += 1
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = [c + 0.5 * (w - c) for c, w in zip(cen, pts[-1])]
            fc = f(con); used += 1
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:  # shrink towards the best point
                for i in range(1, n + 1):
                    pts[i] = [b + 0.5 * (x - b) for b, x in zip(pts[0], pts[i])]
                    vals[i] = f(pts[i]); used += 1
    best = min(range(n + 1), key=lambda i: vals[i])
    return pts[best], vals[best]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--min-dim", type=int, default=128)
    ap.add_argument("--evals", type=int, default=100)
    ap.add_argument("--out", default="configs/ns_coefficients/fp4_fitted.json")
    ap.add_argument("--terms", type=int, default=1,
                    help="NVFP4 operand terms of the NS the fit runs (1: how the committed table "
                         "was fitted, the noisier case, so its margin also covers 2 terms)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    table, t0, cache = {}, time.time(), {}
    for shape in preset_shapes():
        small = reduced(shape, args.min_dim)
        # Aspect groups of half an octave share one fit (1, ~1.5, ~2.7–3, 4 among our presets).
        ratio_key = round(2 * math.log2(small[1] / small[0])) / 2
        if ratio_key not in cache:
            mats = samples(small)
            polars = [polar(G) for G in mats]
            f = lambda th: objective(th, mats, polars, args.terms)  # noqa: E731
            x0 = list(MUON) + list(FINISH)
            theta, val = nelder_mead(f, x0, evals=args.evals)
            cache[ratio_key] = (theta, val, f(x0),
                                objective(list(MUON) * 2, mats, polars, args.terms))
        theta, val, val0, muon = cache[ratio_key]
        table[f"{shape[0]}x{shape[1]}"] = dict(
            fitted_at=list(small), schedule=[list(map(lambda v: round(v, 4), t))
                                             for t in schedule(theta)],
            err_vs_polar=round(val, 4), err_start=round(val0, 4), err_muon5=round(muon, 4))
        print(f"{shape} @ {small}: fitted {val:.4f}  start {val0:.4f}  muon×5 {muon:.4f}  "
              f"({time.time() - t0:.0f} s)", flush=True)
    with open(args.out, "w") as fh:
        json.dump(dict(method="see benchmarks/studies/fit_ns_coefficients.py", min_dim=args.min_dim,
                       nvfp4_terms=args.terms, table=table), fh, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
