"""Triton NVFP4 quantize (``quantize_triton``): fused amax, 1×16 / 16×16 tiles, nearest /
stochastic, 4/6, RHT-16; the kernels and their host side.

Bit-exact with :func:`fullstack_fp4.nvfp4.reference.quantize_reference` (the oracle; see its
docstring and docs/nvfp4-format.md for the contract). Every FP32 operation below is the
reference's, in the reference's order; what a kernel adds is *how* each step is computed:

* **Tensor scales.** ``enc = min(div_rn(M·6, amax), FP32_MAX)``, ``enc = 1`` if ``enc == 0``,
  ``dec = div_rn(1, enc)``. ``div_rn`` is IEEE round-to-nearest division (Triton's ``/`` on
  FP32 is ``div.full.f32``, an approximation with 2 ulp error, so it is never used for a value
  that reaches the output). Each program recomputes enc/dec from the amax (two divisions per
  program, nothing next to its 4096+ elements); program 0 stores ``dec`` as the tensor scale.
  As in the reference (TE's order), an all-zero tensor gets ``enc = FP32_MAX`` and a subnormal
  ``dec``: the kernels never flush subnormals (no ``.ftz``), so this is reproduced.
* **Block scale.** ``s = e4m3_rne(min(bamax · (enc · fp32(1/6)), 448))`` (1/4 for the map-to-4
  candidate), rounded to E4M3 in integer arithmetic (``fp4_math.e4m3_rne``): normal range by adding
  ``0x7FFFF + lsb`` to the FP32 bits and truncating 20 mantissa bits (RNE to 3 bits; the carry
  moves into the exponent on its own); below 2⁻⁶ (E4M3 subnormals, quantum 2⁻⁹) by
  ``(v + 2¹⁴) − 2¹⁴``, whose FP32 ulp is exactly 2⁻⁹ so the hardware's RNE addition does the
  rounding. Tested against ``torch.Tensor.to(torch.float8_e4m3fn)`` on every E4M3 midpoint.
  The same code runs under the interpreter and on the GPU (no reliance on a backend's fp8 cvt).
  The kernels use ``fp4_math.e4m3_rne1`` (one rounding add ``v + 2^(E+20)`` for every range,
  subnormals included; same values).
* **Element factor.** ``f = min(div_rn(1, fp32(s) · dec), FP32_MAX)``: a zero scale gives
  ``f = FP32_MAX`` (TE), so non-zero elements of such a block saturate to ±6 and decode to 0.
* **E2M1 rounding** of ``a = |clamp(x·f, −6, 6)|`` (``fp4_math.e2m1_code``): with ``inv`` = 2, 1, ½
  for ``a`` in [0, 2), [2, 4), [4, 6] (the reciprocal of the grid step), ``t = a · inv`` is exact
  and the grid point index inside the binade is ``rint(t)`` (nearest) or ``floor(t) + (u <
  t − floor(t))`` (stochastic). ``rint`` is ``bits(t + 2²³) & 7``: ``t + 2²³`` has ulp 1, so the
  FP32 addition rounds ``t`` to an integer with ties to even, and ties-to-even on the index is
  ties-to-even on the E2M1 mantissa (0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4). The
  code is the index plus 2 per binade boundary crossed; the sign bit comes from ``y < 0`` (so
  ``-0`` gets code 8 like the reference / TE, and ``y == -0.0`` gets 0). ``t − floor(t)`` equals
  the contract's ``(a − lo) / (hi − lo)`` exactly (both exact in FP32). The kernels, without
  compare/select ladders or float->int conversions (``fp4_math.e2m1_rne_t``, ``nib_sr``):
  nearest is ``rne(min(2a, a + 2, a/2 + 4, 7))`` in code space (three roundings at 2²³, the
  min of the rounded terms is the rounded min); stochastic takes ``inv`` from the exponent
  bits, ``r = rint(a·inv)`` and ``d = a·inv − r`` (exact), and the index
  ``r − [d < 0] + [u < (d < 0 ? d + 1 : d)]`` (= ``floor + [u < frac]``).
* **4/6.** Both candidates are rounded to nearest; ``err = Σ |x − (q · s) · dec|`` with each term
  in FP32 and the sum in FP64 (``(q · s)`` is exact; ``| |x| − r·s·dec |`` equals
  ``|x − q·s·dec|`` bit for bit since ``q`` has ``x``'s sign); keep 4 iff ``err4 < err6``.
  The kernel sums each 8-element half in element order, then low + high.
* **FMA contraction is disabled** (``enable_fp_fusion=False`` at every launch): a fused
  ``x·f − lo`` or ``x − q·s·dec`` would skip a rounding the reference performs.

**Fused amax.** When ``global_amax`` is not given, a first kernel (``amax._amax_kernel``) reads
``x`` once, each program reduces ``|x|`` over its tile (a NaN-propagating float max,
``max.NaN``, whose NaN is positive) and does **one** ``atomic_max`` on the FP32 bit pattern
viewed as int32 (for non-negative floats integer order is float order; NaN bit patterns are
above +Inf, so a NaN cannot be lost the way ``max`` on floats may drop it).
The quantize kernel then reads ``x`` a second time and takes the amax from device memory: no
host round trip between the two kernels; the host checks finiteness once, after both are
queued (``.item()``), and raises ``ValueError`` (the codes computed from a non-finite amax are
thrown away). To recover part of the second read from L2, the quantize kernel walks its tiles
in reverse order after an amax pass (the amax pass finished on the tensor's tail, which is
what is still in L2). With ``global_amax`` given, ``x`` is read once; the quantize kernel then
tracks the observed amax the same way (one atomic per program, from its block maxima, taken
NaN-propagating in that mode) only to detect NaN/Inf.

**RHT-16 fused.** With ``rht_signs``, each 16-block is transformed in registers before
anything else, with :func:`fullstack_fp4.nvfp4.hadamard.hadamard16`'s arithmetic: × signs
(exact), butterflies with strides 1, 2, 4, 8 (``(a + b, a − b)``), × 0.25 (exact). The global
amax must then be the amax of the *transformed* tensor, because the block scales and the
tensor scale are computed from the transformed values (a block whose transformed max exceeds
the raw amax would otherwise get a scale above 448·enc/6 and saturate); so the amax pass
applies the same transform. The result equals ``quantize_reference(hadamard16(x, signs))``
bit for bit. A caller that passes ``global_amax`` together with ``rht_signs`` must pass the
amax of the transformed tensor.

**Stochastic rounding.** ``rand`` (FP32 uniforms, shape of ``x``) is read if given (tests);
otherwise the kernel draws 8 random bits an element from Philox4x32-10 under ``seed``: the
stream of :mod:`.sr_stream` (its docstring has the counter/word/byte mapping and why 8 bits;
``sr_stream.sr_uniforms`` computes it in PyTorch). One Philox call covers 4 rows × 4 elements
of a block; these tiled kernels hold one row of a block a thread, so they evaluate the call of
each (row, element quad) and keep the row's word — one call per 4 elements. The kernel
evaluates the Philox4x32-10 rounds itself (``fp4_math.philox10``: one 64-bit product per
``umulhi``/low pair) on int32 counters, through ``tl.randint4x`` where a counter may pass 2³¹.
:func:`philox_uniforms` dumps the same stream through ``tl.randint4x``
(``fp4_math.philox_halves``); a test checks that it is ``sr_uniforms``.

**Tiled kernel** (``_quantize_kernel``). A program owns ``BLOCK_M`` rows × ``BLOCK_B``
16-blocks, each block held in *eo* form (``fp4_math``): even / odd elements of each 8-element
half, BF16 read as int32 words (one integer op a value), so every per-block reduction, RHT
butterfly and nibble packing stays inside a thread. int32 offsets unless an offset may reach
2³¹ (``I64``, chosen on the host), a 2-D grid (no integer division), compile-time RHT signs,
two blocks a thread for nearest rounding, the 8 code bytes of a block in one 8-byte store.
``benchmarks/bench_nvfp4_quantize.py --sass`` counts its SASS instructions.

**Flat kernels** (``_quantize_flat_kernel``, ``amax._amax_flat_kernel``): the commonest call —
a contiguous BF16 tensor, 1×16 blocks, round-to-nearest, the 6 rule, no RHT (the NVFP4
linear's forward activation, any ``quantize(x)`` with defaults). The tiled kernel gives each
thread whole 16-blocks, so each of its loads is a 16-byte vector per thread at a 32-byte stride
across the warp (half of every sector per instruction). For a contiguous tensor with K % 16 ==
0 no 16-block straddles a row, and the scale tensor ``[..., K // 16]`` in row-major order *is*
the flat block index: block ``b`` is words ``8b .. 8b+7`` of the tensor viewed as int32, its
scale is byte ``b``, its codes are bytes ``8b .. 8b+7``. A program takes ``NBP`` consecutive
blocks as a ``[NBP, 2, 4]`` word tensor: each thread loads one 16-byte half-block, consecutive
threads consecutive halves, so a warp instruction reads 512 contiguous bytes (full sectors) and
stores one 4-byte code word, again contiguous across the warp; the block max pairs two threads
(one shuffle). Same helpers, same bits (tests/fullstack_fp4/nvfp4/test_quantize_flat.py);
timings: ``docs/perf/nvfp4.md``. ``flat=False`` or an explicit ``config`` runs the tiled one.
"""

