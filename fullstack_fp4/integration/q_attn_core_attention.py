"""megatron-core core-attention module running Q-Attn (``fp4.attention: q_attn``).

Drop-in for ``submodules.self_attention.submodules.core_attention`` of a layer spec (the slot
``DotProductAttention`` fills in the local spec). megatron-core builds it as
``core_attention(config=, layer_number=, attn_mask_type=, attention_type=, cp_comm_type=,
softmax_scale=, pg_collection=)`` and calls ``forward(query, key, value, attention_mask,
attn_mask_type=None, attention_bias=None, packed_seq_params=None)`` with q ``[sq, b, heads,
d]``, k/v ``[sk, b, groups, d]`` (RoPE already applied by the attention layer, so the
quantized views are of the rotated Q, K) and expects ``[sq, b, heads · d]``.

Layout, no copies: megatron's q, k, v are ``[s, b, h, d]`` views of the QKV projection output
(or RoPE's output). They are permuted — not copied — to Q-Attn's logical ``[b, h, s, d]``; the
Triton kernels read them through their strides, store O as ``[s, b, h, d]`` so that the
``[s, b, h·d]`` returned here is a view of it (the output projection saves that view: one copy
of O in memory, shared with Q-Attn's saved O), read dO in place, and store dQ, dK, dV as
``[s, b, h, d]`` tensors, which the QKV split's backward concatenates directly. The one copy
left: a V that is a view into the fused QKV buffer is compacted before it is saved for the
backward, so the buffer (Q and K in BF16) is not kept alive (``fullstack_fp4/attention/
layout.py``, ``function._kernel_v``; ``FP4_QATTN_SAVE_V_VIEW=1`` keeps the view instead).

Tensor parallelism: heads are split over the TP ranks; this module sees its partition's
``num_attention_heads / tp`` query heads and ``num_query_groups / tp`` KV heads. Q-Attn's
tensor scales are per (batch, head) (``fullstack_fp4/attention/quant.py``), so the numerics do
not depend on the TP degree and no communication is needed here.

Refused with a clear error (rather than silently computing something else): attention bias,
packed sequences (THD), attention dropout > 0, context parallelism > 1, and any mask other
than causal / no-mask (padding masks would need a mask input the kernels do not take).
"""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from fullstack_fp4.attention import q_attention


def _tp_size(pg_collection) -> int:
    if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
        return pg_collection.tp.size()
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_world_size()
    return 1


class QAttnCoreAttention(MegatronModule):
    """Core attention with NVFP4 ``QKᵀ`` and ``dS`` GEMMs (see module docstring)."""

    # q_attention's backend: None dispatches by device (Triton kernels on CUDA, the reference on
    # CPU); tests set "triton" to run the kernels under TRITON_INTERPRET on CPU
    backend = None

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None, **kwargs):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout and dropout > 0:
            raise ValueError(f"QAttnCoreAttention: attention dropout must be 0 (got {dropout}); "
                             "Q-Attn has no dropout path")
        if getattr(config, "context_parallel_size", 1) > 1:
            raise ValueError("QAttnCoreAttention: context parallelism is not supported")
        self._check_mask_type(attn_mask_type)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        tp = _tp_size(pg_collection)
        if config.num_attention_heads % tp:
            raise ValueError(f"num_attention_heads {config.num_attention_heads} not divisible by TP {tp}")
        self.heads_per_partition = config.num_attention_heads // tp
        groups = config.num_query_groups or config.num_attention_heads
        self.groups_per_partition = max(1, groups // tp)
        self.head_dim = config.kv_channels
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(self.head_dim)
        self.softmax_scale = softmax_scale
        # Megatron's apply_query_key_layer_scaling divides by layer_number before softmax and
        # multiplies back inside an FP32 softmax: a no-op on the probabilities, so ignored.

    @staticmethod
    def _check_mask_type(mask_type):
        if mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(f"QAttnCoreAttention supports causal and no_mask only, got {mask_type}")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("QAttnCoreAttention: attention_bias is not supported")
        if packed_seq_params is not None:
            raise ValueError("QAttnCoreAttention: packed sequences (THD) are not supported")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        self._check_mask_type(mask_type)
        sq, b, h, d = query.shape
        if h != self.heads_per_partition:
            raise ValueError(f"expected {self.heads_per_partition} heads per partition, got {h}")
        # [s, b, n, d] -> [b, n, s, d]: views; the kernels take the strides (module docstring)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        o = q_attention(q, k, v, causal=mask_type == AttnMaskType.causal,
                        softmax_scale=self.softmax_scale, backend=self.backend)
        # O is stored [s, b, h, d] (O's order follows q's): this reshape is a view
        return o.permute(2, 0, 1, 3).reshape(sq, b, h * d)
