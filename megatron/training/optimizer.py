"""Build the optimizer a config names, through megatron-core's optimizer wrappers.

`adamw` is megatron-core's own (torch AdamW inside `Float16OptimizerWithFloat16Params` /
`DistributedOptimizer`: FP32 master weights, grad clipping, no weight decay on norms and
biases). The FP4 optimizers (`q_adamw`, `root`/`muon` and their NVFP4 forms) replace the
inner torch optimizer after megatron-core has built its wrappers, so master weights, grad
clipping, the distributed optimizer's sharding and `dist_checkpointing` stay megatron-core's.
"""
from __future__ import annotations

import torch
from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer

from megatron.training import recipes


def mcore_optimizer_config(cfg) -> McoreOptimizerConfig:
    o, t = cfg.optimizer, cfg.train
    return McoreOptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.beta1,
        adam_beta2=o.beta2,
        adam_eps=o.eps,
        bf16=t.precision == "bf16",
        params_dtype=None,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        clip_grad=t.grad_clip,
    )


def build_optimizer(cfg, model_chunks):
    optimizer = get_megatron_optimizer(mcore_optimizer_config(cfg), model_chunks)
    if cfg.optimizer.name == "adamw":
        use_fused_adamw(optimizer)
    recipes.convert_optimizer(optimizer, cfg, model_chunks)
    recipes.configure_grad_norm(optimizer, cfg, model_chunks)
    return optimizer


def inner_optimizers(optimizer) -> list:
    """The torch optimizers inside megatron-core's wrapper (a ChainedOptimizer holds several)."""
    wrappers = getattr(optimizer, "chained_optimizers", [optimizer])
    return [w.optimizer for w in wrappers if getattr(w, "optimizer", None) is not None]


def use_fused_adamw(optimizer) -> None:
    """Without Transformer Engine / apex, megatron-core falls back to torch AdamW with its
    default multi-tensor (`foreach`) path; on a GPU torch's single-kernel `fused` AdamW is the
    same update in one pass over the state (measured 19 ms -> see BENCHMARKS.md, 4 blocks of 3b)."""
    for inner in inner_optimizers(optimizer):
        if not isinstance(inner, torch.optim.AdamW):
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        if params and all(p.is_cuda and p.dtype == torch.float32 for p in params):
            for g in inner.param_groups:
                g["fused"], g["foreach"] = True, False


def apply_schedule(optimizer, lr: float, weight_decay: float) -> None:
    """Set this step's lr and weight decay on every group (megatron-core's groups carry
    `lr_mult` / `wd_mult`: norms and biases have `wd_mult = 0`)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
