"""NVFP4 Newton–Schulz error table: naive beside ours, random and real matrices.

For each matrix G and each method (a precision/form/coefficients/clip combination):
  (a) iteration error: for every step k, the NVFP4 step from the NVFP4 trajectory's own X_k
      against the exact (FP64) step from the same X_k, relative Frobenius, averaged over steps;
  (b) final error: the NVFP4 result against the FP32 NS result with the same coefficients;
  (c) vs polar: the result against U·Vᵀ (FP64 SVD), what the optimizer actually wants.
Targets: (a) ≤ 3 %, (b) ≤ 5 % (BF16 NS: ~2 %).

Methods: naive = Muon's triple, textbook step, every operand quantized, no clipping;
naive+p99 = the same with p99 clipping of each operand; shifted = our identity-shifted step
with Muon's triple; ours = shifted step + our fitted per-shape schedule ("fp4"); bf16 = dense
BF16 NS with Muon's triple, for scale.

Shapes: the 3b preset's matrices (proj 3072², fc1 3072×8192 per gate/up block, fc2 8192×3072,
QKV 5120×3072, K/V blocks 1024×3072) and the 125m ones, divided by ``--scale`` (rounded to 16)
so that the CPU can run it; ``--scale 1`` is the real size (use a GPU). Random matrices:
full-rank Gaussian, rank-8 + noise, heavy-tailed (log-normal row/col scales).
``--matrices FILE.pt``: a {name: 2-D tensor} dict of real gradients / momenta, run at full size.

Methods: naive (Muon triple, one term, no clip) | naive+p99 | shifted (Muon triple, one term) |
ours-1term | ours-1term-SR | ours (shifted + "fp4" + two-term operands: the default NS) | bf16.

Usage: python benchmarks/studies/ns_error_table.py [--scale 16] [--shapes "3b proj,3b fc2"]
           [--kinds gauss,lowrank,heavy] [--methods naive,ours-1term,ours,bf16]
           [--matrices FILE.pt [--match ns_input[,layers.1.]] [--no-random]] [--device cpu|cuda]
Real matrices: FILE.pt from benchmarks/studies/ns_dump_momentum.py (``--match ns_input``: exactly what the
optimizer passes to the NS). GPU, 3b sizes:
    python benchmarks/studies/ns_error_table.py --device cuda --scale 1 --kinds gauss,lowrank \
        --shapes "3b proj,3b fc2,3b fc1 block,3b k/v block" --matrices DUMP.pt --match ns_input
"""

import argparse

import torch

from fullstack_fp4.optim.newton_schulz import (NVFP4Products, step_nvfp4, newton_schulz,
                                               ns_step)
from fullstack_fp4.optim.ns_coefficients import resolve_schedule

SHAPES = {"3b proj": (3072, 3072), "3b fc1 block": (8192, 3072), "3b fc2": (3072, 8192),
          "3b qkv": (5120, 3072), "3b k/v block": (1024, 3072),
          "125m proj": (768, 768), "125m fc1": (2048, 768)}
# name: newton_schulz keyword arguments (precision, nvfp4_form, coefficients, clip_percentile,
# nvfp4_terms, rounding, backend)
_NV = dict(precision="nvfp4", clip_percentile=None, rounding="nearest", backend="auto")
METHODS = {"naive": dict(_NV, nvfp4_form="naive", coefficients="muon", nvfp4_terms=1),
           "naive+p99": dict(_NV, nvfp4_form="naive", coefficients="muon", nvfp4_terms=1,
                             clip_percentile=99.0),
           "shifted": dict(_NV, nvfp4_form="shifted", coefficients="muon", nvfp4_terms=1),
           "ours-1term": dict(_NV, nvfp4_form="shifted", coefficients="fp4", nvfp4_terms=1),
           "ours-1term-SR": dict(_NV, nvfp4_form="shifted", coefficients="fp4", nvfp4_terms=1,
                                 rounding="stochastic", backend="reference"),
           "ours": dict(_NV, nvfp4_form="shifted", coefficients="fp4", nvfp4_terms=2),
           "bf16": dict(precision="bf16", coefficients="muon")}
DEFAULT_METHODS = "naive,ours-1term,ours,bf16"


def random_matrices(shape, seed):
    m, n = shape
    g = torch.Generator().manual_seed(seed)
    return {"gauss": torch.randn(m, n, generator=g),
            "lowrank": 3 * torch.randn(m, 8, generator=g) @ torch.randn(8, n, generator=g)
            + 0.3 * torch.randn(m, n, generator=g),
            "heavy": torch.randn(m, n, generator=g) * torch.exp(torch.randn(m, 1, generator=g))
            * torch.exp(torch.randn(1, n, generator=g))}


def rel(x, y):
    return ((x.double() - y.double()).norm() / y.double().norm()).item()


def iteration_error(G, schedule, form, clip, terms=1, rounding="nearest", backend="auto"):
    """Mean over steps of ‖nvfp4_step(X_k) − exact_step(X_k)‖ / ‖exact_step(X_k)‖."""
    X = G.float()
    if X.shape[0] > X.shape[1]:
        X = X.T
    X = X / (X.norm() + 1e-7)
    m, n = X.shape
    X = torch.nn.functional.pad(X, (0, -n % 16, 0, -m % 16))
    gen = torch.Generator(device=X.device).manual_seed(0) if rounding == "stochastic" else None
    P = NVFP4Products(backend, clip, rounding, gen, X.device)
    errs = []
    for abc in schedule:
        exact = ns_step(X.double(), abc)
        X = step_nvfp4(X, m, abc, P, form, terms=terms)
        errs.append(rel(X, exact))
    return sum(errs) / len(errs)


