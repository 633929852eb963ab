"""Q-AdamW reads megatron's BF16 grad buffer in place (`parallel.grad_reduce_in_fp32=false`).

With `grad_reduce_in_fp32=false` megatron-core's DDP keeps one BF16 grad buffer (2 B/param
instead of 4), but its wrappers then copy ``main_grad.float()`` into every FP32 main param's
`.grad` before the step (Float16OptimizerWithFloat16Params and DistributedOptimizer
`_copy_model_grads_to_main_grads`), which allocates the FP32 grads after all. Megatron-core's own
way out, the precision-aware optimizer (`use_precision_aware_optimizer`), also moves the main
params into the optimizer (TE FusedAdam); here only its gradient half is taken:

- `_copy_model_grads_to_main_grads` sets ``main.decoupled_grad`` (`QAdamW.GRAD_ATTR`) to the BF16
  buffer view itself — the param's `main_grad`, or for the distributed optimizer this rank's
  slice ``main_grad.view(-1)[start:end]`` — and leaves ``main.grad`` None. No copy.
- grad norm, clipping, zero-count and zero_grad read that attribute, as megatron-core does with
  `use_decoupled_grad=True`. The norm accumulates each tensor in FP32
  (``vector_norm(g, dtype=float32)``), so it is the FP32-buffer run's norm for the same values
  up to the order of the FP32 sum: the same bits on the CPU (test_bf16_grads.py), the last bits
  can differ on CUDA. megatron-core's fallback `multi_tensor_l2norm` without apex would take a
  BF16 norm per tensor.
  Clipping scales the BF16 grads in place: FP32 product, one rounding to BF16.
- `QAdamW` reads ``decoupled_grad`` when set (`grad_of`) and converts to FP32 on load: a BF16
  value is exact in FP32, so given the same BF16 values the step is bit for bit the FP32-grad
  step.

The methods are bound on the wrapper *instances* (megatron's classes stay untouched) and the
wrapper is marked ``fp4_bf16_grads = True``; `guards.py` clips through `clip_by_total_norm`.
A `ChainedOptimizer` around the wrappers gets its norm and `step()` bound the same way.

The numbers: the grad values equal the FP32-buffer run's only where no sum happens in the buffer
— one micro-batch per step and DP = 1. Accumulating micro-batches (`main_grad += grad`) and the
DP reduction then run in BF16, megatron-core's default behaviour, so the values differ.
"""
from __future__ import annotations

import types

import torch
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, count_zeros_fp32
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import (ChainedOptimizer, Float16OptimizerWithFloat16Params,
                                               _zero_grad_group_helper)
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from fullstack_fp4.integration.wrappers import model_main_pairs
from fullstack_fp4.optim.q_adamw.optimizer import GRAD_ATTR

__all__ = ["read_bf16_grads_in_place", "uses_decoupled_grads", "grad_norm_fp32",
           "clip_by_total_norm"]


