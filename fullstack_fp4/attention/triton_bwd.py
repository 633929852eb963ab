"""Triton Q-Attn backward: a row pre-pass, a flash-style dK/dV kernel and a dQ kernel; neither S
nor dS is ever materialised (each kernel recomputes its tiles).

``_delta_kernel`` (one program per (b·h, 64 queries)): ``D = rowsum(dO ⊙ O)`` in FP32 and the
base-2 LSE ``lse2 = lse · (1/ln 2)`` (one FP32 product, as the host would do it).

The dkdv kernel and the recompute dq kernel compute ``P = exp2(τ·log2e · S − lse2)`` from the
head_dim views and, per 64×64 tile (queries × keys),

    dP = dO Vᵀ (BF16),   dS = P ⊙ (dP − D)   (FP32)

then quantize dS **in registers** with the tile's own tensor scale (its amax; ``quant.py``
argues the granularity) in 1×16 blocks along the reduction dimension of the GEMM it feeds:

* ``_dkdv_kernel`` — one program per (b, kv head, 64·RN keys); loops over the group's query
  heads and the 64-query blocks (causal: only blocks at or below the diagonal).
  ``dV += Pᵀ dO`` (BF16), ``dK += dec_tile·dec_q · (dS₄ᵀ)(Q₄ˢ)`` with dSᵀ blocks along queries.
  GQA needs no atomics: the group's heads are summed inside the program.
* ``_dq_kernel`` — one program per (b, head, 64·RM queries); loops over 64-key blocks;
  ``dQ += dec_tile·dec_k · (dS₄)(K₄ˢ)`` with dS blocks along keys. Causal programs run the
  longest query blocks first. (Storing the dkdv kernel's dS tiles as 4-bit codes for the dq
  kernel, instead of recomputing S, P and dP there, made the dkdv kernel slower by more than
  it saved: docs/perf/q-attn.md.)

``RN``/``RM`` (1 or 2, ``knobs.QATTN_BWD``) widen a program's own dimension to 128 rows, so the
MMAs are 128 rows tall; the dS tile stays 64×64 — each 64-row group of the ``[64·R, 64]`` tile
has its own amax and decode scale, applied per row of the product (the rows of a product depend
only on the same rows of dS). The tiles are aligned at (0, 0) in both kernels, i.e. exactly the
reference's dS tiles, so both kernels and ``reference.backward`` quantize the same numbers (up
to the FP32 accumulation order of the recomputed S and dP).

Masks: only the diagonal blocks (causal) and a ragged key tail need the iota compare/select; the
other tiles run an unmasked loop. A ragged *query* tail needs none: its rows load q = dO = 0,
lse2 = D = 0, so their P is 1, their dP and dS are exactly 0 and they add exactly 0 to dV, dK
and to no tile amax — the same numbers the masked code gives.

Layouts (``layout.py``): the views, LSE and delta are internal and contiguous; V and O are read,
and dQ, dK, dV written, through their own (batch, head, seq) strides — under megatron all of
them are ``[s, b, h, d]`` storage, read and written in place. dO is read in place by
``_delta_kernel`` (which reads every element of it anyway), and that pass writes the BF16 dO the
two main kernels read in the contiguous layout (skipped when dO already is a contiguous BF16
tensor). Why not read dO through its strides in ``_dkdv_kernel`` too: its loop loads Q, dO and
Q's seq view per query block, and with contiguous operands the three share one offset tensor
with a compile-time row stride; a runtime dO stride adds its own row offsets to a loop that
already spills (sm_90, triton 3.6, D = 128 default config: 300 B of spill stores with a runtime
dO stride, 164 with the contiguous dO: docs/perf/q-attn.md). The pass costs one extra write of
dO, in a launch that exists anyway; no separate ``.contiguous()`` copy kernel runs.

Epilogue: ``dQ, dK ← τ·(…)`` and the cast to the output dtype happen in the kernels (no
separate FP32 passes on the host); with K-smoothing dK stays FP32 for the seq-mean projection.
Stochastic rounding draws ``tl.rand`` (Philox) per element, keyed by (seed, b·h, query, key);
the dQ and dK quantizations use different seeds (seed + 1 for dQ).
"""

import os

import torch
import triton
import triton.language as tl

from fullstack_fp4 import knobs
from fullstack_fp4.nvfp4.kernels.launch import cdiv, launch

