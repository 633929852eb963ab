"""Resume a checkpoint in another tensor-parallel size when its FP4 state depends on the layout.

megatron-core reshards what it stores as `ShardedTensor`s (model weights, torch-AdamW moments):
every tensor is saved as pieces of its *whole* (layout-free) tensor and each rank of any layout
reads its own piece. Two FP4 states are not of that kind:

* **LoRA-SVD factors** (`fp4.linear=lora_svd`) are per TP shard: each shard ``i`` of a weight
  carries its own ``W_res_i + β L2_i L1_i`` of rank r, so a TP=2 model is a different low-rank
  parametrisation (rank r per half, block-diagonal) from a TP=1 model (rank r overall), and the
  stored factors have TP-dependent shapes (column-parallel `lora_l1 [tp·r, in]`, row-parallel
  `lora_l2 [out, tp·r]`; fullstack_fp4/integration/lora_svd_layers.py).
* **Q-AdamW's 4-bit moments** are one per-rank object (codes, block / chunk scales, tile means
  of the rank's local tensors; fullstack_fp4/integration/optimizers.py, "Checkpoints").

Like megatron, we go through the layout-free form, but convert **at load** instead of changing
the format: the same-layout resume keeps reading exactly what was saved (bit-exact resume is
unchanged), and checkpoints written before this module resume in another layout too. When the
saved TP size differs from this run's (same PP size), `load_resharded` replaces the optimizer
part of the normal load:

1. **Model, except the LoRA factors**: megatron's own resharding (`dist_checkpointing.load` of
   this layout's `sharded_state_dict` without `lora_l1` / `lora_l2`).
2. **Sources in the saved layout** (a second `dist_checkpointing.load`): the per-rank optimizer
   objects of every saved rank of this pipeline stage, and per LoRA-SVD module the whole saved
   factors (and the whole `W_res` when the optimizer held no FP32 copies: fp32 runs).
3. **Layout-free form**, FP32, in each parameter's TP = 1 shape: FP32 masters (the
   optimizer's copies, else the model tensors), and the moments decoded from 4 bits
   (`SavedRank`; distributed-optimizer pieces joined first). A LoRA-SVD module is *folded*
   (reshard_convert.py `lora_to_whole`): per saved shard the dense ``W_i = W_res_i + β L2_i L1_i``
   (the merge the realignment uses: one FP32 rounding), and the dense moments
   ``M_i = m_res + β L2_i m_L1``, ``V_i = v_res + β²(L2_i∘L2_i) v_L1`` (`fold_lora_shard`),
   joined along the partition axis (megatron's SwiGLU `[gate_i; up_i]` order undone:
   tp_layout.py).
4. **This layout** (`lora_from_whole`, `write_optimizer_state`): each rank cuts its shard; a
   LoRA-SVD module is re-split exactly as the realignment does (`split_lora_shard`: randomized
   SVD of the new shard, ``W_res = W − β L2 L1`` after rounding L2: the shard's dense weight is
   kept up to one FP32 rounding) and its moments are routed into the new split
   (``m_L1 = R⁻¹QᵀM/β``, ``m_res = M − β L2 m_L1`` — the dense first moment is unchanged;
   ``v_L1 = (A∘A)V``, ``v_res`` kept). The moments are re-encoded with the codecs on this
   layout's tiles and chunks (`encode_piece`; stochastic-rounding uniforms from a generator
   keyed by seed, parameter name and offset, so every DP replica gets the same state).

What each FP4 state holds and how it is decoded, split and encoded is the recipe's
(fullstack_fp4/integration/reshard_state.py, `SavedRank`, `fold_lora_shard`,
`split_lora_shard`, `write_optimizer_state`); this module reads the checkpoint, joins and cuts
along the partition axes, and writes the model.

Why route the factor moments and not reset them: resharding changes the split of W exactly like
a realignment (another subspace, here of another shape), and the realignment's policy keeps
Adam's momentum of the dense W intact — a reset would throw away ~1/(1−β1) steps of momentum
and the per-feature scale of v (one warm-up's worth of noisy steps) for no gain.

What is exact and what is not:
* the effective weight of every LoRA-SVD shard: up to one FP32 rounding of the merge and of
  ``W − β L2 L1`` (as at a realignment); the model's *function* is unchanged, but the NVFP4
  quantization of the new ``W_res`` is another realisation of the quantization noise, so the
  first resumed loss differs from the uninterrupted run by about as much as two NVFP4 runs of
  the same weights do (measured: docs/multi-gpu.md, "Resharding");
* plain tensors' FP32 masters: exact (cut and re-joined);
* moments: one more quantization (decode → re-encode: the codec's error once more, measured
  in tests/megatron/training/test_reshard_units.py); moments of parameters that keep FP32
  moments are exact, and so is the dense first moment of a LoRA-SVD module in FP32.

Supported: any change of the TP size (same PP size), saved with the plain or the distributed
optimizer at any DP size, resumed with either; optimizer.name=q_adamw (one megatron wrapper);
any fp4.linear / fp4.attention (Q-Attn has no state). Refused with one line naming what is
missing: another PP size, another optimizer's converted state (muon / root and their NVFP4
forms), fp4.linear=lora_svd with megatron's own adamw (its factor moments are megatron
`ShardedTensor`s in the saved factor shapes; not converted).

Memory: every rank reads the optimizer objects of all saved ranks of its stage and the whole
factors (and, in fp32 runs, the whole W_res) of its LoRA-SVD modules: about the stage's state
once more, transiently, on each rank.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from megatron.training.errors import CheckpointError
from megatron.training.reshard_convert import lora_from_whole, lora_to_whole
from megatron.training.tp_layout import from_canonical, is_glu_rows, to_canonical

__all__ = ["SavedLayout", "saved_layout", "needs_reshard", "unsupported_reason", "load_resharded"]


@dataclass(frozen=True)
class SavedLayout:
    tp: int
    pp: int
    dp: int
    distopt: bool


def saved_layout(meta: dict) -> SavedLayout:
    par = meta.get("config", {}).get("parallel", {})
    tp, pp = par.get("tensor_model_parallel_size", 1), par.get("pipeline_model_parallel_size", 1)
    return SavedLayout(tp, pp, max(1, meta.get("world_size", 1) // (tp * pp)),
                       bool(par.get("use_distributed_optimizer", False)))


def needs_reshard(meta: dict, cfg) -> bool:
    """The saved TP size differs from this run's and some saved state depends on it (a
    converted FP4 optimizer's per-rank object, or LoRA-SVD factors). Everything else megatron
    reshards itself."""
    if saved_layout(meta).tp == ps.get_tensor_model_parallel_world_size():
        return False
    return cfg.optimizer.name != "adamw" or cfg.fp4.linear == "lora_svd"


def unsupported_reason(meta: dict, cfg, optimizer) -> str | None:
    """Why this checkpoint cannot be resharded into this run (one clause), or None."""
    from fullstack_fp4.integration.wrappers import converted_wrappers

    s = saved_layout(meta)
    if s.pp != ps.get_pipeline_model_parallel_world_size():
        return (f"the pipeline-parallel size changed too (PP={s.pp} -> "
                f"{ps.get_pipeline_model_parallel_world_size()}); only the TP size is resharded")
    if cfg.optimizer.name != "q_adamw":
        what = ("fp4.linear=lora_svd factors with megatron's adamw state"
                if cfg.optimizer.name == "adamw" else f"a {cfg.optimizer.name} optimizer state")
        return (f"resharding to another TP size is implemented for optimizer.name=q_adamw only, "
                f"not for {what}")
    if len(converted_wrappers(optimizer)) != 1:
        return (f"resharding handles one optimizer wrapper, this run has "
                f"{len(converted_wrappers(optimizer))}")
    return None


# ------------------------------------------------------------------ reading
@contextlib.contextmanager
def _objects_on_cpu():
    """torch.distributed.checkpoint unpickles a `ShardedObject` with a bare ``torch.load``, so
    the tensors of another rank's optimizer object come back on *that* rank's GPU (cuda:1 of a
    TP=2 run) — a device a 1-GPU resume does not have. Inside this block ``torch.load`` maps to
    the CPU unless told otherwise; the converter moves what it needs to this run's device."""
    orig = torch.load

    def load_cpu(*args, **kwargs):
        kwargs.setdefault("map_location", "cpu")
        return orig(*args, **kwargs)

    torch.load = load_cpu
    try:
        yield
    finally:
        torch.load = orig


