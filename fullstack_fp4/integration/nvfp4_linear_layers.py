"""megatron-core column- and row-parallel linears whose local GEMMs run in NVFP4.

The layer spec swaps `ColumnParallelLinear` / `RowParallelLinear` for these subclasses; all of
megatron-core's tensor-parallel plumbing (weight sharding and init, `sharded_state_dict`, the
TP communication around the local GEMM) is inherited unchanged. Only `_forward_impl`, the
local `x @ Wᵀ`, is replaced by `fullstack_fp4.linear.nvfp4_linear`.

Tensor parallelism: every rank must quantize with one tensor scale per logical tensor, so each
operand's amax is all-reduced (MAX) over the TP group before quantizing (`amax_reduce`). For a
column-parallel layer without sequence parallelism megatron-core skips the identity-forward /
all-reduce-backward op on the input and expects `_forward_impl` to all-reduce dgrad
(`allreduce_dgrad=True`); we reproduce that with `copy_to_tensor_model_parallel_region`.
Sequence parallelism is not supported (refused at construction).

BF16 fallback (`fp4.fallback=bf16`, docs/telemetry.md): `switch_module_to_bf16(m)` sets the
per-instance flag `m.fp4_fallback_bf16`; `_forward_impl` then takes megatron-core's own path
(`linear_with_grad_accumulation_and_async_allreduce`, in the params' dtype). The flag is part
of `fullstack_fp4.telemetry.fallback_state(model)`, which the trainer keeps in the checkpoint.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from fullstack_fp4.linear import nvfp4_linear


def _amax_reducer(tp_group):
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return None

    def reduce(amax: torch.Tensor) -> torch.Tensor:
        amax = amax.clone()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp_group)
        return amax

    return reduce


class _NVFP4LocalGEMM:
    """Mixin placed before megatron-core's parallel linear: only the local GEMM changes."""

    _row_parallel = False  # row-parallel input is already split along K: no dgrad all-reduce

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.sequence_parallel:
            raise ValueError(f"{type(self).__name__} does not support sequence parallelism")

    def _forward_impl(self, input, weight, *args, **kwargs):
        if getattr(self, "fp4_fallback_bf16", False):  # switched by the BF16 fallback
            return super()._forward_impl(input, weight, *args, **kwargs)
        return self._nvfp4_forward_impl(input, weight, **kwargs)

    def _nvfp4_forward_impl(self, input, weight, bias=None, *, allreduce_dgrad=False, sequence_parallel=False,
                            **unused):
        if sequence_parallel:
            raise ValueError("NVFP4 linears do not support sequence parallelism")
        if allreduce_dgrad and not self._row_parallel:
            input = copy_to_tensor_model_parallel_region(input, group=self.tp_group)
        return nvfp4_linear(input, weight, bias, amax_reduce=_amax_reducer(self.tp_group))


def switch_module_to_bf16(module) -> None:
    """Make an NVFP4 column/row-parallel linear run megatron-core's high-precision GEMM from now on."""
    if not isinstance(module, (NVFP4ColumnParallelLinear, NVFP4RowParallelLinear)):
        raise TypeError(f"not an NVFP4 parallel linear: {type(module).__name__}")
    module.fp4_fallback_bf16 = True


class NVFP4ColumnParallelLinear(_NVFP4LocalGEMM, ColumnParallelLinear):
    pass


class NVFP4RowParallelLinear(_NVFP4LocalGEMM, RowParallelLinear):
    _row_parallel = True
