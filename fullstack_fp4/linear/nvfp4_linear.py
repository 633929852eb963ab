"""NVFP4 linear layer, NVIDIA's recipe: ``y = x Wᵀ + b`` with all three GEMMs in NVFP4.

Shapes: ``x [..., in]`` (megatron's ``[s, b, h]`` is flattened to ``[T, in]``, T = s·b),
``W [out, in]``. Every GEMM is :func:`fullstack_fp4.nvfp4.gemm.nvfp4_matmul` (``a @ bᵀ`` with
both operands quantized along the reduction dimension K).

=========  =============================  ==========================  ================
GEMM       a (quantized along K)           b (quantized along K)       K
=========  =============================  ==========================  ================
fprop      x      1×16, nearest            W   16×16, nearest          in
dgrad      dY     1×16, stochastic         Wᵀ  16×16 (same codes)      out
wgrad      RHT(dYᵀ) 1×16, stochastic       RHT(xᵀ) 1×16, nearest       T (tokens)
=========  =============================  ==========================  ================

Why each choice:

* **W with 16×16 tiles** (forward *and* dgrad): one scale per tile means the quantization
  does not depend on which axis is the reduction axis, so ``Wᵀ`` quantized along ``out`` is the
  exact transpose of ``W`` quantized along ``in`` (same codes, same tile scales, same tensor
  scale; :meth:`NVFP4Tensor.t` repacks the nibbles). Forward and dgrad therefore see the *same*
  quantized weight, the chain rule holds for the quantized network (dgrad is the true gradient
  of the quantized forward w.r.t. x, up to dY's rounding), and one quantization serves both.
* **Stochastic rounding on dY only**: gradients are averaged over many steps, so an unbiased
  rounding turns the quantization error into zero-mean noise instead of a systematic bias;
  forward operands keep nearest rounding (lower variance, and the forward has no averaging).
  Caveat inherited from the format: an element whose scaled value exceeds 6 (possible only for
  the block max, when the E4M3 block scale rounds down, by at most 1/16 relative) is clamped
  to 6 before rounding, a small bias the tests account for.
* **RHT-16 on both wgrad operands**, blockwise along the tokens (the reduction dim): with
  ``R = blockdiag(diag(s) H16 / 4)`` orthogonal, ``(dYᵀ R)(xᵀ R)ᵀ = dYᵀ R Rᵀ x = dYᵀ x``, so it
  cancels exactly in the product while spreading token outliers over each 16-block.
* **Padding the tokens to a multiple of 16** for wgrad (blocks run along T): zero rows add
  nothing to ``dYᵀ x``, are fixed points of the RHT (``0 · R = 0``) and cannot raise a block's
  amax, so the product is unchanged; only the last, partial 16-block of tokens is affected
  (it is quantized together with zeros, as it would be with any block layout).

Saved for backward: only quantized tensors, never a BF16 copy of x. ``W``'s 16×16 NVFP4
codes (for dgrad) and ``RHT(xᵀ)``'s NVFP4 codes (for wgrad): ≈ 4.5 bits per element instead of
16. The wgrad copy of x is quantized in the forward (the same thing TE does with its
"columnwise" usage), at the cost of one more quantization pass there.

``amax_reduce`` (optional callable on an FP32 0-dim tensor, e.g. an all-reduce MAX over the
tensor-parallel group) is applied to each operand's amax so that every rank uses one tensor
scale; ``None`` means local amax.

Non-finite inputs never raise, on the CPU (reference quantizer) as on CUDA: the quantizations
run with ``check_finite=False``, so a NaN/Inf operand makes that operand's tensor scale NaN and
the GEMM output (forward), dX or dW is entirely NaN. The per-step check the training loop
already does (its divergence guard on the loss and the total grad norm) then skips the update,
once per step and on every rank alike, instead of one ``.item()`` per quantize on CUDA (5 per
linear per step, ~200 µs each with the pipeline drained) or an exception that stops one rank in
the middle of a step (tests/megatron/training/test_reliability.py::test_nan_inside_fp4_recipe_is_a_skipped_step).

GPU path (see docs/perf/nvfp4.md): every operand is built by one
read of its source in its own layout (``fullstack_fp4.nvfp4.kernels.quantize_two_ways``), after
one amax pass that gives both of its amaxes:

=========  ===========================================================================
forward    amax(x), amax(RHT over tokens of x) and amax(W) in one launch (one zeroed
           buffer); one kernel reads x and writes the decoded BF16 fprop operand (1×16) and
           RHT(xᵀ)'s codes (saved, 4-bit) without a transposed copy; one kernel reads W and
           writes its decoded operand, its 16×16 codes (saved for dgrad) and the fprop
           GEMM's alpha ``ts_x · ts_w``.
backward   one amax pass over dY (both amaxes); one kernel reads dY and writes both decoded
           operands, dY (1×16, SR) for dgrad and RHT(dYᵀ) ``[out, T_pad]`` (SR) for wgrad,
           neither as codes, and both GEMMs' alphas; the saved W and RHT(xᵀ) codes are
           decoded in one launch.
GEMMs      ``gemm.decoded_matmul`` on the decoded operands above: one cuBLASLt call
           that reads the alpha ``ts_a · ts_b`` by device pointer and writes the output dtype
           (or adds into the wgrad buffer); backend ``cublas``: ``torch.mm`` with FP32 output,
           then one Triton pass for ``(acc · ts_a · ts_b) → out dtype``.
=========  ===========================================================================

Launches per fwd+bwd (both gradients): 2 zero fills, 2 amax passes, 3 quantize kernels, 1
decode, 3 GEMMs. In a CUDA graph the launches cost no device time on the H200 (kernels follow
each other ~0.4 µs apart); eager, each launch is host time the layer waits on (BENCHMARKS.md,
the NVFP4 linear).

Scale rules (``scale_rule``, per operand; :class:`ScaleRules`): ``"6"`` maps each block's max to
6, ``"4over6"`` also tries the scale that maps it to 4 and keeps the candidate with the lower
error, with 256 instead of 448 as the E4M3 bound of the tensor scale ("Four Over Six", arXiv
2512.02010; the rule and its FP32 order are :mod:`fullstack_fp4.nvfp4.reference`'s). x's rule
applies to x (fprop) and to RHT(xᵀ) (wgrad), dY's to dY (dgrad) and to RHT(dYᵀ) (wgrad; the
choice is made on the nearest-rounded candidates, then the chosen scale rounds stochastically),
W's to its 16×16 tiles (the error of a tile summed over its 256 elements). The tensor amax, and
with it the TP ``amax_reduce``, is the same for both rules. An operand with ``"4over6"`` is
quantized by :func:`fullstack_fp4.nvfp4.quantize` (the reference on CPU, its Triton kernel on
CUDA, bit-identical to it) through the composed path below, not by the fused operand kernels,
which implement the 6 rule only: the forward takes the composed path when x's or W's rule is
4over6, the backward when dY's is (the saved codes are the same format either way).

Same codes, scales, stochastic-rounding draws (Philox seeds drawn from ``generator`` in the
same order: dY's, then RHT(dYᵀ)'s) and GEMM calls as the composition
``quantize`` → ``decode_to_bf16`` → ``nvfp4_matmul``: y, dX and dW are bit-identical to it
(tests under ``TRITON_INTERPRET=1``). The CPU path is that composition with the reference
quantizer.

Gradient-accumulation fusion (``wgrad_accumulator``, both paths): a training loop that sums the
weight gradients of its micro-batches in a buffer of its own (megatron-core's DDP:
``param.main_grad``, FP32 or BF16) would otherwise get dW in W's dtype and add it to that
buffer in a second full pass. With an accumulator the wgrad epilogue adds the scaled FP32 GEMM
accumulator into the buffer directly, ``buf ← buf + acc·(ts_a·ts_b)``, rounded once to
``buf``'s dtype (``gemm.scale_accumulate``): one pass fewer, no dW tensor, and for a BF16
``buf`` one rounding instead of two (dW is not rounded to BF16 before the sum). What the
backward then returns to autograd as W's gradient is the accumulator's business
(:class:`WgradAccumulator`): this package knows no training loop, the integration layer
(``fullstack_fp4/integration/nvfp4_linear_layers.py``) implements megatron's protocol.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Optional, Protocol, Union

import torch
import torch.nn.functional as F

from fullstack_fp4.nvfp4 import DEFAULT_SIGNS, NVFP4Tensor, quantize
from fullstack_fp4.nvfp4.gemm import decode_to_bf16, decoded_matmul, nvfp4_matmul, nvfp4_matmul_nt

__all__ = ["NVFP4LinearFunction", "nvfp4_linear", "nvfp4_linear_forward", "nvfp4_linear_backward",
           "pack_saved", "unpack_saved", "quantize_wgrad_operand", "WgradAccumulator",
           "BufferAccumulator", "ScaleRules", "scale_rules"]

AmaxReduce = Optional[Callable[[torch.Tensor], torch.Tensor]]


class ScaleRules(NamedTuple):
    """The block-scale rule of each operand, ``"6"`` or ``"4over6"`` (module docstring, "Scale
    rules"): ``x`` for x and RHT(xᵀ), ``w`` for W's 16×16 tiles, ``dy`` for dY and RHT(dYᵀ)."""

    x: str = "6"
    w: str = "6"
    dy: str = "6"


_RULES = ("6", "4over6")


def scale_rules(rule: Union[str, Mapping[str, str], ScaleRules, None] = "6") -> ScaleRules:
    """``"6"`` / ``"4over6"`` for every operand, or a mapping of ``x`` / ``w`` / ``dy`` (missing
    keys: ``"6"``), checked."""
    if isinstance(rule, ScaleRules):
        out = rule
    elif rule is None or isinstance(rule, str):
        out = ScaleRules(*(3 * [rule or "6"]))
    else:
        bad = set(rule) - set(ScaleRules._fields)
        if bad:
            raise ValueError(f"scale rules name unknown operand(s) {sorted(bad)}: use x, w, dy")
        out = ScaleRules(**{k: str(v) for k, v in rule.items()})
    for op, r in zip(ScaleRules._fields, out):
        if r not in _RULES:
            raise ValueError(f"scale rule of {op} must be '6' or '4over6', got {r!r}")
    return out


class WgradAccumulator(Protocol):
    """Where a backward adds W's gradient instead of returning it (gradient-accumulation fusion).

    An object, not the buffer itself, because the owner of the buffer, not this package, decides
    two things: which tensor it is at backward time, and what autograd receives as W's gradient
    once it holds the sum (megatron-core wants a placeholder tensor and a flag on the parameter;
    another owner may want None). The backward calls ``buffer()``, adds into it, then returns
    ``accumulated()`` as W's gradient, each once per backward."""

    def buffer(self) -> torch.Tensor:
        """The tensor of W's shape (contiguous, FP32 or BF16) the wgrad is added into in place."""
        ...

    def accumulated(self) -> Optional[torch.Tensor]:
        """Called after the add: what autograd gets as W's gradient."""
        ...


class BufferAccumulator:
    """A :class:`WgradAccumulator` over a tensor the caller owns: the wgrad is added into
    ``buf`` and autograd gets ``None`` for W (a training loop that reads ``buf`` itself; inside
    megatron-core the integration layer's ``MainGradAccumulator`` is the one to use)."""

    __slots__ = ("buf",)

    def __init__(self, buf: torch.Tensor):
        self.buf = buf

    def buffer(self) -> torch.Tensor:
        return self.buf

    def accumulated(self) -> None:
        return None


def _check_finite(t: torch.Tensor) -> bool:
    """No host NaN check per quantize on either path (see module docstring); tests patch this
    to exercise the raising form."""
    return False


def _fused_kernels():
    """The fused-operand kernels (None without Triton)."""
    try:
        from fullstack_fp4.nvfp4.kernels import quantize_two_ways as tqd  # noqa: PLC0415
    except ImportError:
        return None
    return tqd


def _use_fused(t: torch.Tensor) -> bool:
    return t.is_cuda and _fused_kernels() is not None


def _amax(t: torch.Tensor, rht_signs) -> torch.Tensor:
    if t.is_cuda:
        try:
            from fullstack_fp4.nvfp4.kernels.quantize import amax_triton  # noqa: PLC0415
        except ImportError:
            amax_triton = None
        if amax_triton is not None:
            return amax_triton(t.detach(), rht_signs)
    if rht_signs is not None:
        from fullstack_fp4.nvfp4 import hadamard16  # noqa: PLC0415
        t = hadamard16(t.detach(), rht_signs)
    return t.detach().abs().amax().to(torch.float32)


def _quantize(t: torch.Tensor, amax_reduce: AmaxReduce, rht_signs=None, **kw) -> NVFP4Tensor:
    gamax = None
    if amax_reduce is not None:
        gamax = amax_reduce(_amax(t, rht_signs))
    return quantize(t, global_amax=gamax, rht_signs=rht_signs,
                    check_finite=_check_finite(t), **kw)


def pad_tokens(m: torch.Tensor) -> torch.Tensor:
    """``[T, C]`` with zero tokens appended up to a multiple of 16, wgrad's block length
    (zero tokens change no product: module docstring)."""
    pad = (-m.shape[0]) % 16
    return F.pad(m, (0, 0, 0, pad)) if pad else m


def quantize_wgrad_operand(m: torch.Tensor, *, rounding: str, generator=None,
                           amax_reduce: AmaxReduce = None, scale_rule: str = "6") -> NVFP4Tensor:
    """``[T, C]`` -> NVFP4 of ``RHT16(pad(m)ᵀ)``, shape ``[C, T_pad]``, quantized along tokens.

    CUDA, rule ``"6"``: :mod:`fullstack_fp4.nvfp4.kernels.quantize_two_ways` reads ``m`` in place
    (no transposed copy): one amax pass, then the codes; same amax_reduce call and seed draw,
    same bits. Rule ``"4over6"``: :func:`fullstack_fp4.nvfp4.quantize` of the transposed copy."""
    if scale_rule == "6" and _use_fused(m):
        tqd = _fused_kernels()
        obs = tqd.amax_two_ways(m, row=False, col=True)
        gamax = amax_reduce(obs.view(torch.float32)[1]) if amax_reduce is not None else None
        seed = tqd.draw_seed(generator) if rounding == "stochastic" else None
        return tqd.quantize_two_ways(m, obs, col=tqd.ColWay(rounding, decoded=False, codes=True),
                                     amax_col=gamax, seed_col=seed,
                                     check_finite=_check_finite(m)).col_q
    m = pad_tokens(m)
    mt = m.t()
    if m.is_cuda:
        mt = mt.contiguous()           # the kernel reads rows with a contiguous last dim
    return _quantize(mt, amax_reduce, rht_signs=DEFAULT_SIGNS, tile=(1, 16), rounding=rounding,
                     generator=generator, scale_rule=scale_rule)


def _pack(q: NVFP4Tensor):
    return (q.data, q.block_scale, q.tensor_scale), (q.shape, q.dtype, q.tile)


def _unpack(tensors, meta) -> NVFP4Tensor:
    return NVFP4Tensor(*tensors, *meta)


def _composed_forward(x2: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
                      need_dx: bool, need_dw: bool, amax_reduce: AmaxReduce,
                      rules: ScaleRules = ScaleRules()):
    """CPU / reference path of the forward (the composition the GPU path reproduces)."""
    qx = _quantize(x2, amax_reduce, tile=(1, 16), rounding="nearest", scale_rule=rules.x)
    qw = _quantize(weight, amax_reduce, tile=(16, 16), rounding="nearest", scale_rule=rules.w)
    y = nvfp4_matmul(qx, qw, out_dtype=out_dtype)
    qxt = (quantize_wgrad_operand(x2, rounding="nearest", amax_reduce=amax_reduce,
                                  scale_rule=rules.x) if need_dw else None)
    return y, (qw if need_dx else None), qxt


def _composed_backward(dy2: torch.Tensor, qw: Optional[NVFP4Tensor], qxt: Optional[NVFP4Tensor],
                       x_dtype: torch.dtype, w_dtype: torch.dtype, generator,
                       amax_reduce: AmaxReduce, wgrad_into: Optional[torch.Tensor] = None,
                       rules: ScaleRules = ScaleRules()):
    """CPU / reference path of the backward: dX from dY (1×16, SR) and W's saved 16×16 codes
    (read transposed), dW from RHT(dYᵀ) (SR) and RHT(xᵀ)'s saved codes (added into
    ``wgrad_into`` instead, if given: then dW is None)."""
    dx = dw = None
    if qw is not None:
        qdy = _quantize(dy2, amax_reduce, tile=(1, 16), rounding="stochastic", generator=generator,
                        scale_rule=rules.dy)
        dx = nvfp4_matmul_nt(qdy, qw, out_dtype=x_dtype)
    if qxt is not None:
        qdyt = quantize_wgrad_operand(dy2, rounding="stochastic", generator=generator,
                                      amax_reduce=amax_reduce, scale_rule=rules.dy)
        dw = nvfp4_matmul(qdyt, qxt, out_dtype=w_dtype, accumulate_into=wgrad_into)
    return dx, dw


def _fused_forward(x2: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, need_dx: bool,
                   need_dw: bool, amax_reduce: AmaxReduce):
    """GPU path of the forward: ``(y [T, out], W's 16×16 codes or None, RHT(xᵀ)'s codes or
    None)``. amax_reduce is called on x's, W's, then RHT(xᵀ)'s amax (the reference order)."""
    tqd = _fused_kernels()
    check = _check_finite(x2)
    obs_x, obs_w = tqd.amax_two_ways_pair(x2, weight, row_x=True, col_x=need_dw, row_y=True,
                                          col_y=False)
    g_x = g_w = g_xt = None
    if amax_reduce is not None:
        g_x = amax_reduce(obs_x.view(torch.float32)[0])
        g_w = amax_reduce(obs_w.view(torch.float32)[0])
        if need_dw:
            g_xt = amax_reduce(obs_x.view(torch.float32)[1])
    qx = tqd.quantize_two_ways(x2, obs_x, row=tqd.RowWay("nearest"),
                               col=tqd.ColWay("nearest") if need_dw else None,
                               amax_row=g_x, amax_col=g_xt, check_finite=check)
    # W's call also writes the fprop GEMM's alpha, ts_x · ts_w (x's scale is written by now)
    qw = tqd.quantize_two_ways(weight, obs_w, row=tqd.RowWay("nearest", (16, 16), codes=need_dx),
                               amax_row=g_w, check_finite=check, row_peer_scale=qx.row_scale)
    y = decoded_matmul(qx.row_decoded, qw.row_decoded.t(), qx.row_scale, qw.row_scale, out_dtype,
                       alpha=qw.row_alpha)
    return y, qw.row_q, qx.col_q


def _fused_backward(dy2: torch.Tensor, qw: Optional[NVFP4Tensor], qxt: Optional[NVFP4Tensor],
                    x_dtype: torch.dtype, w_dtype: torch.dtype, generator, amax_reduce: AmaxReduce,
                    wgrad_into: Optional[torch.Tensor] = None):
    """GPU path of the backward: ``(dX [T, in] or None, dW [out, in] or None)`` from the saved
    codes (``qw`` for dX, ``qxt`` for dW). Per way in this order: amax_reduce, then the SR seed
    from ``generator`` (dY's way, then RHT(dYᵀ)'s), as the composed path draws them. With
    ``wgrad_into`` the wgrad epilogue adds into it (one Triton pass) and dW is None."""
    tqd = _fused_kernels()
    need_dx, need_dw = qw is not None, qxt is not None
    if not (need_dx or need_dw):
        return None, None
    obs = tqd.amax_two_ways(dy2, row=need_dx, col=need_dw)
    g_row = g_col = seed_row = seed_col = None
    if need_dx:
        g_row = amax_reduce(obs.view(torch.float32)[0]) if amax_reduce is not None else None
        seed_row = tqd.draw_seed(generator)
    if need_dw:
        g_col = amax_reduce(obs.view(torch.float32)[1]) if amax_reduce is not None else None
        seed_col = tqd.draw_seed(generator)
    q = tqd.quantize_two_ways(
        dy2, obs, row=tqd.RowWay("stochastic") if need_dx else None,
        col=tqd.ColWay("stochastic", decoded=True, codes=False) if need_dw else None,
        amax_row=g_row, amax_col=g_col, seed_row=seed_row, seed_col=seed_col,
        check_finite=_check_finite(dy2),
        row_peer_scale=_peer_scale(qw), col_peer_scale=_peer_scale(qxt))
    if need_dx and need_dw:
        w_dec, xt_dec = _decode_pair(qw, qxt)
    else:
        w_dec = decode_to_bf16(qw) if need_dx else None
        xt_dec = decode_to_bf16(qxt) if need_dw else None
    dx = dw = None
    if need_dx:
        dx = decoded_matmul(q.row_decoded, w_dec, q.row_scale, qw.tensor_scale, x_dtype,
                            alpha=q.row_alpha)
    if need_dw:
        dw = decoded_matmul(q.col_decoded, xt_dec.t(), q.col_scale, qxt.tensor_scale,
                            w_dtype, accumulate_into=wgrad_into, alpha=q.col_alpha)
    return dx, dw


def _peer_scale(q: Optional[NVFP4Tensor]) -> Optional[torch.Tensor]:
    """A saved operand's tensor scale as the dY call's peer (its GEMM alpha is written by the
    dY kernel); None where it is absent or not a 1-element FP32 device tensor."""
    if q is None:
        return None
    ts = q.tensor_scale
    if not isinstance(ts, torch.Tensor) or ts.numel() != 1 or ts.dtype != torch.float32:
        return None
    return ts


def _decode_pair(qw: NVFP4Tensor, qxt: NVFP4Tensor):
    """The saved W's and RHT(xᵀ)'s GEMM operands, decoded in one launch."""
    from fullstack_fp4.nvfp4.kernels.decode import decode_bf16_pair  # noqa: PLC0415
    return decode_bf16_pair(qw, qxt)


def nvfp4_linear_forward(x2: torch.Tensor, weight: torch.Tensor, need_dx: bool, need_dw: bool,
                         amax_reduce: AmaxReduce = None, scale_rule="6"):
    """The forward without autograd: ``(y [T, out] in x2's dtype, W's 16×16 codes or None,
    RHT(xᵀ)'s codes or None)`` — the codes are what :func:`nvfp4_linear_backward` needs for dX
    (``need_dx``) and dW (``need_dw``). For an autograd Function that wraps the NVFP4 GEMMs with
    more terms (LoRA-SVD) without a nested autograd graph: that would keep the output and the
    graph's Python bookkeeping alive until the backward. ``scale_rule``: :func:`scale_rules`."""
    rules = scale_rules(scale_rule)
    if rules.x == "6" and rules.w == "6" and _use_fused(x2):
        return _fused_forward(x2, weight, x2.dtype, need_dx, need_dw, amax_reduce)
    return _composed_forward(x2, weight, x2.dtype, need_dx, need_dw, amax_reduce, rules)


def nvfp4_linear_backward(dy2: torch.Tensor, qw: Optional[NVFP4Tensor], qxt: Optional[NVFP4Tensor],
                          x_dtype: torch.dtype, w_dtype: torch.dtype, generator=None,
                          amax_reduce: AmaxReduce = None,
                          wgrad_into: Optional[torch.Tensor] = None, scale_rule="6"):
    """The backward without autograd: ``(dX [T, in] or None, dW [out, in] or None)`` from
    ``dY [T, out]`` and the codes :func:`nvfp4_linear_forward` returned (dX needs ``qw``, dW
    ``qxt``); SR seeds come from ``generator`` (dY's way first, then RHT(dYᵀ)'s).

    ``wgrad_into`` (``[out, in]``, contiguous FP32 or BF16; needs ``qxt``): the wgrad is added
    into it in place, ``wgrad_into ← wgrad_into + acc·(ts_a·ts_b)`` rounded once to its dtype
    (``gemm.scale_accumulate``), and dW is returned as None. Same codes, draws and GEMM as
    without it: the sum equals ``(wgrad_into.float() + dW_fp32).to(wgrad_into.dtype)`` where
    ``dW_fp32`` is the dW this function returns for ``w_dtype=torch.float32``. ``scale_rule``:
    :func:`scale_rules` (dY's entry applies here; x's and W's are in the saved codes)."""
    if wgrad_into is not None and qxt is None:
        raise ValueError("wgrad_into needs the wgrad operand codes (qxt)")
    rules = scale_rules(scale_rule)
    if rules.dy == "6" and _use_fused(dy2):
        return _fused_backward(dy2, qw, qxt, x_dtype, w_dtype, generator, amax_reduce, wgrad_into)
    return _composed_backward(dy2, qw, qxt, x_dtype, w_dtype, generator, amax_reduce, wgrad_into,
                              rules)


def pack_saved(qw: Optional[NVFP4Tensor], qxt: Optional[NVFP4Tensor]):
    """The codes as plain tensors for ``ctx.save_for_backward`` and their metadata."""
    tensors, meta = [], {}
    for key, q in (("w", qw), ("xt", qxt)):
        if q is not None:
            t, meta[key] = _pack(q)
            tensors += t
    return tensors, meta


def unpack_saved(tensors, meta) -> tuple:
    """Inverse of :func:`pack_saved`: ``(qw or None, qxt or None)``."""
    tensors, out = list(tensors), {}
    for key in ("w", "xt"):
        if key in meta:
            out[key], tensors = _unpack(tensors[:3], meta[key]), tensors[3:]
    return out.get("w"), out.get("xt")


class NVFP4LinearFunction(torch.autograd.Function):
    """``y = x Wᵀ + b`` with NVFP4 fprop, dgrad and wgrad (see module docstring). With a
    ``wgrad_accumulator`` the wgrad is added into its buffer and W's gradient is whatever
    ``accumulated()`` returns (gradient-accumulation fusion, module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias=None, generator=None, amax_reduce=None,
                wgrad_accumulator: Optional[WgradAccumulator] = None, rules: ScaleRules = ScaleRules()):
        in_f, out_f = weight.shape[1], weight.shape[0]
        if x.shape[-1] != in_f:
            raise ValueError(f"x last dim {x.shape[-1]} != in_features {in_f}")
        x2 = x.reshape(-1, in_f)
        y, qw, qxt = nvfp4_linear_forward(x2, weight, ctx.needs_input_grad[0],
                                          ctx.needs_input_grad[1], amax_reduce, rules)
        if bias is not None:
            y = y + bias.to(y.dtype)
        saved, ctx.meta = pack_saved(qw, qxt)
        ctx.save_for_backward(*saved)
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.generator, ctx.amax_reduce, ctx.rules = generator, amax_reduce, rules
        ctx.wgrad_accumulator = wgrad_accumulator if qxt is not None else None
        return y.reshape(*x.shape[:-1], out_f)

    @staticmethod
    def backward(ctx, grad_out):
        dy2 = grad_out.reshape(-1, grad_out.shape[-1])
        qw, qxt = unpack_saved(ctx.saved_tensors, ctx.meta)
        accumulator = ctx.wgrad_accumulator
        dx, dw = nvfp4_linear_backward(
            dy2, qw, qxt, ctx.x_dtype, ctx.w_dtype, ctx.generator, ctx.amax_reduce,
            wgrad_into=accumulator.buffer() if accumulator is not None else None,
            scale_rule=ctx.rules)
        if accumulator is not None:
            dw = accumulator.accumulated()   # dW is in its buffer already
        if dx is not None:
            dx = dx.reshape(ctx.x_shape)
        db = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.to(torch.float32).sum(dim=0).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None


def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                 generator: Optional[torch.Generator] = None,
                 amax_reduce: AmaxReduce = None,
                 wgrad_accumulator: Optional[WgradAccumulator] = None,
                 scale_rule="6") -> torch.Tensor:
    """Functional NVFP4 linear, ``x [..., in]``, ``weight [out, in]`` (both multiples of 16).
    ``wgrad_accumulator``: add W's gradient into its buffer instead of returning it (module
    docstring, "Gradient-accumulation fusion"). ``scale_rule``: ``"6"``, ``"4over6"`` or a
    mapping of ``x`` / ``w`` / ``dy`` (module docstring, "Scale rules")."""
    return NVFP4LinearFunction.apply(x, weight, bias, generator, amax_reduce, wgrad_accumulator,
                                     scale_rules(scale_rule))
