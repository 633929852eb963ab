"""Run megatron-core's training machinery on a machine without CUDA, changing only megatron-core's calls.

megatron-core 0.16.1 hard-codes CUDA in its training machinery (about 175
`torch.cuda.current_device()` calls): DDP grad buffers, the optimizers' `found_inf` /
`_scale` tensors (`device='cuda'` literals), grad-norm clipping, parameter type checks that
expect `'torch.cuda.FloatTensor'`, and `torch.cuda.synchronize()` in the checkpoint writer.
The model code itself runs on CPU. Rather than fork those files, `enable()` redirects exactly
these CUDA entry points to the CPU, at start-up, and only when no CUDA device exists:

| megatron-core's call                     | on CPU becomes                                   |
| ---------------------------------------- | ------------------------------------------------ |
| `torch.cuda.current_device()`            | `torch.device("cpu")`                            |
| `torch.cuda.synchronize()`               | no-op                                            |
| `Tensor.cuda(...)`                       | the tensor itself                                |
| `torch.{tensor,zeros,empty,ones,full,arange,zeros_like,empty_like}(device='cuda...')` | the same on `cpu` |
| `Tensor.type()` (no argument)            | the CUDA type name, so `'torch.cuda.FloatTensor'` checks pass |

Only megatron-core's calls. torch, torch.cuda and their functions are never replaced: every
module of megatron-core reaches them through its own global name `torch`, so `enable()` gives
each one (those imported, and — through an import hook while enabled — those imported later)
its own `torch`: a module object holding torch's attributes except the factories above and
`cuda` (likewise torch.cuda's, except `current_device` / `synchronize`). Replacing torch's
factories process-wide would break other code in the process, not only while enabled: torch's
`with torch.device(...)` context recognises the factories by identity, from a set it caches at
its first use, so a Hugging Face model built later (`from_pretrained` builds under such a
context) got uninitialised RoPE buffers — tests/megatron/training/test_cpu_compat.py builds
plain torch modules and a Hugging Face Llama before, while and after, and compares them.
A tensor method is looked up on the tensor, not in a module's globals, so `Tensor.cuda` and
`Tensor.type` are the two attributes replaced while enabled: by wrappers that act only when
their caller's module is part of megatron-core and otherwise call the original with the same
arguments. `disable()` restores every module's `torch`, the two methods and the import hook.

Why this and not a `TorchFunctionMode`: a mode intercepts every op of every step; megatron-core's
own `torch` costs a dictionary lookup, as before. Why in the product and not only in tests:
the quickstart and CI train through the same megatron-core DDP / optimizer /
dist_checkpointing code path as a GPU run, so a CPU run tests what a GPU run executes.

`import_megatron_core()` runs before megatron-core is imported. Its `jit_fuser`
(`torch.compile`, decorating about 40 fused elementwise helpers at import time) is set to
megatron-core's own no-op, as its `disable_jit_fuser()` does: the first decoration imports
TorchInductor, ~1.5-2 s of every process start on a 2-core CPU, and the test suite starts many
training processes. None of those helpers runs in our CPU runs (counted in BF16, FP32,
NVFP4-linear + Q-Attn and LoRA-SVD + Q-AdamW runs: no call), and a call would run the same
arithmetic eagerly instead of through Inductor's CPU code generator. On every machine it also
filters megatron-core's known start-up warnings (`KNOWN_WARNINGS`) once, so a rank does not
print seven lines that say nothing about the run.

Nothing here runs when `torch.cuda.is_available()`; `enable()` is idempotent.
"""
from __future__ import annotations

import functools
import importlib.abc
import sys
import types
import warnings

import torch

_FACTORIES = ("tensor", "zeros", "empty", "ones", "full", "arange", "zeros_like", "empty_like")
_PREFIX = "megatron.core"

# megatron-core 0.16.1's warnings that hold for every run of this project (message regexes):
KNOWN_WARNINGS = (
    # x4, at import (optimizer/__init__.py, optimizer/optimizer.py, optimizer/clip_grads.py,
    # megatron_fsdp/mixed_precision.py): we run torch's AdamW and multi-tensor ops on purpose
    r"Transformer Engine and Apex are not installed\. Falling back to",
    # x2, at import (models/backends.py, models/gpt/gpt_layer_specs.py): torch's RMSNorm on purpose
    r"Apex is not installed\. Falling back to Torch Norm",
    # at every TransformerConfig: raised by megatron-core's own default cuda_graph_scope="full"
    r"full scope is deprecated\. Use empty cuda_graph_scope",
)

