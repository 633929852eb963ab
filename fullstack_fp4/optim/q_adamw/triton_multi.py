"""The fused Q-AdamW step over many parameters in one launch (a multi-tensor launch).

Why: ``triton_step.launch`` steps one parameter per launch. Each launch ends with a partly filled
last wave of programs — SMs idle while the slowest programs finish — and the next launch starts
only after it; a 1.0B-parameter model in 3b-shaped matrices is ~51 launches a step
(docs/perf/q-adamw.md, "Options, off by default", has the cost of both). One launch over all of a step's parameters fills
the machine until the last parameter's last wave.

How: the grid is the concatenation of every parameter's own grid (``triton_step``'s: one program
per ``CPP`` chunks of 1024 entries on the parameter's chunk grid). A program finds its
parameter in ``prog`` (one int32 per program: the parameter's row of ``tab``) and reads the
parameter's row of ``tab`` (int64): where its tensors are, its sizes, its placement and its
seed; then it runs exactly ``triton_step._step_program`` — the per-parameter kernel's body —
with its program index within that parameter's grid. So each parameter is stepped bit for bit
as its own launch steps it (tests/.../test_q_adamw_multi.py).

Where the tensors are: as element offsets from one base tensor per kind (the tensor of that
kind with the lowest address, so offsets are never negative), stored in units that keep the
per-parameter kernel's vector accesses: ``p`` and ``g`` in units of 16 bytes, the codes in
units of 16 bytes (read as int32 pairs), the BF16 model parameter in units of 16 bytes. Triton
cannot know the alignment of a loaded address; it can of ``base + 4 · k`` (the base a
16-byte-aligned argument, ``4 · k`` entries of FP32 a multiple of 16 bytes), so the rows are
still read with 16-byte loads. Sizes the same way: ``n`` as ``16 · n16`` and ``npad`` as
``64 · npad64``, so the masks stay constant over each 4-entry vector. A parameter that does not
fit these units (``n`` not a multiple of 16; a tensor that is a view at an odd offset)
is not batched: :func:`batchable` says which, and the optimizer launches those one by one.

The step's scalars (learning rate, betas, bias corrections, the step's share of the seed) are
the launch's, so one launch takes parameters of one param group at one step count, with one
gradient dtype and all or none writing a BF16 model parameter; the optimizer groups them so.
The per-parameter seed ``optimizer._seed(seed, key, t)`` is ``(base + t · 104729) mod (2^31 −
1)`` with ``base = (seed · 1000003 + key · 7919) mod (2^31 − 1)`` from the table and the
step's part an argument (both < 2^31, so the sum is exact in int64).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional, Sequence

import torch
import triton
import triton.language as tl

from fullstack_fp4.nvfp4.kernels.launch import launch as launch_kernel

from . import triton_step
from .codecs import BLOCK, CHUNK, TILE
from .triton_step import _step_program

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
SEED_MOD = 2 ** 31 - 1
# Columns of the per-parameter table.
(C_P, C_G, C_MC, C_MS, C_MCS, C_VC, C_VS, C_VCS, C_VMEAN, C_MO, C_N16, C_NPAD64, C_PH_ROWS,
 C_ROW0, C_SEED, C_START) = range(16)
NCOL = 16
# Programs of a parameter's own grid that one program runs in turn: 1, since SUB > 1's loop
# spills at the 128-register cap and measured 8-14% slower on the H200 (docs/perf/q-adamw.md)
SUB = 1
_STATE_KEYS = ("exp_avg_codes", "exp_avg_scales", "exp_avg_chunk_scales", "exp_avg_sq_codes",
               "exp_avg_sq_scales", "exp_avg_sq_chunk_scales", "exp_avg_sq_means")


@triton.jit(do_not_specialize=["tseed"])   # the step's share of the seed changes every step
def q_adamw_multi_kernel(tab_ptr, prog_ptr, p_base, g_base, mc_base, ms_base, mcs_base,
                         vc_base, vs_base, vcs_base, vmean_base, mo_base, tseed,
                         decay, beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size,
                         rtab_ptr, G_UNIT: tl.constexpr, MO_UNIT: tl.constexpr, SUB: tl.constexpr,
                         CPP_C: tl.constexpr, FAST_DEC: tl.constexpr, U8: tl.constexpr,
                         ROUNDS: tl.constexpr, HAS_MODEL_OUT: tl.constexpr,
                         BF16_HW: tl.constexpr, FAST_DIV: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row = tab_ptr + tl.load(prog_ptr + pid).to(tl.int64) * 16
    # offsets times their constant unit: Triton then knows each pointer's alignment (docstring)
    p_ptr = p_base + tl.load(row + 0) * 4
    g_ptr = g_base + tl.load(row + 1) * G_UNIT
    mc_ptr = mc_base + tl.load(row + 2) * 16
    ms_ptr = ms_base + tl.load(row + 3)
    mcs_ptr = mcs_base + tl.load(row + 4)
    vc_ptr = vc_base + tl.load(row + 5) * 16
    vs_ptr = vs_base + tl.load(row + 6)
    vcs_ptr = vcs_base + tl.load(row + 7)
    vmean_ptr = vmean_base + tl.load(row + 8)
    mo_ptr = mo_base + tl.load(row + 9) * MO_UNIT
    # sizes, placement, seed in 32 bits, as the per-parameter kernel gets them (int64 index
    # arithmetic on them cost ~40 more instructions per 16 entries)
    n = tl.load(row + 10).to(tl.int32) * 16
    npad = tl.load(row + 11).to(tl.int32) * 64     # TILE
    ph_rows = tl.load(row + 12).to(tl.int32)
    row0 = tl.load(row + 13).to(tl.int32)
    seed = tl.load(row + 14) + tseed                     # int64; both terms < 2^31 - 1
    seed = tl.where(seed >= 2147483647, seed - 2147483647, seed).to(tl.int32)
    # this program's SUB consecutive programs of the parameter's own grid, one after another
    # (the lookups above are paid once for SUB of them), the last one's cut at the grid's end
    if SUB == 1:    # no loop: a loop keeps the pointers live across its body (spills)
        _step_program(pid - tl.load(row + 15), p_ptr, g_ptr, mc_ptr, ms_ptr, mcs_ptr,
                      vc_ptr, vs_ptr, vcs_ptr, vmean_ptr, p_ptr, n, npad, seed, ph_rows, row0,
                      decay, beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, mo_ptr,
                      rtab_ptr, False, CPP_C, FAST_DEC, U8, ROUNDS, HAS_MODEL_OUT, BF16_HW,
                      FAST_DIV)
    else:
        nsub = (ph_rows * 16 + npad + (1024 * CPP_C - 1)) // (1024 * CPP_C)
        k0 = (pid - tl.load(row + 15)) * SUB
        for k in range(k0, tl.minimum(k0 + SUB, nsub)):
            _step_program(k, p_ptr, g_ptr, mc_ptr, ms_ptr, mcs_ptr,
                          vc_ptr, vs_ptr, vcs_ptr, vmean_ptr, p_ptr, n, npad, seed, ph_rows,
                          row0, decay, beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size,
                          mo_ptr, rtab_ptr, False, CPP_C, FAST_DEC, U8, ROUNDS, HAS_MODEL_OUT,
                          BF16_HW, FAST_DIV)


class Item(NamedTuple):
    """One parameter of a multi-tensor launch: what ``triton_step.launch`` takes for it.
    ``seed_base``: ``(seed · 1000003 + key · 7919) mod (2^31 − 1)`` (module docstring)."""
    p: torch.Tensor             # flat FP32
    g: torch.Tensor             # flat FP32 or BF16, contiguous
    st: dict                    # the kernel's state views (optimizer.kernel_views)
    n: int
    npad: int
    phase: int
    row0: int
    seed_base: int
    model_out: Optional[torch.Tensor] = None    # flat BF16 viewed as int16, or None


def seed_base(seed: int, key: int) -> int:
    return (seed * 1_000_003 + key * 7_919) % SEED_MOD


def step_seed(t: int) -> int:
    return (t * 104_729) % SEED_MOD


def _g_unit(g: torch.Tensor) -> int:
    return 16 // g.element_size()


def batchable(it: Item) -> bool:
    """Whether ``it`` can join a multi-tensor launch: ``n`` a multiple of 16 and every tensor
    the kernel reads as vectors at a 16-byte-aligned address (module docstring). The offsets
    from the launch's base tensors are then multiples of the units too, as the bases are
    batchable tensors' addresses."""
    if it.n % BLOCK or it.g.dtype not in (torch.float32, torch.bfloat16):
        return False
    vec = [it.p, it.g, it.st["exp_avg_codes"], it.st["exp_avg_sq_codes"]]
    if it.model_out is not None:
        vec.append(it.model_out)
    return all(t.data_ptr() % 16 == 0 for t in vec) and \
        all(it.st[k].data_ptr() % it.st[k].element_size() == 0 for k in _STATE_KEYS)


