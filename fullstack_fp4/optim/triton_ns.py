"""Fused NVFP4 operand for the emulated Newton–Schulz products (Hopper path).

On Hopper an NVFP4 product is emulated as a BF16 GEMM on the *decoded* operands
``e2m1(code) · fp32(block_scale)`` (exact in BF16, see ``fullstack_fp4.nvfp4.gemm``) with the two
FP32 tensor scales applied to the FP32 result. The NS never needs the packed codes, so
``quantize_decode`` goes straight from the FP32 matrix to that BF16 operand in ONE kernel:
block amax, E4M3 scale, E2M1 rounding and decode in registers, one read of the FP32 input and one
BF16 write — instead of quantize (read, write packed codes + scales) then decode (read both,
write BF16) as separate passes, plus the transpose copy for column-wise operands: the kernel
reads any strides, so ``X`` quantized along dim 0 (the operand of ``B'·X``) is read in place and
written directly in ``X``'s layout, ready for a plain NN GEMM.

Numerics are the project contract (docs/nvfp4-format.md, RTN, 1×16, 6-rule): the E4M3 and E2M1
rounding helpers are imported from ``fullstack_fp4.nvfp4.kernels.fp4_math`` (bit-exact with the
reference there), the tensor scale follows the reference's FP32 order. So
``decoded · tensor_scale == quantize(x).dequantize()`` bit for bit (tested under
TRITON_INTERPRET=1), and ``decoded_matmul`` equals ``nvfp4_matmul`` up to accumulation order.
The global amax is a separate torch reduction (one read); the kernel reads it from device memory,
so there is no host synchronisation anywhere in an NS step (hence no NaN/Inf ValueError
here: a non-finite input turns the whole result NaN instead).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fullstack_fp4.nvfp4.kernels.launch import cdiv, launch
from fullstack_fp4.nvfp4.kernels.fp4_math import FP32_MAX, INV6, e2m1_code, e4m3_rne, neg_where

__all__ = ["quantize_decode", "decoded_matmul", "decoded_matmul_unscaled", "abs_max", "split2",
           "sym_two_term", "cross_two_term_axpy"]


@triton.jit
def _qdq_kernel(x_ptr, out_ptr, amax_ptr, scale_ptr, ts_ptr, R, NBLK, sxr, sxk, sor, sok,
                d_ptr, dts_ptr, BM: tl.constexpr, NB: tl.constexpr, HAS_RES: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_b = tl.program_id(1)
    rows = pid_r * BM + tl.arange(0, BM)[:, None, None]
    blks = pid_b * NB + tl.arange(0, NB)[None, :, None]
    cols = blks * 16 + tl.arange(0, 16)[None, None, :]
    mask = (rows < R) & (blks < NBLK)
    x = tl.load(x_ptr + rows * sxr + cols * sxk, mask=mask, other=0.0).to(tl.float32)
    x = x * tl.load(scale_ptr)      # fused device scalar (the basin guard's sqrt(s)); 1 = none
    if HAS_RES:
        # The two-term split's second operand: the residual x − dec₀·ts₀ of the first one, as
        # torch computes it (one product, one difference; launched without FMA contraction).
        # dec₀ has the output's layout (quantize_decode's default), so it is read like out.
        d = tl.load(d_ptr + rows * sor + cols * sok, mask=mask, other=0.0).to(tl.float32)
        x = x - d * tl.load(dts_ptr)
    amax = tl.load(amax_ptr)
    # Tensor scale in the reference's FP32 order: enc = 2688 / amax, capped, 1 if that is 0.
    enc = tl.minimum(tl.math.div_rn(2688.0, amax), FP32_MAX)
    enc = tl.where(enc == 0.0, 1.0, enc)
    dec = tl.math.div_rn(1.0, enc)
    # The tensor scale, written by program (0, 0) (no 5 tiny torch launches per operand).
    if (pid_r == 0) & (pid_b == 0):
        tl.store(ts_ptr, dec)
    bamax = tl.max(tl.abs(x), 2)                                    # [BM, NB]
    s = tl.minimum(bamax * (enc * INV6), 448.0)
    s_val, _ = e4m3_rne(s)
    f = tl.minimum(tl.math.div_rn(tl.full(s_val.shape, 1.0, tl.float32), s_val * dec), FP32_MAX)
    y = tl.minimum(tl.maximum(x * f[:, :, None], -6.0), 6.0)
    _, r = e2m1_code(y, y, False)
    val = neg_where(y < 0.0, r) * s_val[:, :, None]                 # exact, fits BF16
    tl.store(out_ptr + rows * sor + cols * sok, val.to(tl.bfloat16), mask=mask)


_ONES: dict = {}


def _ones(device) -> torch.Tensor:
    t = _ONES.get(device)
    if t is None:
        t = _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return t


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 1-element FP32 tensor: ONE reduction pass (``x.abs().amax()`` writes and
    re-reads a full |x| copy)."""
    return torch.linalg.vector_norm(x.detach(), ord=float("inf")).to(torch.float32).reshape(1)


