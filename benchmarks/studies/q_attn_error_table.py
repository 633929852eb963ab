"""Error contribution of each Q-Attn GEMM path (CPU, reference implementation).

For one random attention problem with realistic activation statistics (per-channel scales
drawn log-normal, a per-channel offset on K — the thing K-smoothing removes — and a few outlier
tokens), computes O, dQ, dK, dV with:
  * every path BF16 (the floor: BF16 rounding of operands only),
  * exactly one of the five paths (qk, pv, dv, dp, ds) in NVFP4, with / without K-smoothing,
  * the default recipe (qk + ds), with / without K-smoothing, nearest vs stochastic dS,
and reports the relative Frobenius error ‖x − x_exact‖ / ‖x_exact‖ against FP64 exact
attention on the same BF16 inputs. Stochastic rows also report the error of the mean of N
draws (what is left is bias: if it falls like 1/√N, SR is unbiased there).

Usage: python benchmarks/studies/q_attn_error_table.py [--seq 256] [--heads 4] [--kv-heads 2] [--dim 64]
Prints a markdown table.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from fullstack_fp4.attention import q_attention  # noqa: E402


def make_inputs(b, h, hk, s, d, seed):
    g = torch.Generator().manual_seed(seed)
    # Scaled so that the logits τ·q·k have a std of ~1.5 (a trained model's typical range;
    # much larger logits make softmax near one-hot and every perturbation chaotic).
    ch_q = torch.exp(0.3 * torch.randn(1, h, 1, d, generator=g))
    ch_k = torch.exp(0.3 * torch.randn(1, hk, 1, d, generator=g))
    q = torch.randn(b, h, s, d, generator=g) * ch_q
    k = torch.randn(b, hk, s, d, generator=g) * ch_k + 1.0 * torch.randn(1, hk, 1, d, generator=g)
    v = torch.randn(b, hk, s, d, generator=g)
    for t in (q, k):                       # a few outlier tokens (attention-sink-like)
        idx = torch.randint(0, s, (max(1, s // 64),), generator=g)
        t[:, :, idx] *= 3.0
    do = torch.randn(b, h, s, d, generator=g) * 1e-3
    return [x.to(torch.bfloat16) for x in (q, k, v, do)]


def exact(q, k, v, do, causal=True):
    g = q.shape[1] // k.shape[1]
    qe, ke, ve = [x.double().requires_grad_() for x in (q, k, v)]
    o = torch.nn.functional.scaled_dot_product_attention(
        qe, ke.repeat_interleave(g, 1), ve.repeat_interleave(g, 1), is_causal=causal)
    o.backward(do.double())
    return o.detach(), qe.grad, ke.grad, ve.grad


def run(q, k, v, do, **kw):
    qq, kk, vv = [x.clone().requires_grad_() for x in (q, k, v)]
    o = q_attention(qq, kk, vv, causal=True, backend="reference", **kw)
    o.backward(do)
    return o.detach().double(), qq.grad.double(), kk.grad.double(), vv.grad.double()


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sr-draws", type=int, default=8)
    a = ap.parse_args()
    q, k, v, do = make_inputs(1, a.heads, a.kv_heads, a.seq, a.dim, a.seed)
    ref = exact(q, k, v, do)
    bf16 = {p: "bf16" for p in ("qk", "pv", "dv", "dp", "ds")}
    rows = [("all BF16 (floor)", dict(paths=bf16))]
    for p in ("qk", "pv", "dv", "dp", "ds"):
        for sm in (True, False):
            rows.append((f"only {p} NVFP4, K-smooth {'on' if sm else 'off'}",
                         dict(paths={**bf16, p: "nvfp4"}, k_smoothing=sm)))
    rows.append(("default (qk+ds), K-smooth on", dict(k_smoothing=True)))
    rows.append(("default (qk+ds), K-smooth off", dict(k_smoothing=False)))
    print(f"shape 1x{a.heads}x{a.seq}x{a.dim}, kv heads {a.kv_heads}, causal; "
          f"relative Frobenius error vs FP64 exact attention on the same BF16 inputs\n")
    print("| configuration | O | dQ | dK | dV |")
    print("| --- | --- | --- | --- | --- |")
    for name, kw in rows:
        out = run(q, k, v, do, **kw)
        print(f"| {name} | " + " | ".join(f"{rel(x, r):.4f}" for x, r in zip(out, ref)) + " |")
    # Stochastic rounding of dS: single draw, and the mean of N draws.
    for label, paths in (("only ds", {**bf16, "ds": "nvfp4"}), ("default", None)):
        gen = torch.Generator().manual_seed(1)
        draws = [run(q, k, v, do, paths=paths, ds_rounding="stochastic", generator=gen)
                 for _ in range(a.sr_draws)]
        one = draws[0]
        mean = [sum(x[i] for x in draws) / len(draws) for i in range(4)]
        print(f"| {label}, dS stochastic (1 draw) | " +
              " | ".join(f"{rel(x, r):.4f}" for x, r in zip(one, ref)) + " |")
        print(f"| {label}, dS stochastic (mean of {a.sr_draws}) | " +
              " | ".join(f"{rel(x, r):.4f}" for x, r in zip(mean, ref)) + " |")


if __name__ == "__main__":
    main()
