"""Triton prologue: the NVFP4 views of a ``[B, H, S, D]`` tensor (Q, or K − mean) in two passes.

The input is read through its (batch, head, seq) strides (megatron's ``[s, b, h, d]`` views
without a copy, ``layout.py``); everything written (views, codes, scales) is contiguous.

1. ``_amax_kernel`` — one program per (b·h, 128 rows): ``max |x − mean|`` over its rows as FP32
   bits, one ``atomic_max`` into ``amax[b·h]`` (for non-negative floats the int32 bit order is
   the float order; a max is exact and order-free, so this is the torch ``abs().amax()``'s value
   bit for bit). ``mean`` is K-smoothing's FP32 seq-mean (``quant.smooth_k``), subtracted here
   in FP32 exactly as torch does (``kf − mean``), so the smoothed K is never materialised.
2. ``_prologue_kernel`` — one program per (b·h, 16 or 64 rows: ``prologue_config``): loads
   its tile once (FP32, minus the mean), derives the tensor scale from ``amax[b·h]`` (program (b·h, 0) stores the
   decode scale) and quantizes it both ways (``quant.py``):
     * along head_dim: blocks ``[1, 16]`` of each row   (the ``S = Q Kᵀ`` operand),
     * along seq:      blocks ``[16, 1]`` of each column (the ``dQ``, ``dK`` operands).
   What it writes is chosen per launch (constexpr flags):
     * ``HD_BF16`` / ``SQ_BF16``: the values ``code · block_scale`` as BF16 (exact) — the forward
       needs the head_dim view as a BF16 MMA operand; both as BF16 is the "BF16-view path"
       (``prologue.make_views``: tests, benchmark stage timings);
     * ``PACK_HD`` / ``PACK_SQ``: codes + E4M3 scale bytes in ``packed.py``'s layout — what the
       autograd function saves for the backward (0.5625 B/element instead of 2).
Rows past S load as 0 (after the mean subtraction): zeros never raise a block amax, so a partial
last block quantizes as the zero-padded reference does, and the seq view's padding rows get code 0.
"""

import torch
import triton
import triton.language as tl

from fullstack_fp4 import knobs
from fullstack_fp4.nvfp4.kernels.launch import cdiv, launch

from .layout import bhs_strides, kernel_operand
from .packed import PackedView, empty_packed, padded_seq
from .triton_nvfp4 import block_scales, e4m3_bits, head_scales, qdq_codes

BLOCK_S = 64       # prologue rows per program at D <= 64 (a multiple of 16: whole seq blocks)
AMAX_ROWS = 128    # amax rows per program (fewer atomics)


def prologue_config(d: int):
    """``(rows per program, warps)`` of ``_prologue_kernel``; ``knobs.QATTN_PROLOGUE``
    (``FP4_QATTN_PROLOGUE="rows,warps"``) overrides (rows a power of two >= 16;
    ``benchmarks/bench_q_attn.py --sweep``).

    Occupancy is the question: at D = 128, 64 rows on 8 warps take 183 registers (sm_90
    compile gate), i.e. one program = 8 warps per SM, and the kernel, a load-quantize-store
    stream, has nothing to hide its latency with (0.23 ms for Q and K at 1x24x4096x128, ~5x
    its bytes at copy speed). The D = 128 default, 16 rows on 2 warps (154 registers, 6
    programs = 12 warps per SM), was the fastest of the sweep on the H200: the prologue stage
    (amax, K mean and views of Q and K) about half the time of 64 rows on 8 warps
    (``bench_q_attn.py --sweep``; docs/perf/q-attn.md). D <= 64 keeps 64 rows on 4 warps (not
    measured). The
    numbers do not depend on the tiling (every block and scale lies inside one program's
    rows; tests/fullstack_fp4/attention/test_kernels.py checks 16, 32 and 64 rows bit for bit)."""
    cfg = knobs.QATTN_PROLOGUE
    if cfg is not None:
        knobs.check_qattn_prologue(cfg)
        return tuple(cfg)
    return (16, 2) if d >= 128 else (BLOCK_S, 4)