_POLAR: dict = {}


def _polar(G):
    """U·Vᵀ of G (FP64 SVD), computed once per matrix (full-size SVDs are the slow part)."""
    key = (G.data_ptr(), tuple(G.shape), G.device)
    if key not in _POLAR:
        _POLAR.clear()
        U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
        _POLAR[key] = U @ Vh
    return _POLAR[key]


_REF32: dict = {}


def _ref32(G, sched):
    """The FP32 NS result with ``sched``, once per (matrix, schedule): methods that share a
    schedule share it (at 3b sizes each is ≈ 2 TFLOP on a CPU)."""
    key = (G.data_ptr(), tuple(G.shape), G.device, tuple(tuple(abc) for abc in sched))
    if key not in _REF32:
        if _REF32 and next(iter(_REF32))[:3] != key[:3]:
            _REF32.clear()
        _REF32[key] = newton_schulz(G, coefficients=sched, precision="fp32")
    return _REF32[key]


def evaluate(G, method):
    kw = dict(METHODS[method])
    precision = kw["precision"]
    sched = resolve_schedule(kw.pop("coefficients"), G.shape, 5)
    if kw.get("rounding") == "stochastic":
        kw["generator"] = torch.Generator(device=G.device).manual_seed(0)
    out = newton_schulz(G, coefficients=sched, **kw)
    ref32 = _ref32(G, sched)
    polar = _polar(G)
    # Diverged = left the quintic's basin: non-finite, or spectral norm > 1.5 (every triple we
    # use maps [0, 1] below 1.31, so only an escaped singular value gets there).
    ok = bool(torch.isfinite(out).all()) and \
        torch.linalg.matrix_norm(out.double(), ord=2).item() <= 1.5
    it = (iteration_error(G, sched, kw["nvfp4_form"], kw["clip_percentile"], kw["nvfp4_terms"],
                          kw["rounding"], kw["backend"]) if precision == "nvfp4" else float("nan"))
    return it, (rel(out, ref32) if ok else float("inf")), (rel(out, polar) if ok else float("inf"))


def fmt(v):
    return "diverged" if v == float("inf") else ("–" if v != v else f"{100 * v:.1f}%")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=8.0)
    ap.add_argument("--matrices", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--methods", default=DEFAULT_METHODS,
                    help=f"comma list of {', '.join(METHODS)}")
    ap.add_argument("--kinds", default="gauss,lowrank,heavy")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help="comma list of preset shape names (see SHAPES); '' = none (real only)")
    ap.add_argument("--no-random", action="store_true", help="only the --matrices ones")
    ap.add_argument("--match", default="", help="with --matrices: only names containing this "
                    "(e.g. ns_input: what the optimizer passes to the NS); a comma list: "
                    "names containing all of them (e.g. ns_input,layers.1.)")
    args = ap.parse_args()
    methods = args.methods.split(",")
    cases = []
    kinds = args.kinds.split(",")
    for sname in ([] if args.no_random else [s for s in args.shapes.split(",") if s]):
        shape = SHAPES[sname]
        small = tuple(max(16, int(round(d / args.scale / 16)) * 16) for d in shape)
        for kind, G in random_matrices(small, seed=len(cases)).items():
            if kind in kinds:
                cases.append((f"{sname} {kind}", G))
    if args.matrices:
        for name, G in torch.load(args.matrices, map_location="cpu").items():
            if G.ndim == 2 and all(part in name for part in args.match.split(",")):
                cases.append((f"real {name}", G.float()))
    head = " | ".join(f"{m} (a) | {m} (b) | {m} vs UVᵀ" for m in methods)
    print(f"| matrix | shape | {head} |")
    print("| --- | --- |" + " --- |" * (3 * len(methods)))
    sums = {m: [0.0, 0, 0.0, 0, 0] for m in methods}  # Σ(a), n(a), Σ(b), n(b), diverged
    for name, G in cases:
        G = G.to(args.device)
        cells = []
        for m in methods:
            it, fin, pol = evaluate(G, m)
            cells += [fmt(it) if m != "bf16" else "–", fmt(fin), fmt(pol)]
            if it == it and it != float("inf"):   # (a): every matrix where it is finite
                sums[m][0] += it
                sums[m][1] += 1
            if fin != float("inf"):
                sums[m][2] += fin
                sums[m][3] += 1
            else:
                sums[m][4] += 1
        print(f"| {name} | {tuple(G.shape)} | " + " | ".join(cells) + " |", flush=True)
    print()
    print("| method | diverged | mean (a) (finite) | mean (b) (non-diverged) |")
    print("| --- | --- | --- | --- |")
    for m, (si, ki, sf, kf, nd) in sums.items():
        print(f"| {m} | {nd} / {len(cases)} | {fmt(si / ki) if ki else '–'} ({ki}) | "
              f"{fmt(sf / kf) if kf else '–'} ({kf}) |")


if __name__ == "__main__":
    main()
