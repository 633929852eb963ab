"""Per-recipe quantization statistics, computed from outside the recipes (docs/telemetry.md).

Each function reads only public APIs (fullstack_fp4.nvfp4 / .optim / .attention) plus tensors
and module attributes, so the recipes need no instrumentation. Every sampled statistic returns
*sums* (Σ err², Σ ref²; or counts) over a uniform sample of self-contained units, so that

  * scaled by N/n they are unbiased for the full-tensor sums (fullstack_fp4/telemetry/stats.py);
  * sums from several micro-batches / calls add up, and ``sqrt(Σ err² / Σ ref²)`` is the ratio
    estimate of the relative error (consistent, O(1/n) bias);
  * with ``n >= N`` the unit set is enumerated once: exactly the full statistic (tested).

A *unit* is the smallest piece whose quantization does not depend on the rest of the tensor
once the tensor-level scale is fixed: a 1×16 block (activations, gradients, wgrad operands), a
16×16 tile (weights), a 1024-entry chunk (Q-AdamW: its chunk scale is the chunk's own amax), a
query row (Q-Attn S: Q's per-head scale is passed in), a 64-query tile row (Q-Attn dS: dS's
tensor scale is per 64×64 tile).
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from .stats import nvfp4_qdq, rht_signs_on, to_device

__all__ = ["q_adamw_group_sums", "wgrad_operand_sums", "rht16_tokens_amax", "wgrad_operand_blocks", "wgrad_operand_sample", "lora_svd_sums", "lora_svd_sample", "q_adamw_chunk_sums", "q_adamw_sample_sums",
           "ns_stats", "attn_s_sums", "attn_ds_sums", "sample_indices"]


def sample_indices(n_total: int, n: int, generator: Optional[torch.Generator]) -> torch.Tensor:
    """``n`` uniform draws with replacement from ``range(n_total)``; all once if ``n >= n_total``."""
    if n >= n_total:
        return torch.arange(n_total)
    return torch.randint(n_total, (n,), generator=generator)


# ----------------------------------------------------------------------------- NVFP4 wgrad
_AMAX_CHUNK = 1 << 24      # FP32 elements per pass of rht16_tokens_amax (64 MiB per temporary)


def rht16_tokens_amax(m: torch.Tensor, *, chunk_elems: int = _AMAX_CHUNK,
                      kernel: Optional[bool] = None) -> torch.Tensor:
    """``hadamard16(pad(m)ᵀ, DEFAULT_SIGNS).abs().amax()`` of ``m [T, C]`` (any float dtype, or
    ``[..., C]`` flattened to tokens), without the FP32 copy of ``m``, the padding copy, the
    transpose or the full transformed tensor: ``m`` is viewed as ``[T/16, 16, C]`` and the
    RHT-16 is applied along dim 1 in FP32 chunks of about ``chunk_elems`` entries.

    Bit-identical to the reference: per element the same FP32 operations in the same order
    (``× signs`` exact, the butterfly's ``a ± b`` at strides 1, 2, 4 (``wht16``), ``× ¼`` exact
    up to underflow and monotone). The last stride-8 stage is folded into the reduction:
    ``max(|fl(a + b)|, |fl(a − b)|) = fl(|a| + |b|)`` (round-to-nearest is symmetric and
    monotone), so the maximum is the same number. The zero tokens of the padding are
    zero-filled in a separate ``[16, C]`` tail (only when ``T % 16``).

    ``kernel`` (default: on CUDA tensors): the NVFP4 linear's own one-read Triton pass
    (:func:`fullstack_fp4.nvfp4.kernels.quantize_two_ways.amax_two_ways`, the column way only),
    which computes the same FP32 butterflies and takes the max on the FP32 bits: the same number,
    without the chunked torch passes and their FP32 temporaries — the largest GPU cost of the
    linears' telemetry step (`BENCHMARKS.md#telemetry`). Needs bf16/fp16/fp32 and C % 16 == 0, else the
    torch path runs.
    """
    m2 = m.detach().reshape(-1, m.shape[-1])
    t, c = m2.shape
    if kernel is None:
        kernel = m2.is_cuda
    if kernel and c % 16 == 0 and t > 0 and m2.dtype in (torch.bfloat16, torch.float16, torch.float32):
        from fullstack_fp4.nvfp4.kernels.quantize_two_ways import amax_two_ways

        # the kernel's RHT is ``hadamard16``'s (× signs, butterflies, × ¼): the amax itself
        return amax_two_ways(m2, row=False, col=True).view(torch.float32)[1].clone()
    s = rht_signs_on(m2.device).view(1, 16, 1)
    amax = torch.zeros((), dtype=torch.float32, device=m2.device)

    def part(blk):                                   # blk [nb, 16, c] -> max |RHT| (unscaled)
        y = blk.float() * s
        for h in (1, 2, 4):
            y = y.reshape(y.shape[0], 16 // (2 * h), 2, h, c)
            a, b = y[:, :, 0], y[:, :, 1]
            y = torch.stack((a + b, a - b), dim=2).reshape(-1, 16, c)
        return (y[:, :8].abs() + y[:, 8:].abs()).amax()

    t16 = t - t % 16
    nb = t16 // 16
    if nb:
        mv = m2[:t16].view(nb, 16, c) if m2.is_contiguous() else m2[:t16].reshape(nb, 16, c)
        step = max(1, chunk_elems // (16 * c))
        for i in range(0, nb, step):
            amax = torch.maximum(amax, part(mv[i:i + step]))
    if t16 < t:
        tail = m2.new_zeros(16, c)
        tail[: t - t16] = m2[t16:]
        amax = torch.maximum(amax, part(tail[None]))
    return amax * 0.25


def wgrad_operand_blocks(m: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Blocks ``idx`` (row-major over ``[C, T_pad/16]``) of the wgrad operand *before* the
    RHT, i.e. of ``pad(m)ᵀ``: ``[n, 16]`` FP32, block ``i`` = tokens ``16·(i mod T_pad/16) + 0..15``
    of channel ``i div (T_pad/16)`` (zero for padding tokens). Only ``n·16`` entries are read."""
    m2 = m.detach().reshape(-1, m.shape[-1])
    t = m2.shape[0]
    nb_col = -(-t // 16)
    ch = idx // nb_col
    rows = (idx % nb_col)[:, None] * 16 + torch.arange(16, device=idx.device)[None, :]
    vals = m2[rows.clamp(max=t - 1), ch[:, None]].float()
    if t % 16:
        vals = torch.where(rows < t, vals, torch.zeros((), device=vals.device))
    return vals


def wgrad_operand_sums(m: torch.Tensor, *, rounding: str, blocks: int = 64,
                       generator: Optional[torch.Generator] = None, scale_rule: str = "6"):
    """(Σ err², Σ x²) of the wgrad operand ``RHT16(pad(m)ᵀ)`` (fullstack_fp4.linear's
    ``quantize_wgrad_operand``): ``m [T, C]`` (x or dY) transposed to ``[C, T_pad]``, RHT-16 and
    1×16 blocks along the tokens, ``rounding`` nearest (x) or stochastic (dY), ``scale_rule``
    that of x or dY (the linear's ``ScaleRules``: x's rule covers RHT(xᵀ), dY's RHT(dYᵀ)).

    The tensor scale is that of the *transformed* operand (``rht16_tokens_amax``: one pass over
    ``m`` in its own layout, bit-identical to the amax of ``hadamard16(pad(m)ᵀ)``); only the
    ``blocks`` sampled 16-token blocks are gathered (``wgrad_operand_blocks``) and quantized
    with the recipe's quantizer (RHT fused). The error is compared in the original basis, equal
    to the transformed one because the RHT is orthogonal. Same draws, in the same order, from
    ``generator`` as ``sampled_sums`` over the transposed operand (block indices, then the
    stochastic-rounding draw): the same numbers as that composition.
    """
    from fullstack_fp4.nvfp4 import DEFAULT_SIGNS

    sblk, gamax = wgrad_operand_sample(m, blocks=blocks, generator=generator)
    qdq = nvfp4_qdq(global_amax=gamax, tile=(1, 16), rounding=rounding,
                    generator=generator if rounding == "stochastic" else None,
                    rht_signs=DEFAULT_SIGNS, scale_rule=scale_rule)
    e = sblk - qdq(sblk)
    return e.pow(2).sum(), sblk.pow(2).sum()


def wgrad_operand_sample(m: torch.Tensor, *, blocks: int = 64,
                         generator: Optional[torch.Generator] = None):
    """(``[n, 16]`` FP32 blocks of ``pad(m)ᵀ`` before the RHT, the transformed operand's tensor
    amax): what ``wgrad_operand_sums`` quantizes (the same draws), for a caller that quantizes
    many samples at once (``batched_qdq.qdq_rows`` with the default RHT signs)."""
    c = m.shape[-1]
    t = m.numel() // c if c else 0
    gamax = rht16_tokens_amax(m)
    n_total = c * (-(-t // 16))
    if blocks >= n_total:
        idx = torch.arange(n_total, device=m.device)
    else:
        idx = to_device(torch.randint(n_total, (blocks,), generator=generator, device="cpu"), m.device)
    return wgrad_operand_blocks(m, idx), gamax


# ----------------------------------------------------------------------------- LoRA-SVD
def lora_svd_sums(w_res: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor, beta: float, *,
                  tiles: int = 64, generator: Optional[torch.Generator] = None,
                  scale_rule: str = "6") -> Dict[str, tuple]:
    """Sampled sums for a LoRA-SVD weight ``W = W_res + β L2 L1`` over 16×16 tiles of W:

    * ``energy``: (Σ ‖β L2 L1‖², Σ ‖W‖²) — energy fraction captured by the BF16 subspace;
    * ``w_res``: (Σ ‖W_res − Q(W_res)‖², Σ ‖W_res‖²) — W_res quantized as the recipe does
      (16×16 tiles, nearest, tensor scale from W_res's full amax, ``scale_rule`` the module's
      ``lora_scale_rule.w``).

    A tile of the branch is ``β L2[rows] L1[:, cols]`` (16×r by r×16): the full product
    ``L2 L1`` is never formed.
    """
    smp = lora_svd_sample(w_res, l1, l2, beta, tiles=tiles, generator=generator)
    qdq = nvfp4_qdq(global_amax=smp["w_res_amax"], tile=(16, 16), rounding="nearest",
                    scale_rule=scale_rule)
    tiles2 = smp["w_res_tiles"]
    err = tiles2 - qdq(tiles2)
    return {"energy": smp["energy"], "w_res": (err.pow(2).sum(), tiles2.pow(2).sum())}


def lora_svd_sample(w_res: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor, beta: float, *,
                    tiles: int = 64, generator: Optional[torch.Generator] = None) -> Dict[str, object]:
    """``lora_svd_sums`` before W_res's quantization: ``energy`` (its sums), ``w_res_tiles``
    (``[n·16, 16]`` FP32, the sampled tiles of W_res) and ``w_res_amax`` (W_res's full amax,
    its tensor scale), for a caller that quantizes many samples at once."""
    wr = w_res.detach()
    out_f, in_f = wr.shape
    if out_f % 16 or in_f % 16:
        raise ValueError(f"W_res shape {tuple(wr.shape)} is not a multiple of 16×16")
    nb_col = in_f // 16
    idx = to_device(sample_indices((out_f // 16) * nb_col, tiles, generator), wr.device)
    r0, c0 = (idx // nb_col) * 16, (idx % nb_col) * 16
    ar = torch.arange(16, device=wr.device)
    rows = r0[:, None] + ar[None, :]                              # [n, 16]
    cols = c0[:, None] + ar[None, :]                              # [n, 16]
    res = wr[rows[:, :, None], cols[:, None, :]].float()          # [n, 16, 16]
    l2s = l2.detach().float()[rows]                               # [n, 16, r]
    l1s = l1.detach().float()[:, cols].permute(1, 0, 2)           # [n, r, 16]
    branch = float(beta) * torch.bmm(l2s, l1s)                    # [n, 16, 16]
    full = res + branch
    return {"energy": (branch.pow(2).sum(), full.pow(2).sum()),
            "w_res_tiles": res.reshape(-1, 16),                   # 16-row tiles stay tiles
            "w_res_amax": wr.abs().amax().float()}


# ----------------------------------------------------------------------------- Q-AdamW
def _chunk_bounds(j: int, n: int, phase: int, chunk: int):
    """Local entries [lo, hi) of chunk ``j`` of a flat tensor stored from grid entry ``phase``."""
    return max(0, j * chunk - phase), min((j + 1) * chunk - phase, n)


def _chunk_state(ms, j: int, n: int, phase: int, chunk: int, block: int):
    """The MomentState of chunk ``j`` alone. The layout is chunk-aligned (codecs.py docstring):
    codes, block scales and tile means of the chunk's entries plus that chunk's scale form a
    valid state of its own (with the grid phase kept for the first, partial chunk)."""
    from fullstack_fp4.optim.q_adamw import MomentState

    lo, hi = _chunk_bounds(j, n, phase, chunk)
    tile = ms.tile
    unit = max(block, tile)
    npad_c = -(-(hi - lo) // unit) * unit
    tm = None if ms.tile_mean is None else ms.tile_mean[lo // tile: lo // tile + npad_c // tile]
    kw = {"phase": phase} if (j == 0 and phase) else {}
    return MomentState(ms.codes[lo // 2: lo // 2 + npad_c // 2],
                       ms.block_scale[lo // block: lo // block + npad_c // block],
                       ms.chunk_scale[j: j + 1], hi - lo, tile_mean=tm, tile=tile, **kw)


def q_adamw_chunk_sums(m_prev, v_prev, g, *, beta1, beta2, eps, step, generator=None, phase: int = 0,
                       rand=None, per_chunk: bool = False):
    """Sums for one self-contained chunk given its decoded previous moments and gradient.

    m = β1 m̂ + (1−β1) g, v = β2 v̂ + (1−β2) g² (FP32, the step's fresh moments), then the
    public codecs: m̃ = decode(encode(m)), ṽ = decode(encode(v)); the update
    u = m / (sqrt(v)/sqrt(1−β2^t) + eps) against ũ from (m̃, ṽ). ``clamped`` counts entries of
    ṽ raised by the decode guard (the relative floor μ/4), i.e. where the guarded and the
    unguarded decodes differ.

    ``rand``: the first moment's stochastic-rounding uniforms (else drawn from ``generator``).
    ``per_chunk``: the inputs are several whole chunks back to back (phase 0; the codecs are
    chunk-local, so each chunk is encoded exactly as alone) and every sum is returned per
    chunk, a ``[n_chunks]`` tensor (``q_adamw_group_sums``).
    """
    from fullstack_fp4.optim.q_adamw import (decode_exp_avg, decode_exp_avg_sq, encode_exp_avg,
                                             encode_exp_avg_sq)

    kw = {"phase": phase} if phase else {}
    g = g.reshape(-1).float()
    m = beta1 * m_prev + (1.0 - beta1) * g
    v = beta2 * v_prev + (1.0 - beta2) * g * g
    if rand is not None:
        rand = to_device(rand, m.device)
    elif generator is not None and generator.device != m.device:
        # the collector's generator lives on the CPU; the codec would draw on m's device with it
        from fullstack_fp4.optim.q_adamw.codecs import padded_numel

        rand = to_device(torch.rand(padded_numel(m.numel()), generator=generator), m.device)
    mq = decode_exp_avg(encode_exp_avg(m, rand=rand, generator=None if rand is not None else generator, **kw))
    vs = encode_exp_avg_sq(v, **kw)
    vq = decode_exp_avg_sq(vs)
    v_raw = decode_exp_avg_sq(vs, guard="none")
    ibc2 = 1.0 / math.sqrt(1.0 - beta2 ** step)
    u = m / (v.sqrt() * ibc2 + eps)
    uq = mq / (vq.sqrt() * ibc2 + eps)
    if per_chunk:
        from fullstack_fp4.optim.q_adamw.codecs import CHUNK

        r = lambda a: a.reshape(-1, CHUNK)                    # noqa: E731
        s = lambda a, b: ((r(a) - r(b)).pow(2).sum(1), r(a).pow(2).sum(1))   # noqa: E731
        return {"m": s(m, mq), "v": s(v, vq), "update": s(u, uq),
                "v_clamped": ((r(vq) != r(v_raw)).sum(1).float(),
                              torch.full((m.numel() // CHUNK,), float(CHUNK), device=v.device))}
    s = lambda a, b: ((a - b).pow(2).sum(), a.pow(2).sum())     # noqa: E731
    return {"m": s(m, mq), "v": s(v, vq), "update": s(u, uq),
            "v_clamped": ((vq != v_raw).sum().float(),
                          torch.full((), float(v.numel()), device=v.device))}   # a fill, not a copy


def _step_count(state: dict) -> int:
    """Steps taken so far. QAdamW keeps ``state["step"]`` as a CPU tensor (its own ``.item()``
    each step is then free), and ``Optimizer.load_state_dict`` leaves a ``step`` tensor where
    it is: reading it is no device sync. (A device tensor would cost one sync; QAdamW's own
    ``.item()`` would cost the same each step.) The state is never modified."""
    st = state.get("step")
    if st is None:
        return 0
    if not torch.is_tensor(st):
        return int(st)
    return int(st.item())


def _chunk_prev_moments(ms, vs, j: int, n: int, phase: int, length: int, device):
    """Decoded FP32 (m, v) of chunk ``j`` before this step (``ms``/``vs``: the parameter's
    unpacked MomentStates; None before the first step: zero moments of ``length`` entries)."""
    from fullstack_fp4.optim.q_adamw import decode_exp_avg, decode_exp_avg_sq
    from fullstack_fp4.optim.q_adamw.codecs import BLOCK, CHUNK

    if ms is None:
        z = torch.zeros(length, dtype=torch.float32, device=device)
        return z, z
    return (decode_exp_avg(_chunk_state(ms, j, n, phase, CHUNK, BLOCK)),
            decode_exp_avg_sq(_chunk_state(vs, j, n, phase, CHUNK, BLOCK)))


def q_adamw_sample_sums(state: dict, grad: torch.Tensor, *, beta1: float, beta2: float,
                        eps: float, chunks: int = 2, generator=None, phase: int = 0) -> Dict[str, tuple]:
    """Sampled sums over ``chunks`` uniformly drawn 1024-entry chunks of one QAdamW parameter
    (``state``: its optimizer state *before* this step; empty = zero moments, step 1;
    ``phase``: the chunk-grid phase of a piece of a larger tensor, QAdamW's placement)."""
    from fullstack_fp4.optim.q_adamw.codecs import CHUNK
    from fullstack_fp4.optim.q_adamw.state import unpack_state

    n = grad.numel()
    g = grad.detach().reshape(-1)
    step = _step_count(state) + 1
    n_chunks = -(-(phase + n) // CHUNK)
    acc: Dict[str, list] = {}
    ms = vs = None
    if "exp_avg_codes" in state:
        ms, vs = unpack_state(state, n, phase) if phase else unpack_state(state, n)
    for j in sample_indices(n_chunks, chunks, generator).tolist():
        lo, hi = _chunk_bounds(j, n, phase, CHUNK)
        ph = phase if j == 0 else 0
        m_prev, v_prev = _chunk_prev_moments(ms, vs, j, n, phase, hi - lo, g.device)
        part = q_adamw_chunk_sums(m_prev, v_prev, g[lo:hi], beta1=beta1, beta2=beta2, eps=eps,
                                  step=step, generator=generator, phase=ph)
        for k, (a, b) in part.items():
            if k in acc:
                acc[k][0] = acc[k][0] + a
                acc[k][1] = acc[k][1] + b
            else:
                acc[k] = [a, b]
    return {k: tuple(v) for k, v in acc.items()}


def _cat_states(states: list):
    """Whole-chunk MomentStates back to back: a valid state of their total length (the layout is
    chunk-aligned); FP8 scales concatenated as bytes."""
    from fullstack_fp4.optim.q_adamw import MomentState

    bs = torch.cat([st.block_scale.view(torch.uint8) for st in states]).view(torch.float8_e4m3fn)
    tm = None if states[0].tile_mean is None else torch.cat([st.tile_mean for st in states])
    return MomentState(torch.cat([st.codes for st in states]), bs,
                       torch.cat([st.chunk_scale for st in states]),
                       sum(st.numel for st in states), tile_mean=tm, tile=states[0].tile)


def q_adamw_group_sums(items: list, *, beta1: float, beta2: float, eps: float, chunks: int = 2,
                       generator: Optional[torch.Generator] = None) -> list:
    """``[q_adamw_sample_sums(state, grad, phase=phase, ...) for state, grad, phase in items]``
    (one optimizer param group), with the sampled chunks of *all* parameters decoded, encoded
    and reduced together: the public codecs run a fixed number of times per group and step
    size instead of seven times per sampled chunk (each codec call costs host work, kernel
    launches and, through ``hadamard16``'s sign check, host syncs on the GPU).

    The same draws from ``generator`` in the same order (per parameter: its chunk indices, then
    per chunk its stochastic-rounding uniforms), the same per-element FP32 arithmetic (the
    codecs are chunk-local; whole chunks are batched, a chunk cut by the tensor's end or by the
    grid phase goes through ``q_adamw_chunk_sums`` alone), so the same quantized values; a
    chunk's Σ is a row sum of the ``[n_chunks, 1024]`` batch instead of a flat sum, which can
    differ from it in the last bits (FP32 summation order: relative ≤ 1023·2⁻²⁴, in practice
    ~1e-7). Parameters with a different step count are batched separately (bias correction).
    """
    from fullstack_fp4.optim.q_adamw import decode_exp_avg, decode_exp_avg_sq
    from fullstack_fp4.optim.q_adamw.codecs import BLOCK, CHUNK, padded_numel
    from fullstack_fp4.optim.q_adamw.state import unpack_state

    out: list = [dict() for _ in items]
    batches: Dict[int, list] = {}                   # step -> [(item index, m state, v state, g piece, rand)]

    def add(i, k, a, b):
        acc = out[i]
        if k in acc:
            acc[k] = (acc[k][0] + a, acc[k][1] + b)
        else:
            acc[k] = (a, b)

    for i, (state, grad, phase) in enumerate(items):
        n = grad.numel()
        g = grad.detach().reshape(-1)
        step = _step_count(state) + 1
        ms = vs = None
        if "exp_avg_codes" in state:
            ms, vs = unpack_state(state, n, phase) if phase else unpack_state(state, n)
        for j in sample_indices(-(-(phase + n) // CHUNK), chunks, generator).tolist():
            lo, hi = _chunk_bounds(j, n, phase, CHUNK)
            ph = phase if j == 0 else 0
            rand = None if generator is None else torch.rand(padded_numel(hi - lo), generator=generator)
            if hi - lo == CHUNK and ph == 0 and rand is not None:
                cm = None if ms is None else _chunk_state(ms, j, n, phase, CHUNK, BLOCK)
                cv = None if vs is None else _chunk_state(vs, j, n, phase, CHUNK, BLOCK)
                batches.setdefault(step, []).append((i, cm, cv, g[lo:hi], rand))
                continue
            m_prev, v_prev = _chunk_prev_moments(ms, vs, j, n, phase, hi - lo, g.device)
            part = q_adamw_chunk_sums(m_prev, v_prev, g[lo:hi], beta1=beta1, beta2=beta2, eps=eps,
                                      step=step, generator=generator, phase=ph, rand=rand)
            for k, (a, b) in part.items():
                add(i, k, a, b)
    for step, units in batches.items():
        dev = units[0][3].device
        m_prev = torch.zeros(len(units) * CHUNK, dtype=torch.float32, device=dev)
        v_prev = torch.zeros_like(m_prev)
        pk = [u_i for u_i, u in enumerate(units) if u[1] is not None]
        if pk:
            rows = to_device(torch.tensor(pk), dev)
            m_prev.view(-1, CHUNK)[rows] = decode_exp_avg(_cat_states([units[u][1] for u in pk])).view(-1, CHUNK)
            v_prev.view(-1, CHUNK)[rows] = decode_exp_avg_sq(_cat_states([units[u][2] for u in pk])).view(-1, CHUNK)
        g = torch.cat([u[3].float() for u in units])
        rand = torch.cat([u[4] for u in units])
        part = q_adamw_chunk_sums(m_prev, v_prev, g, beta1=beta1, beta2=beta2, eps=eps, step=step,
                                  rand=rand, per_chunk=True)
        # per parameter: the sum of its chunks' rows (a parameter's units are consecutive);
        # a padded gather, not index_add (deterministic on the GPU too), one per sum
        owners = [u[0] for u in units]
        present = list(dict.fromkeys(owners))
        rows_of = {i: [r for r, o in enumerate(owners) if o == i] for i in present}
        width = max(len(v) for v in rows_of.values())
        gidx = to_device(torch.tensor([rows_of[i] + [len(units)] * (width - len(rows_of[i]))
                                       for i in present]), dev)
        pad = torch.zeros(1, dtype=torch.float32, device=dev)
        for k, (a, b) in part.items():
            sa, sb = torch.cat([a, pad])[gidx].sum(1), torch.cat([b, pad])[gidx].sum(1)
            for pi, i in enumerate(present):
                add(i, k, sa[pi], sb[pi])
    return out


# ----------------------------------------------------------------------------- Newton–Schulz
def _orth_err(x: torch.Tensor) -> torch.Tensor:
    """‖XXᵀ − I‖_F / ‖I‖_F on the smaller Gram matrix (min(m, n) = its size)."""
    x = x.float()
    if x.shape[0] > x.shape[1]:
        x = x.mT
    gram = x @ x.mT
    eye = torch.eye(gram.shape[0], device=x.device)
    return (gram - eye).norm() / math.sqrt(gram.shape[0])


def ns_stats(g: torch.Tensor, *, steps: int, coefficients, precision: str = "nvfp4",
             clip_percentile=None, backend: str = "auto", ns_fn=None) -> Dict[str, torch.Tensor]:
    """Newton–Schulz telemetry on one matrix ``g`` (what the optimizer orthogonalises).

    ``ns_step``: max over k of ‖X_k − N(X_{k−1})‖ / ‖N(X_{k−1})‖ where X_k is the NVFP4
    iterate after k steps and N the exact FP32 step (``ns_step``) from the *same* input
    X_{k−1}: the error one quantized step adds, without the accumulation of earlier steps.
    X_k comes from a k-step NS call with the schedule's first k triples; with nearest rounding
    (the recipe's) its first k−1 steps are those of the (k−1)-step call, so X_{k−1} is the true
    input of step k. ``ns_orth``: ‖XXᵀ − I‖/‖I‖ of the final NVFP4 output; ``ns_orth_fp32``:
    the same for the FP32 iteration (the coefficients alone do not converge to exactly
    orthogonal: this is the floor ``ns_orth`` is to be compared with).

    ``ns_fn(g, steps, schedule, precision)`` runs the NS; default: the public
    ``newton_schulz`` with ``clip_percentile`` / ``backend``. The collector passes the
    optimizer's own ``orthogonalize`` (so every option the optimizer uses is applied).
    """
    from fullstack_fp4.optim import newton_schulz, resolve_schedule
    from fullstack_fp4.optim.newton_schulz import ns_step

    if ns_fn is None:
        def ns_fn(x, k, sched, prec):
            return newton_schulz(x, steps=k, coefficients=sched, precision=prec,
                                 clip_percentile=clip_percentile, backend=backend)
    sched = [tuple(t) for t in resolve_schedule(coefficients, tuple(g.shape), steps)]
    x = g.float()
    x_prev = x / (x.norm() + 1e-7)        # newton_schulz's own normalisation (eps 1e-7)
    worst = torch.zeros((), device=g.device)
    for k in range(1, len(sched) + 1):
        xk = ns_fn(g, k, sched[:k], precision).float()
        ref = ns_step(x_prev, sched[k - 1])
        worst = torch.maximum(worst, (xk - ref).norm() / ref.norm())
        x_prev = xk
    exact = ns_fn(g, len(sched), sched, "fp32")
    return {"ns_step": worst, "ns_orth": _orth_err(x_prev), "ns_orth_fp32": _orth_err(exact)}


# ----------------------------------------------------------------------------- Q-Attn
def _head_qdq(x: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Q-Attn's view of one head ``x [S, D]`` (``per_head_view(.., "head_dim")``: 1×16 blocks
    along head_dim, nearest, the 6 rule (Q-Attn's only one), tensor scale from the head's amax),
    dequantized; only ``rows`` of it if given (each row is its own set of blocks once the head
    amax is fixed)."""
    qdq = nvfp4_qdq(global_amax=x.abs().amax(), tile=(1, 16), rounding="nearest")
    return qdq(x if rows is None else x[rows])


def attn_s_sums(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, *, causal: bool = True,
                smooth: bool = True):
    """(Σ err², Σ S²) of ``S = Q Kᵀ`` on one head: ``q [Sq, D]``, ``k [Sk, D]`` (that head's
    KV head), ``rows`` the sampled query indices. Exact S from FP32 Q, K; quantized S from
    Q-Attn's views (1×16 along head_dim, per-head tensor scale from the *whole* head's amax;
    K smoothed by its sequence mean when ``smooth``, as Q-Attn does by default, on both sides:
    smoothing shifts each row of S by a constant, which the softmax ignores, so the error of
    the smoothed S is the one that matters). Masked (causal) entries are excluded.
    """
    qf, kf = q.detach().float(), k.detach().float()
    if smooth:
        kf = kf - kf.mean(dim=0, keepdim=True)
    rows = to_device(rows, q.device)
    s = qf[rows] @ kf.T
    sq = _head_qdq(qf, rows) @ _head_qdq(kf).T
    if causal:
        keep = torch.arange(kf.shape[0], device=q.device)[None, :] <= rows[:, None]
        s, sq = s * keep, sq * keep
    return (s - sq).pow(2).sum(), s.pow(2).sum()


def ds_row_tile_dequant(ds: torch.Tensor, *, zero_from: Optional[int] = None) -> torch.Tensor:
    """``tile_dequant(ds[None, None], "keys", "nearest")[0, 0]`` of one tile row ``ds [≤64, N]``
    (fullstack_fp4.attention.quant), without its host syncs: ``tile_dequant`` tests every
    64×64 tile's amax on the host (``if amax == 0``) and quantizes it with the reference
    quantizer (finite checks: more syncs), i.e. several syncs per tile. Here the tiles' amaxes
    are one reduction, all tiles are quantized and dequantized in one batched call with the
    reference's arithmetic, each with its own amax (``batched_qdq.qdq_rows``: no finite check,
    no sync, a few dozen launches instead of ~30 per tile), and an all-zero
    tile is set to zero on the device (``torch.where``) instead of being skipped on the host.
    ``zero_from``: tiles from this key on are known to be zero (above the causal diagonal);
    they are not quantized at all. Nearest rounding only (a stochastic draw per tile would
    depend on which tiles the host skips)."""
    from fullstack_fp4.attention.quant import DS_TILE

    from .batched_qdq import qdq_rows

    r, n = ds.shape
    T = DS_TILE
    npad = -(-n // T) * T
    xp = torch.nn.functional.pad(ds.float(), (0, npad - n, 0, T - r))            # [T, npad]
    nt = npad // T if zero_from is None else min(npad // T, -(-zero_from // T))
    out = torch.zeros_like(xp)
    if nt == 0:
        return out[:r, :n]
    tiles = xp[:, : nt * T].reshape(T, nt, T).permute(1, 0, 2).contiguous()     # [nt, T, T]
    amax = tiles.abs().amax(dim=(1, 2))                                           # one reduction
    # all tiles in one call, each row with its tile's tensor scale (batched_qdq: the
    # reference's arithmetic per row, bit for bit)
    deq = qdq_rows(tiles.reshape(nt * T, T), amax.repeat_interleave(T)).reshape(nt, T, T)
    deq = torch.where((amax == 0)[:, None, None], torch.zeros((), device=deq.device), deq)
    out[:, : nt * T] = deq.permute(1, 0, 2).reshape(T, nt * T)
    return out[:r, :n]


def attn_ds_sums(q, k, v, o, do, tile_row: int, *, scale: float, causal: bool = True,
                 smooth: bool = True, ds_rounding: str = "nearest", generator=None):
    """(Σ err², Σ dS²) of dS on one head, for the 64 query rows of ``tile_row``.

    dS = P ⊙ (dP − D) with P the softmax of the (quantized-view) scores as Q-Attn's backward
    forms it, dP = dO Vᵀ (BF16 operands) and D = rowsum(dO ⊙ O); then dS quantized as Q-Attn
    feeds it to the dQ GEMM: 1×16 blocks along the keys, one tensor scale per aligned 64×64
    tile (``tile_dequant``; for nearest rounding its sync-free equivalent
    ``ds_row_tile_dequant``). A 64-row tile row depends only on its own rows: a valid unit.
    """
    from fullstack_fp4.attention.quant import DS_TILE, tile_dequant

    qf, kf = q.detach().float(), k.detach().float()
    if smooth:
        kf = kf - kf.mean(dim=0, keepdim=True)
    lo, hi = tile_row * DS_TILE, min((tile_row + 1) * DS_TILE, qf.shape[0])
    rows = torch.arange(lo, hi, device=q.device)
    logits = (_head_qdq(qf, rows) @ _head_qdq(kf).T) * scale
    if causal:
        mask = torch.arange(kf.shape[0], device=q.device)[None, :] > torch.arange(lo, hi, device=q.device)[:, None]
        logits = logits.masked_fill(mask, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    dof = do.detach().float()[lo:hi]
    bf = lambda t: t.to(torch.bfloat16).float()                # noqa: E731
    dp = bf(dof) @ bf(v.detach().float()).T
    delta = (dof * o.detach().float()[lo:hi]).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    if ds_rounding == "nearest":   # the same numbers as tile_dequant, without its host syncs
        dsq = ds_row_tile_dequant(ds, zero_from=hi if causal else None)
    else:
        dsq = tile_dequant(ds[None, None], "keys", ds_rounding, generator)[0, 0]
    return (ds - dsq).pow(2).sum(), ds.pow(2).sum()
