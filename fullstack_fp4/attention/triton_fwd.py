"""Triton Q-Attn forward: flash-attention style, S never materialised.

One program per (b·h, BLOCK_M queries). Operands are the prologue's views: ``q_hd``, ``k_hd``
hold ``code · block_scale`` in BF16 (exact), so ``tl.dot`` on them is the NVFP4 GEMM up to
accumulation order (Hopper has no FP4 tensor cores: BENCHMARKS.md#setup); the two per-head decode scales,
the softmax scale and log2(e) are folded into one FP32 factor applied to the accumulator.
Online softmax in FP32 with exp2; ``P`` is rounded to BF16 for ``O += P V`` (BF16 path, FP32
accumulation). Causal programs split the key loop: blocks left of the diagonal need no mask,
the diagonal block(s) do; the sequence tail is masked everywhere (any length).

Layouts (``layout.py``): ``q_hd``, ``k_hd`` are the prologue's contiguous views; ``V`` is read
and ``O`` written through their (batch, head, seq) strides, so megatron's ``[s, b, h, d]`` V
needs no copy and O is stored in the caller's order (its ``[s, b, h·d]`` is a view).

Outputs: ``O`` BF16, and the natural-log LSE ``(max + log2(sum)) · ln 2`` (``max + log2(sum)``
is the base-2 LSE of the scaled logits; the backward converts back with one FP32 multiply).
Causal programs run the longest query blocks first (program 0 takes the last block).
"""

import os

import torch
import triton
import triton.language as tl

from fullstack_fp4 import knobs
from fullstack_fp4.nvfp4.kernels.launch import cdiv, launch

from .layout import CONTIGUOUS, bhs_strides, empty_in_order, kernel_operand
from .triton_nvfp4 import dot_bf16, to_bf16

LOG2E = 1.4426950408889634
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, v_ss, start_n_lo, start_n_hi, offs_m, Sk,
               qk_mul, D: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
               CAUSAL: tl.constexpr, INTERP: tl.constexpr):
    offs_d = tl.arange(0, D)
    for start_n in range(start_n_lo, start_n_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = offs_n[:, None] < Sk
        k = tl.load(k_base + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        s = dot_bf16(q, tl.trans(k), INTERP) * qk_mul
        if MASK:
            valid = offs_n[None, :] < Sk
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None])
            s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * v_ss + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot_bf16(to_bf16(p, INTERP), v, INTERP)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, dq_ptr, dk_ptr, o_ptr, lse_ptr, Sq, Sk, H, GROUPS, scale2,
                v_sb, v_sh, v_ss, o_sb, o_sh, o_ss,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, INTERP: tl.constexpr):
    bh = tl.program_id(1)
    if CAUSAL:
        # longest rows first (the last query block reads every key block): the short programs
        # fill the tail of the launch instead of a long one running alone at the end
        start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    else:
        start_m = tl.program_id(0) * BLOCK_M
    b = bh // H
    h = bh % H
    hk = h // GROUPS
    bkv = b * (H // GROUPS) + hk
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + bh * Sq * D + offs_m[:, None] * D + offs_d[None, :],
                mask=offs_m[:, None] < Sq, other=0.0)
    qk_mul = tl.load(dq_ptr + bh) * tl.load(dk_ptr + bkv) * scale2
    k_base = k_ptr + bkv * Sk * D                  # the prologue's view: contiguous
    v_base = v_ptr + b * v_sb + hk * v_sh          # V: the caller's strides (layout.py)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if CAUSAL:
        lo = start_m                                   # blocks left of the diagonal: unmasked
        hi = tl.minimum(start_m + BLOCK_M, Sk)
    else:
        lo = (Sk // BLOCK_N) * BLOCK_N
        hi = Sk
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, v_ss, 0, lo, offs_m, Sk,
                               qk_mul, D, BLOCK_N, False, CAUSAL, INTERP)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, v_ss, lo, hi, offs_m, Sk,
                               qk_mul, D, BLOCK_N, True, CAUSAL, INTERP)
    o = acc / l_i[:, None]
    row_mask = offs_m < Sq
    tl.store(o_ptr + b * o_sb + h * o_sh + offs_m[:, None] * o_ss + offs_d[None, :],
             to_bf16(o, INTERP), mask=row_mask[:, None])
    # natural-log LSE (lse2 · ln 2, one FP32 product, no separate pass on the host)
    tl.store(lse_ptr + bh * Sq + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453,
             mask=row_mask)


def fwd_config(d: int, is_interp: bool):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). BLOCK_N must divide BLOCK_M (causal split).

    ``knobs.QATTN_FWD`` (``(bm, bn, warps, stages)``, set from code) overrides
    (``benchmarks/bench_q_attn.py --sweep``)."""
    cfg = knobs.QATTN_FWD
    if cfg is not None:
        knobs.check_qattn_fwd(cfg)
        return tuple(cfg)
    if d <= 64:
        return 128, 64, 4, 3
    # D = 128: 64-row programs on 4 warps measured 18% faster than 128 rows on 8 warps on the
    # H200 at 1x24x4096x128 causal (`bench_q_attn.py --sweep`; docs/perf/q-attn.md). Why is not
    # measured; a guess: twice the programs fill the 132 SMs better on the causal triangle
    return 64, 64, 4, 3


def attention_forward(views, v: torch.Tensor, *, causal: bool, scale: float,
                      out_order=CONTIGUOUS):
    """``(O bf16 [B,H,Sq,D], lse natural [B,H,Sq] fp32)``.

    ``v`` may have any (batch, head, seq) strides (read in place when BF16 with a unit head_dim
    stride); ``O`` is stored dense in ``out_order`` (``layout.dim_order`` of the caller's Q:
    ``(2, 0, 1, 3)`` is megatron's ``[s, b, h, d]``, so its ``[s, b, h·d]`` is a view)."""
    q, k = views.q_hd, views.k_hd
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    if d not in (16, 32, 64, 128):
        raise ValueError(f"Triton Q-Attn supports head_dim 16/32/64/128, got {d}")
    # BF16 PV operand (as the backward); an FP32 v fails to compile
    v = kernel_operand(v.to(torch.bfloat16))
    o = empty_in_order(q.shape, out_order, torch.bfloat16, q.device)
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
    bm, bn, warps, stages = fwd_config(d, False)
    grid = (cdiv(sq, bm), b * h)
    launch(_fwd_kernel, grid,
           q, k, v, views.dec_q_hd.contiguous(), views.dec_k_hd.contiguous(), o, lse,
           sq, sk, h, h // hk, scale * LOG2E, *bhs_strides(v), *bhs_strides(o),
           D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, INTERP=INTERPRET,
           num_warps=warps, num_stages=stages)
    return o, lse
