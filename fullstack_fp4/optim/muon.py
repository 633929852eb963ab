"""Muon (and the shared machinery of orthogonalised optimizers) for plain 2-D torch params.

Muon step for a weight ``W`` (rows × cols) with gradient ``G``, as Keller Jordan's reference
(github.com/KellerJordan/Muon, ``muon.py``: ``muon_update`` + ``zeropower_via_newtonschulz5``):

    M ← μ·M + (1 − μ)·G                       (EMA momentum, μ = 0.95)
    D = (1 − μ)·G + μ·M   if nesterov else M  (Nesterov look-ahead, on by default)
    U = NS₅(D) · sqrt(max(1, rows / cols))     (NS: newton_schulz, BF16, Muon's triple, X/‖X‖_F
                                               first, tall matrices transposed; the factor keeps
                                               the RMS of a tall matrix's update equal to a
                                               wide one's)
    W ← W·(1 − lr·wd) − lr·U                   (decoupled weight decay, AdamW-style)

Against that reference the step is the same up to the order of FP32 sums (tested against an
FP64 re-derivation in tests/fullstack_fp4/optim/test_reference_steps.py); the reference's Nesterov
overwrites the caller's gradient in place (``grad.lerp_``), this one does not. Against
megatron-core's ``TensorParallelMuon`` (emerging-optimizers' ``OrthogonalizedOptimizer``): the
same EMA momentum; megatron's defaults are Nesterov off (``muon_use_nesterov=False``) and the
"spectral" shape factor ``sqrt(max(rows, cols))`` (update RMS ≈ 1, so its lrs are ~1/sqrt(max)
of these), FP32-IO NS with BF16 products, and the QKV split per query group, as here. Fused
weights are split into their logical matrices here (below); the reference takes whatever 2-D
parameters it is given. docs/optimizers.md lists what the other (AdamW) groups get.

Fused logical matrices: a parameter may carry ``ns_split_sizes`` (a list of row counts along
dim 0 summing to ``rows``), e.g. megatron's fused QKV ``[q_rows, k_rows, v_rows]`` or gate/up
``[ffn, ffn]``. Each block is then orthogonalised (and shape-scaled, and for Root clamped) as
its own matrix: the polar factor of a concatenation mixes the blocks' spectra (a Q head's
update would depend on the V gradient's scale), which is not the update of separate matrices.
Momentum stays one buffer per parameter (element-wise, so splitting it changes nothing).
Blocks that are interleaved rather than contiguous (megatron's fused QKV stores each query
group's q, k, v rows together) also carry ``ns_row_perm``: the rows are regrouped by that
permutation before the blocks are cut, and the update is scattered back.

Tensor parallelism ("duplicated", megatron-LM Muon's ``tp_mode``): a parameter that is one TP
rank's shard of a larger matrix may carry ``ns_tp_axis`` (0: column-parallel, split along the
rows; 1: row-parallel, split along the columns) and ``ns_tp_group`` (the TP process group).
Each logical block (after the row permutation / split above, which on every rank yields its
own slice of each 1-GPU block) is then all-gathered over the group in rank order along that
axis; ``_pre_ns``, NS and the shape scale run on the FULL block (every rank computes the same
thing) and the rank keeps its slice, so the update equals the 1-GPU update. Momentum stays
local (element-wise). Without these attributes (plain tensors, TP=1, ``tp_mode=blockwise``)
each block is orthogonalised as stored.

Data parallelism with a distributed optimizer (megatron's ``DistributedOptimizer``, which
hands each DP rank one flat 1-D piece ``W.view(-1)[start:end]`` of some matrices): the
optimizer is given every matrix of the model in one order common to all DP ranks
(``set_dp_matrices``: a list of :class:`DPMatrix`, each with this rank's piece or none, and the
DP group); the pieces themselves are its params (1-D, each tagged ``ns_dp_spec``). A step then
updates each piece's momentum (element-wise, as before), writes every piece into one zeroed
buffer holding all the whole matrices, sums that buffer over the DP group (each entry has
exactly one non-zero contributor, so the sum is exact), and every rank that holds a piece of a
matrix runs the 1-GPU update on the whole matrix (row permutation, blocks, ``_pre_ns``, NS,
scale) and keeps its piece. The
update therefore equals the 1-GPU update given the same gradients; the NS of a matrix is
computed by each rank holding a piece of it (twice for a matrix cut by a shard boundary).
Cost: one all-reduce of an FP32 buffer of the size of all matrices per step. Momentum stays
in the pieces, so the state is sharded as the distributed optimizer intends. With TP > 1 (a :class:`DPMatrix` carrying ``ns_tp_axis``) the
summed matrix is this TP rank's shard, gathered over TP as above: every TP rank's buffer has the
same layout (TP splits evenly), so the same DP rank holds the same pieces on every TP rank and
the TP gathers match.

``ns_cuda_graph=True``: on CUDA each NS runs as a CUDA graph captured once per matrix shape
(``newton_schulz_graphed``): the same kernels on the same values, one launch instead of the
~55–80 per NVFP4 NS step (or ~5 per BF16 step) that otherwise leave the GPU waiting on Python
at the 3b shapes. Not a param-group option (an optimizer state dict does not carry it): the
trainer turns it on (``optimizer.orthogonal.cuda_graph``); off by default here, since each
captured shape keeps its buffers for the process's life.

Only 2-D parameters (or tagged pieces) are accepted; ``split_params_for_orthogonal``
separates them from the rest (embeddings, output layer, norms, biases), which go to AdamW /
QAdamW.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Iterable, Optional

import torch

from .newton_schulz import newton_schulz, newton_schulz_graphed

__all__ = ["Muon", "OrthogonalOptimizer", "DPMatrix", "split_params_for_orthogonal", "split_blocks"]


class DPMatrix:
    """One whole matrix of the model as a DP rank of a distributed optimizer sees it:
    ``shape`` (rows, cols); ``piece``, this rank's 1-D piece of its flattened FP32 main weight
    (the optimizer's param) or None; ``start``/``end``: where the piece sits in the flattened
    matrix. Carries ``ns_split_sizes`` / ``ns_row_perm`` like a whole param would."""

    def __init__(self, shape, piece: Optional[torch.Tensor] = None, start: int = 0, end: int = 0,
                 device=None):
        rows, cols = (int(v) for v in shape)
        if piece is not None and (piece.dim() != 1 or piece.numel() != end - start
                                  or not 0 <= start < end <= rows * cols):
            raise ValueError(f"piece of {tuple(piece.shape)} at [{start}, {end}) does not fit a "
                             f"{rows}x{cols} matrix")
        self.shape, self.piece, self.start, self.end = (rows, cols), piece, start, end
        self.device = piece.device if piece is not None else device

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def split_blocks(t: torch.Tensor, p: torch.nn.Parameter) -> list[torch.Tensor]:
    """Views of ``t`` (shaped like ``p``) along dim 0 per ``p.ns_split_sizes`` (or ``[t]``)."""
    sizes = getattr(p, "ns_split_sizes", None)
    if sizes is None:
        return [t]
    sizes = [int(s) for s in sizes]
    if sum(sizes) != t.shape[0] or min(sizes) <= 0:
        raise ValueError(f"ns_split_sizes {sizes} do not partition {t.shape[0]} rows")
    return list(torch.split(t, sizes, dim=0))


def split_params_for_orthogonal(named_params: Iterable[tuple[str, torch.nn.Parameter]], *,
                                is_embedding_or_output: Callable[[str, torch.nn.Parameter], bool]):
    """``(matrix_params, other_params)``: trainable 2-D hidden weights go to Muon / Root; the
    rest (anything not 2-D, and embedding / output layers, whose rows are token vectors and
    which the Muon literature keeps on AdamW) go to AdamW. Frozen params are dropped."""
    matrices, others = [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        (matrices if p.ndim == 2 and not is_embedding_or_output(name, p) else others).append(p)
    return matrices, others


class OrthogonalOptimizer(torch.optim.Optimizer):
    """Shared step: momentum → per-block pre-processing → NS → shape scale → decoupled WD.
    Subclasses define ``_momentum`` (returns the NS input D), ``_pre_ns`` and ``_scale``."""

    def __init__(self, params, *, lr, momentum, weight_decay, ns_steps, ns_precision,
                 ns_coefficients, ns_clip_percentile, ns_backend, defaults_extra,
                 ns_nvfp4_terms=None, ns_cuda_graph=False):
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ValueError(f"bad lr={lr} / momentum={momentum} / weight_decay={weight_decay}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps,
                        ns_precision=ns_precision, ns_coefficients=ns_coefficients,
                        ns_clip_percentile=ns_clip_percentile, ns_backend=ns_backend,
                        ns_nvfp4_terms=ns_nvfp4_terms, **defaults_extra)
        super().__init__(params, defaults)
        self.ns_cuda_graph = bool(ns_cuda_graph)
        self.dp_matrices: list[DPMatrix] = []
        self.dp_group = None
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2 and getattr(p, "ns_dp_spec", None) is None:
                    raise ValueError(f"{type(self).__name__} takes 2-D weights only, got "
                                     f"{tuple(p.shape)}; give it to AdamW "
                                     "(split_params_for_orthogonal)")

    def _momentum(self, g, state, group):  # pragma: no cover - abstract
        raise NotImplementedError

    def _pre_ns(self, d_block, group):
        """The matrix NS orthogonalises, from one logical block of D (Muon: D itself)."""
        return d_block

    def _scale(self, rows, cols, group) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def set_dp_matrices(self, matrices: list, dp_group) -> None:
        """Every matrix of the model, in an order common to all ranks of ``dp_group``, each a
        :class:`DPMatrix` (module docstring, data parallelism). Each local piece must be one of
        this optimizer's params; the pieces get ``ns_dp_spec``."""
        mine = {id(p) for g in self.param_groups for p in g["params"]}
        for m in matrices:
            if m.piece is not None:
                if id(m.piece) not in mine:
                    raise ValueError("a DPMatrix piece is not a param of this optimizer")
                m.piece.ns_dp_spec = m
        untagged = [tuple(p.shape) for g in self.param_groups for p in g["params"]
                    if p.ndim != 2 and getattr(p, "ns_dp_spec", None) is None]
        if untagged:
            raise ValueError(f"params {untagged[:3]} are neither 2-D nor a piece of a DPMatrix")
        self.dp_matrices, self.dp_group = list(matrices), dp_group
        # where each whole matrix sits in the step's flat buffer (fixed for the run)
        self._dp_offsets = list(itertools.accumulate((m.numel for m in self.dp_matrices), initial=0))

    def orthogonalize(self, d: torch.Tensor, group, cuda_graph: Optional[bool] = None) -> torch.Tensor:
        """NS of ``d`` with the group's options; as a CUDA graph when ``cuda_graph`` (default:
        the optimizer's ``ns_cuda_graph``) and ``d`` is on CUDA (``newton_schulz_graphed``).
        Callers that vary the steps or schedule per call (the telemetry's per-step error) pass
        ``cuda_graph=False``: each variant would be captured and kept."""
        graph = self.ns_cuda_graph if cuda_graph is None else cuda_graph
        ns = newton_schulz_graphed if graph else newton_schulz   # eager off CUDA
        return ns(d, steps=group["ns_steps"], coefficients=group["ns_coefficients"],
                  precision=group["ns_precision"], clip_percentile=group["ns_clip_percentile"],
                  backend=group["ns_backend"], nvfp4_terms=group.get("ns_nvfp4_terms"))

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None or getattr(p, "ns_dp_spec", None) is not None:
                    continue   # pieces of a matrix: _step_dp_pieces, after the whole params
                d = self._momentum(p.grad, self.state[p], group)
                update = self._whole_update(d, p, group, p.dtype)
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(update, alpha=-lr)
        if self.dp_matrices:
            self._step_dp_pieces()
        return loss

    def _whole_update(self, d, spec, group, dtype):
        """The update of a whole matrix (a param, or a :class:`DPMatrix`'s summed pieces) from
        its NS input ``d`` (``_momentum``'s D); ``spec`` carries the tags (module docstring):
        rows permuted, blocks, ``_pre_ns``, NS (gathered over TP with ``ns_tp_axis``), shape
        scale, rows permuted back."""
        perm = getattr(spec, "ns_row_perm", None)
        if perm is not None:  # interleaved logical blocks: regroup rows first
            perm = perm.to(d.device)
            d = d.index_select(0, perm)
        update = torch.empty_like(d, dtype=dtype)
        tp_axis, tp_group = getattr(spec, "ns_tp_axis", None), getattr(spec, "ns_tp_group", None)
        for d_b, u_b in zip(split_blocks(d, spec), split_blocks(update, spec)):
            if tp_axis is None:
                o = self.orthogonalize(self._pre_ns(d_b, group), group)
                u_b.copy_(o.to(dtype) * self._scale(d_b.shape[0], d_b.shape[1], group))
            else:
                u_b.copy_(self._orthogonalize_tp(d_b, tp_axis, tp_group, group, dtype))
        if perm is not None:  # scatter the update back to the stored row order
            update = torch.empty_like(update).index_copy_(0, perm, update)
        return update

    def _step_dp_pieces(self):
        """Pieces of whole matrices under a distributed optimizer (module docstring)."""
        import torch.distributed as dist

        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        mats = self.dp_matrices
        live = [m for m in mats if m.piece is not None and m.piece.grad is not None]
        dev = next((m.device for m in mats if m.device is not None), None)
        n = self._dp_offsets[-1]
        D = torch.zeros(n, dtype=torch.float32, device=dev)
        at = {id(m): b for m, b in zip(mats, self._dp_offsets)}
        for m in live:
            b, p = at[id(m)], m.piece
            D[b + m.start: b + m.end] = self._momentum(p.grad, self.state[p], group_of[id(p)])
        # one non-zero contributor per entry: the sums are the whole matrices, exactly
        dist.all_reduce(D, group=self.dp_group)
        for m in live:
            b, p = at[id(m)], m.piece
            group = group_of[id(p)]
            d = D[b: b + m.numel].view(m.shape)
            piece = self._whole_update(d, m, group, p.dtype).view(-1)[m.start: m.end]
            lr, wd = group["lr"], group["weight_decay"]
            if wd:
                p.mul_(1 - lr * wd)
            p.add_(piece, alpha=-lr)

    def _orthogonalize_tp(self, d_b, axis, tp_group, group, dtype):
        """Duplicated TP: gather the block over ``tp_group`` along ``axis``, pre-process,
        orthogonalise and scale the whole block, return this rank's slice (see the module
        docstring)."""
        import torch.distributed as dist

        rank = dist.get_rank(group=tp_group)
        d_f = _all_gather_along(d_b, axis, tp_group)
        o = self.orthogonalize(self._pre_ns(d_f, group), group)
        o = o.to(dtype) * self._scale(d_f.shape[0], d_f.shape[1], group)
        n = d_b.shape[axis]
        return o.narrow(axis, rank * n, n)


def _all_gather_along(t: torch.Tensor, axis: int, group) -> torch.Tensor:
    """The TP ranks' ``t`` (equal shapes) concatenated in rank order along ``axis``."""
    import torch.distributed as dist

    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=axis)


class Muon(OrthogonalOptimizer):
    """Muon; ``ns_precision="nvfp4"`` (with e.g. ``ns_coefficients="fp4"``) is q_muon."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0,
                 ns_steps=5, ns_precision="bf16", ns_coefficients="muon",
                 ns_clip_percentile=None, ns_backend="auto", ns_nvfp4_terms=None,
                 ns_cuda_graph=False):
        super().__init__(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                         ns_steps=ns_steps, ns_precision=ns_precision,
                         ns_coefficients=ns_coefficients, ns_clip_percentile=ns_clip_percentile,
                         ns_backend=ns_backend, defaults_extra=dict(nesterov=nesterov),
                         ns_nvfp4_terms=ns_nvfp4_terms, ns_cuda_graph=ns_cuda_graph)

    def _momentum(self, g, state, group):
        mu = group["momentum"]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(g)
        buf = state["momentum_buffer"]
        buf.lerp_(g, 1 - mu)
        return g.lerp(buf, mu) if group["nesterov"] else buf

    def _scale(self, rows, cols, group) -> float:
        return math.sqrt(max(1.0, rows / cols))
