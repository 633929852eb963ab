"""One read of an activation (or weight) → every NVFP4 operand the linear needs from it.

The NVFP4 linear (``fullstack_fp4.linear.nvfp4_linear``) needs two quantizations of each of
``x [T, C]`` and ``dY [T, C]``, and the GEMMs on Hopper are emulated on *decoded* BF16
operands ``e2m1(code) · fp32(block_scale)`` (exact in BF16, see ``gemm.py``):

* **row way**: 1×16 blocks along C (fprop's x, dgrad's dY), or 16×16 tiles (the weight);
* **column way**: ``RHT16`` along the tokens, then 1×16 blocks along the tokens — the wgrad
  operand ``quantize(hadamard16(pad(m)ᵀ))`` of shape ``[C, T_pad]`` (T_pad = T rounded up
  to 16, padded tokens are zeros).

One kernel reads a tile of ``m`` **in its own layout** (16 tokens × ``16·NB`` channels), does both ways in registers and writes only
what a consumer reads: the decoded BF16 operand of each way the GEMMs use now, and packed
codes + E4M3 scales only for what is saved for backward (the weight's 16×16 codes for dgrad,
``RHT(xᵀ)``'s codes for wgrad). The global amaxes of both ways come from one earlier pass
(:func:`amax_two_ways`, kernels in ``amax.py``), because every block scale depends on the
tensor scale. Writing each operand's packed codes and reading them back to decode them, with a
BF16 transposed copy of ``m`` for the column way, would move several times the bytes.

**Numerics** are :func:`fullstack_fp4.nvfp4.reference.quantize_reference`'s bit for bit (the
FP32 contract of docs/nvfp4-format.md, 6-rule), through the ``fp4_math`` helpers the
quantize kernel uses: ``tensor_scales`` (enc/dec), ``candidate_fast`` / ``candidate_nb`` (E4M3
block scale and element factor), ``nib_rne`` / ``nib_sr`` (E2M1 codes, nearest / stochastic),
``e2m1_rne_val`` (the nearest value, when only the decoded operand is written),
``bf16w_to_f32`` (BF16 read as int32 words), ``philox10``, ``rht16_tokens``. The RHT is
:func:`fullstack_fp4.nvfp4.hadamard.hadamard16`'s arithmetic — × signs (compile-time: ``x·(−1)``
is written ``−x``, the same value), butterflies with strides 1, 2, 4, 8 as ``(a + b, a − b)``,
× ¼ — on the 16 tokens of a block. A decoded value ``±e2m1 · s`` (``s`` the E4M3 scale as FP32)
is exact in FP32 and in BF16, so its BF16 is the top half of its FP32 bits; its sign is the
code's (``-0`` for a negative value rounded to 0), as decoding the code gives.

**Stochastic rounding draws are :mod:`.sr_stream`'s**, as ``quantize_triton``'s for the same
seed, on the *quantized* tensor: for the row way that is ``m`` (rows = tokens), for the column
way ``[C, T_pad]`` (rows = channels, blocks = token blocks, the position inside a block = token
mod 16), so ``quantize_triton(hadamard16(pad(m)ᵀ), seed=s)`` and this kernel round every element
with the same uniform. One Philox4x32-10 call gives 4 rows × 4 elements of a block (8 bits an
element), which is 4 of a lane's values × 4 of its tokens in the row way and its 4 channels × 4
tokens in the column way: a lane makes 4 calls a way for its 64 values. Counters below 2³¹ go
through ``philox10`` (the same rounds as ``tl.randint4x``), larger ones through
``tl.randint4x`` on int64 (``I64``, chosen on the host with the offsets' width).

**Layout.** A program owns 16 tokens × ``16·NB`` channels (NB = 32: 512 channels, 4 warps;
dY's call NB = 64 on 8 warps, :func:`_config`); where the column way writes codes (x's call)
it walks ``COL_CODES_TBS`` = 4 such token blocks in a loop and stores a channel's codes and
scale bytes of all four as one run each (``_store_col_codes``).
Each token row is held in the "eo" form of ``fp4_math``: four ``[NB, 4]`` tensors, elements
``2q, 2q+1`` (low half) and ``8+2q, 9+2q`` (high half) of each block, read as int32 words of
two BF16. The 16 rows are 16-tuples, so the lane of ``(block, q)`` holds its four channels for
all 16 tokens (64 FP32 values): the column way (RHT butterflies, block amax over tokens,
per-channel scale) is register arithmetic between tuple entries; the row way's block amax is a
4-lane reduction (its scale computed by each of the 4 lanes). The row way visits a lane's 16
tokens in the order of their Philox calls (tokens 2k, 2k+1, 8+2k, 9+2k share call k). Column
outputs (16 tokens of a channel: 8 words of BF16
or 2 words of codes) are stored per channel from registers.

**Non-finite input, no host sync.** A NaN/Inf in ``m`` (seen by the amax pass), or a given
amax that is NaN/Inf/negative, stores a NaN tensor scale (as ``quantize_triton`` with
``check_finite=False``): every product with that operand is NaN.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

import triton
import triton.language as tl
from triton.language import core as tlc   # to_tensor: not re-exported by triton 3.6's tl

from fullstack_fp4 import knobs

from ..hadamard import DEFAULT_SIGNS
from ..tensor import NVFP4Tensor
from .amax import _amax_pair_kernel, _amax_two_ways_kernel
from .fp4_math import (FP32_MAX, INV6, NAN_BITS, bf16_word, bf16w_to_f32, candidate_fast,
                       candidate_nb, dec_nib_bits, e2m1_rne_val, neg_where, nib_rne, nib_sr,
                       philox10, rcp_kd, rht16_tokens, sr_u8, tensor_scales)
from .launch import cdiv, launch, next_pow2

__all__ = ["RowWay", "ColWay", "TwoWays", "amax_two_ways", "amax_two_ways_pair", "quantize_two_ways",
           "draw_seed"]

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_I32_LIMIT = 2**31 - 1


# ----------------------------------------------------------------------------- host side
@dataclass(frozen=True)
class RowWay:
    """Quantization of ``m [T, C]`` along C: 1×16 blocks, or 16×16 tiles (``tile=(16, 16)``,
    T a multiple of 16: the weight). ``decoded``: write the BF16 GEMM operand ``[T, C]``;
    ``codes``: write packed codes + E4M3 scales (an :class:`NVFP4Tensor`, e.g. to save)."""
    rounding: str = "nearest"
    tile: tuple = (1, 16)
    decoded: bool = True
    codes: bool = False


@dataclass(frozen=True)
class ColWay:
    """Quantization of ``hadamard16(pad(m)ᵀ)`` (``[C, T_pad]``, RHT-16 and 1×16 blocks along
    the tokens): the wgrad operand. ``decoded`` / ``codes`` as in :class:`RowWay`."""
    rounding: str = "nearest"
    decoded: bool = False
    codes: bool = True


@dataclass
class TwoWays:
    """What :func:`quantize_two_ways` wrote; ``None`` for what was not asked. ``*_scale`` is
    the FP32 0-dim tensor (decode) scale of that way, ``*_decoded`` the BF16 operand
    ``e2m1 · e4m3`` without it, ``*_q`` the NVFP4 tensor (codes, block scales, tensor scale),
    ``*_alpha`` (asked with ``*_peer_scale``) that scale times the other GEMM operand's, as a
    1-element FP32 tensor: the GEMM's alpha (``gemm.decoded_matmul(alpha=)``)."""
    row_decoded: Optional[torch.Tensor] = None
    row_q: Optional[NVFP4Tensor] = None
    row_scale: Optional[torch.Tensor] = None
    col_decoded: Optional[torch.Tensor] = None
    col_q: Optional[NVFP4Tensor] = None
    col_scale: Optional[torch.Tensor] = None
    row_alpha: Optional[torch.Tensor] = None
    col_alpha: Optional[torch.Tensor] = None


