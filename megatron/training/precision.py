"""Which FP4 modules run in BF16: by module name (`fp4.keep_bf16`) and from a step on (`fp4.bf16_from`).

**The map** (`fp4.keep_bf16`, with `fp4.bf16_first_layers` / `bf16_last_layers` as shorthands):
fnmatch patterns over the names of the modules an FP4 recipe would replace, named as in a
one-stage model (global layer index, whatever the pipeline split):

    decoder.layers.<i>.self_attention.linear_qkv      linear (nvfp4 | lora_svd)
    decoder.layers.<i>.self_attention.linear_proj     linear
    decoder.layers.<i>.self_attention.core_attention  attention (q_attn)
    decoder.layers.<i>.mlp.linear_fc1                 linear
    decoder.layers.<i>.mlp.linear_fc2                 linear

`bf16_first_layers: N` is the patterns `decoder.layers.<i>.*` for i < N, `bf16_last_layers` the
same for the last N layers. A matched module keeps megatron's BF16 module in the layer spec
(`model.block_spec` → `recipes.convert_layer_spec(..., keep_bf16=...)`): it is never built as
an FP4 module, so LoRA-SVD adds no factors to it. A user pattern that matches no FP4 module of
this config (a typo, a layer index past the last layer, `*.core_attention` without Q-Attn) is a
config error naming the pattern and the modules that exist (`check_config`, called by
`config_validate.validate_config`: the one place the map is checked).

Checkpoints: megatron-core saves the layers' tensors stacked, one `ShardedTensor` per parameter
name with the layer as its first axis (`decoder.layers.mlp.linear_fc1.weight [num_layers, ...]`),
which needs every layer to hold the same parameters. LoRA-SVD's factors (`lora_l1` / `lora_l2`)
exist only in the linears it replaces, so where the map keeps a linear slot in BF16 in some layers
and not in all (`bf16_first_layers`, `bf16_last_layers`, `decoder.layers.<i>.*`), the stacked
factor tensors would miss those layers and the save fails. Such a model saves each layer under its
own keys (`decoder.layers.<i>.…`: megatron-core's `hetereogenous_dist_checkpoint`, set by
`model.transformer_config` from :func:`layers_differ_in_state`); every other config keeps the
stacked keys (NVFP4 linears and Q-Attn hold megatron's own parameters, so their checkpoints
are unchanged).

**The schedule** (`fp4.bf16_from`): an integer S ≥ 1, or a fraction f ∈ (0, 1] of `train.iters`
meaning S = ⌊f · train.iters⌋ (computed on the decimal value, so 0.29 × 100 is 29). The first S
optimizer steps run the configured FP4 recipes; right after step S (the trainer's `iteration`
reaching S, before that step's validation and checkpoint) every FP4 module of the linear and of
the attention is switched to BF16 with the per-module switch the telemetry fallback uses
(`switch_to_bf16`), and stays so. The model at a step k ≥ S is therefore the BF16 one
everywhere: in training, in the trainer's validation at k, resumed from a checkpoint at k, and
in scripts/evaluate.py. NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149, App. D) runs the
final learning-rate decay in BF16. The optimizer is not switched (Q-AdamW / Q-Root keep their
4-bit states: they have no BF16 path). The switch depends on the step count only, so a resumed run switches at the same step:
a run resumed at or after S switches when it loads the checkpoint, one resumed before S when it
reaches S; the losses are those of the uninterrupted run
(tests/megatron/training/test_precision_schedule.py). A fraction follows the run's current
`train.iters` (a run continued to a new length switches at f of the new length; the resume says
where the switch moves, and which steps run FP4 again when the checkpoint was already past the
old switch). A changed `fp4.bf16_from`, `fp4.linear_scale_rule` or `fp4.unquantized_operands`
is refused on a full resume unless stated (`train.continue_with: [new_precision]`,
megatron/training/continuation.py). Logged once per process: `[precision] ...`. The telemetry
fallback's per-module switches are recorded in the checkpoint as before; a resume reports as
fallbacks only those the schedule did not make.

What "BF16" means per recipe (`switch_to_bf16`, shared with the telemetry fallback):

* NVFP4 linear: megatron-core's own GEMM in the params' dtype (`switch_module_to_bf16`).
* LoRA-SVD: W_res's GEMMs unquantized, the BF16 branch as before (`lora_exact`):
  ``y = x W_resᵀ + β (x L1ᵀ) L2ᵀ``, the same function of the parameters as the merged dense
  ``W = W_res + β L2 L1`` up to BF16 rounding. Not a merge into one dense W: that would change
  the parameter set mid-run (W_res and L1 become one tensor, the optimizer state with them),
  so the checkpoint after the switch would not have the layout of the one before it, and
  resume across the switch could not be exact. Under the dense route (the default) W_res gets
  the whole gradient ``dYᵀX`` and L1 none, which is exactly the dense W's BF16 gradient; the
  realignments go on as scheduled and only move mass between the two terms.
* Q-Attn: megatron's SDPA core attention (`SDPACoreAttention.forward`).
"""
from __future__ import annotations