def _whole_request(like: ShardedTensor, leaf: str, shape, dtype, device) -> ShardedTensor:
    """A read of the whole (unsplit over TP) tensor ``<module>.<leaf>`` of ``like``'s layer:
    only the prepended (layer) axes of ``like`` are kept. replica_id 1: never a main replica."""
    key = like.key.rsplit(".", 1)[0] + "." + leaf
    pre = like.prepend_axis_num
    offsets = [(k, like.global_offset[k], like.global_shape[k]) for k in range(pre)]
    return ShardedTensor.from_rank_offsets(key, torch.empty(shape, dtype=dtype, device=device),
                                           *offsets, replica_id=1, prepend_axis_num=pre)


def _object_requests(s: SavedLayout) -> dict:
    """The optimizer objects of every saved rank of this pipeline stage."""
    from fullstack_fp4.integration.optimizers import STATE_KEY

    pp_rank = ps.get_pipeline_model_parallel_rank()
    out = {}
    for t in range(s.tp):
        for d in range(s.dp if s.distopt else 1):
            shape, offset = ((s.pp, s.tp, s.dp), (pp_rank, t, d)) if s.distopt else \
                ((s.pp, s.tp), (pp_rank, t))
            out[f"{t}.{d}"] = ShardedObject(STATE_KEY, None, shape, offset, replica_id=0)
    return out