_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")   # read once, as Triton does


def _interpreter() -> bool:
    return _INTERPRET


# dY's call (both ways stochastic, decoded only; ``_config(wide=True)``): round each element
# straight to its decoded value (``_dec_sr_bits``: 12% fewer SASS instructions to the first
# EXIT than through the nibble, sm_90, triton 3.6) under a register cap (the direct form
# compiles to 184 registers, 1 CTA of 8 warps an SM; capped at 128 it spills 64 B a thread and
# runs faster on the H200: docs/perf/nvfp4.md).
SR_DIRECT = True
WIDE_MAXNREG = 128
# The calls whose block scales take their element factor 1/(s·dec) without div_rn's branch
# (fp4_math.candidate_nb: the same values) are ``knobs.TWO_WAYS_RCP`` (``FP4_TWO_WAYS_RCP``,
# default "W"): "x" (row nearest + column codes), "W" (16×16 tiles), "dY" (both ways
# stochastic, decoded), "other". On the H200 only W's call gains (96 instead of 168
# registers); without the branches ptxas interleaves the row way's 16 scale chains, and x's
# and dY's calls take more registers and time (docs/perf/nvfp4.md).


def _call_kind(row, col, wide: bool) -> str:
    """Which of the linear's calls a launch is, for ``knobs.TWO_WAYS_RCP``."""
    if wide:
        return "dY"
    if row is not None and tuple(row.tile) == (16, 16):
        return "W"
    if row is not None and col is not None and col.codes:
        return "x"
    return "other"


# Token blocks a program when the column way writes codes (x's call): the codes and scale
# bytes of a channel for 4 token blocks are one 32-byte and one 4-byte store, where one program
# a token block would write 8 bytes and 1 byte of a channel (at 8192 × 3072 those small stores
# were most of the L2 write requests under Nsight Compute: docs/perf/nvfp4.md). 1 where the
# token blocks are not a multiple of it.
COL_CODES_TBS = 4


