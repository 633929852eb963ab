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

BF16 switch (the telemetry fallback `fp4.fallback=bf16`, docs/telemetry.md, and the precision
schedule `fp4.bf16_from` of the training loop): `switch_module_to_bf16(m)` sets the
per-instance flag `m.fp4_fallback_bf16`; `_forward_impl` then takes megatron-core's own path
(`linear_with_grad_accumulation_and_async_allreduce`, in the params' dtype). The flag is part
of `fullstack_fp4.telemetry.fallback_state(model)`, which the trainer keeps in the checkpoint.

Block-scale rules (`fp4.linear_scale_rule`, the constructor's `scale_rule`): `"6"` or `"4over6"`
per operand (x, w, dy), passed to `nvfp4_linear` (fullstack_fp4/linear/nvfp4_linear.py, "Scale
rules"); the TP amax reduction is the same for both.

Gradient-accumulation fusion (`parallel.gradient_accumulation_fusion`, the constructor's
`fuse_wgrad_accumulation`, default on): inside megatron-core's DDP every parameter has a
`main_grad` (its view of the FP32 or BF16 grad buffer where micro-batches and DP ranks are
summed) and a `grad_added_to_main_grad` flag. Then the NVFP4 wgrad epilogue adds
`acc·(ts_a·ts_b)` straight into `weight.main_grad` (`MainGradAccumulator`), rounded once, instead
of writing a BF16 dW that DDP's backward hook adds in a second pass
(`param.main_grad.add_(param.grad)`). This is megatron-core's own protocol for its apex-fused
linears (`LinearWithGradAccumulationAndAsyncCommunication.backward`): set
`grad_added_to_main_grad = True`, so that the hook, which still runs for the parameter, does
not add again (DDP resets the flag in `zero_grad_buffer`, once per step, so micro-batches 2..n
keep adding), and hand autograd a placeholder `torch.empty` gradient. Why a placeholder and not
None: autograd still runs the parameter's accumulation node and DDP's hook for None, but under
`overlap_grad_reduce` the hook asserts `param.grad is not None` before it marks the parameter
ready in its bucket (the signal that starts the bucket's all-reduce), so every fused parameter
must deliver some gradient; `torch.empty` costs an allocation and no memory traffic, and the hook
drops it (`param.grad = None`). It has the weight's dtype so that autograd does not cast it.
Megatron's own linears keep `config.gradient_accumulation_fusion=False` (theirs needs apex); the
BF16 fallback path therefore stays unfused.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from fullstack_fp4.linear import nvfp4_linear
from fullstack_fp4.linear.nvfp4_linear import scale_rules
from fullstack_fp4.linear.partial_nvfp4 import check_kept, partial_nvfp4_linear


class MainGradAccumulator:
    """megatron-core's gradient-accumulation-fusion protocol for one weight, as the NVFP4 /
    LoRA-SVD backward's `WgradAccumulator` (module docstring): add into `weight.main_grad`,
    then flag it and return a placeholder gradient."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.nn.Parameter):
        self.weight = weight

    def buffer(self) -> torch.Tensor:
        return self.weight.main_grad   # read at backward time, as DDP's hook reads it

    def accumulated(self) -> torch.Tensor:
        w = self.weight
        w.grad_added_to_main_grad = True
        return torch.empty(w.main_grad.shape, dtype=w.dtype, device=w.main_grad.device)


def main_grad_accumulator(weight, enabled: bool):
    """A `MainGradAccumulator` when the wgrad can be fused into megatron's grad buffer: fusion
    `enabled`, a backward will run (grad mode, trainable weight) and `weight` is inside
    megatron-core's DDP (it has `main_grad` and `grad_added_to_main_grad`); else None (dW is
    returned as usual, e.g. outside DDP, in evaluation, or fusion off)."""
    if not (enabled and torch.is_grad_enabled() and weight.requires_grad):
        return None
    if not (hasattr(weight, "main_grad") and hasattr(weight, "grad_added_to_main_grad")):
        return None
    return MainGradAccumulator(weight)


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

    def __init__(self, *args, fuse_wgrad_accumulation: bool = True, unquantized_operands=(),
                 scale_rule="6", **kwargs):
        super().__init__(*args, **kwargs)
        if self.sequence_parallel:
            raise ValueError(f"{type(self).__name__} does not support sequence parallelism")
        # not megatron's `gradient_accumulation_fusion` attribute: that one stays False (its
        # fusion needs apex) and is what the BF16 fallback path passes to megatron-core
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        # diagnostic (`fp4.unquantized_operands`): these operands skip quantization, FP64 GEMMs
        self.unquantized_operands = check_kept(unquantized_operands)
        self.scale_rule = scale_rules(scale_rule)   # fp4.linear_scale_rule

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
        reduce = _amax_reducer(self.tp_group)
        accumulator = main_grad_accumulator(weight, self.fuse_wgrad_accumulation)
        if self.unquantized_operands:
            return partial_nvfp4_linear(input, weight, bias, keep=self.unquantized_operands,
                                        amax_reduce=reduce, wgrad_accumulator=accumulator,
                                        scale_rule=self.scale_rule)
        return nvfp4_linear(input, weight, bias, amax_reduce=reduce, wgrad_accumulator=accumulator,
                            scale_rule=self.scale_rule)


def switch_module_to_bf16(module) -> None:
    """Make an NVFP4 column/row-parallel linear run megatron-core's high-precision GEMM from now on."""
    if not isinstance(module, (NVFP4ColumnParallelLinear, NVFP4RowParallelLinear)):
        raise TypeError(f"not an NVFP4 parallel linear: {type(module).__name__}")
    module.fp4_fallback_bf16 = True


class NVFP4ColumnParallelLinear(_NVFP4LocalGEMM, ColumnParallelLinear):
    pass


class NVFP4RowParallelLinear(_NVFP4LocalGEMM, RowParallelLinear):
    _row_parallel = True


def nvfp4_layer_specs(fuse_wgrad_accumulation: bool = True, unquantized_operands=(), scale_rule="6"):
    """(column, row) `ModuleSpec`s of the NVFP4 linears carrying the trainer's settings
    (`parallel.gradient_accumulation_fusion`, the diagnostic `fp4.unquantized_operands`,
    `fp4.linear_scale_rule`) into their constructors."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    params = dict(fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                  unquantized_operands=tuple(unquantized_operands),
                  scale_rule=scale_rules(scale_rule))
    return (ModuleSpec(module=NVFP4ColumnParallelLinear, params=dict(params)),
            ModuleSpec(module=NVFP4RowParallelLinear, params=dict(params)))
