"""Which params megatron-core's optimizer wrappers hand their inner optimizer.

Shared by the optimizer conversion (optimizers.py) and the methods it binds on a wrapper
(bf16_grads.py, lora_grad_norm.py); depends on megatron-core only.
"""
from __future__ import annotations

from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import (ChainedOptimizer, FP32Optimizer,
                                               Float16OptimizerWithFloat16Params)

__all__ = ["megatron_wrappers", "model_main_pairs", "main_to_model", "inner_params",
           "converted_wrappers"]


def megatron_wrappers(optimizer) -> list:
    """The wrappers of a (possibly chained) megatron-core optimizer."""
    if isinstance(optimizer, ChainedOptimizer):
        return list(optimizer.chained_optimizers)
    return [optimizer]


def model_main_pairs(wrapper):
    """(model param, the main param the inner optimizer sees for it): megatron's
    DistributedOptimizer its FP32 shards (only the params of which this DP rank holds a piece),
    Float16OptimizerWithFloat16Params its FP32 copies (FP32 params: themselves), FP32Optimizer
    the model params themselves."""
    if isinstance(wrapper, DistributedOptimizer):
        for mgs, sgs in ((wrapper.model_float16_groups, wrapper.shard_fp32_from_float16_groups),
                         (wrapper.model_fp32_groups, wrapper.shard_fp32_groups)):
            for mg, sg in zip(mgs, sgs):
                yield from ((mp, sp) for mp, sp in zip(mg, sg) if sp is not None)
    elif isinstance(wrapper, Float16OptimizerWithFloat16Params):
        for g16, g32 in zip(wrapper.float16_groups, wrapper.fp32_from_float16_groups):
            yield from zip(g16, g32)
        for g in wrapper.fp32_from_fp32_groups:
            yield from ((p, p) for p in g)
    elif isinstance(wrapper, FP32Optimizer):
        yield from ((p, p) for g in wrapper.optimizer.param_groups for p in g["params"])
    else:
        raise TypeError(f"no main-param map for {type(wrapper).__name__}")


def main_to_model(wrapper) -> dict:
    """id(main param (or shard) the inner optimizer sees) -> model param."""
    return {id(main): mp for mp, main in model_main_pairs(wrapper)}


def inner_params(wrapper) -> list:
    """The inner optimizer's params in `state_dict` order (what the payload's lists follow)."""
    return [p for g in wrapper.optimizer.param_groups for p in g["params"]]


def converted_wrappers(optimizer) -> list:
    """The megatron wrappers whose inner optimizer `convert_optimizer` replaced."""
    return [w for w in megatron_wrappers(optimizer) if getattr(w, "fp4_converted", False)]