from __future__ import annotations

import math
import struct
from typing import Optional

import torch

import triton
import triton.language as tl

from ..tensor import NVFP4Tensor
from .amax import _amax_flat_kernel, _amax_kernel
from .fp4_math import (FP32_MAX, NAN_BITS, bf16w_to_f32, block_amax_eo, candidate_fast,
                       e2m1_code, e2m1_rne_val, e4m3_rne, e4m3_rne1, err_eo, load_eo, max_nan,
                       nib_rne, nib_sr, pack_word, philox_eo, philox_halves, rht16_eo,
                       store_codes, tensor_scales, tile_coords, tile_coords_2d, tile_reduce_max,
                       tile_reduce_sum)
from .launch import cdiv, launch, next_pow2


__all__ = ["quantize_triton", "amax_triton", "philox_uniforms", "e4m3_rne_triton",
           "e2m1_round_triton", "rounding_probe_triton"]

_SCALE_RULES = {"6": 448.0, "4over6": 256.0}
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------- host side
_INTERPRET = None


def _is_interpreter() -> bool:
    """TRITON_INTERPRET as triton.jit saw it (it decides at decoration time), read once."""
    global _INTERPRET
    if _INTERPRET is None:
        import os
        _INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return _INTERPRET


_cdiv, _pow2 = cdiv, next_pow2     # not triton.cdiv / next_power_of_2: see launch.cdiv


def _interpreter_config(rows: int, nblk: int):
    """Under the interpreter the cost is per op and program: one tile over as much of the
    tensor as is not mostly padding."""
    return (min(max(_pow2(rows), 16), 64),
            min(_pow2(max(nblk, 1)), 8), 4)


