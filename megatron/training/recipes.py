"""The recipe switches of the config and which of them are implemented.

The schema knows every name from the start, so a config written for a later release reads
correctly; choosing a name whose implementation has not landed is a config error that says
so, instead of a silent BF16 run.
"""
from __future__ import annotations

from megatron.training import precision

LINEAR = ("bf16", "nvfp4", "lora_svd")
ATTENTION = ("bf16", "q_attn")
OPTIMIZERS = ("adamw", "q_adamw", "root", "q_root", "muon", "q_muon")

# (config key, name) pairs whose implementation is wired into the trainer.
IMPLEMENTED = {
    ("fp4.linear", "bf16"),
    ("fp4.linear", "nvfp4"),
    ("fp4.linear", "lora_svd"),
    ("fp4.attention", "bf16"),
    ("fp4.attention", "q_attn"),
    ("optimizer.name", "adamw"),
    ("optimizer.name", "q_adamw"),
    ("optimizer.name", "muon"),
    ("optimizer.name", "q_muon"),
    ("optimizer.name", "root"),
    ("optimizer.name", "q_root"),
}


def unavailable_reason(kind: str, name: str) -> str | None:
    if (kind, name) in IMPLEMENTED:
        return None
    return "is part of the schema but not implemented in this release yet; choose another value"


def convert_layer_spec(spec, cfg, *, layer_index: int, keep_bf16=frozenset()):
    """Rewrite one transformer layer's spec for the configured FP4 recipes.

    A converter swaps submodules (linears, core attention); the layer classes stay megatron's.
    `spec` is a private deep copy the caller hands over. `keep_bf16`: slots of this layer
    (`precision.SLOTS`, e.g. "mlp.linear_fc2") left as they are (`fp4.keep_bf16`).
    """
    subs = {"self_attention": spec.submodules.self_attention.submodules,
            "mlp": spec.submodules.mlp.submodules}

    def put(col, row):
        for slot, mod in (("self_attention.linear_qkv", col), ("mlp.linear_fc1", col),
                          ("self_attention.linear_proj", row), ("mlp.linear_fc2", row)):
            if slot not in keep_bf16:
                parent, name = slot.split(".")
                setattr(subs[parent], name, mod)

    # our linears' wgrad fusion into megatron's main_grad (megatron's own linears: see model.py)
    fuse = cfg.parallel.gradient_accumulation_fusion
    rules = precision.scale_rules(cfg)
    if cfg.fp4.linear == "nvfp4":
        from fullstack_fp4.integration.nvfp4_linear_layers import nvfp4_layer_specs

        put(*nvfp4_layer_specs(fuse_wgrad_accumulation=fuse,
                               unquantized_operands=cfg.fp4.unquantized_operands, scale_rule=rules))
    if cfg.fp4.linear == "lora_svd":
        from fullstack_fp4.integration.lora_svd_layers import lora_svd_layer_specs

        put(*lora_svd_layer_specs(cfg.fp4.lora_svd, fuse_wgrad_accumulation=fuse, scale_rule=rules))
    if cfg.fp4.attention == "q_attn" and "self_attention.core_attention" not in keep_bf16:
        from fullstack_fp4.integration.q_attn_core_attention import QAttnCoreAttention

        subs["self_attention"].core_attention = QAttnCoreAttention
    return spec


def after_model_build(model, cfg) -> None:
    """Hook for recipes that need the built module tree (e.g. initial SVD splits)."""
    if cfg.fp4.linear == "lora_svd":  # the initial split runs in the layers' __init__
        from fullstack_fp4.integration.lora_svd_layers import check_supported

        check_supported(cfg)
    return None


def convert_optimizer(optimizer, cfg, model_chunks) -> None:
    """Swap the inner torch optimizer of megatron-core's wrapper for the configured recipe."""
    if cfg.optimizer.name == "adamw":
        return None
    from fullstack_fp4.integration.optimizers import convert_optimizer as convert

    convert(optimizer, cfg, model_chunks)
    return None


def configure_grad_norm(optimizer, cfg, model_chunks) -> None:
    """LoRA-SVD with `fp4.lora_svd.clip_dense_norm`: clip (and log) by the norm of the
    dense-equivalent gradient, not of the routed factor gradients
    (fullstack_fp4/integration/lora_grad_norm.py). Off by default: measured worse."""
    if cfg.fp4.linear == "lora_svd" and cfg.fp4.lora_svd.clip_dense_norm:
        from fullstack_fp4.integration.lora_grad_norm import clip_by_dense_norm

        clip_by_dense_norm(optimizer, model_chunks)


def after_optimizer_step(model_chunks, optimizer, cfg, iteration: int) -> None:
    """Hook run after every optimizer step (`iteration` = steps done), e.g. LoRA-SVD realignment.

    Must be a pure function of (model, optimizer, cfg, iteration) so that a resumed run
    repeats exactly what an uninterrupted one did.
    """
    if cfg.fp4.linear == "lora_svd" and iteration % cfg.fp4.lora_svd.realign_interval == 0:
        from fullstack_fp4.integration.lora_svd_layers import realign_model

        realign_model(model_chunks, optimizer, seed=cfg.train.seed, iteration=iteration)
    return None
