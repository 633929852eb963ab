"""Launch an already compiled Triton kernel without ``JITFunction.run``'s per-call work.

Why: the NVFP4 linear makes ~11 Triton launches a forward+backward and Q-Attn ~8, so at the
3b shapes the GPU waits for the host (BENCHMARKS.md §G.6: the full stack's GPU sat idle 21 ms a
step). Triton 3.6's ``fn[grid](...)`` does, on every call, work whose result only changes when
the *kind* of arguments changes: bind the arguments and defaults, specialise each one (C++),
build the cache key (``str(options)`` included), look the kernel up, re-check the globals it
used, and build a launch-metadata dict for the launch hooks, which (``HookChain`` objects,
never ``None``) the C launcher then calls with no hook in them. Run24's host profile put
``JITFunction.run`` at 28% of the NVFP4 linear's host time.

How: :func:`launch` keys its own cache on everything Triton specialises on — each tensor's
dtype and 16-byte alignment; each int's ``== 1``, divisibility by 16 and width (32 / 64 bit,
unsigned above 2⁶³); each float, bool and ``None`` by type; constexpr arguments by value; the
launch options (``num_warps`` …) by value; the current device. That key can only be *finer*
than Triton's (it never ignores what Triton looks at; it may tell apart what Triton does not,
which only costs one more lookup through ``JITFunction.run``). The first call of a key goes
through ``fn[grid](...)``, which compiles or finds the kernel and launches it, and returns the
compiled kernel; later calls of that key hand the arguments straight to its C launcher, exactly
as ``JITFunction.run`` does at its end (same argument order, constexprs included, same stream).

It steps aside — plain ``fn[grid](...)`` — under ``TRITON_INTERPRET=1`` (the CPU tests: the
interpreter has no compiled kernel), when a launch hook is registered (a profiler such as
proton wants every launch's metadata), and with ``FULLSTACK_FP4_LEAN_LAUNCH=0`` (A/B timing,
debugging). ``FULLSTACK_FP4_LEAN_LAUNCH=verify`` checks every lean launch against the kernel
``JITFunction.run`` would pick; the GPU check (``scripts/gpu/check_lean_launch.py``) runs the
recipes so and compares their outputs with the plain launches' bit for bit.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Dict, Tuple

import torch

__all__ = ["launch", "lean_enabled", "bind_arguments", "specialization_key", "compiled_for",
           "VERIFIED"]

_I32_MIN, _I32_MAX, _U64_MIN = -(2 ** 31), 2 ** 31 - 1, 2 ** 63


def lean_enabled() -> bool:
    """Whether :func:`launch` may bypass ``JITFunction.run`` (read per call: tests flip it)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return os.environ.get("FULLSTACK_FP4_LEAN_LAUNCH", "1") != "0"


def _verifying() -> bool:
    """``FULLSTACK_FP4_LEAN_LAUNCH=verify``: every lean launch also asks ``JITFunction.run``
    (``warmup=True``: find, do not launch) which kernel it would launch, and raises if that is
    not the one the lean path launches. The GPU check runs the recipes so."""
    return os.environ.get("FULLSTACK_FP4_LEAN_LAUNCH", "1") == "verify"


#: Lean launches checked against ``JITFunction.run`` in verify mode (read by the GPU check).
VERIFIED = {"launches": 0}


class _Signature:
    """What is fixed per ``@triton.jit`` function: parameter names, defaults, constexpr flags."""

    __slots__ = ("names", "index", "defaults", "constexpr")

    def __init__(self, fn):
        params = inspect.signature(fn.fn).parameters
        self.names = list(params)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.defaults = [p.default for p in params.values()]
        indices = getattr(fn, "constexprs", None)   # a JITFunction's; the interpreter's has none
        if indices is None:
            indices = [i for i, p in enumerate(params.values()) if _is_constexpr(p.annotation)]
        self.constexpr = [i in set(indices) for i in range(len(self.names))]


def _is_constexpr(annotation) -> bool:
    """``tl.constexpr``, also as the string a ``from __future__ import annotations`` leaves."""
    if isinstance(annotation, str):
        return annotation.split(".")[-1] == "constexpr"
    return getattr(annotation, "__name__", "") == "constexpr"


_SIGNATURES: Dict[Any, _Signature] = {}


def _signature(fn) -> _Signature:
    sig = _SIGNATURES.get(fn)
    if sig is None:
        sig = _SIGNATURES[fn] = _Signature(fn)
    return sig


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or repr(fn)