def uses_decoupled_grads(wrapper) -> bool:
    """Whether ``wrapper``'s main params hold their grads in ``decoupled_grad`` (ours, or
    megatron-core's precision-aware optimizer)."""
    return bool(getattr(wrapper, "fp4_bf16_grads", False)
                or getattr(getattr(wrapper, "config", None),
                           "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))


def clip_by_total_norm(optimizer, grad_norm: float) -> None:
    """Clip every sub-optimizer of ``optimizer`` (a ChainedOptimizer or one wrapper) by the
    already computed total norm, as megatron-core's step() does, each through the attribute its
    grads sit in (``decoupled_grad`` for BF16 grads read in place, else ``.grad``)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        params = opt.get_parameters()
        if params and opt.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                                         use_decoupled_grad=uses_decoupled_grads(opt))


def grad_norm_fp32(grads: list, group) -> float:
    """The L2 norm of all ``grads`` (any float dtype) over ``group``, accumulated in FP32:
    megatron-core's `get_grad_norm_fp32` (norm_type 2) without its per-tensor BF16 norms."""
    if grads:
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
        total = (torch.linalg.vector_norm(norms) ** 2.0).reshape(1)
    else:
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        total = torch.zeros(1, dtype=torch.float32, device=dev)
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=group)
    return total.item() ** (1.0 / 2.0)


# ------------------------------------------------------------------ methods bound on a wrapper
def _copy_model_grads_to_main_grads(self):
    if self.is_stub_optimizer:
        return
    distopt = isinstance(self, DistributedOptimizer)
    for model_param, main in model_main_pairs(self):
        g = getattr(model_param, "main_grad", None)
        if g is None:   # not in a DDP grad buffer (megatron falls back to `.grad` there too)
            g = model_param.grad
        if g is not None and distopt:
            rng = self._get_model_param_range_map(model_param)["param"]
            g = g.view(-1)[rng.start:rng.end]
        setattr(main, GRAD_ATTR, g)
        main.grad = None
        if model_param is not main:
            model_param.grad = None   # as megatron does after its copy


def _get_main_grads_for_grad_norm(self):
    # megatron-core's filter (not shared, not a TP duplicate), reading the decoupled grad
    tp_group = getattr(self, "tp_group", None)
    return [getattr(p, GRAD_ATTR) for p in self.get_parameters()
            if getattr(p, GRAD_ATTR, None) is not None and param_is_not_shared(p)
            and param_is_not_tensor_parallel_duplicate(p, tp_group)]


@torch.no_grad()
def _get_grad_norm(self):
    return grad_norm_fp32(self.get_main_grads_for_grad_norm(), self.get_grad_stats_parallel_group())


def _clip_grad_norm(self, clip_grad: float) -> float:
    grad_norm = self.get_grad_norm()
    params = self.get_parameters()
    if params:
        clip_grad_by_total_norm_fp32(params, clip_grad, grad_norm, use_decoupled_grad=True)
    return grad_norm


def _count_zeros(self) -> float:
    return count_zeros_fp32(self.get_parameters(),
                            grad_stats_parallel_group=self.get_grad_stats_parallel_group(),
                            use_decoupled_grad=True, tp_group=getattr(self, "tp_group", None))


def _collect_main_grad_data_for_unscaling(self):
    # a grad scaler (fp16 loss scaling) unscales what the optimizer will read
    return [getattr(p, GRAD_ATTR).data for p in self.get_parameters()
            if getattr(p, GRAD_ATTR, None) is not None]


def _zero_grad(self, set_to_none: bool = True, _megatron=None):
    _megatron(set_to_none)
    if not self.is_stub_optimizer:
        _zero_grad_group_helper(self.get_parameters(), set_to_none, use_decoupled_grad=True)


# ------------------------------------------------------------------ ChainedOptimizer
@torch.no_grad()
def _chained_get_grad_norm(self, _megatron=None):
    subs = self.chained_optimizers
    if len(subs) == 1 or not self.grads_states_parallel_group_is_shared():
        return _megatron()   # per-sub norms: each sub's own (bound) get_grad_norm
    grads = [g for o in subs for g in o.get_main_grads_for_grad_norm()]
    return grad_norm_fp32(grads, self.get_grad_stats_parallel_group())


@torch.no_grad()
def _chained_step(self):
    """megatron-core's ChainedOptimizer.step, clipping each sub through the attribute it uses."""
    if self.prepare_grads():
        return False, None, None
    grad_norm = self.get_grad_norm()
    clip_by_total_norm(self, grad_norm)
    num_zeros = None
    if self.config.log_num_zeros_in_grad:
        num_zeros = sum(o.count_zeros() for o in self.chained_optimizers)
    return self.step_with_ready_grads(), grad_norm, num_zeros


def _bind(obj, name: str, fn, **partial) -> None:
    if partial:
        impl = fn

        def fn(self, *a, _impl=impl, **kw):
            return _impl(self, *a, **partial, **kw)
    setattr(obj, name, types.MethodType(fn, obj))


def read_bf16_grads_in_place(optimizer) -> int:
    """Make every Float16 / distributed megatron wrapper in ``optimizer`` hand its inner
    optimizer the grad buffer's BF16 views as ``decoupled_grad`` (module docstring). Returns the
    number of wrappers changed (FP32Optimizer and stubs are left alone: an FP32 grad buffer is
    already read without a copy)."""
    subs = list(optimizer.chained_optimizers) if isinstance(optimizer, ChainedOptimizer) \
        else [optimizer]
    changed = 0
    for w in subs:
        if not isinstance(w, (Float16OptimizerWithFloat16Params, DistributedOptimizer)) \
                or w.is_stub_optimizer:
            continue
        _bind(w, "_copy_model_grads_to_main_grads", _copy_model_grads_to_main_grads)
        _bind(w, "get_main_grads_for_grad_norm", _get_main_grads_for_grad_norm)
        _bind(w, "get_grad_norm", _get_grad_norm)
        _bind(w, "clip_grad_norm", _clip_grad_norm)
        _bind(w, "count_zeros", _count_zeros)
        _bind(w, "_collect_main_grad_data_for_unscaling", _collect_main_grad_data_for_unscaling)
        _bind(w, "zero_grad", _zero_grad, _megatron=w.zero_grad)
        w.fp4_bf16_grads = True
        changed += 1
    if changed and isinstance(optimizer, ChainedOptimizer):
        _bind(optimizer, "get_grad_norm", _chained_get_grad_norm, _megatron=optimizer.get_grad_norm)
        _bind(optimizer, "step", _chained_step)
    return changed
