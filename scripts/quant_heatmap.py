"""Per-layer heat maps of quantization telemetry from a run's metrics.jsonl (docs/telemetry.md).

    python scripts/quant_heatmap.py RUN_LOG_DIR/metrics.jsonl -o heatmap.png [--tensor NAME]

One PNG per run: one panel per statistic family present in the run (the per-recipe names of
docs/telemetry.md), each with its own colour scale because their ranges differ:

  linear operands   x, w, dy, wgrad_x, wgrad_dy, w_res       rel_err (NVFP4 / LoRA-SVD linears)
  LoRA-SVD energy   lora_energy                              fraction in the BF16 subspace
  Q-Attn            s, ds                                    rel_err
  Q-AdamW           m, v, update                             rel_err
  Q-AdamW clamp     v_clamped                                fraction of v entries floored
  Newton–Schulz     ns_step, ns_orth, ns_orth_fp32           rel_err (step error, ‖XXᵀ−I‖/‖I‖)

Rows: ``<module or optimizer/param path>/<tensor>`` in natural (layer) order; columns: the
iterations that logged telemetry; blank where a row has no value (a module switched to BF16,
or an NS matrix not sampled at that interval). ``--tensor`` keeps only that tensor's rows.
"""
from __future__ import annotations

import json
import math
import re
import sys

PREFIX, SUFFIXES = "quant/", ("/rel_err", "/frac")
FAMILIES = [  # (title, tensors, colour-bar label)
    ("linear operands (NVFP4 / LoRA-SVD W_res GEMM)", ("x", "w", "dy", "wgrad_x", "wgrad_dy", "w_res"), "rel_err"),
    ("LoRA-SVD: energy in the BF16 subspace", ("lora_energy",), "fraction"),
    ("Q-Attn: S = QKᵀ and dS", ("s", "ds"), "rel_err"),
    ("Q-AdamW: moments and update", ("m", "v", "update"), "rel_err"),
    ("Q-AdamW: v entries raised by the guard", ("v_clamped",), "fraction"),
    ("Q-Muon / Q-Root Newton–Schulz", ("ns_step", "ns_orth", "ns_orth_fp32"), "rel_err"),
]


def _natural(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def family(row: str) -> str:
    tensor = row.rsplit("/", 1)[-1]
    return next((title for title, ts, _ in FAMILIES if tensor in ts), "other")


def quant_matrix(path: str, tensor: str | None = None):
    """(rows, iterations, matrix) with matrix[i][j] = the value of rows[i] at iterations[j] (NaN if absent)."""
    by_iter: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            for k, v in rec.items():
                suffix = next((s for s in SUFFIXES if k.endswith(s)), None)
                if k.startswith(PREFIX) and suffix and isinstance(v, (int, float)):
                    row = k[len(PREFIX):-len(suffix)]
                    if tensor is None or row.rsplit("/", 1)[-1] == tensor:
                        by_iter.setdefault(int(rec["iter"]), {})[row] = float(v)
    if not by_iter:
        raise ValueError(f"{path}: no quant/<path>/<tensor>/rel_err records"
                         + (f" for tensor {tensor!r}" if tensor else "")
                         + " (was the run started with logging.quant_stats_interval > 0 and an FP4 recipe?)")
    iters = sorted(by_iter)
    rows = sorted({r for d in by_iter.values() for r in d}, key=_natural)
    matrix = [[by_iter[it].get(r, math.nan) for it in iters] for r in rows]
    return rows, iters, matrix


def panels(rows, matrix):
    """[(title, label, rows, matrix)] per family present, in FAMILIES order."""
    out = []
    for title, _, label in FAMILIES + [("other", (), "value")]:
        idx = [i for i, r in enumerate(rows) if family(r) == title]
        if idx:
            out.append((title, label, [rows[i] for i in idx], [matrix[i] for i in idx]))
    return out


def plot(rows, iters, matrix, out: str, title: str = "quantization telemetry") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ps = panels(rows, matrix)
    heights = [max(1.2, 0.16 * len(r) + 0.8) for _, _, r, _ in ps]
    fig, axes = plt.subplots(len(ps), 1, squeeze=False, gridspec_kw={"height_ratios": heights},
                             figsize=(max(7, 0.35 * len(iters) + 5), sum(heights) + 1))
    step = max(1, len(iters) // 20)
    for ax, (name, label, prow, pmat) in zip(axes[:, 0], ps):
        a = np.ma.masked_invalid(np.array(pmat, dtype=float))
        im = ax.imshow(a, aspect="auto", interpolation="nearest", cmap="viridis")
        ax.set_yticks(range(len(prow)))
        ax.set_yticklabels(prow, fontsize=5)
        ax.set_xticks(range(0, len(iters), step))
        ax.set_xticklabels([str(i) for i in iters[::step]], fontsize=7, rotation=90)
        ax.set_title(name, fontsize=9)
        fig.colorbar(im, ax=ax, label=label)
    axes[-1, 0].set_xlabel("iteration")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.985))  # leave the suptitle its own strip
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    from megatron.training.errors import ArgumentParser  # one `error:` line, exit 2

    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", help="metrics.jsonl of a run")
    ap.add_argument("-o", "--out", default="quant_heatmap.png")
    ap.add_argument("--tensor", default=None,
                    help="only this tensor (x, w, dy, wgrad_x, wgrad_dy, w_res, lora_energy, s, ds, m, v, "
                         "update, v_clamped, ns_step, ns_orth, ns_orth_fp32)")
    a = ap.parse_args(argv)
    try:
        rows, iters, matrix = quant_matrix(a.metrics, a.tensor)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plot(rows, iters, matrix, a.out)
    print(f"wrote {a.out}: {len(rows)} rows x {len(iters)} iterations in {len(panels(rows, matrix))} panel(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