from .layout import CONTIGUOUS, bhs_strides, empty_in_order, kernel_operand
from .triton_nvfp4 import dot_bf16, to_bf16, encode_scales, block_scales, qdq_apply

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634
BLOCK = 64   # = quant.DS_TILE: the dS tile and the kernels' loop step


@triton.jit
def _quantize_tile(x, u, ROWS: tl.constexpr, COLS: tl.constexpr, STOCH: tl.constexpr):
    """``(values, dec)``: ``x [ROWS, COLS=64]`` in 1×16 blocks along axis 1, one tensor scale per
    64-row group (a 64×64 dS tile). ``dec`` is a scalar for ROWS = 64, else one per row.

    Block scale and encode factor are computed once per 16-block (``block_scales``) on the
    reduced ``[ROWS, COLS/16]`` amax and broadcast in 3D; only the E2M1 rounding is per element.
    """
    x3 = tl.reshape(x, [ROWS, COLS // 16, 16])
    bam = tl.max(tl.abs(x3), axis=2)
    if ROWS == 64:
        enc6, dec = encode_scales(tl.max(tl.max(bam, 1), 0))
        s, f = block_scales(bam, enc6, dec)
    else:
        gam = tl.max(tl.max(tl.reshape(bam, [ROWS // 64, 64, COLS // 16]), 2), 1)   # per group
        enc6, dec_g = encode_scales(gam)
        enc6 = tl.reshape(tl.broadcast_to(enc6[:, None], [ROWS // 64, 64]), [ROWS])
        dec = tl.reshape(tl.broadcast_to(dec_g[:, None], [ROWS // 64, 64]), [ROWS])
        s, f = block_scales(bam, enc6[:, None], dec[:, None])
    if STOCH:
        u3 = tl.reshape(u, [ROWS, COLS // 16, 16])
    else:
        u3 = x3
    v3 = qdq_apply(x3, s[:, :, None], f[:, :, None], u3, STOCH)
    return tl.reshape(v3, [ROWS, COLS]), dec


@triton.jit
def _ds_product(ds, op, dec_op, u, ROWS: tl.constexpr, COLS: tl.constexpr,
                DS_FP4: tl.constexpr, STOCH: tl.constexpr, INTERP: tl.constexpr):
    """``dS₄ · op`` scaled to real units: the dS (or dSᵀ) tile ``[ROWS, COLS]`` quantized along
    its columns (the reduction), times the seq view ``op [COLS, D]`` (decode scale ``dec_op``)."""
    if DS_FP4:
        vals, dec_t = _quantize_tile(ds, u, ROWS, COLS, STOCH)
        if ROWS == 64:
            return dot_bf16(to_bf16(vals, INTERP), op, INTERP) * (dec_t * dec_op)
        else:
            return dot_bf16(to_bf16(vals, INTERP), op, INTERP) * (dec_t * dec_op)[:, None]
    else:
        return dot_bf16(to_bf16(ds, INTERP), op, INTERP)


@triton.jit
def _dkdv_loop(dk, dv, k, v, qh_ptr, qs_ptr, do_ptr, lse_ptr, delta_ptr, bh, lo, hi, offs_n,
               start_n, Sq, Sk, qk_mul, dec_qs, seed,
               D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr,
               CAUSAL: tl.constexpr, DS_FP4: tl.constexpr, STOCH: tl.constexpr,
               INTERP: tl.constexpr):
    offs_d = tl.arange(0, D)
    for start_m in range(lo, hi, BM):
        offs_m = start_m + tl.arange(0, BM)
        m_ok = offs_m < Sq
        q_offs = bh * Sq * D + offs_m[:, None] * D + offs_d[None, :]
        q = tl.load(qh_ptr + q_offs, mask=m_ok[:, None], other=0.0)
        do = tl.load(do_ptr + q_offs, mask=m_ok[:, None], other=0.0)
        lse = tl.load(lse_ptr + bh * Sq + offs_m, mask=m_ok, other=0.0)
        delta = tl.load(delta_ptr + bh * Sq + offs_m, mask=m_ok, other=0.0)
        qkT = dot_bf16(k, tl.trans(q), INTERP) * qk_mul                      # [BN, BM]
        pT = tl.math.exp2(qkT - lse[None, :])
        if MASK:
            valid = m_ok[None, :] & (offs_n[:, None] < Sk)
            if CAUSAL:
                valid = valid & (offs_m[None, :] >= offs_n[:, None])
            pT = tl.where(valid, pT, 0.0)
        dv += dot_bf16(to_bf16(pT, INTERP), do, INTERP)
        dpT = dot_bf16(v, tl.trans(do), INTERP)
        dsT = pT * (dpT - delta[None, :])
        qs = tl.load(qs_ptr + q_offs, mask=m_ok[:, None], other=0.0)
        u = dsT
        if STOCH:
            u = tl.rand(seed, (bh * Sq + offs_m[None, :]) * Sk + offs_n[:, None])
        dk += _ds_product(dsT, qs, dec_qs, u, BN, BM, DS_FP4, STOCH, INTERP)
    return dk, dv


@triton.jit(do_not_specialize=["seed"])   # a fresh seed each call: no recompiles
def _dkdv_kernel(qh_ptr, kh_ptr, qs_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr,
                 decqh_ptr, deckh_ptr, decqs_ptr, dk_ptr, dv_ptr,
                 Sq, Sk, H, GROUPS, scale, scale2, seed,
                 v_sb, v_sh, v_ss, dk_sb, dk_sh, dk_ss, dv_sb, dv_sh, dv_ss,
                 D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
                 DS_FP4: tl.constexpr, STOCH: tl.constexpr, DK_BF16: tl.constexpr,
                 DV_BF16: tl.constexpr, INTERP: tl.constexpr):
    start_n = tl.program_id(0) * BN
    bkv = tl.program_id(1)
    hk_n = H // GROUPS
    b = bkv // hk_n
    hk = bkv % hk_n
    offs_n = start_n + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    n_ok = offs_n < Sk
    k = tl.load(kh_ptr + bkv * Sk * D + offs_n[:, None] * D + offs_d[None, :],
                mask=n_ok[:, None], other=0.0)
    v = tl.load(v_ptr + b * v_sb + hk * v_sh + offs_n[:, None] * v_ss + offs_d[None, :],
                mask=n_ok[:, None], other=0.0)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    dec_k = tl.load(deckh_ptr + bkv)
    # query blocks [mlo, mhi) masked (the diagonal; all of them for a ragged key block), the
    # rest [mhi, Sq) unmasked (module docstring)
    if CAUSAL:
        mlo = start_n          # the first query block that sees these keys (BN is a multiple of BM)
        mhi = start_n + BN
    else:
        mlo = 0
        mhi = 0
    if start_n + BN > Sk:
        mhi = Sq
    for g in range(0, GROUPS):
        bh = b * H + hk * GROUPS + g
        qk_mul = tl.load(decqh_ptr + bh) * dec_k * scale2
        dec_qs = tl.load(decqs_ptr + bh)
        dk, dv = _dkdv_loop(dk, dv, k, v, qh_ptr, qs_ptr, do_ptr, lse_ptr, delta_ptr, bh,
                            mlo, mhi, offs_n, start_n, Sq, Sk, qk_mul, dec_qs, seed,
                            D, BM, BN, True, CAUSAL, DS_FP4, STOCH, INTERP)
        dk, dv = _dkdv_loop(dk, dv, k, v, qh_ptr, qs_ptr, do_ptr, lse_ptr, delta_ptr, bh,
                            mhi, Sq, offs_n, start_n, Sq, Sk, qk_mul, dec_qs, seed,
                            D, BM, BN, False, CAUSAL, DS_FP4, STOCH, INTERP)
    dk = dk * scale
    dk_offs = b * dk_sb + hk * dk_sh + offs_n[:, None] * dk_ss + offs_d[None, :]
    if DK_BF16:
        tl.store(dk_ptr + dk_offs, to_bf16(dk, INTERP), mask=n_ok[:, None])
    else:
        tl.store(dk_ptr + dk_offs, dk, mask=n_ok[:, None])
    dv_offs = b * dv_sb + hk * dv_sh + offs_n[:, None] * dv_ss + offs_d[None, :]
    if DV_BF16:
        tl.store(dv_ptr + dv_offs, to_bf16(dv, INTERP), mask=n_ok[:, None])
    else:
        tl.store(dv_ptr + dv_offs, dv, mask=n_ok[:, None])


@triton.jit
def _dq_loop(dq, q, do, lse, delta, kh_ptr, ks_ptr, v_head, v_ss, bh, bkv, lo, hi, offs_m, Sq,
             Sk, qk_mul, dec_ks, seed,
             D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr,
             CAUSAL: tl.constexpr, DS_FP4: tl.constexpr, STOCH: tl.constexpr,
             INTERP: tl.constexpr):
    offs_d = tl.arange(0, D)
    for start_n in range(lo, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        n_ok = offs_n < Sk
        kv_offs = bkv * Sk * D + offs_n[:, None] * D + offs_d[None, :]
        k = tl.load(kh_ptr + kv_offs, mask=n_ok[:, None], other=0.0)
        v = tl.load(v_head + offs_n[:, None] * v_ss + offs_d[None, :], mask=n_ok[:, None],
                    other=0.0)
        qk = dot_bf16(q, tl.trans(k), INTERP) * qk_mul                       # [BM, BN]
        p = tl.math.exp2(qk - lse[:, None])
        if MASK:
            valid = (offs_m[:, None] < Sq) & n_ok[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(valid, p, 0.0)
        dp = dot_bf16(do, tl.trans(v), INTERP)
        ds = p * (dp - delta[:, None])
        ks = tl.load(ks_ptr + kv_offs, mask=n_ok[:, None], other=0.0)
        u = ds
        if STOCH:
            u = tl.rand(seed, (bh * Sq + offs_m[:, None]) * Sk + offs_n[None, :])
        dq += _ds_product(ds, ks, dec_ks, u, BM, BN, DS_FP4, STOCH, INTERP)
    return dq


@triton.jit(do_not_specialize=["seed"])
def _dq_kernel(qh_ptr, kh_ptr, ks_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr,
               decqh_ptr, deckh_ptr, decks_ptr, dq_ptr,
               Sq, Sk, H, GROUPS, scale, scale2, seed,
               v_sb, v_sh, v_ss, dq_sb, dq_sh, dq_ss,
               D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
               DS_FP4: tl.constexpr, STOCH: tl.constexpr, DQ_BF16: tl.constexpr,
               INTERP: tl.constexpr):
    pid = tl.program_id(0)
    if CAUSAL:
        pid = tl.num_programs(0) - 1 - pid      # longest (last) query blocks first
    start_m = pid * BM
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUPS
    bkv = b * (H // GROUPS) + hk
    offs_m = start_m + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    m_ok = offs_m < Sq
    q_offs = bh * Sq * D + offs_m[:, None] * D + offs_d[None, :]
    q = tl.load(qh_ptr + q_offs, mask=m_ok[:, None], other=0.0)
    do = tl.load(do_ptr + q_offs, mask=m_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + bh * Sq + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(delta_ptr + bh * Sq + offs_m, mask=m_ok, other=0.0)
    qk_mul = tl.load(decqh_ptr + bh) * tl.load(deckh_ptr + bkv) * scale2
    dec_ks = tl.load(decks_ptr + bkv)
    dq = tl.zeros([BM, D], tl.float32)
    # key blocks [0, nlo) unmasked, [nlo, nhi) masked (the diagonal / the ragged key tail)
    if CAUSAL:
        nlo = start_m
        nhi = tl.minimum(start_m + BM, Sk)
    else:
        nlo = (Sk // BN) * BN
        nhi = Sk
    v_head = v_ptr + b * v_sb + hk * v_sh          # V row 0 of kv head hk (caller's strides)
    dq = _dq_loop(dq, q, do, lse, delta, kh_ptr, ks_ptr, v_head, v_ss, bh, bkv, 0, nlo, offs_m,
                  Sq, Sk, qk_mul, dec_ks, seed, D, BM, BN, False, CAUSAL, DS_FP4, STOCH, INTERP)
    dq = _dq_loop(dq, q, do, lse, delta, kh_ptr, ks_ptr, v_head, v_ss, bh, bkv, nlo, nhi, offs_m,
                  Sq, Sk, qk_mul, dec_ks, seed, D, BM, BN, True, CAUSAL, DS_FP4, STOCH, INTERP)
    dq = dq * scale
    dq_offs = b * dq_sb + h * dq_sh + offs_m[:, None] * dq_ss + offs_d[None, :]
    if DQ_BF16:
        tl.store(dq_ptr + dq_offs, to_bf16(dq, INTERP), mask=m_ok[:, None])
    else:
        tl.store(dq_ptr + dq_offs, dq, mask=m_ok[:, None])


@triton.jit
def _delta_kernel(do_ptr, o_ptr, lse_ptr, delta_ptr, lse2_ptr, dob_ptr, S, H,
                  do_sb, do_sh, do_ss, o_sb, o_sh, o_ss, D: tl.constexpr, BLOCK: tl.constexpr,
                  WRITE_DO: tl.constexpr, INTERP: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < S
    cols = tl.arange(0, D)[None, :]
    do = tl.load(do_ptr + b * do_sb + h * do_sh + rows[:, None] * do_ss + cols, mask=ok[:, None],
                 other=0.0).to(tl.float32)
    if WRITE_DO:
        # the main kernels' dO operand: BF16 (RNE, as Tensor.to) in the contiguous layout
        tl.store(dob_ptr + bh * S * D + rows[:, None] * D + cols, to_bf16(do, INTERP),
                 mask=ok[:, None])
    o = tl.load(o_ptr + b * o_sb + h * o_sh + rows[:, None] * o_ss + cols, mask=ok[:, None],
                other=0.0).to(tl.float32)
    tl.store(delta_ptr + bh * S + rows, tl.sum(do * o, 1), mask=ok)
    lse = tl.load(lse_ptr + bh * S + rows, mask=ok, other=0.0)
    tl.store(lse2_ptr + bh * S + rows, lse * 1.4426950408889634, mask=ok)


def bwd_config(d: int):
    """``((warps, stages, RN) of _dkdv_kernel, (warps, stages, RM) of _dq_kernel)``; RN/RM:
    the program's own dimension in 64-row groups (keys for dkdv, queries for dq; the dS tile
    stays 64×64). ``knobs.QATTN_BWD`` (``(w_kv, st_kv, w_q, st_q[, rn, rm])``, set from code)
    overrides (``benchmarks/bench_q_attn.py --sweep``)."""
    cfg = knobs.QATTN_BWD
    if cfg is not None:
        knobs.check_qattn_bwd(cfg)
        rn, rm = cfg[4:6] if len(cfg) == 6 else (1, 1)
        return (cfg[0], cfg[1], rn), (cfg[2], cfg[3], rm)
    if d <= 64:
        return (4, 2, 1), (4, 2, 1)
    # D = 128: 8 warps = 2 warpgroups. With a 64-row program both warpgroups need the whole
    # 64×64 P/dS tile as the register A operand of the next wgmma (they split N), so each
    # computes exp2, dS and the quantization of the *whole* tile (SASS: 32 MUFU.EX2 per thread
    # per tile = 4096 / 128) and the GEMMs run as 64x32 wgmmas. 128 rows give each warpgroup
    # its own 64 rows: half the elementwise instructions per tile, 64x64 / 64x128 wgmmas.
    # Registers 255 (dkdv, no spill) / 210 (dq), smem 164 KB at 2 stages (compile gate).
    # 3 pipeline stages measured 5% faster on the H200 at 1x24x4096x128 causal
    # (`bench_q_attn.py --sweep`; docs/perf/q-attn.md).
    return (8, 3, 2), (8, 3, 2)


def _dq_register_cap(d: int, warps: int, stochastic: bool) -> dict:
    """Launch option for the recompute dq kernel: at D <= 64 on 4 warps, at most 168 registers,
    which keeps 3 programs per SM (3 × 128 threads × 168 ≤ 64 K registers; 65 KB of shared
    memory each). Reading V through runtime strides (``layout.py``) takes the kernel to
    168–176 registers (2 programs per SM) on triton 3.6; capped, ptxas fits it in 142–162
    without spills (compile gate). Register allocation only: the numbers do not change. Not
    for stochastic dS (211–255 registers: capped it spills) nor for 8 warps / D = 128 (one
    program per SM, held by shared memory)."""
    return {"maxnreg": 168} if d <= 64 and warps == 4 and not stochastic else {}


def attention_backward(do, o, lse, v, views, *, causal: bool, scale: float, ds_fp4: bool = True,
                       ds_stochastic: bool = False, seed: int = 0, out_dtypes=None,
                       out_orders=None):
    """``(dQ, dK, dV)``. ``lse`` is the forward's natural-log LSE [B, H, Sq]; ``ds_fp4`` says
    whether the ds path is NVFP4 (else dS and the seq views are plain BF16). ``out_dtypes``:
    the dtypes of (dQ, dK, dV), default FP32; BF16 outputs are rounded in the kernels (RNE, as
    ``Tensor.to``), other dtypes are cast from FP32 on the host.

    Layouts (``layout.py``): ``do``, ``o`` and ``v`` are read through their (batch, head, seq)
    strides; dQ, dK, dV are stored dense in ``out_orders`` (three ``layout.dim_order`` tuples,
    default contiguous): megatron's ``[s, b, h, d]`` order hands them to the QKV split's
    backward without a copy."""
    qh, kh = views.q_hd, views.k_hd
    b, h, sq, d = qh.shape
    hk, sk = kh.shape[1], kh.shape[2]
    groups = h // hk
    dev = qh.device
    dq_t, dk_t, dv_t = out_dtypes or (torch.float32,) * 3
    order_q, order_k, order_v = out_orders or (CONTIGUOUS,) * 3
    o, do = kernel_operand(o), kernel_operand(do)
    delta = torch.empty(b, h, sq, dtype=torch.float32, device=dev)
    lse2 = torch.empty_like(delta)
    # D = rowsum(dO ⊙ O) from dO in its own dtype (an FP32 dO is not rounded for D); the pass
    # also writes the main kernels' BF16 contiguous dO unless dO already is one (module docstring)
    do_ready = do.dtype == torch.bfloat16 and do.is_contiguous()
    do_bf = do if do_ready else torch.empty(b, h, sq, d, dtype=torch.bfloat16, device=dev)
    launch(_delta_kernel, (b * h, cdiv(sq, BLOCK)),
        do, o, lse.contiguous(), delta, lse2, do_bf, sq, h, *bhs_strides(do), *bhs_strides(o),
        D=d, BLOCK=BLOCK, WRITE_DO=not do_ready, INTERP=INTERPRET)
    do = do_bf
    v = kernel_operand(v.to(torch.bfloat16))     # BF16 MMA operand (a no-op for BF16 V)
    smoothed = views.smoothed
    bf = torch.bfloat16
    dq = empty_in_order(qh.shape, order_q, bf if dq_t == bf else torch.float32, dev)
    dk = empty_in_order(kh.shape, order_k, bf if (dk_t == bf and not smoothed) else torch.float32,
                        dev)
    dv = empty_in_order(kh.shape, order_v, bf if dv_t == bf else torch.float32, dev)
    scale2 = scale * LOG2E
    (w_kv, st_kv, rn), (w_q, st_q, rm) = bwd_config(d)
    common = dict(D=d, BM=BLOCK, CAUSAL=causal, DS_FP4=ds_fp4, STOCH=ds_stochastic,
                  INTERP=INTERPRET)
    launch(_dkdv_kernel, (cdiv(sk, BLOCK * rn), b * hk),
        qh, kh, views.q_sq, v, do, lse2, delta, views.dec_q_hd, views.dec_k_hd, views.dec_q_sq,
        dk, dv, sq, sk, h, groups, scale, scale2, seed,
        *bhs_strides(v), *bhs_strides(dk), *bhs_strides(dv), BN=BLOCK * rn,
        DK_BF16=dk.dtype == bf, DV_BF16=dv.dtype == bf, **common,
        num_warps=w_kv, num_stages=st_kv)
    common["BM"] = BLOCK * rm
    launch(_dq_kernel, (cdiv(sq, BLOCK * rm), b * h),
        qh, kh, views.k_sq, v, do, lse2, delta, views.dec_q_hd, views.dec_k_hd,
        views.dec_k_sq, dq, sq, sk, h, groups, scale, scale2, seed + 1, *bhs_strides(v),
        *bhs_strides(dq), BN=BLOCK, DQ_BF16=dq.dtype == bf, **common, num_warps=w_q,
        num_stages=st_q, **_dq_register_cap(d, w_q, ds_stochastic))
    if smoothed:
        dk -= dk.mean(dim=2, keepdim=True)   # K-smoothing: project out the seq-mean (prologue.py)
    return dq.to(dq_t), dk.to(dk_t), dv.to(dv_t)
