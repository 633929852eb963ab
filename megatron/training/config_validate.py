"""Cross-field rules of a run config, checked before anything is built.

Each rule raises `ConfigError` with a message that says what to change. The list of recipe
names comes from `megatron.training.recipes`, the one place that knows which recipes exist.
"""
from __future__ import annotations

import os

from megatron.training.errors import ConfigError
from megatron.training.config_schema import RunConfig


def _choice(key: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(allowed)}; got '{value}'")


def _positive(key: str, value, allow_zero: bool = False) -> None:
    if value is None:
        raise ConfigError(f"{key} must be set")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key} must be {'>= 0' if allow_zero else '> 0'}; got {value}")


def validate_config(cfg: RunConfig, world_size: int | None = None) -> None:
    from megatron.training import recipes

    m, p, t, o, f, d, c, lg = (cfg.model, cfg.parallel, cfg.train, cfg.optimizer, cfg.fp4,
                               cfg.data, cfg.checkpoint, cfg.logging)
    for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length"):
        if getattr(m, k) is None:
            raise ConfigError(f"model.{k} is not set: set it or choose a model.preset")
        _positive(f"model.{k}", getattr(m, k))
    if m.num_query_groups is None:
        m.num_query_groups = m.num_attention_heads
    _positive("model.num_query_groups", m.num_query_groups)
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"model.hidden_size ({m.hidden_size}) must be divisible by "
                          f"model.num_attention_heads ({m.num_attention_heads})")
    if m.num_attention_heads % m.num_query_groups:
        raise ConfigError(f"model.num_attention_heads ({m.num_attention_heads}) must be divisible by "
                          f"model.num_query_groups ({m.num_query_groups})")
    _choice("model.position_embedding", m.position_embedding, ("rope", "learned"))

    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    _positive("parallel.tensor_model_parallel_size", tp)
    _positive("parallel.pipeline_model_parallel_size", pp)
    if m.num_attention_heads % tp or m.num_query_groups % tp:
        raise ConfigError(f"model.num_attention_heads ({m.num_attention_heads}) and model.num_query_groups "
                          f"({m.num_query_groups}) must be divisible by parallel.tensor_model_parallel_size ({tp})")
    if m.ffn_hidden_size % tp:
        raise ConfigError(f"model.ffn_hidden_size ({m.ffn_hidden_size}) must be divisible by "
                          f"parallel.tensor_model_parallel_size ({tp})")
    if m.num_layers % pp:
        raise ConfigError(f"model.num_layers ({m.num_layers}) must be divisible by "
                          f"parallel.pipeline_model_parallel_size ({pp})")

    _positive("train.iters", t.iters)
    _positive("train.micro_batch_size", t.micro_batch_size)
    _positive("train.global_batch_size", t.global_batch_size)
    _positive("train.log_interval", t.log_interval)
    _positive("train.eval_interval", t.eval_interval)
    _positive("train.eval_iters", t.eval_iters, allow_zero=True)
    if t.exit_interval is not None:
        _positive("train.exit_interval", t.exit_interval)
    _choice("train.precision", t.precision, ("bf16", "fp32"))
    _positive("train.max_consecutive_skips", t.max_consecutive_skips, allow_zero=True)
    _positive("train.manual_gc_interval", t.manual_gc_interval, allow_zero=True)
    if t.loss_spike_factor is not None:
        if t.loss_spike_factor <= 1:
            raise ConfigError(f"train.loss_spike_factor must be > 1 (or null); got {t.loss_spike_factor}")
        if cfg.parallel.pipeline_model_parallel_size > 1:
            raise ConfigError("train.loss_spike_factor needs the loss on every rank; it is only on the last "
                              "pipeline stage, so use it with pipeline_model_parallel_size=1")
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if world % (tp * pp):
        raise ConfigError(f"world size {world} is not divisible by tensor x pipeline parallel size ({tp} x {pp})")
    dp = world // (tp * pp)
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(f"train.global_batch_size ({t.global_batch_size}) must be divisible by "
                          f"train.micro_batch_size ({t.micro_batch_size}) x data-parallel size ({dp})")

    _choice("optimizer.name", o.name, recipes.OPTIMIZERS)
    if not p.grad_reduce_in_fp32 and t.precision != "bf16":
        # megatron gives every grad buffer the params' dtype then: the switch would do nothing
        raise ConfigError(f"parallel.grad_reduce_in_fp32=false needs train.precision=bf16 (with "
                          f"{t.precision} params the grad buffers are {t.precision} anyway)")
    _choice("optimizer.schedule", o.schedule, ("cosine", "wsd", "constant"))
    _positive("optimizer.lr", o.lr)
    _positive("optimizer.min_lr", o.min_lr, allow_zero=True)
    if o.min_lr > o.lr:
        raise ConfigError(f"optimizer.min_lr ({o.min_lr}) must not exceed optimizer.lr ({o.lr})")
    _positive("optimizer.warmup_iters", o.warmup_iters, allow_zero=True)
    if not 0 <= o.beta1 < 1 or not 0 <= o.beta2 < 1:
        raise ConfigError("optimizer.beta1 and optimizer.beta2 must lie in [0, 1)")
    if not 0 < o.wsd_decay_fraction <= 1:
        raise ConfigError("optimizer.wsd_decay_fraction must lie in (0, 1]")
    _choice("optimizer.orthogonal.coefficients", o.orthogonal.coefficients, ("auto", "muon", "root", "fitted"))
    if o.orthogonal.nvfp4_terms not in (1, 2, 3):
        raise ConfigError(f"optimizer.orthogonal.nvfp4_terms must be 1, 2 or 3; got {o.orthogonal.nvfp4_terms}")
    if o.orthogonal.tp_mode not in ("duplicated", "blockwise"):
        raise ConfigError(f"optimizer.orthogonal.tp_mode must be duplicated or blockwise; got {o.orthogonal.tp_mode!r}")

    _choice("fp4.linear", f.linear, recipes.LINEAR)
    _choice("fp4.attention", f.attention, recipes.ATTENTION)
    _choice("fp4.fallback", f.fallback, ("off", "warn", "bf16"))
    _positive("fp4.bf16_first_layers", f.bf16_first_layers, allow_zero=True)
    _positive("fp4.bf16_last_layers", f.bf16_last_layers, allow_zero=True)
    if f.bf16_first_layers + f.bf16_last_layers > m.num_layers:
        raise ConfigError("fp4.bf16_first_layers + fp4.bf16_last_layers exceeds model.num_layers")
    from megatron.training import precision

    precision.check_config(cfg)   # fp4.keep_bf16, fp4.bf16_from, fp4.linear_scale_rule
    for kind, name in (("fp4.linear", f.linear), ("fp4.attention", f.attention), ("optimizer.name", o.name)):
        reason = recipes.unavailable_reason(kind, name)
        if reason:
            raise ConfigError(f"{kind}: '{name}' {reason}")
    if f.linear != "bf16" and (m.hidden_size % 16 or m.ffn_hidden_size % 16):
        raise ConfigError("NVFP4 linears need model.hidden_size and model.ffn_hidden_size divisible by 16")
    if f.unquantized_operands:
        if f.linear != "nvfp4":
            raise ConfigError(f"fp4.unquantized_operands is a diagnostic of fp4.linear=nvfp4; got fp4.linear={f.linear}")
        from fullstack_fp4.linear.partial_nvfp4 import OPERANDS

        bad = [o for o in f.unquantized_operands if o not in OPERANDS]
        if bad or len(set(f.unquantized_operands)) != len(f.unquantized_operands):
            raise ConfigError(f"fp4.unquantized_operands must be distinct names from {', '.join(OPERANDS)}; "
                              f"got {f.unquantized_operands}")
    if f.linear == "lora_svd":
        lr_ = f.lora_svd
        _positive("fp4.lora_svd.rank", lr_.rank)
        if lr_.rank >= min(m.hidden_size, m.ffn_hidden_size) // tp:
            raise ConfigError(f"fp4.lora_svd.rank ({lr_.rank}) must be below the smallest per-rank matrix dimension")
        _positive("fp4.lora_svd.realign_interval", lr_.realign_interval)
        _choice("fp4.lora_svd.route", lr_.route, ("projected", "dense"))
        if lr_.clip_dense_norm and lr_.route != "projected":
            raise ConfigError("fp4.lora_svd.clip_dense_norm=true needs fp4.lora_svd.route=projected: "
                              "with the dense route the gradient norm already is the dense one")

    if not d.mock:
        if not d.path:
            raise ConfigError("data.path is empty: give indexed-dataset prefixes, or set data.mock=true")
        if d.weights is not None and len(d.weights) != len(d.path):
            raise ConfigError(f"data.weights has {len(d.weights)} entries but data.path has {len(d.path)}")
        if not d.tokenizer:
            raise ConfigError("data.tokenizer is not set (a SentencePiece .model file)")
        parts = d.split.split(",")
        try:
            nums = [float(x) for x in parts]
        except ValueError:
            nums = []
        if len(nums) != 3 or min(nums) < 0 or sum(nums) <= 0:
            raise ConfigError(f"data.split must be three non-negative numbers like '98,2,0'; got '{d.split}'")
    elif m.vocab_size is None:
        raise ConfigError("data.mock=true needs model.vocab_size")

    if c.load not in ("auto", "none") and not c.load:
        raise ConfigError("checkpoint.load must be auto, none or a path")
    from megatron.training import continuation

    continuation.check_config(cfg)   # checkpoint.load_mode, override_scheduler, train.continue_with
    if c.save_interval is not None:
        _positive("checkpoint.save_interval", c.save_interval)
        if not c.save_dir:
            raise ConfigError("checkpoint.save_interval is set but checkpoint.save_dir is not")
    _positive("checkpoint.keep_last", c.keep_last)
    _choice("logging.wandb_mode", lg.wandb_mode, ("offline", "online", "disabled"))
    _positive("logging.quant_stats_interval", lg.quant_stats_interval, allow_zero=True)
    _positive("logging.quant_stats_blocks", lg.quant_stats_blocks)
    if f.fallback != "off":
        if not lg.quant_stats_interval:
            raise ConfigError(f"fp4.fallback={f.fallback} needs quantization telemetry: set logging.quant_stats_interval > 0")
        if f.linear == "bf16" and f.attention == "bf16" and not o.name.startswith("q_"):
            raise ConfigError(f"fp4.fallback={f.fallback} needs an FP4 recipe to watch (fp4.linear=nvfp4|lora_svd, "
                              "fp4.attention=q_attn or a q_* optimizer); every recipe is BF16")
    for key in ("fallback_threshold", "fallback_threshold_lora_svd", "fallback_threshold_attention",
                "fallback_threshold_optimizer"):
        v = getattr(f, key)
        if v is None or not v > 0:
            raise ConfigError(f"fp4.{key} must be > 0; got {v}")
    if f.fallback_intervals < 1:
        raise ConfigError(f"fp4.fallback_intervals must be >= 1; got {f.fallback_intervals}")