def _default_config(nblk: int, rows: int = 16, heavy: bool = False):
    """(BLOCK_M rows, BLOCK_B 16-blocks, num_warps) of the quantize kernel.

    heavy: stochastic rounding or the 4/6 rule (more live registers a block)."""
    if _is_interpreter():
        return _interpreter_config(rows, nblk)
    nb = 8 if nblk >= 8 else _pow2(nblk)
    if heavy:
        # one block a thread: for SR / 4-over-6 two blocks a thread need 74-139 registers for a
        # 7-10% cut in instructions (docs/perf/nvfp4.md)
        return 16, nb, 4
    # 32 rows x 8 blocks, 4 warps: two blocks a thread, which halves the per-thread setup
    # (tile coordinates, tensor scales) per element at 56 registers: 18.1 vs 20.3 SASS
    # instructions an element for 1x16 nearest. `benchmarks/bench_nvfp4_quantize.py --sweep`
    # times the alternatives on a GPU.
    return 32, nb, 4


def _amax_config(nblk: int, rows: int = 16):
    """(BLOCK_M, BLOCK_B, num_warps) of the amax pass: 64 rows x 8 blocks, 4 blocks a thread
    (8 16-byte loads in flight per thread, a quarter of the programs and atomics)."""
    if _is_interpreter():
        return _interpreter_config(rows, nblk)
    nb = 8 if nblk >= 8 else _pow2(nblk)
    return 64, nb, 4


_I32_LIMIT = 2**31 - 1

#: Bytes at the end of the input that the amax pass loads ``evict_last``, so that more of what the
#: quantize pass reads first (it walks the tiles in reverse) is still in L2 (H200: 50 MB). 0: the
#: default policy everywhere (LRU already keeps the tail; evict_last may also shield it from the
#: quantize's own code writes). Not enabled blind: ``bench_nvfp4_quantize.py --sweep`` times it.
AMAX_L2_TAIL_BYTES = 0


