"""How low can Q-AdamW's second-moment codec family push the √v error on iid data?

    python benchmarks/studies/q_adamw_iid_floor.py              # 4 draws × 65,536 entries (~50 s, 2 CPUs)
    python benchmarks/studies/q_adamw_iid_floor.py --seeds 8 --n 131072
    python benchmarks/studies/q_adamw_iid_floor.py --from-checkpoint runs/quickstart/checkpoints/iter_0000300
        # instead: codecs.py's version 1, 4/6 at tile 64 and its default (version 2) on the
        # moments of a finished AdamW run (e.g. `make quickstart`), pooled over its tensors as
        # q_adamw_error_table.py pools

Question. On the "iid lognormal σ" synthetic set of benchmarks/studies/q_adamw_error_table.py the v codec
of version 1 (codecs.encode_exp_avg_sq with ``tile=32, scale_rule="6"``: √v → BF16 mean per 32-tile → RHT-16
of the residual → NVFP4 1×16, 6-rule, RTN, FP32 scale per 1024-chunk → ŝ = max(r̂ + μ, μ/4),
v̂ = ŝ²) had, on the README's draw, a √v relL2 35% below direct NVFP4 on v; the target is 50%.
This script measures which error source limits it and whether a variant reaches −50% within
the 1.2 B/param state budget. The rows turn knobs of version 1 (``D``). The codec's version 2
(``V2``, codecs.CODEC_VERSION, the default) is the "4" rule (every block max → 4) with a
64-entry tile: within a point of the 4/6 rule at that tile, at no cost in the fused kernel,
where 4/6 costs ~15% more instructions (codecs.py's docstring).

What it measures: √v relL2 = ||sqrt(v̂) − sqrt(v)|| / ||sqrt(v)||, plus u relL2 and u max
(u = m / (√v + eps) with exact m: what a variant does to the update), all from ``metrics`` of
q_adamw_error_table.py, on that script's ``synthetic_moments`` (iid and structured sets, drawn
as its table draws them: ``torch.manual_seed(seed)``, then iid, then structured, so seed 0 is
the README's table), averaged over ``--seeds`` draws. "%" is the mean against the mean of
direct NVFP4 on v (``direct_nvfp4``: one FP32 tensor scale, 1×16 E4M3 blocks, 6-rule, RTN);
"worst" is the least favourable draw's own ratio.

Rows:
* codecs.py itself (version 1; 4/6 at tile 64; the default, version 2) and this script's
  re-implementation of version 1 (``V2``, its re-implementation of version 2, is tested
  against the codec in tests/benchmarks/test_q_adamw_iid_floor.py);
* one idealisation or knob at a time: exact FP32 tile mean, no guard or a lower one (μ/8,
  μ/16), 4/6 rule, no Hadamard, Hadamard 32/64/128 (orthonormal Sylvester, random signs;
  crosses 16-blocks, never a chunk), tile 16/64/128, no mean, per-block FP32 scales (no E4M3
  rounding, no chunk scale), FP32 scales with an MSE-searched block-max target (an upper bound
  on what better block scales could buy);
* combinations of those, and the mean's bytes re-spent (tile 16 with an E4M3 mean);
* floors of a 4-bit code: (a) NVFP4 on √v itself (no mean, no Hadamard), unguarded or with its
  zero code decoded as a floor; (b) Lloyd-Max: 16 non-uniform levels fitted (weighted by block
  scale², i.e. to minimise the actual squared error) to the block-max-normalised residuals,
  FP32 scale per 16-block, one codebook per tensor or per 1024-chunk, the levels' cost ignored
  — and (b') the same on √v itself. (A codebook per 16-block is no floor: 16 levels for 16
  values reconstruct them exactly.)
* outside E2M1: an unsigned 4-bit grid (UE2M2, UE3M1) on √v with the same E4M3 block and FP32
  chunk scales: √v >= 0, so E2M1's sign bit is wasted on it; these spend it on the grid.

Arithmetic: FP64 except where a storage format is the point (BF16/E4M3 means, E4M3 block
scales, FP32 chunk scales, E2M1 codes). The re-implementation's 4/6 and scale search pick, per
block, the candidate with the smaller squared error (codecs.py uses an L1 code-domain
criterion; SSE is the metric's own and so the best case for 4/6: compare "codecs.py, 4/6").
Bytes per parameter are for both moments (m fixed at 0.5 + 1/16 + 4/1024 = 0.5664), padding
ignored; the Lloyd-Max rows' levels are not counted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from q_adamw_error_table import _pool, direct_nvfp4, metrics, synthetic_moments, train_moments  # noqa: E402

from fullstack_fp4.nvfp4.e2m1 import e2m1_decode, e2m1_round_nearest  # noqa: E402
from fullstack_fp4.nvfp4.hadamard import DEFAULT_SIGNS, hadamard_matrix  # noqa: E402
from fullstack_fp4.optim.q_adamw.codecs import decode_exp_avg_sq, encode_exp_avg_sq  # noqa: E402

BLOCK, CHUNK = 16, 1024
E4M3_MAX = 448.0
M_BYTES = 0.5 + 1 / 16 + 4 / 1024          # the first moment's state, unchanged throughout
BUDGET = 1.2


@dataclass(frozen=True)
class Variant:
    name: str
    tile: int = 32           # entries per tile mean; 0 = no mean subtraction
    mean: str = "bf16"       # "bf16" | "fp32" | "e4m3" (E4M3 × FP32 max-mean scale per chunk)
    had: int = 16            # Hadamard size (orthonormal, signed: ``rotation``); 0 = none
    rule: str = "6"          # "6" | "4over6" | "4" | "3" | "4.5" | "5" (block max → that) |
                             # "search" (block max → best of 3..9, FP32 scales only)
    scale: str = "e4m3"      # "e4m3" (× FP32 per 1024-chunk) | "fp32" (per 16-block, exact)
    quant: str = "nvfp4"     # "nvfp4" (E2M1 codes) | "lloyd-tensor" | "lloyd-chunk"
    grid: str = "e2m1"       # nvfp4's 4-bit grid: "e2m1" or an unsigned one (UGRIDS; tile 0)
    guard: float = 0.25      # ŝ >= guard·μ (tile 0, no Hadamard: ŝ >= guard·unit, the block's
                             # decoded code 1.0, so a zero code decodes to guard·unit); 0: ŝ >= 0

    def bytes_per_param(self) -> float:
        """State bytes of m and v per parameter (padding ignored)."""
        v = 0.5                                          # 4-bit codes
        if self.quant == "nvfp4":
            v += (1 if self.scale == "e4m3" else 4) / BLOCK
            v += 4 / CHUNK if self.scale == "e4m3" else 0.0
        else:                                            # FP32 block scale; levels not counted
            v += 4 / BLOCK
        if self.tile:
            v += {"bf16": 2, "fp32": 4, "e4m3": 1}[self.mean] / self.tile
            v += 4 / CHUNK if self.mean == "e4m3" else 0.0
        return M_BYTES + v


# ----------------------------------------------------------------------------- transforms
_ROT: dict = {}


def rotation(size: int) -> torch.Tensor:
    """Orthonormal R = diag(signs) · H_size / sqrt(size) (FP64); size 16 uses codecs.py's
    (Transformer Engine's) signs, so it is the codec's RHT-16; larger sizes fixed random signs."""
    if size not in _ROT:
        if size == BLOCK:
            signs = torch.tensor(DEFAULT_SIGNS, dtype=torch.float64)
        else:
            g = torch.Generator().manual_seed(1234 + size)
            signs = torch.randint(0, 2, (size,), generator=g).double() * 2 - 1
        h = hadamard_matrix(size, torch.float64) / size ** 0.5
        _ROT[size] = signs[:, None] * h
    return _ROT[size]


def forward(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if size == 0 else (x.view(-1, size) @ rotation(size)).reshape(-1)


def inverse(y: torch.Tensor, size: int) -> torch.Tensor:
    return y if size == 0 else (y.view(-1, size) @ rotation(size).T).reshape(-1)


# ----------------------------------------------------------------------------- 4-bit quantizers
def e2m1_rtn(t: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value of ``t`` (saturating at ±6), FP64 in and out."""
    return e2m1_decode(e2m1_round_nearest(t.float())).double()


# Unsigned 4-bit grids for a nonnegative input (√v itself): E2M1 spends its sign bit on a
# sign √v never has; these spend it on a mantissa bit (UE2M2) or an exponent bit (UE3M1).
UGRIDS = {"ue2m2": (0, .25, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7),
          "ue3m1": (0, .5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)}


def grid_rtn(t: torch.Tensor, grid: str) -> torch.Tensor:
    """Nearest value of ``grid`` ("e2m1", signed, or an unsigned UGRIDS one: t >= 0)."""
    if grid == "e2m1":
        return e2m1_rtn(t)
    g = torch.tensor(UGRIDS[grid], dtype=torch.float64)
    i = torch.bucketize(t.clamp(0, g[-1]), (g[1:] + g[:-1]) / 2)
    return g[i]


def nvfp4_blocks(z: torch.Tensor, rule: str, scale: str, grid: str = "e2m1"):
    """Quantize-dequantize ``z`` (flat FP64, length a multiple of CHUNK) in 1×16 blocks of
    4-bit ``grid`` codes; returns ``(ẑ, unit)``, ``unit`` the decoded value of code 1.0 of each
    entry's block (block scale × chunk scale)."""
    gmax = 6.0 if grid == "e2m1" else float(UGRIDS[grid][-1])
    z3 = z.view(-1, CHUNK // BLOCK, BLOCK)
    bamax = z3.abs().amax(-1, keepdim=True)
    if scale == "e4m3":
        m_rule = E4M3_MAX if rule == "6" else 256.0     # codecs/_SCALE_RULES: room for ×6/4
        dec = (bamax.amax(dim=(1, 2), keepdim=True) / (gmax * m_rule)).float()
        dec = dec.clamp(min=2.0 ** -126).double()

    def candidate(target: float):
        if scale == "e4m3":
            s = (bamax / (target * dec)).clamp(max=E4M3_MAX).float()
            sd = s.to(torch.float8_e4m3fn).double() * dec          # RNE to E4M3 (subnormals too)
        else:
            sd = (bamax / target).float().double()                  # FP32 block scale
        q = torch.where(sd > 0, grid_rtn(z3 / torch.where(sd > 0, sd, 1.0), grid) * sd, 0.0)
        return q, sd, ((q - z3) ** 2).sum(-1, keepdim=True)

    # the block max goes to the grid max ("6"), or the better of that and 2/3 of it ("4over6",
    # E2M1's 6 and 4), or to 2/3 of it ("4", codec version 2), or to another fixed target
    # ("3", "4.5", "5": the block max lands on 3, 4.5 or 5 of the grid's scale), or the best of
    # 3/6..9/6 of it ("search", FP32 scales only)
    fracs = {"6": (1.0,), "4over6": (1.0, 2 / 3), "4": (2 / 3,), "3": (0.5,), "4.5": (0.75,),
             "5": (5 / 6,), "search": tuple((3.0 + 0.25 * k) / 6 for k in range(25))}[rule]
    if rule == "search" and scale != "fp32":
        raise ValueError("the scale search is an FP32-scale idealisation")
    best, unit, err = candidate(gmax * fracs[0])
    for f in fracs[1:]:
        q, sd, e = candidate(gmax * f)
        better = e < err
        best, err = torch.where(better, q, best), torch.where(better, e, err)
        unit = torch.where(better, sd, unit)
    return best.reshape(-1), unit.expand_as(z3).reshape(-1)


def lloyd_blocks(z: torch.Tensor, group: int, iters: int = 60) -> torch.Tensor:
    """Oracle floor: per 16-block FP32 scale = block amax; the normalised values u = z / amax
    in [-1, 1] are quantized to 16 levels fitted by weighted Lloyd-Max (weights amax², so the
    fit minimises the squared error in z) to the values of each ``group`` entries."""
    z3 = z.view(-1, BLOCK)
    amax = z3.abs().amax(-1, keepdim=True).float().double()
    u = torch.where(amax > 0, z3 / torch.where(amax > 0, amax, 1.0), 0.0).reshape(-1, group)
    w = (amax ** 2).expand_as(z3).reshape(-1, group)
    q = torch.linspace(0.5 / 16, 1 - 0.5 / 16, 16, dtype=torch.float64)
    levels = torch.quantile(u, q, dim=1).T.contiguous()             # [groups, 16]
    for _ in range(iters):
        idx = (u[:, :, None] - levels[:, None, :]).abs().argmin(-1)  # [groups, group]
        onehot = torch.nn.functional.one_hot(idx, 16).double() * w[:, :, None]
        num = (onehot * u[:, :, None]).sum(1)
        den = onehot.sum(1)
        levels = torch.where(den > 0, num / den.clamp(min=1e-300), levels)
    idx = (u[:, :, None] - levels[:, None, :]).abs().argmin(-1)
    uq = torch.gather(levels, 1, idx)
    return (uq.reshape(-1, BLOCK) * amax).reshape(-1)


# ----------------------------------------------------------------------------- the codec family
def round_mean(mu: torch.Tensor, fmt: str, tile: int) -> torch.Tensor:
    if fmt == "fp32":
        return mu.float().double()
    if fmt == "bf16":
        return mu.float().to(torch.bfloat16).double()                # RNE, as the codec
    if fmt == "e4m3":                                                # relative to the chunk max
        per = mu.view(-1, CHUNK // tile)
        c = (per.amax(1, keepdim=True) / E4M3_MAX).float().clamp(min=2.0 ** -126).double()
        return ((per / c).float().to(torch.float8_e4m3fn).double() * c).reshape(-1)
    raise ValueError(fmt)


def roundtrip_v(v: torch.Tensor, var: Variant) -> torch.Tensor:
    """v̂ (FP64) of ``v`` (flat FP32, length a multiple of CHUNK) under ``var``."""
    s = v.double().clamp(min=0).sqrt()
    if var.tile:
        mu = round_mean(s.view(-1, var.tile).mean(1), var.mean, var.tile)
        mu_e = mu.repeat_interleave(var.tile)
    else:
        mu_e = torch.zeros_like(s)
    z = forward(s - mu_e, var.had)
    if var.quant == "nvfp4":
        zq, unit = nvfp4_blocks(z, var.rule, var.scale, var.grid)
    else:
        zq = lloyd_blocks(z, z.numel() if var.quant == "lloyd-tensor" else CHUNK)
    sh = inverse(zq, var.had) + mu_e
    if var.guard and var.tile:
        sh = torch.maximum(sh, var.guard * mu_e)
    elif var.guard and var.quant == "nvfp4" and not var.had:
        sh = torch.maximum(sh, var.guard * unit)
    elif var.guard:
        raise ValueError(f"{var.name}: no guard defined without a mean or with a Hadamard")
    return sh.clamp(min=0) ** 2


def codec(v: torch.Tensor, **kw) -> torch.Tensor:
    """codecs.py itself (its 4/6 picks by an L1 code-domain criterion, not SSE)."""
    return decode_exp_avg_sq(encode_exp_avg_sq(v, **kw)).double()


# ----------------------------------------------------------------------------- the rows
D = Variant("default")        # codec version 1, the baseline each row turns one knob of
V2 = replace(D, name="version 2", rule="4", tile=64)     # the codec's default
ROOT = replace(D, tile=0, had=0, guard=0.0)     # NVFP4 on √v itself: no mean, no Hadamard
VARIANTS = [
    ("re-implementation", [D]),
    ("one error source removed (or one knob turned)", [
        replace(D, name="tile mean exact (FP32)", mean="fp32"),
        replace(D, name="no μ/4 guard (ŝ >= 0)", guard=0.0),
        replace(D, name="guard μ/8", guard=0.125),
        replace(D, name="guard μ/16", guard=0.0625),
        replace(D, name="4/6 rule", rule="4over6"),
        replace(D, name="\"4\" rule (block max → 4)", rule="4"),
        replace(D, name="no Hadamard", had=0),
        replace(D, name="Hadamard 32", had=32),
        replace(D, name="Hadamard 64", had=64),
        replace(D, name="Hadamard 128", had=128),
        replace(D, name="tile 16", tile=16),
        replace(D, name="tile 64", tile=64),
        replace(D, name="tile 128", tile=128),
        replace(D, name="no mean subtraction (RHT-16 of √v, ŝ >= 0)", tile=0, guard=0.0),
        replace(D, name="per-block FP32 scales", scale="fp32"),
        replace(D, name="per-block FP32 scales, searched target", scale="fp32", rule="search"),
    ]),
    ("combinations", [
        replace(D, name="4/6, no guard", rule="4over6", guard=0.0),
        replace(D, name="4/6, guard μ/8", rule="4over6", guard=0.125),
        replace(D, name="4/6, guard μ/16", rule="4over6", guard=0.0625),
        replace(D, name="4/6, no Hadamard", rule="4over6", had=0),
        replace(D, name="4/6, Hadamard 32", rule="4over6", had=32),
        replace(D, name="4/6, tile 16", rule="4over6", tile=16),
        replace(D, name="4/6, tile 64", rule="4over6", tile=64),
        replace(D, name="4/6, tile 64, FP32 mean", rule="4over6", tile=64, mean="fp32"),
        replace(D, name="4/6, tile 64, Hadamard 32", rule="4over6", tile=64, had=32),
        replace(D, name="4/6, tile 64, guard μ/8", rule="4over6", tile=64, guard=0.125),
        replace(D, name="4/6, tile 128", rule="4over6", tile=128),
        replace(V2, name="\"4\" rule, tile 64 (version 2)"),
        replace(V2, name="\"4\" rule, tile 128", tile=128),
        *(replace(V2, name=f"block max → {t}, tile 64", rule=t) for t in ("3", "4.5", "5")),
        replace(D, name="FP32 scales, 4/6", scale="fp32", rule="4over6"),
        replace(D, name="FP32 scales searched, tile 16, FP32 mean", scale="fp32",
                rule="search", tile=16, mean="fp32"),
        replace(D, name="FP32 scales searched, tile 16, FP32 mean, no H", scale="fp32",
                rule="search", tile=16, mean="fp32", had=0),
        replace(D, name="FP32 scales searched, tile 16, FP32 mean, no guard", scale="fp32",
                rule="search", tile=16, mean="fp32", guard=0.0),
        replace(D, name="FP32 scales searched, tile 16, FP32 mean, no H, no guard",
                scale="fp32", rule="search", tile=16, mean="fp32", had=0, guard=0.0),
        replace(D, name="tile 16, E4M3 mean (× chunk FP32): in budget", tile=16, mean="e4m3"),
        replace(D, name="4/6, tile 16, E4M3 mean: in budget", tile=16, mean="e4m3",
                rule="4over6"),
    ]),
    ("floors of a 4-bit code (a: NVFP4 on √v; b: Lloyd-Max, levels free)", [
        replace(ROOT, name="(a) NVFP4 on √v (chunk scales), ŝ >= 0"),
        replace(ROOT, name="(a) NVFP4 on √v, 4/6", rule="4over6"),
        replace(ROOT, name="(a) NVFP4 on √v, FP32 scales searched", scale="fp32",
                rule="search"),
        replace(ROOT, name="(a) NVFP4 on √v, zero code → unit/4 (guard)", guard=0.25),
        replace(ROOT, name="(a) NVFP4 on √v, 4/6, zero code → unit/4", rule="4over6",
                guard=0.25),
        replace(D, name="(b) Lloyd-Max per tensor, residual, no H", had=0,
                quant="lloyd-tensor"),
        replace(D, name="(b) Lloyd-Max per tensor, residual, RHT-16", quant="lloyd-tensor"),
        replace(D, name="(b) Lloyd-Max per chunk, residual, no H", had=0, quant="lloyd-chunk"),
        replace(D, name="(b) Lloyd-Max per chunk, residual, RHT-16", quant="lloyd-chunk"),
        replace(D, name="(b) Lloyd-Max per chunk, residual, no H, no guard", had=0,
                quant="lloyd-chunk", guard=0.0),
        replace(D, name="(b) Lloyd-Max per chunk, tile 16 FP32 mean, no H", had=0, tile=16,
                mean="fp32", quant="lloyd-chunk"),
        replace(ROOT, name="(b') Lloyd-Max per tensor, √v (no mean, no H), ŝ >= 0",
                quant="lloyd-tensor"),
        replace(ROOT, name="(b') Lloyd-Max per chunk, √v (no mean, no H), ŝ >= 0",
                quant="lloyd-chunk"),
    ]),
    ("outside E2M1: an unsigned 4-bit grid on √v (E4M3 block + FP32 chunk scales)", [
        replace(ROOT, name="UE2M2 on √v, ŝ >= 0", grid="ue2m2"),
        replace(ROOT, name="UE2M2 on √v, zero code → unit/4", grid="ue2m2", guard=0.25),
        replace(ROOT, name="UE3M1 on √v, ŝ >= 0", grid="ue3m1"),
        replace(ROOT, name="UE3M1 on √v, zero code → unit/4", grid="ue3m1", guard=0.25),
        replace(ROOT, name="UE3M1 on √v, FP32 block scales, zero code → unit/4", grid="ue3m1",
                scale="fp32", guard=0.25),
    ]),
]


def real_rows(checkpoint: str, min_numel: int = 4096) -> None:
    """codecs.py's v codec, three ways, on the moments of a finished AdamW run: every tensor
    QAdamW would quantize (numel >= min_numel) encoded on its own, errors pooled."""
    moments = {k: (m.reshape(-1).float(), v.reshape(-1).float())
               for k, (m, v) in train_moments(0, "cpu", checkpoint=checkpoint).items()
               if v.numel() >= min_numel}
    n = sum(v.numel() for _, v in moments.values())
    print(f"\n### {checkpoint}: {len(moments)} tensors, {n} entries (pooled relL2)\n")
    print("| v codec | v relL2 | √v relL2 | u relL2 | u max |")
    print("|---|---|---|---|---|")
    for name, fn in (("direct NVFP4 on v", direct_nvfp4),
                     ("codecs.py version 1 (6-rule, tile 32)",
                      lambda v: codec(v, scale_rule="6", tile=32)),
                     ("codecs.py, 4/6, tile 64", lambda v: codec(v, scale_rule="4over6", tile=64)),
                     ("codecs.py default (version 2: \"4\" rule, tile 64)", codec)):
        p = _pool([(m, v, metrics(m, v, m, fn(v))) for m, v in moments.values()])
        print(f"| {name} | {p['v relL2']:.4f} | {p['√v relL2']:.4f} | {p['u relL2']:.4g} "
              f"| {p['u max']:.4g} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=4, help="synthetic draws to average over")
    ap.add_argument("--n", type=int, default=1 << 16, help="entries per draw (a multiple of "
                    f"{CHUNK})")
    ap.add_argument("--from-checkpoint", default=None, metavar="DIR",
                    help="the moments of this AdamW checkpoint instead of the synthetic sets")
    args = ap.parse_args(argv)
    if args.from_checkpoint:
        real_rows(args.from_checkpoint)
        return
    if args.n % CHUNK:
        raise SystemExit(f"--n must be a multiple of {CHUNK}")
    t0 = time.time()
    # (name, Variant or a function v -> v̂ with its bytes, section)
    rows = [("direct NVFP4 on v (baseline)", (direct_nvfp4, None), None),
            ("codecs.py version 1 (6-rule, tile 32)",
             (lambda v: codec(v, scale_rule="6", tile=32), D), None),
            ("codecs.py, 4/6, tile 64", (lambda v: codec(v, scale_rule="4over6", tile=64), V2),
             None),
            ("codecs.py default (version 2: \"4\" rule, tile 64)", (codec, V2), None)]
    rows += [(v.name, v, sec) for sec, vs in VARIANTS for v in vs]
    acc = {}     # (row name, structured) -> [[√v relL2], [u relL2], [u max]], one per seed
    for seed in range(args.seeds):
        torch.manual_seed(seed)           # synthetic_moments' Student-t draws use the global RNG
        sets = [synthetic_moments(args.n, seed=seed, structured=st) for st in (False, True)]
        for st, (m, v) in zip((False, True), sets):
            for name, var, _ in rows:
                vh = roundtrip_v(v, var) if isinstance(var, Variant) else var[0](v)
                met = metrics(m, v, m, vh)
                a = acc.setdefault((name, st), [[], [], []])
                for x, k in zip(a, ("√v relL2", "u relL2", "u max")):
                    x.append(met[k])
    mean = {k: [sum(x) / len(x) for x in a] for k, a in acc.items()}
    spread = {k: float(torch.tensor(a[0], dtype=torch.float64).std()) if args.seeds > 1
              else 0.0 for k, a in acc.items()}
    base = {st: mean[(rows[0][0], st)][0] for st in (False, True)}
    # the worst draw: max over draws of (this row / direct NVFP4 on v, same draw) − 1
    worst = {(name, st): max(a / b for a, b in zip(acc[(name, st)][0],
                                                    acc[(rows[0][0], st)][0]))
             for name, _, _ in rows for st in (False, True)}
    print(f"\n### √v relL2, mean of {args.seeds} draws of {args.n} entries "
          f"(± sd over draws; % = mean / mean of direct NVFP4 on v − 1; worst = the largest "
          f"per-draw ratio − 1); B/param = m + v state, budget {BUDGET}\n")
    print("| variant | iid √v relL2 | iid % (worst) | structured √v relL2 | structured % (worst) "
          "| u relL2 iid / str. | u max iid / str. | B/param |")
    print("|---|---|---|---|---|---|---|---|")
    section = None
    for name, var, sec in rows:
        if sec != section and sec is not None:
            print(f"| *{sec}* | | | | | | | |")
            section = sec
        cells = []
        for st in (False, True):
            e = mean[(name, st)][0]
            cells += [f"{e:.4f} ± {spread[(name, st)]:.4f}",
                      f"{100 * (e / base[st] - 1):+.1f}% ({100 * (worst[(name, st)] - 1):+.1f}%)"]
        u = [" / ".join(f"{mean[(name, st)][i]:.3g}" for st in (False, True)) for i in (1, 2)]
        bv = var if isinstance(var, Variant) else var[1]
        b = "" if bv is None else f"{bv.bytes_per_param():.4f}" + \
            ("" if bv.bytes_per_param() <= BUDGET else " (over)")
        print(f"| {name} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | {u[0]} | {u[1]} "
              f"| {b} |")
    print(f"\n{time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
