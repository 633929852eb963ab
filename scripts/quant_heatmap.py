"""Per-layer heat map of quantization error from a run's metrics.jsonl (docs/telemetry.md).

    python scripts/quant_heatmap.py RUN_LOG_DIR/metrics.jsonl -o heatmap.png [--tensor x|w|dy]

Rows: ``<module path>/<x|w|dy>`` (every ``quant/<path>/<tensor>/rel_err`` name, sorted),
columns: the iterations that logged telemetry, colour: rel_err (blank where a row has no value
at that iteration, e.g. after the module switched to BF16).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

PREFIX, SUFFIX = "quant/", "/rel_err"


def quant_matrix(path: str, tensor: str | None = None):
    """(rows, iterations, matrix) with matrix[i][j] = rel_err of rows[i] at iterations[j] (NaN if absent)."""
    by_iter: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            for k, v in rec.items():
                if k.startswith(PREFIX) and k.endswith(SUFFIX) and isinstance(v, (int, float)):
                    row = k[len(PREFIX):-len(SUFFIX)]
                    if tensor is None or row.rsplit("/", 1)[-1] == tensor:
                        by_iter.setdefault(int(rec["iter"]), {})[row] = float(v)
    if not by_iter:
        raise ValueError(f"{path}: no quant/<module>/<tensor>/rel_err records"
                         + (f" for tensor {tensor!r}" if tensor else "")
                         + " (was the run started with logging.quant_stats_interval > 0 and fp4.linear=nvfp4?)")
    iters = sorted(by_iter)
    rows = sorted({r for d in by_iter.values() for r in d})
    matrix = [[by_iter[it].get(r, math.nan) for it in iters] for r in rows]
    return rows, iters, matrix


def plot(rows, iters, matrix, out: str, title: str = "NVFP4 quantization rel_err") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    a = np.ma.masked_invalid(np.array(matrix, dtype=float))
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(iters) + 4), max(3, 0.18 * len(rows) + 1.5)))
    im = ax.imshow(a, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows, fontsize=6)
    step = max(1, len(iters) // 20)
    ax.set_xticks(range(0, len(iters), step))
    ax.set_xticklabels([str(i) for i in iters[::step]], fontsize=7, rotation=90)
    ax.set_xlabel("iteration")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="rel_err")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", help="metrics.jsonl of a run")
    ap.add_argument("-o", "--out", default="quant_heatmap.png")
    ap.add_argument("--tensor", choices=("x", "w", "dy"), default=None, help="only this operand")
    a = ap.parse_args(argv)
    try:
        rows, iters, matrix = quant_matrix(a.metrics, a.tensor)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plot(rows, iters, matrix, a.out)
    print(f"wrote {a.out}: {len(rows)} rows x {len(iters)} iterations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
