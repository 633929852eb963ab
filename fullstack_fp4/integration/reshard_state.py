"""The FP4 state that depends on the tensor-parallel layout: what to decode, re-cut and
re-encode when a checkpoint resumes at another TP size.

Two states are per TP shard instead of pieces of one layout-free tensor:

* **LoRA-SVD factors**: each shard ``i`` of a weight is its own ``W_res_i + β L2_i L1_i`` of
  rank r (lora_svd_layers.py). `fold_lora_shard` turns one saved shard into its dense weight
  and dense moments (the realignment's merge and `dense_moments`); `split_lora_shard` splits a
  dense shard of the new layout again (the realignment's randomized SVD and `route_moments`).
* **Q-AdamW's 4-bit moments**: one optimizer object per rank (optimizers.py, "Checkpoints").
  `SavedRank` decodes the objects of one saved TP rank into FP32 masters and moments by
  parameter name; `encode_piece` re-encodes one inner parameter of this run on its own tiles
  and chunks; `write_optimizer_state` puts masters and moments into this run's wrapper.

Joining the shards of the saved layout along their partition axis and cutting this run's
shard (the layout arithmetic, recipe-free) is the caller's; everything here works on one
shard, or on one rank's flat tensors, in FP32.
"""
from __future__ import annotations

import zlib

import torch

from fullstack_fp4.integration.lora_svd_layers import _LoRASVDMixin, dense_moments, route_moments
from fullstack_fp4.integration.wrappers import inner_params
from fullstack_fp4.linear.lora_svd import lora_svd_split, merge, subspace_basis
from fullstack_fp4.optim.q_adamw.codecs import CHUNK, padded_numel
from fullstack_fp4.optim.q_adamw.optimizer import PLACE_ATTR, Placement
from fullstack_fp4.optim.q_adamw.state import (check_codec_version, decode_param_state,
                                                encode_param_state)

__all__ = ["key_generator", "SavedRank", "payload_names", "encode_piece", "write_optimizer_state",
           "lora_modules", "lora_settings", "lora_shapes", "fold_lora_shard", "split_lora_shard"]


def key_generator(device, *parts) -> torch.Generator:
    """A generator seeded from ``parts`` only: every rank that computes the same thing draws
    the same numbers."""
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32("/".join(map(str, parts)).encode()))
    return gen


# ------------------------------------------------------------------ Q-AdamW state
class SavedRank:
    """One saved TP rank: ``masters[name]`` (flat FP32; ``masters is None`` when the optimizer
    held no copies — megatron's FP32Optimizer, whose masters are the model params) and
    ``states[name] = (m, v, step)`` (flat FP32 moments and the step tensor)."""

    def __init__(self):
        self.masters: dict | None = {}
        self.states: dict = {}

    def add(self, payload: dict, names: list, device) -> None:
        """Take in one optimizer object of this rank (the plain optimizer's, or one DP piece of
        the distributed optimizer's: `layout["q_adamw_places"]` = ``[key, offset, whole numel,
        chunk phase]`` per inner param). Raises ValueError for 4-bit moments of another codec
        version (they would decode to wrong values)."""
        layout, inner = payload["layout"], payload["inner"]
        numels = layout["numels"]
        check_codec_version(inner, dict(enumerate(numels)))
        places = layout.get("q_adamw_places") or [None] * len(numels)
        mains = payload.get("main_params")
        if mains is None:
            self.masters = None
        for k, (name, n, pl) in enumerate(zip(names, numels, places)):
            _, off, full, phase = pl if pl is not None else (None, 0, n, 0)
            if self.masters is not None:
                buf = self.masters.setdefault(name, torch.zeros(full, device=device))
                buf[off:off + n] = mains[k].detach().reshape(-1).to(device, torch.float32)
            st = inner["state"].get(k)
            if st is None:
                continue
            st = {kk: vv.to(device) if torch.is_tensor(vv) else vv for kk, vv in st.items()}
            m, v = decode_param_state(st, n, (phase + off) % CHUNK)
            if name not in self.states:
                self.states[name] = (torch.zeros(full, device=device),
                                     torch.zeros(full, device=device), st["step"].clone().cpu())
            self.states[name][0][off:off + n] = m
            self.states[name][1][off:off + n] = v


def payload_names(payload: dict, model_names: list, names_now: list, wrapper_kind: str) -> list:
    """Parameter names of a saved optimizer object's inner params: saved with it (checkpoints
    since resharding), else from the distributed optimizer's placement keys (the model
    parameter's index), else — an older plain-optimizer object — this run's order when this
    run's wrapper is of the same kind (megatron builds the same param groups at any TP size)."""
    if payload.get("param_names"):
        return list(payload["param_names"])
    places = payload["layout"].get("q_adamw_places")
    if places:
        return [model_names[pl[0]] for pl in places]
    if payload["layout"].get("wrapper") == wrapper_kind and \
            len(payload["layout"]["numels"]) == len(names_now):
        return list(names_now)
    raise ValueError("its optimizer state names no parameters (saved before resharding existed) "
                     "and this run's optimizer is built differently")


def encode_piece(m: torch.Tensor, v: torch.Tensor, step, *, shape, offset: int,
                 full_numel: int, chunk_phase: int, min_numel: int, generator) -> dict:
    """The Q-AdamW state of one inner parameter of this run: entries ``[offset, offset + n)``
    (``n = prod(shape)``) of the whole local moments ``m``, ``v`` (flat FP32), quantized when
    the whole tensor has ``full_numel >= min_numel`` (QAdamW's rule), on the chunk grid at
    ``chunk_phase``; the first moment's stochastic rounding draws from ``generator``."""
    n = torch.Size(shape).numel()
    quantized = full_numel >= min_numel
    rand = torch.rand(padded_numel(n), device=m.device, generator=generator) if quantized else None
    st = encode_param_state(m.reshape(-1)[offset:offset + n], v.reshape(-1)[offset:offset + n],
                            quantized=quantized, shape=shape, phase=chunk_phase, rand=rand)
    st["step"] = step.clone()
    return st


