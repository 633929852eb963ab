"""BF16 core attention for the layer spec, through `F.scaled_dot_product_attention`.

megatron-core's local `DotProductAttention` materialises the full score matrix and takes its
buffer from a global CUDA memory pool; this module hands Q, K, V to PyTorch's SDPA instead,
which picks the flash kernel on a GPU and a fused CPU kernel otherwise. GQA is handled by
SDPA's `enable_gqa` (no K/V head replication in memory).

Layouts (megatron's): q `[sq, b, heads, d]`, k/v `[sk, b, groups, d]`, out `[sq, b, heads*d]`.
Causal masking only (the GPT case); anything else is refused with a clear error rather than
silently ignored.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class SDPACoreAttention(MegatronModule):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **kwargs):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention does not support context parallelism")
        self.attn_mask_type = attn_mask_type
        d = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        mask_type = attn_mask_type or self.attn_mask_type
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPACoreAttention supports neither attention_bias nor packed sequences")
        if mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPACoreAttention supports causal masks only, got {mask_type}")
        sq, b, h, d = query.shape
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale,
            dropout_p=self.dropout if self.training else 0.0, enable_gqa=k.shape[1] != h)
        return out.permute(2, 0, 1, 3).reshape(sq, b, h * d)
