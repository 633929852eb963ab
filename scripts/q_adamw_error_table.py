"""Error table for Q-AdamW's moment codecs: direct NVFP4 vs the pipeline, for v and the update.

    python scripts/q_adamw_error_table.py                       # synthetic heavy-tailed moments
    python scripts/q_adamw_error_table.py --moments real.pt     # + real moments
    python scripts/q_adamw_error_table.py --variants            # + tile / guard alternatives

``--moments FILE.pt``: ``torch.save({name: (exp_avg, exp_avg_sq), ...})`` taken from a real
torch AdamW run (e.g. ``{n: (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])}``); all
tensors are flattened and concatenated per name; the table has one row block per file.

Metrics (all on flat FP32 tensors, FP64 arithmetic for the errors):
* ``v relL2``    ||v̂ − v||₂ / ||v||₂  (dominated by the largest entries)
* ``√v relL2``   ||sqrt(v̂) − sqrt(v)||₂ / ||sqrt(v)||₂ (the scale Adam divides by)
* ``v mean rel`` mean over entries of |v̂ − v| / v  (every entry counts; v == 0 entries skipped)
* ``u relL2``    update u = m / (sqrt(v) + eps): ||û − u|| / ||u|| with exact m, decoded v
* ``u max``      max |û − u| / max |u| (the blow-up an optimizer would feel)
* ``u(m̂,v̂)``   relL2 with both moments decoded
"direct" is fullstack_fp4.nvfp4's quantize (1×16 blocks, one FP32 tensor scale, RTN, 6-rule)
applied to v itself (and to m).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fullstack_fp4.nvfp4 import quantize  # noqa: E402
from fullstack_fp4.optim.q_adamw.codecs import (decode_exp_avg, decode_exp_avg_sq,  # noqa: E402
                                                encode_exp_avg, encode_exp_avg_sq,
                                                state_bytes_per_param)

EPS = 1e-8


def synthetic_moments(n: int = 1 << 16, steps: int = 100, seed: int = 0, structured=False):
    """Adam EMAs (β 0.9/0.999, no bias correction) of heavy-tailed gradients.

    g_t = σ · (0.2·μ + t₃ noise), σ lognormal per entry (sd 1.5 in log space, ~e^±3 across
    entries) — or, ``structured``, σ = row scale × column scale × lognormal(0.5), a 256-wide
    matrix — with a per-entry drift μ ~ N(0, 1). Student-t with 3 dof gives rare huge gradients,
    as real ones have.
    """
    g = torch.Generator().manual_seed(seed)
    if structured:
        cols = 256
        rows = n // cols
        sr = torch.exp(1.0 * torch.randn(rows, 1, generator=g))
        sc = torch.exp(1.0 * torch.randn(1, cols, generator=g))
        sigma = (sr * sc * torch.exp(0.5 * torch.randn(rows, cols, generator=g))).reshape(-1)
    else:
        sigma = torch.exp(1.5 * torch.randn(n, generator=g))
    sigma = sigma.double() * 1e-3
    mu = torch.randn(n, generator=g, dtype=torch.float64)
    m = torch.zeros(n, dtype=torch.float64)
    v = torch.zeros(n, dtype=torch.float64)
    t3 = torch.distributions.StudentT(3.0)
    for _ in range(steps):
        z = t3.sample((n,)).double()
        grad = sigma * (0.2 * mu + z)
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad * grad
    return m.float(), v.float()


def direct_nvfp4(x: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    npad = -(-n // 16) * 16
    xp = torch.zeros(1, npad)
    xp[0, :n] = x.reshape(-1)
    return quantize(xp, backend="reference").dequantize().reshape(-1)[:n].float()


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def metrics(m, v, m_hat, v_hat):
    u = m.double() / (v.double().sqrt() + EPS)
    u_v = m.double() / (v_hat.double().clamp(min=0).sqrt() + EPS)
    u_mv = m_hat.double() / (v_hat.double().clamp(min=0).sqrt() + EPS)
    nz = v > 0
    return {
        "v relL2": _rel(v_hat, v),
        "√v relL2": _rel(v_hat.double().clamp(min=0).sqrt(), v.double().sqrt()),
        "v mean rel": float(((v_hat.double() - v.double()).abs()[nz] / v.double()[nz]).mean()),
        "u relL2": _rel(u_v, u),
        "u max": float((u_v - u).abs().max() / u.abs().max()),
        "u(m̂,v̂)": _rel(u_mv, u),
    }


def rows_for(m, v, variants: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    m_hat = decode_exp_avg(encode_exp_avg(m, generator=gen))
    out = [("direct NVFP4 (v itself, RTN)", metrics(m, v, direct_nvfp4(m), direct_nvfp4(v)),
            "")]
    default = decode_exp_avg_sq(encode_exp_avg_sq(v))
    out.append(("pipeline (tile 32, floor μ/4) [default]", metrics(m, v, m_hat, default),
                f"{state_bytes_per_param(v.numel(), 32):.3f}"))
    if variants:
        for tile in (16, 32, 64):
            st = encode_exp_avg_sq(v, tile=tile, with_floor=True)
            b = f"{state_bytes_per_param(v.numel(), tile):.3f}"
            for guard, c in (("none", 0), ("tile_min", 0), ("relative", 0.5),
                             ("relative", 0.25), ("relative", 0.125), ("relative", 0.0625)):
                vh = decode_exp_avg_sq(st, guard=guard, rel_floor=c)
                name = f"tile {tile}, guard {guard}" + (f" {c}·μ" if c else "")
                bb = f"{float(b) + 2 / tile:.3f}" if guard == "tile_min" else b
                out.append((name, metrics(m, v, m_hat, vh), bb))
        st = encode_exp_avg_sq(v, scale_rule="4over6")
        out.append(("tile 32, μ/4, 4/6 on v", metrics(m, v, m_hat, decode_exp_avg_sq(st)), ""))
        st = encode_exp_avg_sq(v, subtract_mean=False)
        out.append(("sqrt+RHT, no mean subtraction (μ = 0, so no floor)",
                    metrics(m, v, m_hat, decode_exp_avg_sq(st)), ""))
    return out


def print_table(title, rows):
    keys = list(rows[0][1].keys())
    print(f"\n### {title}\n")
    print("| codec | " + " | ".join(keys) + " | B/param (m+v) |")
    print("|---" * (len(keys) + 2) + "|")
    for name, met, b in rows:
        print(f"| {name} | " + " | ".join(f"{met[k]:.4g}" for k in keys) + f" | {b} |")
    d, p = rows[0][1], rows[1][1]
    print(f"\npipeline vs direct: √v relL2 {100 * (1 - p['√v relL2'] / d['√v relL2']):.1f}% "
          f"lower, v relL2 {100 * (1 - p['v relL2'] / d['v relL2']):.1f}% lower, "
          f"v mean rel {100 * (1 - p['v mean rel'] / d['v mean rel']):.1f}% lower, "
          f"u relL2 {100 * (1 - p['u relL2'] / d['u relL2']):.1f}% lower")


def load_moments(path):
    d = torch.load(path, map_location="cpu")
    for name, (m, v) in d.items():
        yield name, m.reshape(-1).float(), v.reshape(-1).float()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moments", help="FILE.pt: {name: (exp_avg, exp_avg_sq)} from torch AdamW")
    ap.add_argument("--variants", action="store_true", help="also tile/guard alternatives")
    ap.add_argument("--n", type=int, default=1 << 16)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    for structured in (False, True):
        m, v = synthetic_moments(args.n, structured=structured)
        kind = "structured rows×cols×lognormal" if structured else "iid lognormal σ"
        print_table(f"synthetic ({kind}, t3 gradients, {args.n} entries)",
                    rows_for(m, v, args.variants))
    if args.moments:
        ms, vs = [], []
        for name, m, v in load_moments(args.moments):
            ms.append(m)
            vs.append(v)
        m, v = torch.cat(ms), torch.cat(vs)
        print_table(f"real moments ({args.moments}, {len(ms)} tensors, {m.numel()} entries)",
                    rows_for(m, v, args.variants))


if __name__ == "__main__":
    main()