def _columns(items: Sequence[Item]):
    """Per column: the base tensor (lowest address) and each item's offset in the column's
    unit."""
    kinds = [
        ([it.p for it in items], 4),
        ([it.g for it in items], _g_unit(items[0].g)),
        ([it.st["exp_avg_codes"] for it in items], 16),
        ([it.st["exp_avg_scales"] for it in items], 1),
        ([it.st["exp_avg_chunk_scales"] for it in items], 1),
        ([it.st["exp_avg_sq_codes"] for it in items], 16),
        ([it.st["exp_avg_sq_scales"] for it in items], 1),
        ([it.st["exp_avg_sq_chunk_scales"] for it in items], 1),
        ([it.st["exp_avg_sq_means"] for it in items], 1),
        ([it.model_out if it.model_out is not None else it.p for it in items],
         8 if items[0].model_out is not None else 4),
    ]
    bases, offsets = [], []
    for ts, unit in kinds:
        base = min(ts, key=lambda t: t.data_ptr())
        step = unit * base.element_size()
        offs = []
        for t in ts:
            d = t.data_ptr() - base.data_ptr()
            if d % step:
                raise ValueError(f"multi-tensor Q-AdamW launch: a tensor sits {d} bytes from "
                                 f"its base, not a multiple of {step} (use batchable())")
            offs.append(d // step)
        bases.append(base)
        offsets.append(offs)
    return bases, offsets


class _Plan(NamedTuple):
    key: tuple
    tab: torch.Tensor
    prog: torch.Tensor
    bases: list
    nprog: int


_PLANS: dict = {}
_MAX_PLANS = 8


def _key(items: Sequence[Item], cpp: int, sub: int) -> tuple:
    parts = [cpp, sub]
    for it in items:
        parts.append((it.p.data_ptr(), it.g.data_ptr(), it.g.dtype, it.n, it.npad, it.phase,
                      it.row0, it.seed_base,
                      None if it.model_out is None else it.model_out.data_ptr(),
                      tuple(it.st[k].data_ptr() for k in _STATE_KEYS)))
    return tuple(parts)


def plan(items: Sequence[Item], cpp: int, sub: int) -> _Plan:
    """The launch's tables, cached by everything they hold (addresses included: a state
    replaced by a checkpoint load, or a parameter reallocated, makes a new plan)."""
    key = _key(items, cpp, sub)
    hit = _PLANS.get(key)
    if hit is not None:
        return hit
    bases, offsets = _columns(items)
    rows, counts, start = [], [], 0
    for i, it in enumerate(items):
        if it.phase % TILE or not 0 <= it.phase < CHUNK or it.npad % TILE or it.n % BLOCK:
            raise ValueError(f"multi-tensor Q-AdamW launch: item {i} has n={it.n}, "
                             f"npad={it.npad}, phase={it.phase}")
        nprog = -(-(it.phase + it.npad) // (CHUNK * cpp * sub))
        rows.append([offsets[c][i] for c in range(10)]
                    + [it.n // BLOCK, it.npad // TILE, it.phase // BLOCK, it.row0, it.seed_base,
                       start])
        counts.append(nprog)
        start += nprog
    dev = items[0].p.device
    tab = torch.tensor(rows, dtype=torch.int64).to(dev)
    prog = torch.repeat_interleave(torch.arange(len(items), dtype=torch.int32),
                                   torch.tensor(counts)).to(dev)
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.pop(next(iter(_PLANS)))
    out = _Plan(key, tab, prog, bases, start)
    _PLANS[key] = out
    return out


def launch_multi(items: Sequence[Item], *, t: int, decay, beta1, omb1, beta2, omb2,
                 inv_sqrt_bc2, eps, step_size, cpp=None, fast_dec=None, maxnreg=None,
                 u8=True, rounds=10, fast_div=None, sub=None) -> None:
    """Step every item in one launch, each exactly as ``triton_step.launch(..., seed=
    optimizer._seed(seed, key, t), phase=, row0=, model_out=)`` would (Philox uniforms; the
    uniforms-given path is the per-parameter launch's only). ``t``: the step count shared by
    all items; the scalars as ``optimizer.kernel_hyper`` gives them. Every item must be
    :func:`batchable`, with one gradient dtype, and all or none with ``model_out``."""
    if not items:
        return
    if len({it.g.dtype for it in items}) != 1 or \
            len({it.model_out is None for it in items}) != 1:
        raise ValueError("multi-tensor Q-AdamW launch: items need one gradient dtype and all "
                         "or none with model_out")
    cpp = triton_step.CPP if cpp is None else cpp
    fast_dec = triton_step.FAST_DEC if fast_dec is None else fast_dec
    maxnreg = triton_step.MAXNREG if maxnreg is None else maxnreg
    extra = {"maxnreg": maxnreg} if maxnreg and not _INTERPRET else {}
    sub = SUB if sub is None else sub
    pl = plan(items, cpp, sub)
    has_out = items[0].model_out is not None
    launch_kernel(q_adamw_multi_kernel, (pl.nprog,), pl.tab, pl.prog, *pl.bases, step_seed(t),
                  decay, beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size,
                  triton_step.recip_table(items[0].p.device),
                  G_UNIT=_g_unit(items[0].g), MO_UNIT=8 if has_out else 4, SUB=sub,
                  CPP_C=cpp, FAST_DEC=bool(fast_dec), U8=bool(u8), ROUNDS=rounds,
                  HAS_MODEL_OUT=has_out, BF16_HW=triton_step.BF16_HW_CVT and not _INTERPRET,
                  FAST_DIV=bool(triton_step.FAST_DIV if fast_div is None else fast_div)
                  and not _INTERPRET,
                  num_warps=2 * cpp, enable_fp_fusion=False, **extra)
