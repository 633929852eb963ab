"""One read of an activation (or weight) → every NVFP4 operand the linear needs from it.

The NVFP4 linear (``fullstack_fp4.linear.nvfp4_linear``) needs two quantizations of each of
``x [T, C]`` and ``dY [T, C]``, and the GEMMs on Hopper are emulated on *decoded* BF16
operands ``e2m1(code) · fp32(block_scale)`` (exact in BF16, see ``gemm.py``):

* **row way**: 1×16 blocks along C (fprop's x, dgrad's dY), or 16×16 tiles (the weight);
* **column way**: ``RHT16`` along the tokens, then 1×16 blocks along the tokens — the wgrad
  operand ``quantize(hadamard16(pad(m)ᵀ))`` of shape ``[C, T_pad]`` (T_pad = T rounded up
  to 16, padded tokens are zeros).

The earlier path wrote each operand's packed codes, read them back to decode them, and made a
BF16 transposed copy of ``m`` for the column way. Here one kernel reads a tile of ``m`` **in
its own layout** (16 tokens × ``16·NB`` channels), does both ways in registers and writes only
what a consumer reads: the decoded BF16 operand of each way the GEMMs use now, and packed
codes + E4M3 scales only for what is saved for backward (the weight's 16×16 codes for dgrad,
``RHT(xᵀ)``'s codes for wgrad). The global amaxes of both ways come from one earlier pass
(:func:`amax_two_ways`), because every block scale depends on the tensor scale.

**Numerics** are :func:`fullstack_fp4.nvfp4.reference.quantize_reference`'s bit for bit (the
FP32 contract of docs/nvfp4-format.md, 6-rule), through :mod:`.triton_quantize`'s own jit
helpers (its "eo" kernels' ones): ``_tensor_scales`` (enc/dec), ``_candidate_fast`` (E4M3 block
scale and element factor), ``_nib_rne`` / ``_nib_sr`` (E2M1 codes, nearest / stochastic),
``_e2m1_rne_val`` (the nearest value, when only the decoded operand is written),
``_bf16w_to_f32`` (BF16 read as int32 words), ``_philox10``. The RHT is
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
tokens in the column way: a lane makes 4 calls a way for its 64 values (it made 16 with 32-bit
uniforms; on the H200 the calls were most of dY's quantize time). Counters below 2³¹ go
through ``_philox10`` (the same rounds as ``tl.randint4x``), larger ones through
``tl.randint4x`` on int64 (``I64``, chosen on the host with the offsets' width).

**Layout.** A program owns 16 tokens × ``16·NB`` channels (NB = 32: 512 channels, 4 warps;
dY's call NB = 64 on 8 warps, :func:`_config`); where the column way writes codes (x's call)
it walks ``COL_CODES_TBS`` = 4 such token blocks in a loop and stores a channel's codes and
scale bytes of all four as one run each (``_store_col_codes``).
Each token row is held in triton_quantize's "eo" form: four ``[NB, 4]`` tensors, elements
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

from .hadamard import DEFAULT_SIGNS
from .triton_launch import cdiv, next_pow2, launch
from .tensor import NVFP4Tensor
from .triton_quantize_jit import FP32_MAX
from .triton_amax_two_ways import _amax_pair_kernel, _amax_two_ways_kernel
from .triton_quantize_decode_kernels import _quantize_two_ways_kernel

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
# EXIT than through the nibble, sm_90, triton 3.6) and the register cap its launch gets (the
# direct form compiles to 184 registers, 1 CTA of 8 warps an SM; capped at 128 it spills 64 B
# a thread). On the H200 (BENCHMARKS.md §L.4), 8192 × 3072 / × 8192: nibble form 0.0995 /
# 0.2565 ms, direct uncapped 0.1080 / 0.2834, direct capped at 128 0.0944 / 0.2428; with the
# direct form's rounding as ceil(v - u) (§U.5) capped at 128 0.0797 / 0.2025.
SR_DIRECT = True
WIDE_MAXNREG = 128
# The calls whose block scales take their element factor 1/(s·dec) without div_rn's branch
# (triton_quantize_jit._candidate_nb: the same values): "x" (row nearest + column codes), "W"
# (16×16 tiles), "dY" (both ways stochastic, decoded), "other". FP4_TWO_WAYS_RCP overrides the
# set (comma-separated; "" for none) for the H200 comparisons. On the H200 (BENCHMARKS.md §W,
# scripts/gpu/rcp_variants.py) only W's call gained: 0.0162 -> 0.0149 ms (3072 × 3072), 0.0413
# -> 0.0378 (8192 × 3072), 168 -> 96 registers; without the branches ptxas interleaves the row
# way's 16 scale chains, and x's call went to 198 registers and 0.0567 -> 0.0679 ms (0.0633
# capped at 168), dY's (capped at 128) 0.0724 -> 0.0799.
RCP_NO_BRANCH = frozenset(os.environ.get("FP4_TWO_WAYS_RCP", "W").split(",")) - {""}


def _call_kind(row, col, wide: bool) -> str:
    """Which of the linear's calls a launch is, for :data:`RCP_NO_BRANCH`."""
    if wide:
        return "dY"
    if row is not None and tuple(row.tile) == (16, 16):
        return "W"
    if row is not None and col is not None and col.codes:
        return "x"
    return "other"


# Token blocks a program when the column way writes codes (x's call): the codes and scale
# bytes of a channel for 4 token blocks are one 32-byte and one 4-byte store, where one program
# a token block wrote 8 bytes and 1 byte of a channel (Nsight Compute, x's call at 8192 × 3072:
# 3.5M L2 write requests, 3.1M of them those two, L2 at 77–82% of its peak, DRAM at 27%;
# BENCHMARKS.md §U.1). 1 where the token blocks are not a multiple of it.
COL_CODES_TBS = 4


def _config(nblk: int, wide: bool = False):
    """(NB 16-channel blocks per program, num_warps): 16 tokens × 512 channels, 4 warps, i.e.
    each thread holds 4 channels × 16 tokens (64 FP32 values); fewer blocks for small C.

    ``wide``: 1024 channels, 8 warps — for dY's call (both ways stochastic, the column way
    decoded), where it took 0.0995 / 0.257 ms against 0.115 / 0.300 at 8192 × 3072 / 8192 on
    the H200; x's, W's and the amax calls were the same or slower with it (NB 8 to 64 and
    register caps swept: benchmarks/profile/sweep_two_ways.py, BENCHMARKS.md §L.1). A thread's work
    and registers do not depend on NB, only the CTA size does."""
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
        RCP_NB=_call_kind(row, col, wide) in RCP_NO_BRANCH,
        num_warps=nw, enable_fp_fusion=False, **cap)
    return out