@triton.jit
def _load_rows(x_ptr, mean_ptr, bh, rows, S, H, sxb, sxh, sxs, D: tl.constexpr,
               SMOOTH: tl.constexpr):
    """``[len(rows), D]`` FP32 rows of head ``bh`` (``x − mean`` if SMOOTH); rows >= S are 0.
    ``x`` is read through its (batch, head, seq) strides (``layout.py``: Q and K come as
    megatron's ``[s, b, h, d]`` views); the mean is internal, ``[B·H, D]`` contiguous."""
    cols = tl.arange(0, D)
    ok = rows[:, None] < S
    x_head = x_ptr + (bh // H) * sxb + (bh % H) * sxh
    x = tl.load(x_head + rows[:, None] * sxs + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if SMOOTH:
        x = tl.where(ok, x - tl.load(mean_ptr + bh * D + cols)[None, :], 0.0)
    return x


@triton.jit
def _amax_kernel(x_ptr, mean_ptr, amax_ptr, S, H, sxb, sxh, sxs, D: tl.constexpr,
                 BLOCK: tl.constexpr, SMOOTH: tl.constexpr):
    bh = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = _load_rows(x_ptr, mean_ptr, bh, rows, S, H, sxb, sxh, sxs, D, SMOOTH)
    bits = tl.abs(x).to(tl.int32, bitcast=True)
    tl.atomic_max(amax_ptr + bh, tl.max(tl.max(bits, 1), 0))


@triton.jit
def _pack_pairs(c):
    """``[R, N, 2]`` int32 codes -> ``[R, N]`` uint8 bytes (element 0 low nibble, 1 high)."""
    lo, hi = tl.split(c)
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _prologue_kernel(x_ptr, mean_ptr, amax_ptr, dec_ptr, hd_ptr, sq_ptr,
                     hdc_ptr, hds_ptr, sqc_ptr, sqs_ptr, S, SP, H, sxb, sxh, sxs,
                     D: tl.constexpr, BLOCK: tl.constexpr, SMOOTH: tl.constexpr,
                     HD_BF16: tl.constexpr, SQ_BF16: tl.constexpr,
                     PACK_HD: tl.constexpr, PACK_SQ: tl.constexpr):
    bh = tl.program_id(0)
    sb = tl.program_id(1)
    rows = sb * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    x = _load_rows(x_ptr, mean_ptr, bh, rows, S, H, sxb, sxh, sxs, D, SMOOTH)
    enc6, dec = head_scales(tl.load(amax_ptr + bh).to(tl.float32, bitcast=True))
    if sb == 0:
        tl.store(dec_ptr + bh, dec)
    ax = tl.abs(x)
    ok = rows[:, None] < S
    offs = bh * S * D + rows[:, None] * D + cols[None, :]      # the BF16 views: contiguous
    if HD_BF16 or PACK_HD:
        # along head_dim: [BLOCK, D/16, 16]; scales once per block, then broadcast
        s, f = block_scales(tl.max(tl.reshape(ax, [BLOCK, D // 16, 16]), axis=2), enc6, dec)
        v3, c3 = qdq_codes(tl.reshape(x, [BLOCK, D // 16, 16]), s[:, :, None], f[:, :, None])
        if HD_BF16:
            tl.store(hd_ptr + offs, tl.reshape(v3, [BLOCK, D]).to(tl.bfloat16), mask=ok)
        if PACK_HD:
            b = _pack_pairs(tl.reshape(c3, [BLOCK, D // 2, 2]))
            hcols = tl.arange(0, D // 2)
            tl.store(hdc_ptr + bh * S * (D // 2) + rows[:, None] * (D // 2) + hcols[None, :], b,
                     mask=ok)
            scols = tl.arange(0, D // 16)
            tl.store(hds_ptr + bh * S * (D // 16) + rows[:, None] * (D // 16) + scols[None, :],
                     e4m3_bits(s).to(tl.uint8), mask=ok)
    if SQ_BF16 or PACK_SQ:
        # along seq: [BLOCK/16, 16, D]
        s, f = block_scales(tl.max(tl.reshape(ax, [BLOCK // 16, 16, D]), axis=1), enc6, dec)
        v3, c3 = qdq_codes(tl.reshape(x, [BLOCK // 16, 16, D]), s[:, None, :], f[:, None, :])
        if SQ_BF16:
            tl.store(sq_ptr + offs, tl.reshape(v3, [BLOCK, D]).to(tl.bfloat16), mask=ok)
        if PACK_SQ:
            # rows 2i, 2i+1 of the tile -> byte row i: [BLOCK/2, 2, D] -> [BLOCK/2, D, 2]
            pairs = tl.permute(tl.reshape(c3, [BLOCK // 2, 2, D]), (0, 2, 1))
            r2 = sb * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
            tl.store(sqc_ptr + bh * (SP // 2) * D + r2[:, None] * D + cols[None, :],
                     _pack_pairs(pairs), mask=r2[:, None] < SP // 2)
            r16 = sb * (BLOCK // 16) + tl.arange(0, BLOCK // 16)
            tl.store(sqs_ptr + bh * (SP // 16) * D + r16[:, None] * D + cols[None, :],
                     e4m3_bits(s).to(tl.uint8), mask=r16[:, None] < SP // 16)


def quantize_views(x: torch.Tensor, mean=None, *, hd_bf16: bool = False, sq_bf16: bool = False,
                   pack_hd: bool = False, pack_sq: bool = False) -> dict:
    """The NVFP4 views of ``x [B, H, S, D]`` (of ``x − mean`` with ``mean [B, H, 1, D]`` FP32).

    ``x`` may have any (batch, head, seq) strides — megatron's ``[s, b, h, d]`` views are read
    in place (``layout.py``); the views written are contiguous ``[B, H, S, D]``.
    Returns ``{"dec": fp32 [B, H], "hd", "sq": BF16 values or None, "hd_packed", "sq_packed":
    PackedView or None}`` as requested. Two launches (amax, then the views), no host sync.
    """
    x = kernel_operand(x)
    strides = bhs_strides(x)
    b, h, s, d = x.shape
    dev = x.device
    smooth = mean is not None
    mean_t = mean.reshape(b, h, d).to(torch.float32).contiguous() if smooth else x
    amax = torch.zeros(b * h, dtype=torch.int32, device=dev)     # FP32 bits, max-reduced
    warps = 8 if d >= 128 else 4
    launch(_amax_kernel, (b * h, cdiv(s, AMAX_ROWS)), x, mean_t, amax, s, h, *strides,
           D=d, BLOCK=AMAX_ROWS, SMOOTH=smooth, num_warps=warps)
    dec = torch.empty(b, h, dtype=torch.float32, device=dev)
    hd = torch.empty(x.shape, dtype=torch.bfloat16, device=dev) if hd_bf16 else None
    sq = torch.empty(x.shape, dtype=torch.bfloat16, device=dev) if sq_bf16 else None
    hdp = empty_packed(b, h, s, d, "head_dim", dev) if pack_hd else None
    sqp = empty_packed(b, h, s, d, "seq", dev) if pack_sq else None
    dummy = dec   # pointer for outputs a launch does not write (never dereferenced)
    rows, pwarps = prologue_config(d)
    launch(_prologue_kernel, (b * h, cdiv(s, rows)),
        x, mean_t, amax, dec, hd if hd_bf16 else dummy, sq if sq_bf16 else dummy,
        hdp.codes if pack_hd else dummy, hdp.scales if pack_hd else dummy,
        sqp.codes if pack_sq else dummy, sqp.scales if pack_sq else dummy, s, padded_seq(s),
        h, *strides, D=d, BLOCK=rows, SMOOTH=smooth, HD_BF16=hd_bf16, SQ_BF16=sq_bf16,
        PACK_HD=pack_hd, PACK_SQ=pack_sq, num_warps=pwarps)
    return {"dec": dec, "hd": hd, "sq": sq, "hd_packed": hdp, "sq_packed": sqp}


__all__ = ["quantize_views", "PackedView"]
