"""Build the Llama-style megatron-core `GPTModel` a config describes.

RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases, untied embeddings. The layer spec
is megatron-core's local spec with the core attention swapped for `SDPACoreAttention`; FP4
recipes then rewrite each layer's spec (`recipes.convert_layer_spec`), so the layers never
branch on a flag. Modules named by `fp4.keep_bf16` (and the `bf16_first_layers` /
`bf16_last_layers` shorthands; megatron/training/precision.py) keep the BF16 spec; each
pipeline stage builds only its own layers.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                          get_num_layers_to_build)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron.training import precision, recipes
from megatron.training.config_schema import RunConfig
from megatron.training.sdpa_attention import SDPACoreAttention


def padded_vocab_size(vocab: int, cfg: RunConfig) -> int:
    multiple = cfg.model.make_vocab_size_divisible_by * cfg.parallel.tensor_model_parallel_size
    return ((vocab + multiple - 1) // multiple) * multiple


def transformer_config(cfg: RunConfig, *, use_cpu_initialization: bool,
                       perform_initialization: bool = True) -> TransformerConfig:
    m, p = cfg.model, cfg.parallel
    bf16 = cfg.train.precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.hidden_size // m.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,  # the fused bias-SwiGLU needs a bias; we have none
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_method_std,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        autocast_dtype=dtype,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        sequence_parallel=False,
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=perform_initialization,
        # megatron's own (BF16) linears: their fusion needs apex / TE. Ours (NVFP4, LoRA-SVD) fuse
        # by parallel.gradient_accumulation_fusion, through their layer specs (recipes.py)
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
        deallocate_pipeline_outputs=True,
        # per-layer checkpoint keys where LoRA-SVD's factors exist in some layers only
        # (precision.py, "Checkpoints"); megatron-core reads it in sharded_state_dict alone
        hetereogenous_dist_checkpoint=precision.layers_differ_in_state(cfg),
    )


def bf16_layer_spec():
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def block_spec(cfg: RunConfig, tconfig: TransformerConfig, pp_rank: int | None = None) -> TransformerBlockSubmodules:
    """One spec per layer of this pipeline stage, each converted by the configured recipes."""
    base = bf16_layer_spec()
    offset = get_transformer_layer_offset(tconfig, pp_rank=pp_rank)
    n = get_num_layers_to_build(tconfig, pp_rank=pp_rank)
    kept = precision.bf16_module_names(cfg)
    specs = []
    for i in range(offset, offset + n):
        spec = copy.deepcopy(base)
        keep = precision.kept_slots(kept, i)
        specs.append(spec if keep == frozenset(precision.SLOTS)
                     else recipes.convert_layer_spec(spec, cfg, layer_index=i, keep_bf16=keep))
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=base.submodules.input_layernorm)


def build_model(cfg: RunConfig, vocab_size: int, *, pre_process: bool = True, post_process: bool = True,
                pp_rank: int | None = None, use_cpu_initialization: bool | None = None,
                perform_initialization: bool = True) -> GPTModel:
    if use_cpu_initialization is None:
        use_cpu_initialization = not torch.cuda.is_available()
    tconfig = transformer_config(cfg, use_cpu_initialization=use_cpu_initialization,
                                 perform_initialization=perform_initialization)
    model = GPTModel(
        config=tconfig,
        transformer_layer_spec=block_spec(cfg, tconfig, pp_rank),
        vocab_size=padded_vocab_size(vocab_size, cfg),
        max_sequence_length=cfg.model.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope" if cfg.model.position_embedding == "rope" else "learned_absolute",
        rotary_base=cfg.model.rotary_base,
    )
    recipes.after_model_build(model, cfg)
    return model


def count_parameters(cfg: RunConfig, vocab_size: int) -> dict:
    """Parameter counts from the shapes alone (what --dry-run prints, also on a meta model)."""
    m = cfg.model
    h, f, L = m.hidden_size, m.ffn_hidden_size, m.num_layers
    d = h // m.num_attention_heads
    v = padded_vocab_size(vocab_size, cfg)
    attn = h * (h + 2 * m.num_query_groups * d) + h * h
    mlp = h * 2 * f + f * h
    per_layer = attn + mlp + 2 * h
    emb = v * h + (m.seq_length * h if m.position_embedding == "learned" else 0)
    total = L * per_layer + h + emb + v * h
    if cfg.fp4.linear == "lora_svd":  # factors L2 [out, r] and L1 [r, in] beside each W_res
        r, qkv_out = cfg.fp4.lora_svd.rank, h + 2 * m.num_query_groups * d
        sides = {"self_attention.linear_qkv": h + qkv_out, "self_attention.linear_proj": h + h,
                 "mlp.linear_fc1": h + 2 * f, "mlp.linear_fc2": f + h}
        kept = precision.bf16_module_names(cfg)
        lora = sum(r * sides[s] for i in range(L) for s in sides
                   if f"decoder.layers.{i}.{s}" not in kept)
        total += lora
        return {"total": total, "embedding": emb, "output_layer": v * h,
                "transformer": L * per_layer + h + lora}
    return {"total": total, "embedding": emb, "output_layer": v * h, "transformer": L * per_layer + h}


def flops_per_token(cfg: RunConfig, vocab_size: int) -> float:
    """Model FLOPs per trained token (forward + backward = 3x forward), causal attention.

    Matmuls: 6 x (transformer matrices + output layer). Attention scores and PV: per layer
    4·s·h forward, halved by the causal mask, times 3 for backward: 6·s·h.
    """
    m = cfg.model
    c = count_parameters(cfg, vocab_size)
    matmul_params = c["transformer"] - m.num_layers * 2 * m.hidden_size - m.hidden_size + c["output_layer"]
    return 6.0 * matmul_params + 6.0 * m.num_layers * m.seq_length * m.hidden_size
