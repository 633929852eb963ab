"""Build the optimizer a config names, through megatron-core's optimizer wrappers.

`adamw` is megatron-core's own (torch AdamW inside `Float16OptimizerWithFloat16Params` /
`DistributedOptimizer`: FP32 master weights, grad clipping, no weight decay on norms and
biases). The FP4 optimizers (`q_adamw`, `root`/`muon` and their NVFP4 forms) replace the
inner torch optimizer after megatron-core has built its wrappers, so master weights, grad
clipping, the distributed optimizer's sharding and `dist_checkpointing` stay megatron-core's.
"""
from __future__ import annotations

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
    recipes.convert_optimizer(optimizer, cfg, model_chunks)
    return optimizer


def apply_schedule(optimizer, lr: float, weight_decay: float) -> None:
    """Set this step's lr and weight decay on every group (megatron-core's groups carry
    `lr_mult` / `wd_mult`: norms and biases have `wd_mult = 0`)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