import fnmatch
from fractions import Fraction

from megatron.training.errors import ConfigError

__all__ = ["SLOTS", "fp4_module_names", "bf16_module_names", "kept_slots", "layers_differ_in_state",
           "check_config", "switch_step", "switch_to_bf16", "PrecisionSchedule", "SCALE_RULES", "scale_rules"]

LINEAR_SLOTS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                "mlp.linear_fc2")
ATTENTION_SLOTS = ("self_attention.core_attention",)
SLOTS = LINEAR_SLOTS + ATTENTION_SLOTS
SCALE_RULES = ("6", "4over6")


def _layer_name(i: int, slot: str) -> str:
    return f"decoder.layers.{i}.{slot}"


def _fp4_slots(cfg) -> tuple:
    f = cfg.fp4
    return ((LINEAR_SLOTS if f.linear != "bf16" else ())
            + (ATTENTION_SLOTS if f.attention != "bf16" else ()))


def fp4_module_names(cfg) -> list[str]:
    """Names of the modules this config's FP4 recipes replace, before the map is applied."""
    slots = _fp4_slots(cfg)
    return [_layer_name(i, s) for i in range(cfg.model.num_layers) for s in slots]


def _shorthand_patterns(cfg) -> list[str]:
    f, n = cfg.fp4, cfg.model.num_layers
    layers = list(range(f.bf16_first_layers)) + list(range(n - f.bf16_last_layers, n))
    return [f"decoder.layers.{i}.*" for i in sorted(set(layers))]


def _existing(cfg) -> str:
    slots = _fp4_slots(cfg)
    n = cfg.model.num_layers
    return f"decoder.layers.{{0..{n - 1}}}.{{{', '.join(slots)}}}"


def bf16_module_names(cfg) -> frozenset:
    """Names (:func:`fp4_module_names`) that keep BF16: matched by `fp4.keep_bf16` or by the
    `bf16_first_layers` / `bf16_last_layers` shorthands. Raises ConfigError for a user pattern
    that matches nothing."""
    names = fp4_module_names(cfg)
    kept = set()
    for pat in cfg.fp4.keep_bf16:
        hit = fnmatch.filter(names, pat)
        if not hit:
            what = _existing(cfg) if names else "none (every recipe of fp4.linear / fp4.attention is bf16)"
            raise ConfigError(f"fp4.keep_bf16 pattern {pat!r} matches no FP4 module; the FP4 "
                              f"modules of this config are {what}")
        kept.update(hit)
    for pat in _shorthand_patterns(cfg):
        kept.update(fnmatch.filter(names, pat))
    return frozenset(kept)


def kept_slots(kept: frozenset, layer_index: int) -> frozenset:
    """The slots (:data:`SLOTS`) of layer ``layer_index`` (global) that keep BF16."""
    return frozenset(s for s in SLOTS if _layer_name(layer_index, s) in kept)


def layers_differ_in_state(cfg) -> bool:
    """Do the transformer layers hold different parameters? Only LoRA-SVD adds parameters to
    the modules it replaces (its factors); a linear kept in BF16 has none. So they differ when
    fp4.linear=lora_svd keeps some linear slot in BF16 in some layers but not in all (module
    docstring, "Checkpoints"). Decided on the config's global layer indices, so every pipeline
    stage (and every tool rebuilding the model from a checkpoint's config) agrees."""
    if cfg.fp4.linear != "lora_svd":
        return False
    kept = bf16_module_names(cfg)
    linear = frozenset(LINEAR_SLOTS)
    return len({kept_slots(kept, i) & linear for i in range(cfg.model.num_layers)}) > 1


def switch_step(cfg) -> int | None:
    """Steps run in FP4 before the switch (``S``), or None (no schedule). Assumes a checked
    config (:func:`check_config`)."""
    v = cfg.fp4.bf16_from
    if v is None:
        return None
    if isinstance(v, int):
        return v
    return int(Fraction(repr(v)) * cfg.train.iters)    # floor, on the decimal value


def scale_rules(cfg) -> dict:
    """``{"x": .., "w": .., "dy": ..}`` of `fp4.linear_scale_rule` (checked values)."""
    r = cfg.fp4.linear_scale_rule
    return {"x": r.x, "w": r.w, "dy": r.dy}