def _load_model_except_factors(model, dist_dir: str, factor_keys: set) -> dict:
    """megatron's own resharding for everything but the LoRA-SVD factors; returns the
    `sharded_state_dict` it used."""
    model_sd = model.sharded_state_dict()
    state = dist_checkpointing.load({"model": {k: v for k, v in model_sd.items()
                                               if k not in factor_keys}}, dist_dir)
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    if set(missing) - factor_keys or unexpected:
        raise CheckpointError(f"model state mismatch (missing {sorted(set(missing) - factor_keys)[:3]}, "
                              f"unexpected {sorted(unexpected)[:3]})")
    return model_sd


def _read_sources(s: SavedLayout, mods, model_sd, dist_dir: str, *, whole_w: bool, device) -> dict:
    from fullstack_fp4.integration.reshard_state import lora_shapes

    tp_now = ps.get_tensor_model_parallel_world_size()
    lora = {}
    for name, mod in mods:
        like, sh = model_sd[f"{name}.lora_l1"], lora_shapes(mod, tp_now, s.tp)
        lora[name] = {"l1": _whole_request(like, "lora_l1", sh["l1_all"], mod.lora_l1.dtype, device),
                      "l2": _whole_request(like, "lora_l2", sh["l2_all"], mod.lora_l2.dtype, device)}
        if whole_w:
            lora[name]["w"] = _whole_request(like, "weight", sh["w_all"], mod.weight.dtype, device)
    with _objects_on_cpu():
        # validation off: every rank reads whole tensors and other ranks' objects, which
        # megatron's check (each saved piece read exactly once, as a main replica) forbids
        return dist_checkpointing.load({"objects": _object_requests(s), "lora": lora}, dist_dir,
                                       validate_access_integrity=False)


def _agree_over_dp(tensors) -> None:
    """Every DP replica computed the same split from the same inputs; make that bit-exact by
    construction (GPU linear algebra on different devices is not promised to be): DP rank 0's
    values, broadcast within this rank's DP group."""
    if ps.get_data_parallel_world_size() == 1:
        return
    src, group = ps.get_data_parallel_src_rank(), ps.get_data_parallel_group()
    for t in tensors:
        dist.broadcast(t, src=src, group=group)


def _view(x: torch.Tensor, shape, name: str) -> torch.Tensor:
    if x.numel() != torch.Size(shape).numel():
        raise CheckpointError(f"{name}: {x.numel()} entries per saved TP shard, this model "
                              f"expects {list(shape)} (another padded vocabulary or shape?)")
    return x.view(shape)


# ------------------------------------------------------------------ the load
@torch.no_grad()
def load_resharded(path: str, meta: dict, *, model, optimizer, cfg) -> None:
    """Load model and optimizer of a checkpoint saved at another TP size (module docstring).
    Collective: every rank calls it. Raises CheckpointError (one line) on a problem."""
    from fullstack_fp4.integration.reshard_state import (SavedRank, key_generator, lora_modules,
                                                         payload_names)
    from fullstack_fp4.integration.wrappers import converted_wrappers

    s = saved_layout(meta)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    wrapper = converted_wrappers(optimizer)[0]
    device = next(model.parameters()).device
    dist_dir = os.path.join(path, "dist")
    glu = bool(getattr(model.config, "gated_linear_unit", False))
    mods = lora_modules(model)
    factor_keys = {f"{n}.{leaf}" for n, _ in mods for leaf in ("lora_l1", "lora_l2")}

    # 1-2: read. The FP32 masters are in the optimizer objects unless megatron's FP32Optimizer
    # saved them (fp32 run, plain optimizer: the model params are the masters); only then is
    # the whole W_res of each LoRA-SVD module read.
    model_sd = _load_model_except_factors(model, dist_dir, factor_keys)
    masters_saved = s.distopt or meta.get("config", {}).get("train", {}).get("precision") == "bf16"
    src = _read_sources(s, mods, model_sd, dist_dir, whole_w=not masters_saved, device=device)
    model_names = [n for n, _ in model.named_parameters()]
    saved = []
    for t in range(s.tp):
        rank = SavedRank()
        for d in range(s.dp if s.distopt else 1):
            obj = src["objects"][f"{t}.{d}"]
            try:
                names = payload_names(obj, model_names, wrapper.fp4_param_names,
                                      type(wrapper).__name__)
                rank.add(obj, names, device)    # refuses another Q-AdamW codec version
            except ValueError as e:
                raise CheckpointError(str(e)) from None
        saved.append(rank)
    if masters_saved != (saved[0].masters is not None):
        raise CheckpointError(f"its optimizer objects {'lack' if masters_saved else 'hold'} the FP32 "
                              "master copies its config implies")

    # 3-4: convert
    new_masters, new_states, model_only = {}, {}, {}
    seed_parts = ("reshard", cfg.train.seed, meta.get("iteration"))
    for name, mod in mods:
        _convert_lora(name, mod, saved, src["lora"][name], s.tp, tp, tp_rank, glu, masters_saved,
                      key_generator(device, *seed_parts, name, tp_rank),
                      new_masters, new_states, model_only)
    skip = {f"{n}.{leaf}" for n, _ in mods for leaf in ("weight", "lora_l1", "lora_l2")}
    for name, p in model.named_parameters():
        if name not in skip and p.requires_grad:
            _convert_plain(name, p, saved, s.tp, tp, tp_rank, glu, masters_saved,
                           new_masters, new_states)

    # 5: write
    _write(model, wrapper, new_masters, new_states, model_only, seed=cfg.train.seed, device=device)