def quantize_decode(x: torch.Tensor, out: torch.Tensor | None = None, BM: int = 32, NB: int = 4,
                    amax: torch.Tensor | None = None, scale: torch.Tensor | None = None):
    """``(decoded BF16 [R, K], tensor_scale FP32 0-dim)`` for the 2-D ``x`` quantized along its
    last dim (K % 16 == 0). ``x`` may be any strided view (e.g. ``X.t()``); ``out`` (same
    logical shape, any strides) lets the caller pick the layout of the decoded operand — by
    default one laid out like ``x``'s storage, so a transposed view stays a transposed view.

    ``scale`` (1-element FP32 device tensor): quantize ``x · scale`` without materialising it
    (bit-identical: the kernel multiplies in FP32 as torch would). ``amax`` (1-element FP32):
    max |x · scale| when the caller already has it (``abs_max(x) · scale`` is exactly that:
    FP32 rounding is monotone), so one reduction serves several operands of the same matrix."""
    if x.ndim != 2 or x.shape[1] % 16:
        raise ValueError(f"need a 2-D tensor with last dim % 16 == 0, got {tuple(x.shape)}")
    R, K = x.shape
    if out is None:
        out = (torch.empty((K, R), dtype=torch.bfloat16, device=x.device).t()
               if x.stride(0) == 1 and x.stride(1) != 1
               else torch.empty((R, K), dtype=torch.bfloat16, device=x.device))
    # No NaN/Inf check here (it would cost a host sync per operand, 20 per NS): a non-finite
    # input makes amax, hence every output, NaN, which the optimizer cannot miss.
    if amax is None:
        amax = abs_max(x) if scale is None else abs_max(x) * scale.reshape(1)
    if scale is None:
        scale = _ones(x.device)
    ts = torch.empty(1, dtype=torch.float32, device=x.device)
    grid = (cdiv(R, BM), cdiv(K // 16, NB))
    launch(_qdq_kernel, grid, x, out, amax.reshape(1), scale.reshape(1), ts, R, K // 16,
           x.stride(0), x.stride(1), out.stride(0), out.stride(1), out, ts, BM=BM, NB=NB,
           HAS_RES=False)
    return out, ts.reshape(())  # = tensor_scales(amax)[1], the reference's FP32 order


@triton.jit
def _res_amax_kernel(x_ptr, d_ptr, scale_ptr, dts_ptr, amax_ptr, N, BLOCK: tl.constexpr):
    """max |x·scale − d·ts| over BLOCK entries of the flat storage, one atomic_max on the
    FP32 bits (non-negative floats order as int32; a NaN's bits exceed +Inf's, so it wins)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32) * tl.load(scale_ptr)
    r = x - tl.load(d_ptr + offs, mask=m, other=0.0).to(tl.float32) * tl.load(dts_ptr)
    tl.atomic_max(amax_ptr, tl.max(tl.abs(r).to(tl.int32, bitcast=True), 0))


def _dense_storage(t: torch.Tensor) -> bool:
    """A 2-D tensor that covers its storage densely in row- or column-major order."""
    return t.is_contiguous() or t.t().is_contiguous()


def split2(x: torch.Tensor, amax: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> list:
    """The two-term operand of ``x · scale`` (newton_schulz._split with two terms) in three
    kernels and no FP32 temporaries: ``q₀ = quantize_decode(x)``; the residual's amax (one
    pass over x and dec₀); ``q₁`` = the residual quantized, computed inside the quantize
    kernel. Bit for bit what ``_split`` computes from ``x · scale`` with ``dec·ts`` and a
    subtraction in torch (tested): the residual is formed with the same two roundings.
    ``x`` must cover its storage densely (row- or column-major, e.g. X or X.t()): the residual
    amax then walks x and dec₀ (laid out like x) as flat arrays."""
    if not _dense_storage(x):
        raise ValueError(f"split2 needs a densely stored 2-D tensor, got strides {x.stride()}")
    if scale is None:
        scale = _ones(x.device)
    q0 = quantize_decode(x, amax=amax, scale=scale)
    dec0, ts0 = q0
    bits = torch.zeros(1, dtype=torch.int32, device=x.device)
    n = x.numel()
    BLOCK = 2048
    launch(_res_amax_kernel, (cdiv(n, BLOCK),), x, dec0, scale.reshape(1), ts0.reshape(1),
           bits, n, BLOCK=BLOCK, enable_fp_fusion=False)
    R, K = x.shape
    out = torch.empty_like(dec0)             # dec₀'s layout, which is x's
    ts1 = torch.empty(1, dtype=torch.float32, device=x.device)
    BM, NB = 32, 4
    launch(_qdq_kernel, (cdiv(R, BM), cdiv(K // 16, NB)), x, out, bits.view(torch.float32),
           scale.reshape(1), ts1, R, K // 16, x.stride(0), x.stride(1), out.stride(0),
           out.stride(1), dec0, ts0.reshape(1), BM=BM, NB=NB, HAS_RES=True,
           enable_fp_fusion=False)
    return [q0, (out, ts1.reshape(()))]


@triton.jit
def _sym_sum_kernel(a_ptr, c_ptr, sa_ptr, sc_ptr, M, sa0, sa1, sc0, sc1, BT: tl.constexpr):
    """a = (a·sa + c·sc) + (c·sc)ᵀ in place on an M×M tile grid (any strides; c read
    transposed for the last term)."""
    i = tl.program_id(0) * BT + tl.arange(0, BT)[:, None]
    j = tl.program_id(1) * BT + tl.arange(0, BT)[None, :]
    m = (i < M) & (j < M)
    sa = tl.load(sa_ptr)
    sc = tl.load(sc_ptr)
    a = tl.load(a_ptr + i * sa0 + j * sa1, mask=m, other=0.0)
    c = tl.load(c_ptr + i * sc0 + j * sc1, mask=m, other=0.0)
    ct = tl.load(c_ptr + j * sc0 + i * sc1, mask=m, other=0.0)
    tl.store(a_ptr + i * sa0 + j * sa1, (a * sa + c * sc) + ct * sc, mask=m)


def sym_two_term(q: list) -> torch.Tensor:
    """Σ_{i+j<2} q_i·q_jᵀ for one two-term operand on both sides (the symmetric products
    A = X·Xᵀ and D·Dᵀ): two GEMMs, then ONE pass forming ``P₀₀ + P₀₁ + P₀₁ᵀ`` with
    ``P = acc · (ts · ts)`` — the additions and roundings of ``_mm_terms(symmetric=True)``
    (``P.mm(S0, T0).add_(C).add_(C.mT)``), bit for bit, without its three FP32 passes. The
    result is written over the first GEMM's output, so it keeps that layout, as the composition
    does."""
    acc_c, s_c = decoded_matmul_unscaled(q[0], q[1])
    acc_a, s_a = decoded_matmul_unscaled(q[0], q[0])
    M = acc_a.shape[0]
    BT = 32
    launch(_sym_sum_kernel, (cdiv(M, BT), cdiv(M, BT)), acc_a, acc_c, s_a.reshape(1),
           s_c.reshape(1), M, acc_a.stride(0), acc_a.stride(1), acc_c.stride(0),
           acc_c.stride(1), BT=BT, enable_fp_fusion=False)   # each program reads its a(i,j) first
    return acc_a


@triton.jit
def _axpy3_kernel(x_ptr, p0_ptr, p1_ptr, p2_ptr, s_ptr, rs_ptr, coef_ptr, out_ptr, R, C,
                  sx0, sx1, s00, s01, s10, s11, s20, s21, so0, so1,
                  HAS_RS: tl.constexpr, BT: tl.constexpr):
    """out = (x·rs)·coef + ((p0·s0 + p1·s1) + p2·s2) on an R×C tile grid, any strides."""
    i = (tl.program_id(0) * BT + tl.arange(0, BT)[:, None]).to(tl.int64)
    j = (tl.program_id(1) * BT + tl.arange(0, BT)[None, :]).to(tl.int64)
    m = (i < R) & (j < C)
    x = tl.load(x_ptr + i * sx0 + j * sx1, mask=m, other=0.0)
    if HAS_RS:
        x = x * tl.load(rs_ptr)
    t = tl.load(p0_ptr + i * s00 + j * s01, mask=m, other=0.0) * tl.load(s_ptr) \
        + tl.load(p1_ptr + i * s10 + j * s11, mask=m, other=0.0) * tl.load(s_ptr + 1)
    t = t + tl.load(p2_ptr + i * s20 + j * s21, mask=m, other=0.0) * tl.load(s_ptr + 2)
    tl.store(out_ptr + i * so0 + j * so1, x * tl.load(coef_ptr) + t, mask=m)


def cross_two_term_axpy(X: torch.Tensor, rs, coef: torch.Tensor, b: list, c: list) -> torch.Tensor:
    """``(X·rs)·coef + Σ_{i+j<2} b_i·c_jᵀ`` — the last line of the two-term step — as three
    GEMMs and ONE elementwise pass (``rs``: 0-dim tensor or None). The reference sequence
    (``_mm_terms`` then ``(X·rs · coef).add_(out)``) scales each product, adds them in the
    order (0,0), (0,1), (1,0) and then adds them to the scaled X; this pass does the same
    operations in the same order, without FMA contraction, so the result is bit for bit the
    same, without the six FP32 m×n passes in between. The result has X's layout (as
    ``X · coef`` has), whatever the GEMM outputs' layouts."""
    parts = [decoded_matmul_unscaled(b[0], c[0]), decoded_matmul_unscaled(b[0], c[1]),
             decoded_matmul_unscaled(b[1], c[0])]
    if X.ndim != 2 or any(p.shape != X.shape for p, _ in parts):
        raise ValueError(f"cross_two_term_axpy: products of X's shape {tuple(X.shape)} expected")
    scales = torch.stack([s.reshape(()) for _, s in parts])
    out = torch.empty_like(X)
    R, C = X.shape
    BT = 32
    (p0, _), (p1, _), (p2, _) = parts
    launch(_axpy3_kernel, (cdiv(R, BT), cdiv(C, BT)), X, p0, p1, p2, scales,
           (rs if rs is not None else coef).reshape(1), coef.reshape(1), out, R, C,
           X.stride(0), X.stride(1), p0.stride(0), p0.stride(1), p1.stride(0), p1.stride(1),
           p2.stride(0), p2.stride(1), out.stride(0), out.stride(1),
           HAS_RS=rs is not None, BT=BT, enable_fp_fusion=False)
    return out


def decoded_matmul_unscaled(p, q):
    """``(acc, ts_p · ts_q)``: the FP32 BF16-GEMM accumulator of ``p @ q.T`` and the product of
    the tensor scales, for callers that fold the scale into their next elementwise op."""
    (dp, tp), (dq, tq) = p, q
    if dp.is_cuda:
        acc = torch.mm(dp, dq.t(), out_dtype=torch.float32)
    else:
        acc = torch.mm(dp.float(), dq.float().t())
    return acc, tp * tq


def decoded_matmul(p, q) -> torch.Tensor:
    """``p @ q.T`` for two ``quantize_decode`` results: BF16 GEMM with FP32 accumulation and
    output, then ``· (ts_p · ts_q)`` (one FP32 product, as ``nvfp4_matmul``)."""
    (dp, tp), (dq, tq) = p, q
    if dp.is_cuda:
        acc = torch.mm(dp, dq.t(), out_dtype=torch.float32)
    else:
        acc = torch.mm(dp.float(), dq.float().t())
    return acc * (tp * tq)
