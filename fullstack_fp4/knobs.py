"""Kernel knobs: every environment variable that changes how a kernel of the recipes runs.

Each is read once, here, at import. The kernels read the attribute of this module at launch
time, so a benchmark sweep or a test sets the attribute (``knobs.QATTN_PROLOGUE = (16, 4)``,
``monkeypatch.setattr(knobs, ...)``) rather than the environment; the exception is
:data:`LEAN_LAUNCH`, which ``nvfp4/kernels/launch.py`` copies at its own import (afterwards only
its ``set_mode`` changes the mode, not this attribute). **None of them changes a
bit of any result**: they pick tilings, launch paths and storage of the same numbers (each
entry names what checks it). Anything that changes numerics is a validated config
key (``megatron/training/config_schema.py``), never an environment variable; so the tilings
that change an FP32 accumulation order (:data:`QATTN_FWD`, :data:`QATTN_BWD`) and the GEMM
backend (``nvfp4.gemm.set_gemm_backend``) are set from code only, by the benchmarks that
sweep them, and start at their defaults in every run.

A malformed value stops the import with a ``ValueError`` naming the variable (an unknown
``FULLSTACK_FP4_LEAN_LAUNCH`` warns and keeps the default, so that a typo in a launch wrapper
never stops a run).

``FULLSTACK_FP4_LEAN_LAUNCH`` → :data:`LEAN_LAUNCH`
    ``"1"`` (default): ``nvfp4.kernels.launch.launch`` calls a compiled kernel's launcher
    directly after its first call; ``"0"``: every launch through ``JITFunction.run`` (A/B host
    timing, debugging); ``"verify"``: lean launches, each checked against the kernel
    ``JITFunction.run`` would pick. Same kernel, same arguments, same bits
    (``tests/fullstack_fp4/nvfp4/test_triton_launch.py``). Swept by
    ``benchmarks/profile/profile_step_host.py``.

``FP4_TWO_WAYS_RCP`` → :data:`TWO_WAYS_RCP`
    Which calls of the NVFP4 linear's two-way quantize (``"x"``, ``"W"``, ``"dY"``,
    ``"other"``; comma-separated, ``""`` for none; default ``"W"``) take the block scale's
    element factor ``1/(s·dec)`` from the branch-free reciprocal instead of ``div_rn``. Same
    values (``tests/fullstack_fp4/nvfp4/test_triton_quantize_jit.py``); register use and speed
    differ per call (``docs/perf/nvfp4.md``). Compared by running
    ``benchmarks/bench_nvfp4_linear.py`` under each value.

``FP4_DEQUANT_NBP``, ``FP4_DEQUANT_WARPS`` → :data:`DEQUANT_NBP`, :data:`DEQUANT_WARPS`
    Blocks per program (a power of two, default 256) and warps (1, 2, 4, 8 or 16, default 8)
    of the NVFP4 decode kernel. Same bits at every tiling: each output is computed from its own
    16-block's code bytes and scale byte alone (``nvfp4/kernels/decode.py``), so the tiling only
    picks which program computes it. Swept by ``benchmarks/bench_decode.py --sweep``, which
    checks each setting bit for bit before timing it.

``FP4_QATTN_PROLOGUE`` → :data:`QATTN_PROLOGUE`
    ``"rows,warps"`` of the Q-Attn views kernel (rows a power of two >= 16). Bit-identical
    views at every tiling (``tests/fullstack_fp4/attention/test_kernels.py``). Swept by
    ``benchmarks/bench_q_attn.py --sweep``.

``FP4_QATTN_SAVE_V_VIEW`` → :data:`QATTN_SAVE_V_VIEW`
    ``"1"``: Q-Attn saves a view of V for the backward (keeps megatron's fused QKV buffer
    alive); default ``"0"``: a dense copy of V. Memory only, same numbers
    (``tests/fullstack_fp4/attention/test_layouts.py``).

Set from code only (no environment variable; None = the built-in default):

:data:`QATTN_FWD`
    ``(BLOCK_M, BLOCK_N, warps, stages)`` of the Q-Attn forward kernel (BLOCK_N divides
    BLOCK_M); default per head dim (``attention.triton_fwd.fwd_config``). The blocks set the
    FP32 accumulation order of the online softmax and of ``P·V``. Swept by
    ``benchmarks/bench_q_attn.py --sweep``.

:data:`QATTN_BWD`
    ``(w_kv, st_kv, w_q, st_q[, rn, rm])``: warps and pipeline stages of the dK/dV and dQ
    kernels and their 64-row groups per program (1 or 2). The dS tiles stay 64×64 with their
    own scales; the row groups set the FP32 accumulation order of the products
    (``tests/fullstack_fp4/attention/test_kernels.py`` compares them within that order's
    tolerance). Swept by ``benchmarks/bench_q_attn.py --sweep``.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional, Tuple

__all__ = ["LEAN_LAUNCH", "TWO_WAYS_RCP", "DEQUANT_NBP", "DEQUANT_WARPS", "QATTN_FWD",
           "QATTN_BWD", "QATTN_PROLOGUE", "QATTN_SAVE_V_VIEW", "parse_ints",
           "check_qattn_fwd", "check_qattn_bwd", "check_qattn_prologue", "check_dequant"]

LEAN_LAUNCH_MODES = ("0", "1", "verify")
TWO_WAYS_CALLS = ("x", "W", "dY", "other")


def parse_ints(name: str, text: str, counts) -> Optional[Tuple[int, ...]]:
    """``text`` as ``len in counts`` comma-separated ints (None if empty); ``name`` names the
    knob in the error."""
    text = (text or "").strip()
    if not text:
        return None
    counts = (counts,) if isinstance(counts, int) else tuple(counts)
    try:
        vals = tuple(int(x) for x in text.split(","))
    except ValueError:
        vals = ()
    if len(vals) not in counts:
        raise ValueError(f"{name}={text!r}: expected {' or '.join(map(str, counts))} "
                         "comma-separated ints")
    return vals


def check_qattn_fwd(cfg) -> None:
    if cfg is not None and (len(cfg) != 4 or cfg[0] % cfg[1]):
        raise ValueError(f"QATTN_FWD={cfg}: (BLOCK_M, BLOCK_N, warps, stages) with BLOCK_N "
                         "dividing BLOCK_M")


def check_qattn_bwd(cfg) -> None:
    if cfg is None:
        return
    if len(cfg) not in (4, 6) or (len(cfg) == 6 and (cfg[4] not in (1, 2) or cfg[5] not in (1, 2))):
        raise ValueError(f"QATTN_BWD={cfg}: (w_kv, st_kv, w_q, st_q[, rn, rm]) with rn, rm 1 or 2")


def check_qattn_prologue(cfg) -> None:
    if cfg is None:
        return
    if (len(cfg) != 2 or cfg[0] < 16 or cfg[0] % 16 or cfg[0] & (cfg[0] - 1)
            or cfg[1] not in (1, 2, 4, 8, 16)):
        raise ValueError(f"FP4_QATTN_PROLOGUE={cfg}: rows a power of two >= 16, warps 1..16")


def check_dequant(nbp: Optional[int], warps: Optional[int]) -> None:
    if nbp is not None and (nbp < 1 or nbp & (nbp - 1)):
        raise ValueError(f"FP4_DEQUANT_NBP={nbp}: a power of two")
    if warps is not None and warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"FP4_DEQUANT_WARPS={warps}: 1, 2, 4, 8 or 16")


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def _one_int(name: str) -> Optional[int]:
    v = parse_ints(name, _env(name), 1)
    return None if v is None else v[0]


LEAN_LAUNCH: str = _env("FULLSTACK_FP4_LEAN_LAUNCH") or "1"
if LEAN_LAUNCH not in LEAN_LAUNCH_MODES:
    warnings.warn(f"FULLSTACK_FP4_LEAN_LAUNCH={LEAN_LAUNCH!r} is not one of "
                  f"{LEAN_LAUNCH_MODES}: using '1'")
    LEAN_LAUNCH = "1"

TWO_WAYS_RCP: frozenset = frozenset(os.environ.get("FP4_TWO_WAYS_RCP", "W").split(",")) - {""}
if not TWO_WAYS_RCP <= set(TWO_WAYS_CALLS):
    raise ValueError(f"FP4_TWO_WAYS_RCP={os.environ.get('FP4_TWO_WAYS_RCP')!r}: "
                     f"comma-separated names among {TWO_WAYS_CALLS}")

DEQUANT_NBP: Optional[int] = _one_int("FP4_DEQUANT_NBP")
DEQUANT_WARPS: Optional[int] = _one_int("FP4_DEQUANT_WARPS")
check_dequant(DEQUANT_NBP, DEQUANT_WARPS)

QATTN_PROLOGUE: Optional[Tuple[int, ...]] = parse_ints("FP4_QATTN_PROLOGUE",
                                                       _env("FP4_QATTN_PROLOGUE"), 2)
check_qattn_prologue(QATTN_PROLOGUE)

QATTN_SAVE_V_VIEW: bool = _env("FP4_QATTN_SAVE_V_VIEW") == "1"

# code-only overrides (module docstring)
QATTN_FWD: Optional[Tuple[int, ...]] = None
QATTN_BWD: Optional[Tuple[int, ...]] = None
