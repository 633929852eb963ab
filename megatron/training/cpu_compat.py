"""Run megatron-core's training machinery on a machine without CUDA.

megatron-core 0.16.1 hard-codes CUDA in its training machinery (about 175
`torch.cuda.current_device()` calls): DDP grad buffers, the optimizers' `found_inf` /
`_scale` tensors (`device='cuda'` literals), grad-norm clipping, parameter type checks that
expect `'torch.cuda.FloatTensor'`, and `torch.cuda.synchronize()` in the checkpoint writer.
The model code itself runs on CPU. Rather than fork those files, we redirect exactly these
CUDA entry points to the CPU, once, at start-up, and only when no CUDA device exists:

| entry point                              | on CPU becomes                                   |
| ---------------------------------------- | ------------------------------------------------ |
| `torch.cuda.current_device()`            | `torch.device("cpu")`                            |
| `torch.cuda.synchronize()`               | no-op                                            |
| `Tensor.cuda(...)`                       | the tensor itself                                |
| `torch.{tensor,zeros,empty,ones,full,arange}(device='cuda...')` | the same on `cpu`        |
| `Tensor.type()` (no argument)            | the CUDA type name, so `'torch.cuda.FloatTensor'` checks pass |

One more thing is done before megatron-core is imported, by `import_megatron_core()`: its
`jit_fuser` (`torch.compile`, decorating about 40 fused elementwise helpers at import time) is
set to megatron-core's own no-op, as its `disable_jit_fuser()` does. The first decoration
imports TorchInductor: ~1.5-2 s of every process start on a 2-core CPU, and the test suite
starts many training processes. None of those helpers ran in our CPU runs (checked by counting
calls to the decorated functions in BF16, FP32, NVFP4-linear + Q-Attn and LoRA-SVD + Q-AdamW
runs: none), and a call would run the same arithmetic eagerly instead of through Inductor's
CPU code generator.

Why this and not a `TorchFunctionMode`: a mode intercepts every op of every step; patching
the few factory functions costs nothing on the hot path. Why in the product and not only in
tests: the quickstart and CI train through the same megatron-core DDP / optimizer /
dist_checkpointing code path as a GPU run, so a CPU run tests what a GPU run executes.

Nothing here runs when `torch.cuda.is_available()`; `enable()` is idempotent and `disable()`
restores every patched attribute (the tests use both).
"""
from __future__ import annotations

import functools
import sys

import torch

_PATCHED: list[tuple[object, str, object]] = []
_FACTORIES = ("tensor", "zeros", "empty", "ones", "full", "arange", "zeros_like", "empty_like")


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, int) and not isinstance(dev, bool)  # a bare ordinal means a CUDA device


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapper


def _tensor_type(orig):
    @functools.wraps(orig)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = orig(self)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        return orig(self, dtype, non_blocking, **kwargs)

    return type_


def _patch(owner, name, value) -> None:
    _PATCHED.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def enabled() -> bool:
    return bool(_PATCHED)


def enable() -> bool:
    """Redirect megatron-core's CUDA entry points to the CPU. Returns True if it did."""
    if _PATCHED or torch.cuda.is_available():
        return False
    _patch(torch.cuda, "current_device", lambda: torch.device("cpu"))
    _patch(torch.cuda, "synchronize", lambda *a, **k: None)
    _patch(torch.Tensor, "cuda", lambda self, *a, **k: self)
    _patch(torch.Tensor, "type", _tensor_type(torch.Tensor.type))
    for name in _FACTORIES:
        _patch(torch, name, _cpu_factory(getattr(torch, name)))
    return True


def disable() -> None:
    while _PATCHED:
        owner, name, orig = _PATCHED.pop()
        setattr(owner, name, orig)


def _no_compile(model=None, **_kwargs):
    return model if model is not None else (lambda fn: fn)


def import_megatron_core() -> None:
    """Import megatron-core; without CUDA, with its `jit_fuser` already the no-op (see above).

    `megatron/core/jit.py` reads `torch.compile` once, while `import megatron.core` runs, and
    the helpers imported later take its `jit_fuser` from there. So `torch.compile` is the
    identity only during that import, then restored for everyone else."""
    if "megatron.core" in sys.modules or torch.cuda.is_available():
        return
    real = torch.compile
    torch.compile = _no_compile
    try:
        import megatron.core  # noqa: F401
        from megatron.core import jit

        jit.disable_jit_fuser()
    finally:
        torch.compile = real
