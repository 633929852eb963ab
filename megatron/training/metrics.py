"""Per-step metrics to stdout (Megatron style), `metrics.jsonl`, TensorBoard and wandb.

Only the last pipeline stage's first data-parallel / tensor-parallel rank writes (it has the
loss). wandb is optional (installed with `pip install -e .[wandb]`) and offline by default:
no network is assumed.
"""
from __future__ import annotations

import json
import os
import time


class MetricsLogger:
    def __init__(self, cfg, *, enabled: bool):
        self.enabled = enabled
        self.dir = cfg.logging.dir
        self._jsonl = None
        self._tb = None
        self._wandb = None
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
        if cfg.logging.wandb and cfg.logging.wandb_mode != "disabled":
            try:
                import wandb

                self._wandb = wandb.init(project=cfg.logging.wandb_project, mode=cfg.logging.wandb_mode,
                                         dir=self.dir, config=_flat(cfg))
            except ImportError:
                print("[metrics] logging.wandb=true but wandb is not installed "
                      "(pip install -e .[wandb]); wandb logging is off", flush=True)

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
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("iter", "time")}
        if self._tb:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb:
            self._wandb.log(scalars, step=step)

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