def write_optimizer_state(wrapper, params: dict, new_masters: dict, new_states: dict, *,
                          seed, device) -> None:
    """Every inner param of the converted wrapper (the FP32 copy, whole or the distributed
    optimizer's piece: from ``new_masters[name]``, else from the model param ``params[name]``)
    and its Q-AdamW state from ``new_states[name] = (m, v, step)`` (whole local FP32 moments),
    re-encoded with uniforms keyed by seed, parameter name and offset (the same on every DP
    replica). The inner optimizer's previous state is dropped."""
    inner = wrapper.optimizer
    inner.state.clear()
    group_of = {id(p): gr for gr in inner.param_groups for p in gr["params"]}
    for k, (p, name) in enumerate(zip(inner_params(wrapper), wrapper.fp4_param_names)):
        pl = getattr(p, PLACE_ATTR, None) or Placement(k, 0, p.numel(), 0)
        master = new_masters.get(name)
        if master is None:
            master = params[name].detach().float()
        p.copy_(master.reshape(-1)[pl.offset:pl.offset + p.numel()].view_as(p))
        if name in new_states:
            m, v, step = new_states[name]
            inner.state[p] = encode_piece(
                m, v, step, shape=p.shape, offset=pl.offset, full_numel=pl.full_numel,
                chunk_phase=pl.chunk_phase(), min_numel=group_of[id(p)]["min_numel"],
                generator=key_generator(device, "reshard-sr", seed, name, pl.offset))


# ------------------------------------------------------------------ LoRA-SVD factors
def lora_modules(model) -> list:
    """``(name, module)`` of every LoRA-SVD linear of ``model`` (names as in
    ``model.named_modules()``)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _LoRASVDMixin)]


def lora_settings(mod) -> dict:
    """A LoRA-SVD linear's TP sharding axis (``axis``: 0 column-parallel, 1 row-parallel; weight
    and both factors are split along it) and the keyword arguments of `split_lora_shard`."""
    return dict(axis=mod._lora_axis, rank_r=mod.lora_rank, beta=mod.lora_beta,
                factor_dtype=mod.lora_l2.dtype, oversample=mod.lora_oversample,
                power_iters=mod.lora_power_iters, route=mod.lora_route)


def lora_shapes(mod, tp_now: int, tp: int) -> dict:
    """Shapes of a LoRA-SVD linear's tensors at TP size ``tp`` (``mod`` built at ``tp_now``):
    the local ``w`` / ``l1`` and the whole stored ``l1_all`` / ``l2_all`` (the shards' factors
    stacked along the partition axis), and the whole (TP = 1) ``w_all``."""
    out_l, in_l = mod.weight.shape
    r = mod.lora_rank
    if mod._lora_axis == 0:
        out_g, in_g = out_l * tp_now, in_l
        return dict(w=[out_g // tp, in_g], l1=[r, in_g], l1_all=[tp * r, in_g],
                    l2_all=[out_g, r], w_all=[out_g, in_g])
    out_g, in_g = out_l, in_l * tp_now
    return dict(w=[out_g, in_g // tp], l1=[r, in_g // tp], l1_all=[r, in_g],
                l2_all=[out_g, tp * r], w_all=[out_g, in_g])


def fold_lora_shard(w_res, l1, l2, beta: float, states=None) -> dict:
    """One saved shard of a LoRA-SVD linear in dense form, FP32: ``{"w": W_res + β L2 L1}`` (the
    realignment's merge: one FP32 rounding), plus with ``states = (st_res, st_l1)`` (AdamW-layout
    states of W_res and L1) the dense moments ``exp_avg`` / ``exp_avg_sq`` / ``exp_avg_sq_res``
    (`dense_moments`). Every entry has W's shape: row / column blocks of it may be re-joined
    and cut like W."""
    out = {"w": merge(w_res, l1, l2, beta, torch.float32)}
    if states is not None:
        out.update(dense_moments(states[0], states[1], l2, beta))
    return out


def split_lora_shard(w, dense=None, *, rank_r: int, beta: float, factor_dtype, oversample: int,
                     power_iters: int, generator, route: str = "dense"):
    """``(w_res, l2, l1, states)`` of one shard of the new layout from its dense weight ``w``
    and dense moments ``dense`` (`fold_lora_shard`'s keys, or None).

    W_res, L2 (rounded to ``factor_dtype``, returned in FP32) and L1 come from the
    realignment's split (randomized SVD, ``W_res = W − β L2 L1`` after rounding L2); the
    moments are routed into it (`route_moments`; ``states = (st_res, st_l1)``, or None without
    ``dense``). ``route="dense"`` (the layer's ``fp4.lora_svd.route``): W_res got the whole
    gradient, so the dense moments go to W_res unchanged and L1's are 0, as the realignment
    does for that route."""
    w_res, l2, l1 = lora_svd_split(w, rank_r, beta, oversample=oversample,
                                   power_iters=power_iters, generator=generator,
                                   factor_dtype=factor_dtype)
    states = None
    if dense is not None:
        if route == "dense":
            states = ({"exp_avg": dense["exp_avg"], "exp_avg_sq": dense["exp_avg_sq"]},
                      {"exp_avg": torch.zeros_like(l1), "exp_avg_sq": torch.zeros_like(l1)})
        else:
            states = route_moments(dense, l2, subspace_basis(l2.to(factor_dtype)), beta)
    return w_res, l2, l1, states