_modules: dict[str, types.ModuleType] = {}     # megatron-core modules given their own `torch`
_methods: list[tuple[str, object]] = []         # (Tensor attribute, original)
_finder: "_Finder | None" = None
_torch_ns: "_Namespace | None" = None


def filter_known_warnings() -> None:
    for pattern in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)


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


def _in_megatron_core(name) -> bool:
    return isinstance(name, str) and (name == _PREFIX or name.startswith(_PREFIX + "."))


class _Namespace(types.ModuleType):
    """A module object with `base`'s attributes and `overrides`. With `snapshot`, the
    attributes are copied (plain dictionary lookups on the hot path); names missing there
    (submodules imported later) and every name without a snapshot come from `base` itself."""

    def __init__(self, base: types.ModuleType, overrides: dict, *, snapshot: bool):
        super().__init__(base.__name__, base.__doc__)
        if snapshot:
            self.__dict__.update({k: v for k, v in base.__dict__.items() if k != "__getattr__"})
        self.__dict__.update(overrides)
        self.__dict__["_cpu_compat_base"] = base

    def __getattr__(self, name):
        return getattr(self.__dict__["_cpu_compat_base"], name)


def _redirect(module) -> None:
    if _torch_ns is not None and getattr(module, "__dict__", {}).get("torch") is torch:
        module.__dict__["torch"] = _torch_ns
        _modules[module.__name__] = module


class _Loader(importlib.abc.Loader):
    """Wraps a megatron-core module's loader: after the module ran, it gets its own `torch`."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _redirect(module)

    def __getattr__(self, name):   # get_source, get_resource_reader, is_package, ...
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """While enabled, megatron-core modules imported later are redirected too."""

    def find_spec(self, fullname, path, target=None):
        if not _in_megatron_core(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def _tensor_cuda(orig):
    @functools.wraps(orig)
    def cuda(self, *args, **kwargs):
        if _in_megatron_core(sys._getframe(1).f_globals.get("__name__")):
            return self
        return orig(self, *args, **kwargs)

    return cuda


def _tensor_type(orig):
    @functools.wraps(orig)
    def type_(self, *args, **kwargs):
        if not args and not kwargs and _in_megatron_core(sys._getframe(1).f_globals.get("__name__")):
            name = orig(self)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return orig(self, *args, **kwargs)

    return type_


def enabled() -> bool:
    return _torch_ns is not None


def enable() -> bool:
    """Redirect megatron-core's CUDA entry points to the CPU. Returns True if it did."""
    global _torch_ns, _finder
    if _torch_ns is not None or torch.cuda.is_available():
        return False
    cuda_ns = _Namespace(torch.cuda, {"current_device": lambda: torch.device("cpu"),
                                      "synchronize": lambda *a, **k: None}, snapshot=False)
    _torch_ns = _Namespace(torch, {"cuda": cuda_ns, **{n: _cpu_factory(getattr(torch, n)) for n in _FACTORIES}},
                           snapshot=True)
    for name, module in list(sys.modules.items()):
        if _in_megatron_core(name) and module is not None:
            _redirect(module)
    _finder = _Finder()
    sys.meta_path.insert(0, _finder)
    for attr, wrap in (("cuda", _tensor_cuda), ("type", _tensor_type)):
        orig = getattr(torch.Tensor, attr)
        _methods.append((attr, orig))
        setattr(torch.Tensor, attr, wrap(orig))
    return True


def disable() -> None:
    global _torch_ns, _finder
    while _methods:
        attr, orig = _methods.pop()
        setattr(torch.Tensor, attr, orig)
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None
    for module in _modules.values():
        if module.__dict__.get("torch") is _torch_ns:
            module.__dict__["torch"] = torch
    _modules.clear()
    _torch_ns = None


def _no_compile(model=None, **_kwargs):
    return model if model is not None else (lambda fn: fn)


def import_megatron_core() -> None:
    """Import megatron-core; its known warnings filtered, and without CUDA with its
    `jit_fuser` already the no-op (see above).

    `megatron/core/jit.py` reads `torch.compile` once, while `import megatron.core` runs, and
    the helpers imported later take its `jit_fuser` from there. So `torch.compile` is the
    identity only during that import, then restored for everyone else."""
    filter_known_warnings()
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