def _convert_lora(name, mod, saved, src, tp_saved, tp, tp_rank, glu, masters_saved, generator,
                  new_masters, new_states, model_only) -> None:
    from fullstack_fp4.integration.reshard_state import lora_settings, lora_shapes

    wn, l1n, l2n = f"{name}.weight", f"{name}.lora_l1", f"{name}.lora_l2"
    settings = lora_settings(mod)
    a = settings.pop("axis")
    # fc1: the rows of W and L2 (the layer's output rows) are [gate_i; up_i] per shard
    g = a == 0 and is_glu_rows(wn, glu)
    sh = lora_shapes(mod, tp, tp_saved)
    l2 = list(src["l2"].float().chunk(tp_saved, dim=a))
    if masters_saved:
        w = [_view(r.masters[wn], sh["w"], wn) for r in saved]
        l1 = [_view(r.masters[l1n], sh["l1"], l1n) for r in saved]
    else:
        w = [from_canonical(src["w"].float(), a, tp_saved, t, glu=g) for t in range(tp_saved)]
        l1 = list(src["l1"].float().chunk(tp_saved, dim=a))
    states = None
    if all(wn in r.states and l1n in r.states for r in saved):
        states = [({"exp_avg": _view(r.states[wn][0], sh["w"], wn),
                    "exp_avg_sq": _view(r.states[wn][1], sh["w"], wn)},
                   {"exp_avg": _view(r.states[l1n][0], sh["l1"], l1n),
                    "exp_avg_sq": _view(r.states[l1n][1], sh["l1"], l1n)}) for r in saved]
    whole = lora_to_whole(w, l1, l2, settings["beta"], a, g, states)
    w_res, l2_new, l1_new, routed = lora_from_whole(whole, tp, tp_rank, a, g,
                                                    generator=generator, **settings)
    _agree_over_dp([w_res, l2_new, l1_new] + [t for st in routed or () for t in st.values()])
    new_masters[wn], new_masters[l1n], model_only[l2n] = w_res, l1_new, l2_new
    if routed is not None:
        step = saved[0].states[wn][2]
        new_states[wn] = (routed[0]["exp_avg"], routed[0]["exp_avg_sq"], step)
        new_states[l1n] = (routed[1]["exp_avg"], routed[1]["exp_avg_sq"], step)


def _convert_plain(name, p, saved, tp_saved, tp, tp_rank, glu, masters_saved,
                   new_masters, new_states) -> None:
    """Join the saved shards along megatron's partition axis (a replicated tensor: saved rank
    0's copy), cut this rank's."""
    axis = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
    loc = list(p.shape)
    if axis is not None:
        loc[axis] = loc[axis] * tp // tp_saved
    g = is_glu_rows(name, glu)

    def reshard(parts):
        return from_canonical(to_canonical([_view(x, loc, name) for x in parts], axis, glu=g),
                              axis, tp, tp_rank, glu=g)

    if masters_saved:
        new_masters[name] = reshard([r.masters[name] for r in saved])
    if all(name in r.states for r in saved):
        new_states[name] = (reshard([r.states[name][0] for r in saved]),
                            reshard([r.states[name][1] for r in saved]), saved[0].states[name][2])


def _write(model, wrapper, new_masters, new_states, model_only, *, seed, device) -> None:
    """Model params, then every inner param of the optimizer and its Q-AdamW state
    (`write_optimizer_state`)."""
    from fullstack_fp4.integration.reshard_state import write_optimizer_state

    params = dict(model.named_parameters())
    for name, t in {**new_masters, **model_only}.items():
        params[name].copy_(t.view_as(params[name]))
    write_optimizer_state(wrapper, params, new_masters, new_states, seed=seed, device=device)