def _needs_i64(rows: int, nblk: int, bm: int, nb: int, strides) -> bool:
    """Whether an element / word / Philox-counter offset of the padded grid may pass 2^31 - 1
    (then the kernels compute row offsets in int64; otherwise int32, fewer instructions)."""
    rows_pad = _cdiv(rows, bm) * bm
    cols_pad = _cdiv(nblk, nb) * nb * 16
    worst = max([rows_pad * max(int(s), 1) + cols_pad for s in strides]
                + [(rows_pad * nblk + cols_pad // 16) * 4 + 4])
    return worst > _I32_LIMIT


def _grid(rows: int, nblk: int, bm: int, nb: int):
    """(grid, GRID2D): a 2-D grid (block tiles, row tiles) while the row tiles fit CUDA's
    65535 limit of grid axis 1 (no integer division in the kernel), else 1-D."""
    nm, nbk = _cdiv(rows, bm), _cdiv(nblk, nb)
    if nm <= 65535:
        return (nbk, nm), True
    return (nm * nbk,), False


def _sign_mask(rht_signs) -> int:
    """The 16 RHT signs (validated on the host) as a bit mask: bit i set iff sign i is -1."""
    if rht_signs is None:
        return 0
    if isinstance(rht_signs, torch.Tensor):
        rht_signs = rht_signs.detach().to("cpu", torch.float64).reshape(-1).tolist()
    vals = tuple(float(v) for v in rht_signs)
    if len(vals) != 16 or any(v not in (1.0, -1.0) for v in vals):
        raise ValueError("rht_signs must be 16 values of +-1")
    return sum(1 << i for i, v in enumerate(vals) if v == -1.0)


def _x_operand(x2: torch.Tensor):
    """(tensor passed as x, row stride, XW): BF16 as int32 words when its layout allows it."""
    if (x2.dtype == torch.bfloat16 and x2.stride(0) % 2 == 0
            and x2.storage_offset() % 2 == 0):
        return x2.view(torch.int32), x2.stride(0) // 2, True
    return x2, x2.stride(0), False


def _check_input(x: torch.Tensor, tile, rounding, scale_rule):
    tile = tuple(tile)
    if tile not in ((1, 16), (16, 16)):
        raise ValueError(f"tile must be (1, 16) or (16, 16), got {tile}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if scale_rule not in _SCALE_RULES:
        raise ValueError(f"scale_rule must be '6' or '4over6', got {scale_rule!r}")
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"input dtype must be bf16, fp16 or fp32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % 16:
        raise ValueError(f"last dimension must be a multiple of 16, got shape {tuple(x.shape)}")
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if tile == (16, 16) and rows % 16:
        raise ValueError(f"16x16 tiles need the rows ({rows}) to be a multiple of 16")
    return tile, rows, k


def _as_2d(x: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError("quantize_triton needs a contiguous last dimension")
    x2 = x.reshape(rows, k)             # a view unless the leading dims are not collapsible
    return x2


def _launch_amax(x2, amax_bits, rows: int, nblk: int, rht: bool, smask: int,
                 config: Optional[tuple] = None):
    """Queue the amax pass (atomic max of the |x| bits into ``amax_bits``, which must be 0)."""
    if config is not None:
        bm, nb, nw = config
    else:
        bm, nb, nw = _amax_config(nblk, rows)
    xk, stride_xk, xw = _x_operand(x2)
    i64 = _needs_i64(rows, nblk, bm, nb, (x2.stride(0),))
    grid, grid2d = _grid(rows, nblk, bm, nb)
    tail_rows = AMAX_L2_TAIL_BYTES // max(nblk * 16 * x2.element_size(), 1)
    launch(_amax_kernel, grid,
        xk, amax_bits, rows, nblk, stride_xk, rows - tail_rows, RHT=rht, BM=bm, NB=nb, XW=xw,
        I64=i64, SIGN_MASK=smask, GRID2D=grid2d, num_warps=nw, enable_fp_fusion=False)


#: Whether ``quantize_triton`` runs the flat kernels (module docstring) by default where
#: they apply (:func:`_flat_applies`).
FLAT_DEFAULT = True


def _flat_applies(x2, tile, stochastic, four6, rht, rand) -> bool:
    """The flat kernels' case: contiguous BF16 at a 4-byte-aligned address (read as int32
    words), 1x16 tiles, nearest rounding, the 6 rule, no RHT, no explicit uniforms."""
    return (x2.dtype == torch.bfloat16 and tile == (1, 16) and not stochastic and not four6
            and not rht and rand is None and x2.is_contiguous() and x2.storage_offset() % 2 == 0)


def _flat_config(nblk_all: int, config: Optional[tuple] = None):
    """(NBP blocks a program, num_warps) of the flat quantize: 256 blocks (8 KB of BF16) on 4
    warps, i.e. four 16-byte half-blocks a thread in flight; the interpreter takes fewer."""
    if config is not None:
        return config
    if _is_interpreter():
        return min(max(_pow2(nblk_all), 2), 64), 4
    return 256, 4


#: (words a program, num_warps) override of the flat amax pass (benchmark sweeps), or None.
FLAT_AMAX_CONFIG = None


def _flat_amax_config(nwords: int):
    """(words a program, num_warps) of the flat amax pass: 4096 words (16 KB) on 8 warps."""
    if FLAT_AMAX_CONFIG is not None:
        return FLAT_AMAX_CONFIG
    if _is_interpreter():
        return min(max(_pow2(nwords), 16), 1024), 4
    return 4096, 8


def _launch_amax_flat(x2, amax_bits):
    xw = x2.view(torch.int32).reshape(-1)
    nw = xw.numel()
    block, warps = _flat_amax_config(nw)
    launch(_amax_flat_kernel, (_cdiv(nw, block),), xw, amax_bits, nw, BLOCK=block,
           I64=(_cdiv(nw, block) + 1) * block > _I32_LIMIT, num_warps=warps)


def _host_amax_bits(global_amax) -> int:
    """FP32 bits of a host-number amax (rounded as ``torch.tensor(v, dtype=float32)``), or a
    ValueError if it is not finite and >= 0 (checked here: no device round trip)."""
    v = float(global_amax)
    try:
        bits = struct.unpack("<i", struct.pack("<f", v))[0]   # RNE to FP32, as torch
    except OverflowError:                                   # beyond FP32: torch makes it inf
        bits = 0x7F800000
    if not math.isfinite(v) or bits & 0x7FFFFFFF >= 0x7F800000 or v < 0:
        raise ValueError(f"global_amax must be finite and >= 0, got {v}")
    return bits


def quantize_triton(
    x: torch.Tensor,
    *,
    tile=(1, 16),
    rounding: str = "nearest",
    scale_rule: str = "6",
    global_amax=None,
    rand: Optional[torch.Tensor] = None,
    seed: Optional[int] = None,
    rht_signs=None,
    generator: Optional[torch.Generator] = None,
    config: Optional[tuple] = None,
    check_finite: bool = True,
    flat: Optional[bool] = None,
) -> NVFP4Tensor:
    """Quantize ``x`` (BF16/FP16/FP32, any leading dims, contiguous last dim K % 16 == 0) to NVFP4.

    Bit-identical to ``quantize_reference(x if rht_signs is None else hadamard16(x, rht_signs),
    tile=..., rounding=..., scale_rule=..., global_amax=..., rand=...)``.

    rand: FP32 uniforms in [0, 1), shape of ``x`` (stochastic rounding); else Philox in the
        kernel under ``seed`` (drawn from ``generator`` / torch's default generator if None;
        :func:`philox_uniforms` returns the uniforms a given seed produces).
    rht_signs: 16 values ±1 (e.g. ``DEFAULT_SIGNS``) to fuse RHT-16 into the quantize, or None.
        ``global_amax``, when given with RHT, must be the amax of the transformed tensor.
    config: (BLOCK_M, BLOCK_B, num_warps) override (benchmarks); BLOCK_M a multiple of 16 for
        16×16 tiles.
    check_finite: True (default): raise ValueError on NaN/Inf input or a bad ``global_amax``
        (one host sync, after the kernels are queued). False: no sync; a NaN/Inf input (or a
        non-finite / negative amax) instead makes the tensor scale NaN, so anything computed
        from the result (GEMM, dequantize) is NaN and a per-step check downstream (the
        training loop's grad-norm / loss check) catches it. The codes of such a tensor are
        meaningless. Finite inputs give bit-identical results either way.
    Host numbers as ``global_amax`` are passed by value (no H2D copy, no sync); a CUDA tensor
    is read on the device.
    flat: the flat kernels (module docstring) for contiguous BF16, 1x16, nearest, the 6 rule,
        no RHT. None (default): used wherever they apply, if ``FLAT_DEFAULT``, and no
        ``config`` is asked for; True: required (ValueError where they do not apply;
        ``config`` is then (blocks a program, num_warps)); False: the tiled kernel. Same bits
        in every case.
    """
    tile, rows, k = _check_input(x, tile, rounding, scale_rule)
    dev = x.device
    nblk = k // 16
    stochastic = rounding == "stochastic"
    four6 = scale_rule == "4over6"
    tile2d = tile == (16, 16)
    lead = tuple(x.shape[:-1])

    data = torch.empty((*lead, k // 2), dtype=torch.uint8, device=dev)
    scale = torch.empty((*lead, nblk), dtype=torch.uint8, device=dev)
    dec = torch.empty((1,), dtype=torch.float32, device=dev)
    if rows == 0 or k == 0:
        dec.fill_(1.0 / FP32_MAX.value)  # reference: amax 0 -> enc FP32_MAX
        return NVFP4Tensor(data, scale.view(torch.float8_e4m3fn), dec.reshape(()), x.shape,
                           x.dtype, tile)

    x2 = _as_2d(x, rows, k)
    rht = rht_signs is not None
    flat_ok = _flat_applies(x2, tile, stochastic, four6, rht, rand)
    if flat and not flat_ok:
        raise ValueError("flat=True needs a contiguous BF16 input, tile (1, 16), nearest rounding, "
                         "the 6 rule, no RHT and no explicit rand")
    if flat is None:
        flat = flat_ok and FLAT_DEFAULT and config is None
    if flat:
        return _quantize_flat(x2, x, data, scale, dec, global_amax, config, check_finite)
    smask = _sign_mask(rht_signs)

    philox = False
    rand2 = x2          # placeholder pointer, never read unless stochastic with explicit rand
    stride_r = 0
    seed_v = 0
    if stochastic:
        if rand is not None:
            if tuple(rand.shape) != tuple(x.shape):
                raise ValueError(f"rand shape {tuple(rand.shape)} != input shape {tuple(x.shape)}")
            rand2 = rand.to(device=dev, dtype=torch.float32).reshape(rows, k).contiguous()
            stride_r = rand2.stride(0)
        else:
            philox = True
            if seed is None:
                seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator).item())
            seed_v = int(seed)

    bm, nb, nw = (config if config is not None
                  else _default_config(nblk, rows, stochastic or four6))
    if tile2d and bm % 16:
        raise ValueError("BLOCK_M must be a multiple of 16 for 16x16 tiles")
    grid, grid2d = _grid(rows, nblk, bm, nb)
    xk, stride_xk, xw = _x_operand(x2)
    i64 = _needs_i64(rows, nblk, bm, nb, (x2.stride(0), stride_r))

    obs, amax_bits, imm, g = _amax_source(global_amax, dev)
    given = global_amax is not None
    if not given:
        _launch_amax(x2, amax_bits, rows, nblk, rht, smask)
    launch(_quantize_kernel, grid,
        xk, rand2, amax_bits, obs, data.view(torch.int32), scale, dec, seed_v, imm,
        rows, nblk, stride_xk, stride_r,
        M_BOUND=_SCALE_RULES[scale_rule], TILE2D=tile2d, STOCHASTIC=stochastic, PHILOX=philox,
        FOUR_OVER_SIX=four6, RHT=rht, TRACK_AMAX=given, REVERSE=not given,
        AMAX_IMM=given and g is None, BM=bm, NB=nb, XW=xw, I64=i64, SIGN_MASK=smask,
        GRID2D=grid2d, num_warps=nw, enable_fp_fusion=False)

    return _finish(x, data, scale, dec, obs, given, g, check_finite, tile)


def _amax_source(global_amax, dev):
    """``(obs, amax_bits, imm, g)`` for both kernel forms: ``obs`` the zeroed int32 the kernels
    max their observed amax bits into; ``amax_bits`` what they read the scales' amax from (``obs``
    itself when the amax pass fills it or when the amax comes by value); ``imm`` a host number's
    FP32 bits (AMAX_IMM); ``g`` a given device amax as FP32 ``[1]`` (else None)."""
    obs = torch.zeros((1,), dtype=torch.int32, device=dev)
    if global_amax is None:
        return obs, obs, 0, None
    if not isinstance(global_amax, torch.Tensor):
        # A host number: checked on the host and passed by value (its FP32 bits, rounded as
        # torch.as_tensor(..., float32) rounds it). torch.as_tensor(float, device=cuda) would be
        # a pageable H2D copy, i.e. a stream sync per call. obs is then never read as the amax.
        return obs, obs, _host_amax_bits(global_amax), None
    g = global_amax.to(device=dev, dtype=torch.float32).reshape(1)
    return obs, g.view(torch.int32), 0, g


def _finish(x, data, scale, dec, obs, given, g, check_finite, tile) -> NVFP4Tensor:
    """NaN/Inf handling shared by both kernel forms, then the NVFP4Tensor."""
    if given:
        # The kernel poisoned dec for a bad *given* amax; a NaN/Inf seen in the input only
        # shows in obs (the observed amax bits): poison dec for it too (no sync).
        dec = torch.where(obs >= 0x7F800000, torch.full_like(dec, float("nan")), dec)
    if check_finite:
        # One host sync: NaN/Inf in the input <=> the observed amax bits are >= +Inf's.
        bad = obs >= 0x7F800000
        if g is not None:
            bad = bad | ~torch.isfinite(g) | (g < 0)
        if bool(bad.item()):
            if g is not None and not (bool(torch.isfinite(g).all()) and bool((g >= 0).all())):
                raise ValueError(f"global_amax must be finite and >= 0, got {float(g)}")
            raise ValueError("quantize: input holds NaN or Inf")
    return NVFP4Tensor(data, scale.view(torch.float8_e4m3fn), dec.reshape(()), x.shape, x.dtype, tile)


def _quantize_flat(x2, x, data, scale, dec, global_amax, config, check_finite) -> NVFP4Tensor:
    """The flat kernels (module docstring): amax pass (unless given) + one quantize pass."""
    dev = x2.device
    nblk_all = x2.numel() // 16
    nbp, warps = _flat_config(nblk_all, config)
    obs, amax_bits, imm, g = _amax_source(global_amax, dev)
    given = global_amax is not None
    if not given:
        _launch_amax_flat(x2, amax_bits)
    nprog = _cdiv(nblk_all, nbp)
    launch(_quantize_flat_kernel, (nprog,),
        x2.view(torch.int32), amax_bits, obs, data.view(torch.int32), scale, dec, imm, nblk_all,
        TRACK_AMAX=given, REVERSE=not given, AMAX_IMM=given and g is None, NBP=nbp,
        I64=(nprog + 1) * nbp * 8 > _I32_LIMIT, num_warps=warps, enable_fp_fusion=False)
    return _finish(x, data, scale, dec, obs, given, g, check_finite, (1, 16))


def amax_triton(x: torch.Tensor, rht_signs=None, config: Optional[tuple] = None) -> torch.Tensor:
    """``|x|.amax()`` (of ``hadamard16(x, rht_signs)`` if signs are given) as an FP32 0-dim
    device tensor, by the quantize's own amax kernel (NaN propagates: its bits order above
    +Inf). For callers that reduce the amax across ranks before quantizing with RHT.
    config: (BLOCK_M, BLOCK_B, num_warps) override (benchmarks)."""
    if x.shape[-1] % 16:
        raise ValueError(f"last dimension must be a multiple of 16, got shape {tuple(x.shape)}")
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    obs = torch.zeros((1,), dtype=torch.int32, device=x.device)
    if rows and k:
        x2 = _as_2d(x, rows, k)
        _launch_amax(x2, obs, rows, k // 16, rht_signs is not None, _sign_mask(rht_signs),
                     config)
    return obs.view(torch.float32).reshape(())


def philox_uniforms(shape, seed: int, device="cpu") -> torch.Tensor:
    """The FP32 uniforms the quantize kernel draws for a tensor of ``shape`` under ``seed``,
    through the kernels' own Philox helper (``sr_stream.sr_uniforms`` is the same stream in
    PyTorch)."""
    shape = tuple(shape)
    k = shape[-1]
    if k % 16:
        raise ValueError("last dimension must be a multiple of 16")
    rows = 1
    for d in shape[:-1]:
        rows *= d
    u = torch.empty((rows, k), dtype=torch.float32, device=device)
    bm, nb = 16, 4
    grid = (_cdiv(rows, bm) * _cdiv(k // 16, nb),)
    if rows and k:
        _philox_uniforms_kernel[grid](u, int(seed), rows, k // 16, BM=bm, NB=nb, num_warps=4)
    return u.reshape(shape)


def rounding_probe_triton(v: torch.Tensor, u: Optional[torch.Tensor] = None) -> dict:
    """Test hook: the kernels' E4M3 / E2M1 helpers applied elementwise to ``v`` (FP32).

    Keys: ``e4m3_val``/``e4m3_bits`` (:func:`e4m3_rne` of ``min(|v|, 448)``),
    ``e2m1_code`` (:func:`e2m1_code`, nearest, of ``clamp(v, -6, 6)``), ``e4m3_val1``/``e4m3_bits1``
    (:func:`e4m3_rne1`), ``nib_rne`` (nearest nibble of ``v``, saturating), ``rne_val``
    (nearest E2M1 value of ``min(|v|, 6)``), ``nib_sr`` (stochastic nibble of ``v`` with
    uniforms ``u``, zeros if None)."""
    v = v.to(torch.float32).contiguous().reshape(-1)
    u = torch.zeros_like(v) if u is None else u.to(torch.float32).contiguous().reshape(-1)
    if u.shape != v.shape:
        raise ValueError("u must have the shape of v")
    n = v.numel()
    out = dict(e4m3_val=torch.empty_like(v), e4m3_bits=torch.empty(n, dtype=torch.int32, device=v.device),
               e2m1_code=torch.empty(n, dtype=torch.int32, device=v.device),
               e4m3_val1=torch.empty_like(v), e4m3_bits1=torch.empty(n, dtype=torch.int32, device=v.device),
               nib_rne=torch.empty(n, dtype=torch.int32, device=v.device), rne_val=torch.empty_like(v),
               nib_sr=torch.empty(n, dtype=torch.int32, device=v.device))
    block = 1024
    if n:
        _elementwise_probe_kernel[(_cdiv(n, block),)](v, u, *out.values(), n, BLOCK=block,
                                                             enable_fp_fusion=False)
    return out


def e4m3_rne_triton(v: torch.Tensor):
    """Test hook: (E4M3 value as FP32, E4M3 bits) of ``min(|v|, 448)``, and E2M1 nearest codes
    of ``clamp(v, -6, 6)``, through :func:`e4m3_rne` and :func:`e2m1_code` (see
    :func:`rounding_probe_triton`)."""
    o = rounding_probe_triton(v)
    return o["e4m3_val"], o["e4m3_bits"], o["e2m1_code"]


e2m1_round_triton = e4m3_rne_triton


# ----------------------------------------------------------------------------- kernels
@triton.jit(do_not_specialize=["seed", "amax_imm"])
def _quantize_kernel(x_ptr, rand_ptr, amax_ptr, obs_ptr,
                     data_ptr, scale_ptr, dec_ptr, seed, amax_imm,
                     M, NBLK, stride_xm, stride_rm,
                     M_BOUND: tl.constexpr, TILE2D: tl.constexpr, STOCHASTIC: tl.constexpr,
                     PHILOX: tl.constexpr, FOUR_OVER_SIX: tl.constexpr, RHT: tl.constexpr,
                     TRACK_AMAX: tl.constexpr, REVERSE: tl.constexpr, AMAX_IMM: tl.constexpr,
                     BM: tl.constexpr, NB: tl.constexpr, XW: tl.constexpr, I64: tl.constexpr,
                     SIGN_MASK: tl.constexpr, GRID2D: tl.constexpr):
    """One [BM rows × NB blocks] tile (GRID2D: of a 2-D grid, see :func:`tile_coords_2d`) in eo
    form; ``data_ptr`` the codes as int32 words; XW, I64, SIGN_MASK as in :func:`load_eo`,
    :func:`rht16_eo`."""
    if GRID2D:
        rows, blks, mask2, first = tile_coords_2d(M, NBLK, REVERSE, BM, NB)
    else:
        pid = tl.program_id(0)
        if REVERSE:
            pid = tl.num_programs(0) - 1 - pid
        rows, blks, mask2 = tile_coords(pid, M, NBLK, BM, NB)
        first = pid == 0
    e0, o0, e1, o1 = load_eo(x_ptr, rows, blks, mask2, stride_xm, XW, I64, True, BM, NB)
    if RHT:
        e0, o0, e1, o1 = rht16_eo(e0, o0, e1, o1, SIGN_MASK, BM, NB)
    # NaN-propagating block max when the observed amax is tracked (NaN/Inf detection).
    bamax = block_amax_eo(e0, o0, e1, o1, TRACK_AMAX)                  # [BM, NB]
    if TRACK_AMAX:
        obs = tl.reduce(tl.reduce(bamax, 1, max_nan), 0, max_nan)
        tl.atomic_max(obs_ptr, obs.to(tl.int32, bitcast=True))

    if AMAX_IMM:
        gbits = amax_imm                   # host number: its FP32 bits, no device read
    else:
        gbits = tl.load(amax_ptr)
    enc, dec = tensor_scales(gbits, M_BOUND)
    if first:
        # A non-finite (or negative) amax poisons the tensor scale: every product with this
        # tensor is NaN, so a caller that skips the host check still cannot train on garbage.
        bad = ((gbits & 0x7FFFFFFF) >= 0x7F800000) | (gbits.to(tl.float32, bitcast=True) < 0.0)
        nan = tl.full(dec.shape, NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
        tl.store(dec_ptr, tl.where(bad, nan, dec))

    if TILE2D:
        bamax = tile_reduce_max(bamax, BM, NB)
    s_val, s_bits, f = candidate_fast(bamax, enc, dec, 0.1666666716337204)
    if FOUR_OVER_SIX:
        s4_val, s4_bits, f4 = candidate_fast(bamax, enc, dec, 0.25)
        err6 = err_eo(e0, o0, e1, o1, f, s_val, dec, BM, NB)
        err4 = err_eo(e0, o0, e1, o1, f4, s4_val, dec, BM, NB)
        if TILE2D:
            err6 = tile_reduce_sum(err6, BM, NB)
            err4 = tile_reduce_sum(err4, BM, NB)
        use4 = err4 < err6                                             # ties go to 6
        s_bits = tl.where(use4, s4_bits, s_bits)
        f = tl.where(use4, f4, f)

    f3 = f[:, :, None]
    if STOCHASTIC:
        if PHILOX:
            u0, u1, u2, u3 = philox_eo(seed, rows, blks, NBLK, I64, BM, NB)
        else:
            u0, u1, u2, u3 = load_eo(rand_ptr, rows, blks, mask2, stride_rm, False, I64, True,
                                      BM, NB)
        n0 = nib_sr(e0, f3, u0)
        n1 = nib_sr(o0, f3, u1)
        n2 = nib_sr(e1, f3, u2)
        n3 = nib_sr(o1, f3, u3)
    else:
        n0 = nib_rne(e0, f3)
        n1 = nib_rne(o0, f3)
        n2 = nib_rne(e1, f3)
        n3 = nib_rne(o1, f3)
    store_codes(data_ptr, pack_word(n0, n1, BM, NB), pack_word(n2, n3, BM, NB), rows, blks,
                 mask2, NBLK, I64)
    if I64:
        soff = rows.to(tl.int64)[:, None] * NBLK + blks[None, :]
    else:
        soff = rows[:, None] * NBLK + blks[None, :]
    # One byte a block, stored from the registers that computed it: without the hint Triton
    # re-lays the [BM, NB] bytes out for 2-byte vector stores (a shared-memory transpose).
    soff = tl.max_contiguous(soff, [1, 1])
    tl.store(scale_ptr + soff, s_bits.to(tl.uint8), mask=mask2)


@triton.jit(do_not_specialize=["amax_imm"])
def _quantize_flat_kernel(xw_ptr, amax_ptr, obs_ptr, data_ptr, scale_ptr, dec_ptr, amax_imm,
                          NBLK_ALL, TRACK_AMAX: tl.constexpr, REVERSE: tl.constexpr,
                          AMAX_IMM: tl.constexpr, NBP: tl.constexpr, I64: tl.constexpr):
    """``NBP`` consecutive 16-blocks of the flat tensor (layout: module docstring, "Flat kernels").

    data_ptr: the codes viewed as int32 (2 words a block). TRACK_AMAX (global amax given): the
    observed amax bits go to ``obs_ptr`` (NaN-propagating block maxima), for NaN/Inf detection."""
    pid = tl.program_id(0)
    if REVERSE:
        pid = tl.num_programs(0) - 1 - pid
    if I64:
        blk = pid.to(tl.int64) * NBP + tl.arange(0, NBP)
    else:
        blk = pid * NBP + tl.arange(0, NBP)
    h = tl.arange(0, 2)
    q = tl.arange(0, 4)
    bmask = blk < NBLK_ALL
    off = blk[:, None, None] * 8 + h[None, :, None] * 4 + q[None, None, :]
    w = tl.load(xw_ptr + off, mask=bmask[:, None, None], other=0, eviction_policy="evict_first")
    e, o = bf16w_to_f32(w)                                     # [NBP, 2, 4] elements 2j, 2j+1
    if TRACK_AMAX:
        a = max_nan(tl.abs(e), tl.abs(o))
        bamax = tl.reduce(tl.reduce(a, 2, max_nan), 1, max_nan)
        tl.atomic_max(obs_ptr, tl.reduce(bamax, 0, max_nan).to(tl.int32, bitcast=True))
    else:
        bamax = tl.max(tl.max(tl.maximum(tl.abs(e), tl.abs(o)), 2), 1)     # [NBP]

    if AMAX_IMM:
        gbits = amax_imm                       # host number: its FP32 bits, no device read
    else:
        gbits = tl.load(amax_ptr)
    enc, dec = tensor_scales(gbits, 448.0)
    if pid == 0:
        # a non-finite (or negative) amax poisons the tensor scale (as the tiled kernel does)
        bad = ((gbits & 0x7FFFFFFF) >= 0x7F800000) | (gbits.to(tl.float32, bitcast=True) < 0.0)
        nan = tl.full(dec.shape, NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
        tl.store(dec_ptr, tl.where(bad, nan, dec))

    s_val, s_bits, f = candidate_fast(bamax, enc, dec, 0.1666666716337204)
    f3 = f[:, None, None]
    b = nib_rne(e, f3) | (nib_rne(o, f3) << 4)               # byte 4h + q of the block
    b02, b13 = tl.split(tl.reshape(b, (NBP, 2, 2, 2)))          # bytes q = 0, 2 and q = 1, 3
    hw = b02 | (b13 << 8)
    h0, h1 = tl.split(hw)
    word = h0 | (h1 << 16)                                      # [NBP, 2]: bytes 4h .. 4h+3
    tl.store(data_ptr + blk[:, None] * 2 + h[None, :], word, mask=bmask[:, None])
    tl.store(scale_ptr + blk, s_bits.to(tl.uint8), mask=bmask)



@triton.jit(do_not_specialize=["seed"])
def _philox_uniforms_kernel(u_ptr, seed, M, NBLK, BM: tl.constexpr, NB: tl.constexpr):
    rows, blks, mask2 = tile_coords(tl.program_id(0), M, NBLK, BM, NB)
    u_lo, u_hi = philox_halves(seed, rows, blks, NBLK, BM, NB)
    j = tl.arange(0, 8)
    off = (rows.to(tl.int64) * NBLK * 16)[:, None, None] + (blks * 16)[None, :, None] + j[None, None, :]
    tl.store(u_ptr + off, u_lo, mask=mask2[:, :, None])
    tl.store(u_ptr + off + 8, u_hi, mask=mask2[:, :, None])


@triton.jit
def _elementwise_probe_kernel(v_ptr, u_ptr, s_out, s_bits_out, c_out, s1_out, s1_bits_out,
                              c_rne_out, r_val_out, c_sr_out, n, BLOCK: tl.constexpr):
    """Test hook: the E4M3 and E2M1 helpers applied elementwise (``v``; ``u`` the uniforms of
    the stochastic one): the select-ladder ones (:func:`e4m3_rne`, :func:`e2m1_code`, used by
    the NVFP4 Newton–Schulz) and the branch-free ones (:func:`e4m3_rne1`, :func:`nib_rne`, :func:`e2m1_rne_val`,
    :func:`nib_sr`, all with ``f = 1``)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    v = tl.load(v_ptr + i, mask=m, other=0.0)
    u = tl.load(u_ptr + i, mask=m, other=0.0)
    sv, sb = e4m3_rne(tl.minimum(tl.abs(v), 448.0))
    c, _ = e2m1_code(tl.minimum(tl.maximum(v, -6.0), 6.0), v, False)
    tl.store(s_out + i, sv, mask=m)
    tl.store(s_bits_out + i, sb, mask=m)
    tl.store(c_out + i, c, mask=m)
    sv1, sb1 = e4m3_rne1(tl.minimum(tl.abs(v), 448.0))
    tl.store(s1_out + i, sv1, mask=m)
    tl.store(s1_bits_out + i, sb1, mask=m)
    tl.store(c_rne_out + i, nib_rne(v, 1.0), mask=m)
    tl.store(r_val_out + i, e2m1_rne_val(tl.minimum(tl.abs(v), 6.0)), mask=m)
    tl.store(c_sr_out + i, nib_sr(v, 1.0, u), mask=m)
