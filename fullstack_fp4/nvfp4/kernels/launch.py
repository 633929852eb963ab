"""Launch an already compiled Triton kernel without ``JITFunction.run``'s per-call work.

Why: the NVFP4 linear makes ~11 Triton launches a forward+backward and Q-Attn ~8, so at the
3b shapes the GPU waits for the host (``docs/perf/nvfp4.md``). Triton 3.6's ``fn[grid](...)`` does, on every call, work whose result only changes when
the *kind* of arguments changes: bind the arguments and defaults, specialise each one (C++),
build the cache key (``str(options)`` included), look the kernel up, re-check the globals it
used, and build a launch-metadata dict for the launch hooks, which (``HookChain`` objects,
never ``None``) the C launcher then calls with no hook in them: ``JITFunction.run`` was 28% of
the NVFP4 linear's host time under a host profile (``benchmarks/profile/profile_linear_host.py``).

How: :func:`launch` keys its own cache on everything Triton specialises on — each tensor's
dtype and 16-byte alignment; each int's ``== 1``, divisibility by 16 and width (32 / 64 bit,
unsigned above 2⁶³); each float, bool and ``None`` by type; constexpr arguments by value; the
launch options (``num_warps`` …) by value; the current device; the call's shape (which
arguments came by position, which by keyword). That key can only be *finer* than Triton's: it
never ignores what Triton looks at, and where it tells apart what Triton does not, that costs
one more lookup through ``JITFunction.run``. The first call of a key goes
through ``fn[grid](...)``, which compiles or finds the kernel and launches it, and returns the
compiled kernel; later calls of that key hand the arguments straight to its C launcher, exactly
as ``JITFunction.run`` does at its end (same argument order, constexprs included, same stream).

It steps aside — plain ``fn[grid](...)`` — under ``TRITON_INTERPRET=1`` (the CPU tests: the
interpreter has no compiled kernel), when a launch hook is registered (a profiler such as
proton wants every launch's metadata), and in mode ``"0"`` (A/B timing, debugging). Mode
``"verify"`` checks every lean launch against the kernel ``JITFunction.run`` would pick. The
mode starts as ``fullstack_fp4.knobs.LEAN_LAUNCH`` (``FULLSTACK_FP4_LEAN_LAUNCH``);
:func:`set_mode` switches it at run time.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Dict, Tuple

import torch

from fullstack_fp4 import knobs as fp4_knobs

__all__ = ["launch", "lean_enabled", "set_mode", "bind_arguments", "specialization_key",
           "compiled_for", "VERIFIED", "cdiv", "next_pow2"]

_I32_MIN, _I32_MAX, _U64_MIN = -(2 ** 31), 2 ** 31 - 1, 2 ** 63
_MODES = ("0", "1", "verify")

# Read once, as Triton reads TRITON_INTERPRET once: an environment lookup costs ~1 µs, and the
# NVFP4 linear launches 11 kernels a forward+backward.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_MODE = fp4_knobs.LEAN_LAUNCH


def set_mode(mode: str) -> str:
    """``"1"`` lean launches (the default), ``"0"`` every launch through ``JITFunction.run``,
    ``"verify"`` lean launches each checked against the kernel ``JITFunction.run`` would pick
    (raises if they differ). ``fullstack_fp4.knobs.LEAN_LAUNCH`` sets it at import. Returns the
    previous mode."""
    global _MODE
    if mode not in _MODES:
        raise ValueError(f"lean launch mode must be one of {_MODES}, got {mode!r}")
    previous, _MODE = _MODE, mode
    return previous


def lean_enabled() -> bool:
    """Whether :func:`launch` may bypass ``JITFunction.run``."""
    return not _INTERPRET and _MODE != "0"


#: Lean launches checked against ``JITFunction.run`` in verify mode.
VERIFIED = {"launches": 0}


class _Signature:
    """What is fixed per ``@triton.jit`` function: parameter names, defaults, constexpr flags,
    and per call shape (number of positional arguments, keyword names) where each parameter's
    value comes from (a *plan*, built once: binding is then one list comprehension)."""

    __slots__ = ("names", "index", "defaults", "constexpr", "plans")

    def __init__(self, fn):
        params = inspect.signature(fn.fn).parameters
        self.names = list(params)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.defaults = [p.default for p in params.values()]
        indices = getattr(fn, "constexprs", None)   # a JITFunction's; the interpreter's has none
        if indices is None:
            indices = [i for i, p in enumerate(params.values()) if _is_constexpr(p.annotation)]
        self.constexpr = [i in set(indices) for i in range(len(self.names))]
        self.plans = {}

    def plan(self, fn, nargs: int, kwnames: tuple):
        """``(sources, option names)``: ``sources[i]`` is ``(0, j)`` for ``args[j]``, ``(1,
        name)`` for ``kwargs[name]``, ``(2, default)``; raises ``TypeError`` as a call would."""
        key = (nargs, kwnames)
        plan = self.plans.get(key)
        if plan is not None:
            return plan
        n = len(self.names)
        if nargs > n:
            raise TypeError(f"{_name(fn)}: {nargs} positional arguments for {n} parameters")
        sources = [(0, i) for i in range(nargs)] + [None] * (n - nargs)
        options = []
        for name in kwnames:
            i = self.index.get(name)
            if i is None:
                options.append(name)
            elif i < nargs:
                raise TypeError(f"{_name(fn)}: argument {name!r} given twice")
            else:
                sources[i] = (1, name)
        for i in range(nargs, n):
            if sources[i] is None:
                if self.defaults[i] is inspect.Parameter.empty:
                    raise TypeError(f"{_name(fn)}: missing argument {self.names[i]!r}")
                sources[i] = (2, self.defaults[i])
        plan = self.plans[key] = (sources, tuple(options))
        return plan


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


def _bind(fn, args: tuple, kwargs: dict):
    """``(values, options dict, plan key)`` of one call (see :func:`bind_arguments`)."""
    sig = _signature(fn)
    kwnames = tuple(kwargs)
    sources, option_names = sig.plan(fn, len(args), kwnames)
    values = [args[x] if s == 0 else kwargs[x] if s == 1 else x for s, x in sources]
    return values, option_names, (len(args), kwnames)


def bind_arguments(fn, args: tuple, kwargs: dict) -> Tuple[list, dict]:
    """``(values of every kernel parameter in order, launch options)``: ``inspect``'s
    ``bind`` + ``apply_defaults`` for a ``@triton.jit`` function, with the keywords that are
    not parameters (``num_warps``, ``num_stages``, ``enable_fp_fusion`` …) as the options."""
    values, option_names, _ = _bind(fn, args, kwargs)
    return values, {k: kwargs[k] for k in option_names}


def _arg_key(v):
    """What Triton specialises a non-constexpr argument on (see the module docstring)."""
    t = type(v)
    if t is torch.Tensor or t is torch.nn.Parameter or isinstance(v, torch.Tensor):
        return v.dtype, not (v.data_ptr() & 15)
    if t is bool:                    # before int: bool is an int
        return bool
    if t is int:
        return v == 1, not (v & 15), _I32_MIN <= v <= _I32_MAX, v >= _U64_MIN
    if t is float:
        return float
    if v is None:
        return None
    raise _Unkeyed(t.__name__)


class _Unkeyed(Exception):
    """An argument type this key does not model (numpy scalars, tuples …): launch the plain way."""


def _key_and_values(fn, args: tuple, kwargs: dict, device: int):
    """``(cache key, parameter values in order)`` of one call; raises ``_Unkeyed``."""
    values, option_names, plan_key = _bind(fn, args, kwargs)
    flags = _signature(fn).constexpr
    key = (fn, device, plan_key, tuple([kwargs[k] for k in option_names]),
           tuple([v if c else _arg_key(v) for c, v in zip(flags, values)]))
    return key, values


def specialization_key(fn, args: tuple, kwargs: dict, device: int) -> tuple:
    """The cache key :func:`launch` uses for ``fn[grid](*args, **kwargs)`` on ``device``
    (module docstring): finer than or equal to Triton's. Raises ``_Unkeyed`` for an argument
    type it does not model."""
    return _key_and_values(fn, args, kwargs, device)[0]


_COMPILED: Dict[tuple, Any] = {}


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for grid sizes. ``triton.cdiv`` is a ``@jit`` function: calling it from
    host code costs 2–10 µs of Python a call, and a linear's launches make ~17 such calls."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` in plain Python (the same reason as :func:`cdiv`); at least 1
    (Triton's gives 0 for 0)."""
    return 1 << max(int(n) - 1, 0).bit_length()


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
    try:
        key, values = _key_and_values(fn, args, kwargs, device)
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
    if _MODE == "verify":
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
    first launch), to compare with what ``JITFunction.run`` picks."""
    try:
        return _COMPILED.get(specialization_key(fn, args, kwargs, torch.cuda.current_device()))
    except _Unkeyed:
        return None
