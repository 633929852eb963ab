"""Per-step metrics to stdout (Megatron style), `metrics.jsonl`, TensorBoard and wandb.

Only the last pipeline stage's first data-parallel / tensor-parallel rank writes (it has the
loss). wandb is optional (installed with `pip install -e .[wandb]`) and offline by default:
no network is assumed.

Names. `metrics.jsonl` keeps the record's own keys (`loss`, `lr`, `grad_norm`, `val_loss`, ...;
what scripts and tests read). TensorBoard and wandb get Megatron-LM's names instead where
Megatron-LM logs the same quantity (its `training_log` and `evaluate_and_print_results` in
megatron/training/training.py), so dashboards made for Megatron-LM runs read ours:

| record key     | TensorBoard / wandb tag                      | unit / note                       |
| -------------- | -------------------------------------------- | --------------------------------- |
| `loss`         | `lm loss`, `lm loss vs samples`              |                                   |
| `lr`           | `learning-rate`, `learning-rate vs samples`  |                                   |
| `grad_norm`    | `grad-norm`, `grad-norm vs samples`          |                                   |
| `tflops`       | `throughput`                                 | TFLOP/s per GPU                   |
| `step_ms`      | `iteration-time`                             | seconds, as Megatron-LM           |
| `peak_mem_gib` | `mem-max-allocated-bytes`                    | bytes, as Megatron-LM             |
| `val_loss`     | `lm loss validation`, `lm loss validation ppl` | ppl = exp(loss)                 |

(`X vs samples` is plotted against the consumed samples instead of the iteration.) Every
other key (`tokens_per_s`, `mfu`, `consumed_samples`, `skipped`, `total_skips`, the `quant/...`
telemetry) keeps its own name everywhere.

wandb resume: the run id is kept in the checkpoint (`continuation.RunState`), and a resumed
run logs into the same wandb run (`wandb.init(id=..., resume="allow")`).
"""
from __future__ import annotations

import json
import math
import os
import time

# record key -> (Megatron-LM tag, factor); see the module docstring
MEGATRON_TAGS = {"loss": ("lm loss", 1.0), "lr": ("learning-rate", 1.0), "grad_norm": ("grad-norm", 1.0),
                 "tflops": ("throughput", 1.0), "step_ms": ("iteration-time", 1e-3),
                 "peak_mem_gib": ("mem-max-allocated-bytes", float(2**30)), "val_loss": ("lm loss validation", 1.0)}
VS_SAMPLES = ("loss", "lr", "grad_norm")


def dashboard_scalars(record: dict) -> tuple[dict, dict]:
    """(tag -> value by iteration, tag -> value by consumed samples) for TensorBoard / wandb."""
    by_iter, by_samples = {}, {}
    for k, v in record.items():
        if k in ("iter", "time") or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        tag, factor = MEGATRON_TAGS.get(k, (k, 1.0))
        by_iter[tag] = v * factor if factor != 1.0 else v
        if k == "val_loss" and v < 700:   # exp overflows beyond
            by_iter["lm loss validation ppl"] = math.exp(v)
        if k in VS_SAMPLES and isinstance(record.get("consumed_samples"), int):
            by_samples[tag + " vs samples"] = v
    return by_iter, by_samples


class MetricsLogger:
    def __init__(self, cfg, *, enabled: bool):
        self.enabled = enabled
        self.dir = cfg.logging.dir
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._cfg = cfg
        if not enabled or not self.dir:
            return
        os.makedirs(self.dir, exist_ok=True)
        self._jsonl = open(os.path.join(self.dir, "metrics.jsonl"), "a")
        if cfg.logging.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(self.dir, "tensorboard"))
            except ImportError:
                print("[metrics] tensorboard is not installed; TensorBoard logging is off", flush=True)

    def start_wandb(self, run_id: str | None) -> None:
        """Open the wandb run `run_id` (a resumed run continues its own: resume="allow").
        Called once the checkpoint is loaded, when the run id is known."""
        cfg = self._cfg
        if not self.enabled or not self.dir or self._wandb is not None:
            return
        if not cfg.logging.wandb or cfg.logging.wandb_mode == "disabled":
            return
        try:
            import wandb
        except ImportError:
            print("[metrics] logging.wandb=true but wandb is not installed "
                  "(pip install -e .[wandb]); wandb logging is off", flush=True)
            return
        self._wandb = wandb.init(project=cfg.logging.wandb_project, mode=cfg.logging.wandb_mode,
                                 dir=self.dir, config=_flat(cfg), id=run_id, resume="allow")

    def log(self, record: dict, *, stdout: str | None = None) -> None:
        if not self.enabled:
            return
        if stdout:
            print(stdout, flush=True)
        record = {"time": time.time(), **record}
        if self._jsonl:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        step = record.get("iter", 0)
        by_iter, by_samples = dashboard_scalars(record)
        if self._tb:
            for k, v in by_iter.items():
                self._tb.add_scalar(k, v, step)
            for k, v in by_samples.items():
                self._tb.add_scalar(k, v, record["consumed_samples"])
        if self._wandb:
            self._wandb.log(by_iter, step=step)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()


def _flat(cfg) -> dict:
    from megatron.training.config import to_dict

    out = {}
    for section, values in to_dict(cfg).items():
        for k, v in values.items():
            out[f"{section}.{k}"] = v
    return out


def format_train_line(r: dict, total_iters: int) -> str:
    parts = [f" iteration {r['iter']:8d}/{total_iters:8d}",
             f"consumed samples: {r['consumed_samples']:12d}",
             f"elapsed time per iteration (ms): {r['step_ms']:.1f}",
             f"learning rate: {r['lr']:.6E}",
             f"lm loss: {r['loss']:.6E}",
             f"grad norm: {r['grad_norm']:.3f}",
             f"tokens/s: {r['tokens_per_s']:.0f}"]
    if r.get("tflops") is not None:
        parts.append(f"TFLOP/s: {r['tflops']:.1f}")
    if r.get("mfu") is not None:
        parts.append(f"MFU: {100 * r['mfu']:.1f}%")
    if r.get("peak_mem_gib") is not None:
        parts.append(f"peak mem (GiB): {r['peak_mem_gib']:.2f}")
    if r.get("skipped"):
        parts.append(f"skipped: {r['skipped']}")
    return " | ".join(parts) + " |"


def from_last_stage(value: float | None, device) -> float | None:
    """The last pipeline stage's `value` (the validation loss lives there) on every stage of
    this rank's pipeline: one broadcast in the pipeline group; collective, every rank calls it."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return value
    t = torch.tensor([math.nan if value is None else float(value)], dtype=torch.float64, device=device)
    dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    v = t.item()
    return None if math.isnan(v) else v


def done_line(result: dict) -> str:
    """The job's last line (printed once, by global rank 0)."""
    val = result.get("val_loss")
    return f"[train] done at iteration {result['iteration']}" + (
        f", validation loss {val:.4f}" if val is not None else "")
