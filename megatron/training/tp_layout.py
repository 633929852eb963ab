"""Where a tensor-parallel shard's rows / columns sit in the whole (TP = 1) tensor.

megatron-core splits a column-parallel weight along its rows (``partition_dim = 0``) and a
row-parallel weight along its columns (``partition_dim = 1``) into ``tp`` equal contiguous
slices, rank ``i`` holding slice ``i`` — with one exception: the SwiGLU ``linear_fc1`` of a
gated MLP computes ``[gate; up]`` in one GEMM, and each rank holds ``[gate_i; up_i]`` (its
slice of gate, then its slice of up; ``MLP.forward`` chunks the local output in two). Its
checkpoint stores the whole ``[gate; up]`` (megatron's ``apply_swiglu_sharded_factory``), so the
*canonical* form of every tensor here is the TP = 1 tensor, and the local order of a fc1 shard
is not a contiguous slice of it.

These functions map between the two: :func:`local_index` gives, in local order, the canonical
indices (along the partition axis) of rank ``i``'s shard; :func:`to_canonical` joins the shards
of all ranks, :func:`from_canonical` cuts one rank's shard. Pure index arithmetic, exact.
"""
from __future__ import annotations

import torch

__all__ = ["local_index", "to_canonical", "from_canonical", "is_glu_rows"]

_GLU_SUFFIXES = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")


def is_glu_rows(name: str, gated_linear_unit: bool) -> bool:
    """The rows of this tensor are ``[gate_i; up_i]`` on each TP rank (SwiGLU fc1's weight and
    bias; for another tensor whose rows are the layer's output rows, ask with the weight's
    name)."""
    return gated_linear_unit and name.endswith(_GLU_SUFFIXES)


def local_index(size: int, tp: int, rank: int, *, glu: bool = False,
                device=None) -> torch.Tensor:
    """Canonical indices (along the partition axis, whole length ``size``) of rank ``rank``'s
    shard of a ``tp``-way split, in the shard's local order."""
    if size % (2 * tp if glu else tp):
        raise ValueError(f"a dimension of {size} does not split in {tp} TP shards"
                         + (" of gate and up halves" if glu else ""))
    if not glu:
        per = size // tp
        return torch.arange(rank * per, (rank + 1) * per, device=device)
    half = size // 2
    per = half // tp
    part = torch.arange(rank * per, (rank + 1) * per, device=device)
    return torch.cat([part, half + part])


def to_canonical(shards: list[torch.Tensor], axis: int | None, *, glu: bool = False) -> torch.Tensor:
    """The whole tensor from the shards of ranks ``0..tp-1`` (``axis=None``: a replicated
    tensor, every rank holds all of it: rank 0's copy)."""
    if axis is None:
        return shards[0]
    tp = len(shards)
    size = sum(s.shape[axis] for s in shards)
    shape = list(shards[0].shape)
    shape[axis] = size
    out = shards[0].new_empty(shape)
    for rank, s in enumerate(shards):
        out.index_copy_(axis, local_index(size, tp, rank, glu=glu, device=s.device), s)
    return out


def from_canonical(whole: torch.Tensor, axis: int | None, tp: int, rank: int, *,
                   glu: bool = False) -> torch.Tensor:
    """Rank ``rank``'s shard (local order) of the whole tensor ``whole`` split ``tp`` ways."""
    if axis is None:
        return whole.clone()
    idx = local_index(whole.shape[axis], tp, rank, glu=glu, device=whole.device)
    return whole.index_select(axis, idx)