def bind_arguments(fn, args: tuple, kwargs: dict) -> Tuple[list, dict]:
    """``(values of every kernel parameter in order, launch options)``: ``inspect``'s
    ``bind`` + ``apply_defaults`` for a ``@triton.jit`` function, with the keywords that are
    not parameters (``num_warps``, ``num_stages``, ``enable_fp_fusion`` …) as the options."""
    sig = _signature(fn)
    n = len(sig.names)
    if len(args) > n:
        raise TypeError(f"{_name(fn)}: {len(args)} positional arguments for {n} parameters")
    values = list(args) + [inspect.Parameter.empty] * (n - len(args))
    options = {}
    for key, value in kwargs.items():
        i = sig.index.get(key)
        if i is None:
            options[key] = value
        elif i < len(args):
            raise TypeError(f"{_name(fn)}: argument {key!r} given twice")
        else:
            values[i] = value
    for i in range(len(args), n):
        if values[i] is inspect.Parameter.empty:
            values[i] = sig.defaults[i]
            if values[i] is inspect.Parameter.empty:
                raise TypeError(f"{_name(fn)}: missing argument {sig.names[i]!r}")
    return values, options


def _arg_key(v):
    """What Triton specialises a non-constexpr argument on (see the module docstring)."""
    if isinstance(v, torch.Tensor):
        return v.dtype, v.data_ptr() % 16 == 0
    if isinstance(v, bool):          # before int: bool is an int
        return bool
    if isinstance(v, int):
        return v == 1, v % 16 == 0, _I32_MIN <= v <= _I32_MAX, v >= _U64_MIN
    if isinstance(v, float):
        return float
    if v is None:
        return None
    raise _Unkeyed(type(v).__name__)


class _Unkeyed(Exception):
    """An argument type this key does not model (numpy scalars, tuples …): launch the plain way."""


def specialization_key(fn, values: list, options: dict, device: int) -> tuple:
    """The cache key of one launch (module docstring): finer than or equal to Triton's."""
    sig = _signature(fn)
    parts = [fn, device, tuple(sorted(options.items()))]
    for is_constexpr, v in zip(sig.constexpr, values):
        parts.append(("c", v) if is_constexpr else _arg_key(v))
    return tuple(parts)


_COMPILED: Dict[tuple, Any] = {}


try:
    from triton import knobs as _knobs
except ImportError:          # a triton before 3.4: no knobs, launch the plain way
    _knobs = None


def _hooks_idle() -> bool:
    """No launch hook registered (a ``HookChain`` with no calls, or ``None``)."""
    if _knobs is None:
        return False
    knobs = _knobs
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def launch(fn, grid: tuple, *args, **kwargs) -> None:
    """``fn[grid](*args, **kwargs)``, with the per-call work of ``JITFunction.run`` done once
    per specialisation (module docstring). ``grid``: a tuple of 1 to 3 ints."""
    if not lean_enabled() or not _hooks_idle():
        fn[grid](*args, **kwargs)
        return
    device = torch.cuda.current_device()
    values, options = bind_arguments(fn, args, kwargs)
    try:
        key = specialization_key(fn, values, options, device)
    except _Unkeyed:
        fn[grid](*args, **kwargs)
        return
    kernel = _COMPILED.get(key)
    if kernel is None:
        kernel = fn[grid](*args, **kwargs)          # compiles or finds it, and launches
        if hasattr(kernel, "result"):               # asynchronous compile mode
            kernel = kernel.result()
        _COMPILED[key] = kernel
        return
    if _verifying():
        triton_pick = fn.run(*args, grid=grid, warmup=True, **kwargs)
        if triton_pick is not kernel:
            raise RuntimeError(f"lean launch of {_name(fn)}: cached kernel is not the one "
                               "JITFunction.run picks for these arguments")
        VERIFIED["launches"] += 1
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = torch._C._cuda_getCurrentRawStream(device)
    kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None,
               *values)


def compiled_for(fn, *args, **kwargs):
    """The compiled kernel :func:`launch` holds for these arguments (``None`` before their
    first launch): the GPU check compares it with what ``JITFunction.run`` picks."""
    values, options = bind_arguments(fn, args, kwargs)
    try:
        key = specialization_key(fn, values, options, torch.cuda.current_device())
    except _Unkeyed:
        return None
    return _COMPILED.get(key)