def check_config(cfg) -> None:
    """Every rule of `fp4.keep_bf16`, `fp4.bf16_from` and `fp4.linear_scale_rule`
    (called by config_validate.validate_config)."""
    f, t = cfg.fp4, cfg.train
    for op, rule in scale_rules(cfg).items():
        if rule not in SCALE_RULES:
            raise ConfigError(f"fp4.linear_scale_rule.{op} must be one of {', '.join(SCALE_RULES)}; got {rule!r}")
    if any(r != "6" for r in scale_rules(cfg).values()) and f.linear == "bf16":
        raise ConfigError("fp4.linear_scale_rule is a rule of the NVFP4 linear's quantization: set "
                          "fp4.linear=nvfp4 or lora_svd, or leave it at 6")
    # logging.quant_stats_interval goes with any rule: the telemetry measures each operand of a
    # linear with that operand's own rule (fullstack_fp4/telemetry/collector.py), so its errors,
    # and the fallback they drive, are those of this run's quantizer
    bad = [p for p in f.keep_bf16 if not isinstance(p, str) or not p]
    if bad:
        raise ConfigError(f"fp4.keep_bf16 must be a list of non-empty patterns; got {f.keep_bf16}")
    bf16_module_names(cfg)
    v = f.bf16_from
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"fp4.bf16_from must be a step (integer >= 1) or a fraction of train.iters "
                          f"in (0, 1]; got {v!r}")
    if isinstance(v, int):
        if not 1 <= v <= t.iters:
            raise ConfigError(f"fp4.bf16_from={v} must lie in [1, train.iters={t.iters}] as a step "
                              "(or be a fraction in (0, 1], written with a decimal point)")
    else:
        if not 0 < v <= 1:
            raise ConfigError(f"fp4.bf16_from={v} must lie in (0, 1] as a fraction of train.iters "
                              "(a step is an integer, written without a decimal point)")
        if switch_step(cfg) < 1:
            raise ConfigError(f"fp4.bf16_from={v} of train.iters={t.iters} is before the first step: "
                              "every step would run in BF16 (use fp4.linear=bf16 / fp4.attention=bf16)")
    if not _fp4_slots(cfg):
        raise ConfigError("fp4.bf16_from switches the FP4 recipes of the linear and the attention to "
                          "BF16, and both are bf16 here (fp4.linear / fp4.attention)")


def switch_to_bf16(module) -> None:
    """The per-module BF16 path of each recipe (module docstring; docs/telemetry.md § Fallback).
    Sets the flag `fp4_fallback_bf16` that the telemetry's `fallback_state` records."""
    from fullstack_fp4.telemetry import module_recipe

    recipe = module_recipe(module)
    if recipe == "linear":
        from fullstack_fp4.integration.nvfp4_linear_layers import switch_module_to_bf16
        switch_module_to_bf16(module)
    elif recipe == "lora_svd":
        # The recipe's own unquantized W_res path (what `exact_matmuls` uses for evaluation):
        # y = x W_resᵀ + β (x L1ᵀ) L2ᵀ in the params' dtype, same routed backward.
        module.lora_exact = True
        module.fp4_fallback_bf16 = True
    elif recipe == "attention":
        # Q-Attn has no BF16 switch of its own: this instance runs the BF16 core attention of
        # the BF16 spec (SDPACoreAttention.forward, which reads attn_mask_type, softmax_scale
        # and dropout: QAttnCoreAttention has the first two and refuses dropout > 0).
        import types

        from megatron.training.sdpa_attention import SDPACoreAttention
        module.dropout = 0.0
        module.forward = types.MethodType(SDPACoreAttention.forward, module)
        module.fp4_fallback_bf16 = True
    else:
        raise TypeError(f"no BF16 fallback for {type(module).__name__}")


def _fp4_modules(model_chunks):
    from fullstack_fp4.telemetry import module_recipe
    from fullstack_fp4.telemetry.collector import module_path

    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    return [(module_path(n), m) for c in chunks for n, m in c.named_modules()
            if module_recipe(m) is not None]


class PrecisionSchedule:
    """`fp4.bf16_from` in the training loop: :meth:`apply` after every step and on resume
    (module docstring)."""

    def __init__(self, cfg, *, log: bool = True):
        self.step = switch_step(cfg)
        self.value, self.iters = cfg.fp4.bf16_from, cfg.train.iters
        self.log = log
        self.switched: list[str] = []
        self.done = False

    def apply(self, model_chunks, iteration: int) -> list[str]:
        """Switch every FP4 module to BF16 once ``iteration`` (steps done) has reached the
        switch step; returns the names switched by this call."""
        if self.done or self.step is None or iteration < self.step:
            return []
        self.done = True
        mods = [(n, m) for n, m in _fp4_modules(model_chunks) if not getattr(m, "fp4_fallback_bf16", False)]
        for _, m in mods:
            switch_to_bf16(m)
        self.switched = [n for n, _ in mods]
        if self.log:
            how = (f"{self.value} of train.iters={self.iters}" if isinstance(self.value, float)
                   else f"{self.value}")
            print(f"[precision] iteration {iteration}: fp4.bf16_from={how}: steps {self.step + 1}.."
                  f"{self.iters} run in BF16 ({len(mods)} FP4 module(s) switched)", flush=True)
        return self.switched