def _config(nblk: int, wide: bool = False):
    """(NB 16-channel blocks per program, num_warps): 16 tokens × 512 channels, 4 warps, i.e.
    each thread holds 4 channels × 16 tokens (64 FP32 values); fewer blocks for small C.

    ``wide``: 1024 channels, 8 warps — for dY's call (both ways stochastic, the column way
    decoded), the faster on the H200; x's, W's and the amax calls were the same or slower with
    it (NB 8 to 64 and register caps swept by benchmarks/profile/sweep_two_ways.py). A thread's
    work and registers do not depend on NB, only the CTA size does."""
    nb = (64 if wide else 32) if nblk >= 32 else next_pow2(max(nblk, 1))
    if _interpreter():
        nb = min(nb, 4)          # the interpreter's cost grows with masked padding
    return nb, max(1, nb // 8)


# The amax pass: words (or elements) a program, token blocks a program, warps. A lane takes one
# word (two channels) of 16 tokens a token block, so BLOCK = 32 · warps.
AMAX_BLOCK, AMAX_TBS, AMAX_WARPS = 128, 4, 4


def _amax_config(nidx: int, ntb: int):
    """(BLOCK, TBS, num_warps) of the amax pass over ``nidx`` words (or elements) a row and
    ``ntb`` token blocks: fewer lanes for a narrow row, one token block for a short input."""
    if _interpreter():
        return min(16, next_pow2(max(nidx, 1))), 2, 1
    block = min(AMAX_BLOCK, max(32, next_pow2(max(nidx, 1))))
    return block, max(1, min(AMAX_TBS, ntb)), max(1, min(AMAX_WARPS, block // 32))


def _reads_words(m: torch.Tensor) -> bool:
    """BF16 with an even row stride and a 4-byte aligned base is read as int32 words (one word
    = an even/odd element pair); anything else per element."""
    return m.dtype == torch.bfloat16 and m.stride(0) % 2 == 0 and m.data_ptr() % 4 == 0


def _x_args(m: torch.Tensor):
    """(kernel pointer, row stride, XW) of :func:`_reads_words`' choice."""
    if _reads_words(m):
        return m.view(torch.int32), m.stride(0) // 2, True
    return m, m.stride(0), False


def _needs_i64(t: int, c: int, stride: int) -> bool:
    """Whether an element / word offset or a Philox counter of the padded tile grid may pass
    2^31 - 1 (then offsets are int64 and the counters go through ``tl.randint4x``)."""
    tpad = -(-t // 16) * 16
    cpad = -(-c // 512) * 512
    return max(tpad * max(stride, c) + cpad, cpad * (tpad + 16)) > _I32_LIMIT


def _check_m(m: torch.Tensor) -> torch.Tensor:
    if m.dim() != 2:
        raise ValueError(f"expected a 2-D [tokens, channels] tensor, got shape {tuple(m.shape)}")
    if m.dtype not in _INPUT_DTYPES:
        raise ValueError(f"input dtype must be bf16, fp16 or fp32, got {m.dtype}")
    if m.shape[1] % 16:
        raise ValueError(f"channels must be a multiple of 16, got shape {tuple(m.shape)}")
    return m if m.stride(1) == 1 else m.contiguous()


def _signs_mask(rht_signs) -> int:
    """The 16 RHT signs (±1, validated on the host) as a bit mask: bit i set where s_i = −1."""
    if rht_signs is DEFAULT_SIGNS:        # every call of the NVFP4 linear: skip the validation
        return _DEFAULT_MASK
    if isinstance(rht_signs, torch.Tensor):
        rht_signs = rht_signs.detach().to("cpu", torch.float64).reshape(-1).tolist()
    vals = [float(v) for v in rht_signs]
    if len(vals) != 16 or any(v not in (1.0, -1.0) for v in vals):
        raise ValueError("rht_signs must be 16 values of +-1")
    return sum(1 << i for i, v in enumerate(vals) if v < 0)


_DEFAULT_MASK = sum(1 << i for i, v in enumerate(DEFAULT_SIGNS) if v < 0)


def draw_seed(generator: Optional[torch.Generator]) -> int:
    """The Philox seed ``quantize_triton`` draws for stochastic rounding (same call, same
    generator state consumed), so a caller that draws seeds in the same order gets the same
    rounding."""
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator).item())


def _amax_tensor_args(m: torch.Tensor, block: int, tbs: int):
    """(pointer, T, C, row stride, XW, I64, EVEN, programs) of ``m`` in the amax pass at
    ``block`` words (or elements) and ``tbs`` token blocks a program."""
    t, c = m.shape
    xp, stride, xw = _x_args(m)
    nidx = c // 2 if xw else c
    nprog = cdiv(cdiv(t, 16), tbs) * cdiv(nidx, block)
    return (xp, t, c, stride, xw, _needs_i64(t, c, m.stride(0)),
            t % (16 * tbs) == 0 and nidx % block == 0, nprog)


def _amax_block(m: torch.Tensor):
    """(BLOCK, TBS, num_warps) of ``m``'s amax pass (:func:`_amax_config`)."""
    t, c = m.shape
    nidx = c // 2 if _reads_words(m) else c
    return _amax_config(nidx, cdiv(t, 16))


def amax_two_ways(m: torch.Tensor, *, row: bool = True, col: bool = True,
                  rht_signs=DEFAULT_SIGNS) -> torch.Tensor:
    """One read of ``m [T, C]``: int32 ``[2]`` device tensor with the FP32 bits of
    ``max |m|`` (if ``row``) and of ``max |hadamard16(pad(m)ᵀ)|`` (if ``col``), 0 otherwise.
    NaN bit patterns order above +Inf, so a non-finite input shows as bits >= 0x7F800000.
    ``obs.view(torch.float32)[i]`` is the amax as a 0-dim FP32 tensor (for ``amax_reduce``)."""
    m = _check_m(m)
    t, c = m.shape
    obs = torch.zeros((2,), dtype=torch.int32, device=m.device)
    if t == 0 or c == 0 or not (row or col):
        return obs
    block, tbs, nw = _amax_block(m)
    xp, t, c, stride, xw, i64, even, nprog = _amax_tensor_args(m, block, tbs)
    launch(_amax_two_ways_kernel, (nprog,), xp, obs, t, c, stride,
           SIGNS=_signs_mask(rht_signs), ROW=row, COL=col, XW=xw, I64=i64, BLOCK=block, TBS=tbs,
           EVEN=even, num_warps=nw, enable_fp_fusion=False)
    return obs


def amax_two_ways_pair(x: torch.Tensor, y: torch.Tensor, *, row_x: bool = True,
                       col_x: bool = True, row_y: bool = True, col_y: bool = False,
                       rht_signs=DEFAULT_SIGNS):
    """:func:`amax_two_ways` of ``x`` and of ``y`` in one launch and one zeroed buffer (the
    linear's forward: x both ways, W the row way): ``(obs_x, obs_y)``, the same bits as two
    calls. The pair shares the wider of the two tensors' lane counts."""
    x, y = _check_m(x), _check_m(y)
    buf = torch.zeros((4,), dtype=torch.int32, device=x.device)
    obs_x, obs_y = buf[0:2], buf[2:4]
    if x.numel() == 0 or y.numel() == 0 or not (row_x or col_x) or not (row_y or col_y):
        # nothing to pair: each alone (an empty tensor's obs stays 0)
        if x.numel() and (row_x or col_x):
            obs_x.copy_(amax_two_ways(x, row=row_x, col=col_x, rht_signs=rht_signs))
        if y.numel() and (row_y or col_y):
            obs_y.copy_(amax_two_ways(y, row=row_y, col=col_y, rht_signs=rht_signs))
        return obs_x, obs_y
    (bx, tbx, wx), (by, tby, wy) = _amax_block(x), _amax_block(y)
    block, nw = max(bx, by), max(wx, wy)
    ax = _amax_tensor_args(x, block, tbx)
    ay = _amax_tensor_args(y, block, tby)
    launch(_amax_pair_kernel, (ax[7] + ay[7],), ax[0], buf, ax[1], ax[2], ax[3],
           ay[0], ay[1], ay[2], ay[3], ax[7], SIGNS=_signs_mask(rht_signs),
           ROW=row_x, COL=col_x, XW=ax[4], I64=ax[5], TBS=tbx, EVEN=ax[6],
           ROW2=row_y, COL2=col_y, XW2=ay[4], I64_2=ay[5], TBS2=tby, EVEN2=ay[6], BLOCK=block,
           num_warps=nw, enable_fp_fusion=False)
    return obs_x, obs_y


def _amax_arg(given, obs: torch.Tensor, i: int) -> torch.Tensor:
    if given is None:
        return obs.view(torch.float32)[i:i + 1]
    if not isinstance(given, torch.Tensor):
        raise ValueError("a given amax must be a tensor (e.g. the amax_reduce result)")
    return given.detach().to(device=obs.device, dtype=torch.float32).reshape(1)


def _raise_if_nonfinite(obs, gamax, used) -> None:
    """The host check of ``check_finite=True`` (one sync): same messages as ``quantize``."""
    for i in used:
        if int(obs[i]) >= 0x7F800000:
            raise ValueError("quantize: input holds NaN or Inf")
        g = float(gamax[i])
        if not (g >= 0 and g != float("inf")):
            raise ValueError(f"global_amax must be finite and >= 0, got {g}")


def quantize_two_ways(m: torch.Tensor, obs: torch.Tensor, *, row: Optional[RowWay] = None,
                      col: Optional[ColWay] = None, amax_row=None, amax_col=None,
                      seed_row: Optional[int] = None, seed_col: Optional[int] = None,
                      rht_signs=DEFAULT_SIGNS, check_finite: bool = False,
                      row_peer_scale: Optional[torch.Tensor] = None,
                      col_peer_scale: Optional[torch.Tensor] = None) -> TwoWays:
    """The row and/or column quantization of ``m [T, C]`` in one read (module docstring).

    ``obs``: :func:`amax_two_ways`'s result for ``m`` (its observed amax bits; the scales use
    them unless ``amax_row`` / ``amax_col`` — FP32 tensors, e.g. ``amax_reduce`` results — are
    given). ``seed_*``: the Philox seed of a stochastic way (:func:`draw_seed`). Bit-identical to
    ``quantize_triton(m, tile=row.tile, rounding=row.rounding, global_amax=..., seed=seed_row)``
    (decoded: ``decode_to_bf16`` of it) and to ``quantize_triton(hadamard16(pad(m)ᵀ), ...,
    seed=seed_col)``. ``check_finite``: raise ``ValueError`` on a non-finite input or amax (one
    host sync) instead of the NaN tensor scale. ``row_peer_scale`` / ``col_peer_scale``: the
    FP32 tensor scale (1 element, on the device, written before this call) of the operand the
    way's GEMM multiplies it with; the kernel also writes ``row_alpha`` / ``col_alpha`` = this
    way's tensor scale × it, the bits ``torch.mul`` gives.
    """
    m = _check_m(m)
    t, c = m.shape
    dev = m.device
    for way in (row, col):
        if way is not None and way.rounding not in ("nearest", "stochastic"):
            raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {way.rounding!r}")
        if way is not None and not (way.decoded or way.codes):
            raise ValueError("a way must write its decoded operand, its codes or both")
    if row is not None:
        if tuple(row.tile) not in ((1, 16), (16, 16)):
            raise ValueError(f"tile must be (1, 16) or (16, 16), got {row.tile}")
        if tuple(row.tile) == (16, 16) and t % 16:
            raise ValueError(f"16x16 tiles need the rows ({t}) to be a multiple of 16")
    row_sr = row is not None and row.rounding == "stochastic"
    col_sr = col is not None and col.rounding == "stochastic"
    if (row_sr and seed_row is None) or (col_sr and seed_col is None):
        raise ValueError("stochastic rounding needs a seed (draw_seed(generator))")
    g_row, g_col = _amax_arg(amax_row, obs, 0), _amax_arg(amax_col, obs, 1)
    if check_finite:
        _raise_if_nonfinite(obs.cpu(), torch.cat([g_row, g_col]).cpu(),
                            [i for i, w in enumerate((row, col)) if w is not None])

    nblk, tpad = c // 16, -(-t // 16) * 16
    ts = torch.empty((4,), dtype=torch.float32, device=dev)   # scales, then alphas
    out = TwoWays()
    u8 = dict(dtype=torch.uint8, device=dev)
    dummy = ts                      # pointer never written when its output is off
    row_dec = row_data = row_scale = col_dec = col_data = col_scale = dummy
    if row is not None:
        if row.decoded:
            row_dec = out.row_decoded = torch.empty((t, c), dtype=torch.bfloat16, device=dev)
        if row.codes:
            row_data, row_scale = torch.empty((t, c // 2), **u8), torch.empty((t, nblk), **u8)
            out.row_q = NVFP4Tensor(row_data, row_scale.view(torch.float8_e4m3fn), ts[0],
                                    torch.Size((t, c)), m.dtype, tuple(row.tile))
        out.row_scale = ts[0]
    if col is not None:
        if col.decoded:
            col_dec = out.col_decoded = torch.empty((c, tpad), dtype=torch.bfloat16, device=dev)
        if col.codes:
            col_data, col_scale = torch.empty((c, tpad // 2), **u8), torch.empty((c, tpad // 16), **u8)
            out.col_q = NVFP4Tensor(col_data, col_scale.view(torch.float8_e4m3fn), ts[1],
                                    torch.Size((c, tpad)), m.dtype, (1, 16))
        out.col_scale = ts[1]
    peers = []
    for way, peer, i in ((row, row_peer_scale, 0), (col, col_peer_scale, 1)):
        if peer is None:
            peers.append(ts)
            continue
        if way is None:
            raise ValueError("a peer scale was given for a way that is not asked")
        if (not isinstance(peer, torch.Tensor) or peer.numel() != 1
                or peer.dtype != torch.float32 or peer.device != dev):
            raise ValueError("a peer scale must be a 1-element FP32 tensor on the input's device")
        peers.append(peer)
        if i == 0:
            out.row_alpha = ts[2:3]
        else:
            out.col_alpha = ts[3:4]
    if t == 0 or c == 0:
        ts[:2].fill_(1.0 / FP32_MAX.value)   # reference: amax 0 -> enc FP32_MAX
        for i, peer in ((2, row_peer_scale), (3, col_peer_scale)):
            if peer is not None:
                torch.mul(ts[i - 2:i - 1], peer.reshape(1), out=ts[i:i + 1])
        return out

    wide = row_sr and col is not None and col_sr and col.decoded
    nb, nw = _config(nblk, wide)
    cap = dict(maxnreg=WIDE_MAXNREG) if wide and WIDE_MAXNREG and not _interpreter() else {}
    ntb = tpad // 16
    tbs = COL_CODES_TBS if col is not None and col.codes and ntb % COL_CODES_TBS == 0 else 1
    grid = (cdiv(ntb, tbs) * cdiv(nblk, nb),)
    xp, stride, xw = _x_args(m)
    words = (lambda b: b.view(torch.int32) if b is not dummy else b)   # BF16 / code words
    if tbs > 1:                    # a channel's TBS scale bytes as one word
        col_scale = col_scale.view({2: torch.int16, 4: torch.int32}[tbs])
    launch(_quantize_two_ways_kernel, grid,
        xp, g_row, g_col, obs, ts, peers[0], peers[1], words(row_dec), row_data, row_scale,
        words(col_dec), words(col_data), col_scale, int(seed_row or 0), int(seed_col or 0), t, c,
        stride,
        SIGNS=_signs_mask(rht_signs),
        ROW_DEC=row is not None and row.decoded, ROW_CODES=row is not None and row.codes,
        ROW_SR=row_sr, TILE2D=row is not None and tuple(row.tile) == (16, 16),
        COL_DEC=col is not None and col.decoded, COL_CODES=col is not None and col.codes,
        COL_SR=col_sr, SR_DIRECT=SR_DIRECT, XW=xw, I64=_needs_i64(t, c, m.stride(0)), NB=nb,
        TBS=tbs, EVEN=t % (16 * tbs) == 0 and nblk % nb == 0,
        ALPHA_ROW=row_peer_scale is not None, ALPHA_COL=col_peer_scale is not None,
        RCP_NB=_call_kind(row, col, wide) in knobs.TWO_WAYS_RCP,
        num_warps=nw, enable_fp_fusion=False, **cap)
    return out


# ----------------------------------------------------------------------------- kernels
# A token row of a tile is held in "eo" form (fp4_math's): four [NB, 4] FP32 tensors
# e0, o0, e1, o1 = elements 2q, 2q+1 (low half) and 8+2q, 9+2q (high half) of each block; the
# lane of (block, q) holds those four channels for all 16 tokens. A 16-tuple over the tokens of
# one of the four tensors is a "channel group" of the column way.
@triton.jit
def _row_mask(cmask, t, T, EVEN: tl.constexpr):
    """``cmask & (t < T)`` for a scalar token t, broadcast explicitly (the interpreter rejects
    a load mask made by broadcasting a scalar comparison; the compiler folds the ``0 ·``).
    EVEN: every token of the program exists (:func:`_tile_coords`), so ``cmask``."""
    if EVEN:
        return cmask
    return cmask & ((cmask.to(tl.int32) * 0 + t) < T)


@triton.jit
def _load_rows(x_ptr, tb, blk, q, cmask, T, C, stride_t, XW: tl.constexpr,
               I64: tl.constexpr, EVEN: tl.constexpr):
    """The 16 token rows of token block ``tb`` as four 16-tuples (e0, o0, e1, o1) of FP32
    ``[NB, 4]`` (tokens past ``T`` and channels past C load as 0: the column way's zero padding).
    XW: ``x_ptr`` is BF16 viewed as int32 words (``stride_t`` in words): one word = (e, o),
    read as two ``[NB, 4]`` halves. (Reading a block's 32 bytes as ``[NB, 8]`` words and moving
    them to the eo form was slower on the H200: warp shuffles, docs/perf/nvfp4.md.)"""
    E0 = ()
    O0 = ()
    E1 = ()
    O1 = ()
    for i in tl.static_range(16):
        t = tb * 16 + i
        m = _row_mask(cmask, t, T, EVEN)
        if I64:
            roff = t.to(tl.int64) * stride_t
        else:
            roff = t * stride_t
        if XW:
            p = x_ptr + roff + (blk * 8)[:, None] + q[None, :]
            e0, o0 = bf16w_to_f32(tl.load(p, mask=m, other=0))
            e1, o1 = bf16w_to_f32(tl.load(p + 4, mask=m, other=0))
        else:
            p = (x_ptr + roff + (blk * 16)[:, None, None] + 2 * q[None, :, None]
                 + tl.arange(0, 2)[None, None, :])
            m3 = m[:, :, None]
            e0, o0 = tl.split(tl.load(p, mask=m3, other=0.0).to(tl.float32))
            e1, o1 = tl.split(tl.load(p + 8, mask=m3, other=0.0).to(tl.float32))
        E0 = E0 + (e0,)
        O0 = O0 + (o0,)
        E1 = E1 + (e1,)
        O1 = O1 + (o1,)
    return E0, O0, E1, O1


@triton.jit
def _abs_max_tuple(v):
    a = tl.abs(v[0])
    for i in tl.static_range(1, 16):
        a = tl.maximum(a, tl.abs(v[i]))
    return a


@triton.jit
def _stack8(v):
    """8-tuple of ``[NB, 4]`` (index k) -> ``[NB, 4, 8]`` with k on the last axis (in-thread)."""
    b = ()
    for k in tl.static_range(4):
        b = b + (tl.join(v[k], v[k + 4]),)          # new axis: bit 2 of k
    c = (tl.join(b[0], b[2]), tl.join(b[1], b[3]))  # bit 1
    d = tl.join(c[0], c[1])                         # bit 0
    nb: tl.constexpr = d.shape[0]
    return tl.reshape(d, (nb, 4, 8))


@triton.jit
def _tensor_scale(gamax_ptr, obs_ptr):
    """(enc, dec, dec to store) from the amax the scales use (``gamax_ptr``, FP32) and the
    amax bits the pass observed in the input (``obs_ptr``, int32): the reference's order
    (``tensor_scales``); the stored tensor scale is NaN for a non-finite input or a
    NaN/Inf/negative amax."""
    gbits = tl.load(gamax_ptr).to(tl.int32, bitcast=True)
    enc, dec = tensor_scales(gbits, 448.0)
    bad = (((gbits & 0x7FFFFFFF) >= 0x7F800000) | (gbits.to(tl.float32, bitcast=True) < 0.0)
           | (tl.load(obs_ptr) >= 0x7F800000))
    nan = tl.full(dec.shape, NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    return enc, dec, tl.where(bad, nan, dec)


@triton.jit
def _candidate(bamax, enc, dec, RCP_NB: tl.constexpr):
    """(E4M3 scale, its bits, element factor) of a block: :func:`candidate_nb` (no branch)
    or :func:`candidate_fast` (``div_rn``); the same values."""
    if RCP_NB:
        return candidate_nb(bamax, enc, dec, rcp_kd(dec), INV6)
    return candidate_fast(bamax, enc, dec, INV6)


@triton.jit
def _dec_rne_bits(x, f, s_val):
    """FP32 bits of the decoded nearest-rounded value ``±rne(min(|x·f|, 6)) · s`` (exact, so its
    BF16 is the top 16 bits); ``-0`` where a negative ``x·f`` rounds to 0, as the code's decode."""
    y = x * f
    r = e2m1_rne_val(tl.minimum(tl.abs(y), 6.0)) * s_val
    # a true negation: triton 3.6's unary minus gives +0 for -(+0) (fp4_math.neg_where)
    return neg_where(y < 0.0, r).to(tl.int32, bitcast=True)


@triton.jit
def _dec_sr_bits(x, f, u, s_val):
    """FP32 bits of the decoded stochastically rounded value: ``dec_nib_bits(nib_sr(x, f, u),
    s)`` without the nibble. ``nib_sr``'s ``v = a·inv`` (exact, in [0, 4)) rounds to
    ``n = floor(v) + (u < frac(v)) = ceil(v − u)`` grid steps (one FADD and one FRND), and the E2M1 magnitude is ``n · step`` with
    ``step = 1/inv`` (½, 1 or 2: ``bits(1/inv) = 0x7F000000 − bits(inv)`` for a power of two),
    exact; × s exact; the sign is ``y < 0``'s as in the nibble (so ``-0`` for a negative ``y``
    that rounds to 0, ``+0`` for ``y = -0``). For a dY element (both ways decoded, not stored
    as codes) this skips the code arithmetic and its decode: ~10 of ~30 instructions."""
    y = x * f
    a = tl.minimum(tl.abs(y), 6.0)
    invb = tl.minimum(~a.to(tl.int32, bitcast=True) & 0x7F800000, 0x40000000)
    v = a * invb.to(tl.float32, bitcast=True)
    # n = floor(v) + (u < frac(v)) = ceil(v - u), exactly: u = (b + 1/2)/256 is a multiple of
    # 2^-9 and v < 4, so for v >= u the difference is a multiple of ulp(v) below v (exact);
    # for v < u it lies in (-1, 0) however it rounds (ceil 0 = floor(v), and u > v = frac).
    # Then v - u = floor(v) + (frac - u) with frac - u in (-1, 1): ceil adds 1 iff frac > u.
    n = tl.math.ceil(v - u)                   # -0 where v - u is in (-1, 0): cleared below
    mag = (n * (0x7F000000 - invb).to(tl.float32, bitcast=True)) * s_val
    return (mag.to(tl.int32, bitcast=True) & 0x7FFFFFFF) | tl.where(y < 0.0, -2147483648, 0)


@triton.jit
def _philox_words(seed, ctr, I64: tl.constexpr):
    """Philox4x32-10 of ``ctr`` under ``seed``: ``tl.randint4x`` on int64 counters (I64), else
    the same rounds written out on uint32 ones (:func:`philox10`)."""
    if I64:
        return tl.randint4x(seed, ctr)
    s = tlc.to_tensor(seed).to(tl.uint64)       # tl.philox's key: the seed's two words
    k0 = (s & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((s >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return philox10(ctr.to(tl.uint32), k0, k1)


@triton.jit
def _col_sr_words(seed, blk, q, tb, NBLKT, I64: tl.constexpr):
    """The column way's Philox words for the lane's 4 channels × 16 tokens (sr_stream.py on the
    ``[C, T_pad]`` operand): the lane's channels ``16·blk + {2q, 2q+1, 8+2q, 9+2q}`` are one row
    quad ``g = 4·blk + q`` (words 0..3 = channel groups E0, O0, E1, O1), token block ``tb``;
    element quad ``k`` (tokens ``{2k, 2k+1, 8+2k, 9+2k}`` = bytes 0..3) is call ``k``.
    Returns a 16-tuple, index ``4·k + p``: 4 calls instead of 16."""
    g = blk * 4
    if I64:
        base = ((g.to(tl.int64)[:, None] + q[None, :]) * NBLKT + tb) * 4
    else:
        base = ((g[:, None] + q[None, :]) * NBLKT + tb) * 4
    w = ()
    for k in tl.static_range(4):
        w0, w1, w2, w3 = _philox_words(seed, base + k, I64)
        w = w + (w0, w1, w2, w3)
    return w


@triton.jit
def _col_group_uniforms(words, P: tl.constexpr):
    """The 16 tokens' uniforms of channel group ``P`` from :func:`_col_sr_words`' words:
    token ``j`` takes byte ``s(j)`` of call ``q(j)``'s word ``P``."""
    u = ()
    for j in tl.static_range(16):
        u = u + (sr_u8(words[4 * ((j % 8) // 2) + P], (j // 8) * 2 + j % 2),)
    return u


@triton.jit
def _token(E0, O0, E1, O1, I: tl.constexpr):
    """Token ``I``'s four ``[NB, 4]`` values (e0, o0, e1, o1) of the 16-tuples."""
    return E0[I], O0[I], E1[I], O1[I]


@triton.jit
def _row_sr_words(seed, tb, K: tl.constexpr, blk, q, NBLK, I64: tl.constexpr):
    """The row way's Philox words for the tokens ``16·tb + {2K, 2K+1, 8+2K, 9+2K}`` (row quad
    ``g = 4·tb + K``; words 0..3 in that order) of lane ``(blk, q)``: bytes 0..3 of a word are
    the token's e0, o0, e1, o1 (sr_stream.py on ``[T, C]``)."""
    if I64:
        ctr = (((tb * 4 + K).to(tl.int64) * NBLK + blk) * 4)[:, None] + q[None, :]
    else:
        ctr = (((tb * 4 + K) * NBLK + blk) * 4)[:, None] + q[None, :]
    return _philox_words(seed, ctr, I64)


@triton.jit
def _tile_coords(T, C, NB: tl.constexpr, TBS: tl.constexpr, EVEN: tl.constexpr):
    """(pid, token blocks, the program's first token block, its blocks, q, channel mask): a
    program owns TBS consecutive token blocks (16·TBS tokens) × NB 16-channel blocks. EVEN (the
    host's: 16·TBS divides T and NB divides C / 16): every token and channel of every program
    exists, the channel mask is a constant and the compiler drops the masks (sm_90, triton 3.6:
    x's, dY's and W's calls 3256 / 4498 / 2122 -> 3171 / 4382 / 1973 SASS instructions to the
    first EXIT, W's registers 217 -> 168)."""
    pid = tl.program_id(0)
    ntb = tl.cdiv(T, 16)
    ntbp = tl.cdiv(ntb, TBS)
    tb0 = (pid % ntbp) * TBS
    blk = (pid // ntbp) * NB + tl.arange(0, NB)
    q = tl.arange(0, 4)
    if EVEN:
        cmask = tl.full((NB, 4), 1, tl.int1)
    else:
        cmask = (blk < C // 16)[:, None] & (q < 4)[None, :]
    return pid, ntb, tb0, blk, q, cmask


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _col_group(z, c, tb, tpad, ntb, enc, dec, u, cmask, col_dec_ptr, col_data_ptr,
               col_scale_ptr, acc, sc, sub, COL_DEC: tl.constexpr, COL_CODES: tl.constexpr,
               COL_SR: tl.constexpr, SR_DIRECT: tl.constexpr, I64: tl.constexpr,
               TBS: tl.constexpr, RCP_NB: tl.constexpr):
    """The column way for one channel group: ``z`` the RHT'd 16 tokens of channels ``c``; ``u``
    their 16 uniforms (:func:`_col_group_uniforms`) when ``COL_SR``. With ``TBS > 1`` the codes
    (2 words) and the scale byte of token block ``tb`` (the program's ``sub``-th) go into the
    program's ``acc`` ``[NB, 4, 2·TBS]`` words and ``sc`` (byte ``sub``), stored by the caller
    after its last token block; returns (acc, sc)."""
    s_val, s_bits, f = _candidate(_abs_max_tuple(z), enc, dec, RCP_NB)    # per channel
    if I64:
        cc = c.to(tl.int64)
    else:
        cc = c
    k8 = tl.arange(0, 8)[None, None, :]
    m3 = cmask[:, :, None]
    if COL_DEC:
        words = ()
        for k in tl.static_range(8):
            if COL_SR and SR_DIRECT:
                lo = _dec_sr_bits(z[2 * k], f, u[2 * k], s_val)
                hi = _dec_sr_bits(z[2 * k + 1], f, u[2 * k + 1], s_val)
            elif COL_SR:
                lo = dec_nib_bits(nib_sr(z[2 * k], f, u[2 * k]), s_val)
                hi = dec_nib_bits(nib_sr(z[2 * k + 1], f, u[2 * k + 1]), s_val)
            else:
                lo = _dec_rne_bits(z[2 * k], f, s_val)
                hi = _dec_rne_bits(z[2 * k + 1], f, s_val)
            words = words + (bf16_word(lo, hi),)
        # 16 BF16 = 8 words per channel, contiguous in the [C, T_pad] operand (viewed as int32)
        tl.store(col_dec_ptr + (cc * (tpad // 2) + tb * 8)[:, :, None] + k8, _stack8(words),
                 mask=m3)
    if COL_CODES:
        w0 = tl.zeros(c.shape, tl.int32)
        w1 = tl.zeros(c.shape, tl.int32)
        for k in tl.static_range(16):
            if COL_SR:
                nib = nib_sr(z[k], f, u[k])
            else:
                nib = nib_rne(z[k], f)
            if k < 8:
                w0 = w0 | (nib << (4 * k))
            else:
                w1 = w1 | (nib << (4 * (k - 8)))
        if TBS == 1:
            # 16 codes = 8 bytes = 2 words per channel ([C, T_pad / 2] viewed as int32)
            k2 = tl.arange(0, 2)[None, None, :]
            tl.store(col_data_ptr + (cc * (tpad // 8) + tb * 2)[:, :, None] + k2,
                     tl.join(w0, w1), mask=cmask[:, :, None])
            tl.store(col_scale_ptr + cc * ntb + tb, s_bits.to(tl.uint8), mask=cmask)
        else:
            kk = tl.arange(0, 2 * TBS)[None, None, :]
            acc = tl.where(kk == 2 * sub, w0[:, :, None], acc)
            acc = tl.where(kk == 2 * sub + 1, w1[:, :, None], acc)
            sc = sc | ((s_bits & 0xFF) << (8 * sub))
    return acc, sc


@triton.jit
def _store_col_codes(acc, sc, c, tb0, tpad, ntb, cmask, col_data_ptr, col_scale_ptr,
                     I64: tl.constexpr, TBS: tl.constexpr):
    """A channel group's codes and scales of the program's TBS token blocks: ``2·TBS`` words
    (8·TBS bytes) and ``TBS`` scale bytes a channel, each one contiguous run, so a channel's
    codes fill whole 32-byte sectors at TBS = 4 (one 8-byte store and one 1-byte store a token
    block each wrote part of a sector). ``col_scale_ptr`` is the scales viewed as TBS-byte
    words."""
    if I64:
        cc = c.to(tl.int64)
    else:
        cc = c
    kk = tl.arange(0, 2 * TBS)[None, None, :]
    tl.store(col_data_ptr + (cc * (tpad // 8) + tb0 * 2)[:, :, None] + kk, acc,
             mask=cmask[:, :, None])
    tl.store(col_scale_ptr + (cc * ntb + tb0) // TBS, sc.to(col_scale_ptr.dtype.element_ty),
             mask=cmask)


@triton.jit
def _row_way(E0, O0, E1, O1, tb, blk, q, cmask, T, C, nblk, enc, dec, seed_row,
             row_dec_ptr, row_data_ptr, row_scale_ptr, ROW_DEC: tl.constexpr,
             ROW_CODES: tl.constexpr, ROW_SR: tl.constexpr, TILE2D: tl.constexpr,
             SR_DIRECT: tl.constexpr, I64: tl.constexpr, EVEN: tl.constexpr,
             RCP_NB: tl.constexpr):
    """The row way of token block ``tb`` (1×16 blocks along the channels, or 16×16 tiles):
    decoded BF16 words and/or codes + scales."""
    if TILE2D:
        # 16x16 tile = these 16 rows x one 16-channel block: one scale for the tile.
        bm = tl.max(tl.maximum(tl.maximum(_abs_max_tuple(E0), _abs_max_tuple(O0)),
                               tl.maximum(_abs_max_tuple(E1), _abs_max_tuple(O1))), 1)
        s_val, s_bits, f = _candidate(bm, enc, dec, RCP_NB)
    # Tokens in the order of their Philox calls (sr_stream.py): call k covers the tokens
    # 2k, 2k+1, 8+2k, 9+2k (its words 0..3), so one call serves 4 tokens of the lane.
    for k in tl.static_range(4):
        if ROW_SR:
            words = _row_sr_words(seed_row, tb, k, blk, q, nblk, I64)
        for pp in tl.static_range(4):
            # token (pp // 2)·8 + 2k + pp % 2, written inline: a name assigned inside the
            # loop is not a compile-time constant for the tuple subscripts (sm_90 compiler)
            e0, o0, e1, o1 = _token(E0, O0, E1, O1, (pp // 2) * 8 + 2 * k + pp % 2)
            t = tb * 16 + (pp // 2) * 8 + 2 * k + pp % 2
            m = _row_mask(cmask, t, T, EVEN)
            if not TILE2D:
                bm = tl.max(tl.maximum(tl.maximum(tl.abs(e0), tl.abs(o0)),
                                       tl.maximum(tl.abs(e1), tl.abs(o1))), 1)     # [NB]
                s_val, s_bits, f = _candidate(bm, enc, dec, RCP_NB)
            f2 = f[:, None]
            s2 = s_val[:, None]
            if I64:
                t_ = t.to(tl.int64)
            else:
                t_ = t
            if ROW_SR:
                w = words[pp]
                u0, u1, u2, u3 = sr_u8(w, 0), sr_u8(w, 1), sr_u8(w, 2), sr_u8(w, 3)
                if ROW_CODES or not SR_DIRECT:
                    n0 = nib_sr(e0, f2, u0)
                    n1 = nib_sr(o0, f2, u1)
                    n2 = nib_sr(e1, f2, u2)
                    n3 = nib_sr(o1, f2, u3)
            elif ROW_CODES:
                n0 = nib_rne(e0, f2)
                n1 = nib_rne(o0, f2)
                n2 = nib_rne(e1, f2)
                n3 = nib_rne(o1, f2)
            if ROW_DEC:
                if ROW_SR and (ROW_CODES or not SR_DIRECT):
                    w_lo = bf16_word(dec_nib_bits(n0, s2), dec_nib_bits(n1, s2))
                    w_hi = bf16_word(dec_nib_bits(n2, s2), dec_nib_bits(n3, s2))
                elif ROW_SR:
                    w_lo = bf16_word(_dec_sr_bits(e0, f2, u0, s2), _dec_sr_bits(o0, f2, u1, s2))
                    w_hi = bf16_word(_dec_sr_bits(e1, f2, u2, s2), _dec_sr_bits(o1, f2, u3, s2))
                else:
                    w_lo = bf16_word(_dec_rne_bits(e0, f2, s2), _dec_rne_bits(o0, f2, s2))
                    w_hi = bf16_word(_dec_rne_bits(e1, f2, s2), _dec_rne_bits(o1, f2, s2))
                p = row_dec_ptr + t_ * (C // 2) + (blk * 8)[:, None] + q[None, :]   # words
                tl.store(p, w_lo, mask=m)
                tl.store(p + 4, w_hi, mask=m)
            if ROW_CODES:
                p = row_data_ptr + t_ * (C // 2) + (blk * 8)[:, None] + q[None, :]  # bytes
                tl.store(p, (n0 | (n1 << 4)).to(tl.uint8), mask=m)
                tl.store(p + 4, (n2 | (n3 << 4)).to(tl.uint8), mask=m)
                if EVEN:
                    tl.store(row_scale_ptr + t_ * nblk + blk, s_bits.to(tl.uint8))
                else:
                    tl.store(row_scale_ptr + t_ * nblk + blk, s_bits.to(tl.uint8),
                             mask=(blk < nblk) & ((blk * 0 + t) < T))


@triton.jit(do_not_specialize=["seed_row", "seed_col"])
def _quantize_two_ways_kernel(
        x_ptr, gamax_row_ptr, gamax_col_ptr, obs_ptr, ts_ptr, peer_row_ptr, peer_col_ptr,
        row_dec_ptr, row_data_ptr, row_scale_ptr, col_dec_ptr, col_data_ptr, col_scale_ptr,
        seed_row, seed_col, T, C, stride_t, SIGNS: tl.constexpr,
        ROW_DEC: tl.constexpr, ROW_CODES: tl.constexpr, ROW_SR: tl.constexpr,
        TILE2D: tl.constexpr, COL_DEC: tl.constexpr, COL_CODES: tl.constexpr,
        COL_SR: tl.constexpr, SR_DIRECT: tl.constexpr, XW: tl.constexpr, I64: tl.constexpr,
        NB: tl.constexpr, TBS: tl.constexpr, EVEN: tl.constexpr, ALPHA_ROW: tl.constexpr,
        ALPHA_COL: tl.constexpr, RCP_NB: tl.constexpr):
    """TBS token blocks (a loop, not unrolled) × NB channel blocks a program; TBS > 1 only
    where the column way writes codes and the token blocks are a multiple of TBS (the host's
    choice), so every block of the program exists. Program 0 stores the tensor scales
    (``ts[0]``, ``ts[1]``) and, with ALPHA_ROW / ALPHA_COL, each way's GEMM alpha: its tensor
    scale times the other operand's (``peer_*_ptr``, FP32), ``ts[2]`` / ``ts[3]`` (the
    product the GEMM call would otherwise make in a launch of its own)."""
    pid, ntb, tb0, blk, q, cmask = _tile_coords(T, C, NB, TBS, EVEN)
    nblk = C // 16
    tpad = ntb * 16
    c0 = (blk * 16)[:, None] + 2 * q[None, :]          # channel of e0; o0 = +1, e1 = +8
    acc_e0 = tl.zeros((NB, 4, 2 * TBS), tl.int32)
    acc_o0 = tl.zeros((NB, 4, 2 * TBS), tl.int32)
    acc_e1 = tl.zeros((NB, 4, 2 * TBS), tl.int32)
    acc_o1 = tl.zeros((NB, 4, 2 * TBS), tl.int32)
    sc_e0 = tl.zeros((NB, 4), tl.int32)
    sc_o0 = tl.zeros((NB, 4), tl.int32)
    sc_e1 = tl.zeros((NB, 4), tl.int32)
    sc_o1 = tl.zeros((NB, 4), tl.int32)
    for sub in range(TBS):
        tb = tb0 + sub
        E0, O0, E1, O1 = _load_rows(x_ptr, tb, blk, q, cmask, T, C, stride_t, XW, I64, EVEN)
        # the tensor scales are loaded where each way starts (per token block: a few
        # instructions), so the row way's registers do not hold the column way's
        if ROW_DEC or ROW_CODES:
            enc_r, dec_r, dec_out = _tensor_scale(gamax_row_ptr, obs_ptr)
            if pid == 0:
                tl.store(ts_ptr, dec_out)
                if ALPHA_ROW:
                    tl.store(ts_ptr + 2, dec_out * tl.load(peer_row_ptr))
            _row_way(E0, O0, E1, O1, tb, blk, q, cmask, T, C, nblk, enc_r, dec_r, seed_row,
                     row_dec_ptr, row_data_ptr, row_scale_ptr, ROW_DEC, ROW_CODES, ROW_SR,
                     TILE2D, SR_DIRECT, I64, EVEN, RCP_NB)
        if COL_DEC or COL_CODES:
            enc_c, dec_c, dec_out = _tensor_scale(gamax_col_ptr, obs_ptr + 1)
            if pid == 0:
                tl.store(ts_ptr + 1, dec_out)
                if ALPHA_COL:
                    tl.store(ts_ptr + 3, dec_out * tl.load(peer_col_ptr))
            if COL_SR:
                cw = _col_sr_words(seed_col, blk, q, tb, ntb, I64)
                u_e0, u_o0 = _col_group_uniforms(cw, 0), _col_group_uniforms(cw, 1)
                u_e1, u_o1 = _col_group_uniforms(cw, 2), _col_group_uniforms(cw, 3)
            else:
                u_e0, u_o0, u_e1, u_o1 = seed_col, seed_col, seed_col, seed_col   # unused
            acc_e0, sc_e0 = _col_group(rht16_tokens(E0, SIGNS), c0, tb, tpad, ntb, enc_c, dec_c,
                                       u_e0, cmask, col_dec_ptr, col_data_ptr, col_scale_ptr,
                                       acc_e0, sc_e0, sub, COL_DEC, COL_CODES, COL_SR,
                                       SR_DIRECT, I64, TBS, RCP_NB)
            acc_o0, sc_o0 = _col_group(rht16_tokens(O0, SIGNS), c0 + 1, tb, tpad, ntb, enc_c,
                                       dec_c, u_o0, cmask, col_dec_ptr, col_data_ptr,
                                       col_scale_ptr, acc_o0, sc_o0, sub, COL_DEC, COL_CODES,
                                       COL_SR, SR_DIRECT, I64, TBS, RCP_NB)
            acc_e1, sc_e1 = _col_group(rht16_tokens(E1, SIGNS), c0 + 8, tb, tpad, ntb, enc_c,
                                       dec_c, u_e1, cmask, col_dec_ptr, col_data_ptr,
                                       col_scale_ptr, acc_e1, sc_e1, sub, COL_DEC, COL_CODES,
                                       COL_SR, SR_DIRECT, I64, TBS, RCP_NB)
            acc_o1, sc_o1 = _col_group(rht16_tokens(O1, SIGNS), c0 + 9, tb, tpad, ntb, enc_c,
                                       dec_c, u_o1, cmask, col_dec_ptr, col_data_ptr,
                                       col_scale_ptr, acc_o1, sc_o1, sub, COL_DEC, COL_CODES,
                                       COL_SR, SR_DIRECT, I64, TBS, RCP_NB)
    if COL_CODES and TBS > 1:
        _store_col_codes(acc_e0, sc_e0, c0, tb0, tpad, ntb, cmask, col_data_ptr, col_scale_ptr,
                         I64, TBS)
        _store_col_codes(acc_o0, sc_o0, c0 + 1, tb0, tpad, ntb, cmask, col_data_ptr,
                         col_scale_ptr, I64, TBS)
        _store_col_codes(acc_e1, sc_e1, c0 + 8, tb0, tpad, ntb, cmask, col_data_ptr,
                         col_scale_ptr, I64, TBS)
        _store_col_codes(acc_o1, sc_o1, c0 + 9, tb0, tpad, ntb, cmask, col_data_ptr,
                         col_scale_ptr, I64, TBS)
