"""Q-AdamW writes the BF16 model params in its fused step (megatron's main -> model copy, fused).

megatron-core's Float16OptimizerWithFloat16Params and DistributedOptimizer keep FP32 main params
for the inner optimizer and, after ``optimizer.step()``, copy every main param into its BF16
model param (`_copy_main_params_to_model_params`): a separate pass reading 4 B and writing 2 B
per parameter (0.87 ms of an 8.8 ms optimizer phase for 600M params on the H200). Megatron's
precision-aware optimizer (TE FusedAdam with master weights) writes the model param inside the
optimizer kernel instead; here QAdamW does the same:

- Once, after the wrapper is built: every FP32 main param of a BF16 model param gets
  ``fp4_model_param_out`` (`MODEL_OUT_ATTR`) = exactly the memory megatron's copy writes it to —
  the model param itself (Float16 wrapper), or for the distributed optimizer the slice
  ``bucket.param_data.view(-1)[gbuf_world_in_bucket]`` of the DDP param buffer, which is this
  rank's piece of the model param (``model_param.view(-1)[param range]``, the buffer the param
  all-gather then reads; also with ``overlap_param_gather``, whose gather starts after the step).
- QAdamW's step of a quantized param writes ``p_new.to(bfloat16)`` there (kernel: in the same
  pass; CPU reference: ``copy_``) and records it (`model_param_written`).
- `_copy_main_params_to_model_params`, bound on the wrapper instance, is megatron's copy less
  the params whose record stands: the small params QAdamW steps with FP32 moments
  (``min_numel``), params without a grad, FP16 model params — all others are copied as before.
  Every copy call consumes the records, and any in-place write to a main param after its step
  (a checkpoint load's ``copy_``) invalidates its record, so a load that rewrites the main
  params and then copies them to the model params (our converted wrapper's ``load_state_dict``)
  copies everything. megatron's ``reload_model_params`` (model -> main) is untouched.

Not enabled (megatron's copy stays as it is) where that copy does more than copy: FP8 model
params (quantized per shard), Megatron-FSDP, the precision-aware optimizer, MXFP8 param
all-gather through the grad buffer (``reuse_grad_buf_for_mxfp8_param_ag``).
"""
from __future__ import annotations

import types

import torch
from megatron.core.fp8_utils import is_float8tensor
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import (ChainedOptimizer, Float16OptimizerWithFloat16Params,
                                               _multi_tensor_copy_this_to_that)

from fullstack_fp4.optim.q_adamw import QAdamW
from fullstack_fp4.optim.q_adamw.optimizer import (MODEL_OUT_ATTR, MODEL_WRITTEN_ATTR,
                                                   model_param_written)

__all__ = ["write_model_params_in_step", "megatron_copy_targets"]


def _distopt_destination(wrapper, model_param) -> torch.Tensor:
    """This rank's piece of ``model_param`` in the DDP param buffer: the slice megatron's
    DistributedOptimizer._copy_main_params_to_model_params writes the main shard to."""
    world_range = wrapper._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
    gbuf_index, _, bucket_id = wrapper.model_param_gbuf_map[model_param]
    param_data = wrapper.buffers[gbuf_index].buckets[bucket_id].param_data
    return param_data.view(-1)[world_range.start:world_range.end]


def megatron_copy_targets(wrapper) -> list:
    """``[(main param, model memory)]``: every copy megatron's `_copy_main_params_to_model_params`
    makes, in its order (the distributed optimizer also copies its FP32 shards, views of the
    param buffer, onto themselves)."""
    if isinstance(wrapper, DistributedOptimizer):
        groups = ((wrapper.shard_fp32_from_float16_groups, wrapper.model_float16_groups),
                  (wrapper.shard_fp32_groups, wrapper.model_fp32_groups))
        return [(main, _distopt_destination(wrapper, mp))
                for mains, models in groups for sg, mg in zip(mains, models)
                for main, mp in zip(sg, mg)]
    return [(main, mp.detach()) for g16, g32 in zip(wrapper.float16_groups,
                                                    wrapper.fp32_from_float16_groups)
            for mp, main in zip(g16, g32)]


def _fusable(wrapper) -> bool:
    """A Float16 / distributed wrapper around QAdamW whose main -> model copy is a plain copy."""
    if not isinstance(wrapper, (Float16OptimizerWithFloat16Params, DistributedOptimizer)) \
            or wrapper.is_stub_optimizer or not isinstance(wrapper.optimizer, QAdamW):
        return False
    cfg = wrapper.config
    if getattr(cfg, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False) \
            or getattr(cfg, "reuse_grad_buf_for_mxfp8_param_ag", False):
        return False
    if isinstance(wrapper, DistributedOptimizer):
        if wrapper.ddp_config.use_megatron_fsdp:
            return False
        if any(is_float8tensor(mp) for g in wrapper.model_float16_groups for mp in g):
            return False
    return True


def _takes_model_out(main: torch.Tensor, dest: torch.Tensor) -> bool:
    # the kernel writes main.numel() BF16 entries at dest's address
    return (dest.dtype == torch.bfloat16 and main.dtype == torch.float32
            and dest.numel() == main.numel() and dest.is_contiguous()
            and dest.device == main.device)


def _copy_main_params_to_model_params(self):
    """megatron's main -> model copy, less the params whose BF16 copy QAdamW's step wrote."""
    if self.is_stub_optimizer:
        return
    mains, dests = [], []
    for main, dest in self.fp4_copy_targets:
        if not model_param_written(main):
            mains.append(main.data)
            dests.append(dest.data)
        setattr(main, MODEL_WRITTEN_ATTR, None)     # a record serves one copy
    if isinstance(self, DistributedOptimizer):
        for main, dest in zip(mains, dests):       # megatron: per-shard copy_
            dest.copy_(main)
    else:
        _multi_tensor_copy_this_to_that(this=mains, that=dests,
                                        overflow_buf=self._dummy_overflow_buf)


def write_model_params_in_step(optimizer) -> int:
    """Make QAdamW write the BF16 model params in its step for every Float16 / distributed
    megatron wrapper in ``optimizer`` that holds one and BF16 model params (module docstring).
    Returns the number of wrappers changed; each is marked ``fp4_model_write = True``."""
    subs = list(optimizer.chained_optimizers) if isinstance(optimizer, ChainedOptimizer) \
        else [optimizer]
    changed = 0
    for w in subs:
        if not _fusable(w):
            continue
        targets = megatron_copy_targets(w)
        fused = [(main, dest) for main, dest in targets if _takes_model_out(main, dest)]
        if not fused:       # e.g. FP32 model params: megatron's copy stays as it is
            continue
        for main, dest in fused:
            setattr(main, MODEL_OUT_ATTR, dest)
        w.fp4_copy_targets = targets
        w._copy_main_params_to_model_params = types.MethodType(_copy_main_params_to_model_params, w)
        w.fp4_model_write = True
        changed += 1
    return changed
