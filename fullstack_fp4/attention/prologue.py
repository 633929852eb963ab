"""Forward prologue: the quantized views of Q and K, and what of them is saved for the backward.

Four views (each ``values`` in the layout ``[B, H, S, D]`` plus a per-(b, head) FP32 decode
tensor scale, see ``quant.py``):

    q_hd, k_hd : Q, K in 1×16 blocks along head_dim   -> S  = Q₄ K₄ᵀ   (forward, recompute)
    q_sq, k_sq : Q, K in 1×16 blocks along seq        -> dK = dS₄ᵀ Q₄,  dQ = dS₄ K₄

Rounding: nearest (RNE) for all four. Q and K are activations that the forward and the
backward both read; stochastic rounding would add variance to every score without removing
any bias that matters (the softmax sees each score once, not a sum of many roundings of it),
and the two directions of one tensor would carry unrelated noise.

K-smoothing (``smooth=True``): the views of K are taken of ``K − mean_seq(K)``; the backward
projects dK to zero seq-mean (the exact dK has zero seq-mean because softmax is
shift-invariant, so the projection only removes quantization error). When a path is BF16 its
views are the plain tensors with decode scale 1 (K unsmoothed: smoothing is a quantization aid
only).

**Saved for the backward** (``SavedViews``): each NVFP4 view as its 4-bit codes and E4M3
block scales (``packed.py``, 0.5625 B/element; the BF16 values are an exact decode of them),
a BF16-path view as the input tensor itself, and the two decode-scale vectors. The backward
decodes them (``SavedViews.unpack``: ``triton_unpack.py`` on the GPU, ``PackedView.values`` on
the reference path) into the same ``QAttnViews`` a BF16-saving forward would have kept.

Two backends produce bit-identical views: ``"reference"`` (``quant.py``, loops, CPU) and
``"triton"`` (``triton_prologue.py``: an amax kernel and one kernel for both directions).
The Triton prologue reads Q and K through their strides (megatron's ``[s, b, h, d]`` views
without a copy, ``layout.py``); the views it writes are contiguous ``[B, H, S, D]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from .packed import PackedView
from .quant import per_head_packed, seq_mean


@dataclass
class QAttnViews:
    """The GEMM operands: BF16 (triton) or FP32 (reference) values and their decode scales.
    ``q_sq``/``k_sq`` are None in the forward (the forward GEMM reads only the head_dim views)."""
    q_hd: torch.Tensor
    k_hd: torch.Tensor
    q_sq: Optional[torch.Tensor]
    k_sq: Optional[torch.Tensor]
    dec_q_hd: torch.Tensor   # [B, H]   FP32 decode scales (1 for a BF16 view)
    dec_k_hd: torch.Tensor   # [B, Hkv]
    dec_q_sq: torch.Tensor   # [B, H]
    dec_k_sq: torch.Tensor   # [B, Hkv]
    smoothed: bool           # K-smoothing applied: the backward projects dK to zero seq-mean


View = Union[PackedView, torch.Tensor]   # packed NVFP4 view, or the plain input (BF16 path)


@dataclass
class SavedViews:
    """What the forward keeps of the views (module docstring)."""
    q_hd: View
    k_hd: View
    q_sq: View
    k_sq: View
    dec_q: torch.Tensor      # [B, H]   shared by Q's NVFP4 views (ones if none)
    dec_k: torch.Tensor      # [B, Hkv]
    smoothed: bool

    _FIELDS = ("q_hd", "k_hd", "q_sq", "k_sq")

    def flatten(self):
        """``(tensors, rebuild)``: the tensors to ``save_for_backward`` (each once) and a
        function rebuilding the ``SavedViews`` from ``ctx.saved_tensors``."""
        tensors, layout = [], []

        def slot(t):
            for i, u in enumerate(tensors):
                if u is t:
                    return i
            tensors.append(t)
            return len(tensors) - 1
        for name in self._FIELDS:
            v = getattr(self, name)
            if isinstance(v, PackedView):
                layout.append((name, (slot(v.codes), slot(v.scales), v.along, v.seq)))
            else:
                layout.append((name, slot(v)))
        ids = (slot(self.dec_q), slot(self.dec_k))
        smoothed = self.smoothed

        def rebuild(saved):
            kw = {}
            for name, ref in layout:
                kw[name] = (PackedView(saved[ref[0]], saved[ref[1]], ref[2], ref[3])
                            if isinstance(ref, tuple) else saved[ref])
            return SavedViews(**kw, dec_q=saved[ids[0]], dec_k=saved[ids[1]], smoothed=smoothed)
        return tensors, rebuild

    def unpack(self, backend: str) -> QAttnViews:
        """All four views as GEMM operands: BF16 (``"triton"``, one decode launch per tensor)
        or FP32 (``"reference"``); a plain view is cast, its decode scale is 1."""
        plain = torch.bfloat16 if backend == "triton" else torch.float32
        out, decs = {}, {}
        for t, dec in (("q", self.dec_q), ("k", self.dec_k)):
            hd, sq = getattr(self, t + "_hd"), getattr(self, t + "_sq")
            packed = {n: v for n, v in (("hd", hd), ("sq", sq)) if isinstance(v, PackedView)}
            if backend == "triton":
                from .triton_unpack import unpack_views
                dh, ds = unpack_views(packed.get("hd"), packed.get("sq"))
                dec_vals = {"hd": dh, "sq": ds}
            else:
                dec_vals = {n: v.values() for n, v in packed.items()}
            for n, v in (("hd", hd), ("sq", sq)):
                out[f"{t}_{n}"] = dec_vals[n] if n in packed else v.to(plain)
                decs[f"dec_{t}_{n}"] = dec if n in packed else torch.ones_like(dec)
        return QAttnViews(**out, **decs, smoothed=self.smoothed)

    def nbytes(self) -> int:
        tensors, _ = self.flatten()
        return sum(t.numel() * t.element_size() for t in tensors)


def _prepare_reference(x: torch.Tensor, hd: bool, sq: bool) -> dict:
    r = {"hd_packed": None, "sq_packed": None, "dec": None}
    for along, want in (("head_dim", hd), ("seq", sq)):
        if want:
            r[("hd" if along == "head_dim" else "sq") + "_packed"], r["dec"] = per_head_packed(x, along)
    return r


def _quantize(x: torch.Tensor, mean, *, hd: bool, sq: bool, backend: str, fwd_hd: bool,
              bf16_sq: bool = False) -> dict:
    """Packed views of ``x`` (``x − mean``) along the requested directions, plus the forward's
    head_dim operand (BF16 on triton, FP32 on the reference). ``bf16_sq``: also the seq view
    as BF16 values straight from the prologue (``make_views``: the BF16-view path)."""
    if backend == "triton":
        from .triton_prologue import quantize_views
        r = quantize_views(x, mean, hd_bf16=fwd_hd and hd, sq_bf16=bf16_sq and sq,
                           pack_hd=hd, pack_sq=sq)
    else:
        src = x.to(torch.float32) - mean if mean is not None else x
        r = _prepare_reference(src, hd, sq)
        r["hd"] = r["hd_packed"].values() if (fwd_hd and hd) else None
        r["sq"] = r["sq_packed"].values() if (bf16_sq and sq) else None
    return r


def prepare_views(q: torch.Tensor, k: torch.Tensor, *, qk_fp4: bool, ds_fp4: bool,
                  smooth: bool, backend: str = "reference", bf16_sq: bool = False):
    """``(forward views, SavedViews)``: the forward's operands (``q_hd``, ``k_hd`` and their
    decode scales; ``q_sq``/``k_sq`` None unless ``bf16_sq``) and what is saved for the backward."""
    if backend == "triton" and not (qk_fp4 and ds_fp4):
        # a BF16-path view is the input itself, and the kernels read the views as contiguous
        # [B, H, S, D]: strided inputs (megatron's [s, b, h, d]) are copied on these
        # experiment paths only — the NVFP4 views are written contiguous by the prologue
        q, k = q.contiguous(), k.contiguous()
    b, h, _, _ = q.shape
    hk = k.shape[1]
    dev = q.device
    plain = torch.bfloat16 if backend == "triton" else torch.float32
    if not (qk_fp4 and ds_fp4):      # a BF16 path: its views decode with 1
        one_q = torch.ones(b, h, dtype=torch.float32, device=dev)
        one_k = torch.ones(b, hk, dtype=torch.float32, device=dev)
    if not (qk_fp4 or ds_fp4):
        fwd = QAttnViews(q.to(plain), k.to(plain), None, None, one_q, one_k, one_q, one_k, False)
        if bf16_sq:
            fwd.q_sq, fwd.k_sq = fwd.q_hd, fwd.k_hd
        return fwd, SavedViews(q, k, q, k, one_q, one_k, False)
    # FP32 seq-mean as quant.smooth_k computes it; the smoothed K itself is formed in the
    # quantizer (FP32 k − mean per element, smooth_k's single subtraction), never materialised.
    mean = seq_mean(k) if smooth else None
    rq = _quantize(q, None, hd=qk_fp4, sq=ds_fp4, backend=backend, fwd_hd=True, bf16_sq=bf16_sq)
    rk = _quantize(k, mean, hd=qk_fp4, sq=ds_fp4, backend=backend, fwd_hd=True, bf16_sq=bf16_sq)
    saved = SavedViews(rq["hd_packed"] if qk_fp4 else q, rk["hd_packed"] if qk_fp4 else k,
                       rq["sq_packed"] if ds_fp4 else q, rk["sq_packed"] if ds_fp4 else k,
                       rq["dec"], rk["dec"], mean is not None)
    fwd = QAttnViews(rq["hd"] if qk_fp4 else q.to(plain), rk["hd"] if qk_fp4 else k.to(plain),
                     None, None, rq["dec"] if qk_fp4 else one_q, rk["dec"] if qk_fp4 else one_k,
                     rq["dec"] if ds_fp4 else one_q, rk["dec"] if ds_fp4 else one_k,
                     mean is not None)
    if bf16_sq:
        fwd.q_sq = rq["sq"] if ds_fp4 else q.to(plain)
        fwd.k_sq = rk["sq"] if ds_fp4 else k.to(plain)
    return fwd, saved


def make_views(q: torch.Tensor, k: torch.Tensor, *, qk_fp4: bool, ds_fp4: bool, smooth: bool,
               backend: str = "reference") -> QAttnViews:
    """All four views as GEMM operands straight from the prologue (BF16 on triton, FP32 on the
    reference) — the "BF16-view path" the saved 4-bit views must reproduce bit for bit."""
    return prepare_views(q, k, qk_fp4=qk_fp4, ds_fp4=ds_fp4, smooth=smooth, backend=backend,
                         bf16_sq=True)[0]
