"""Put the FP4 optimizers inside megatron-core's optimizer wrappers (`optimizer.name`).

megatron-core builds its wrapper first (`FP32Optimizer`, `Float16OptimizerWithFloat16Params`
or `DistributedOptimizer`, possibly inside a one-element `ChainedOptimizer`): FP32 main
params, grad clipping, the distributed optimizer's flat shards and param↔main-param copies
stay megatron-core's. `convert_optimizer` then replaces the wrapper's inner torch AdamW:

- `q_adamw`: `QAdamW` over the *same* param-group dicts (megatron's `lr_mult`/`wd_mult`
  and the trainer's per-step `lr` / `weight_decay` keep working), `min_numel` from
  `optimizer.q_adamw.min_numel`, `approx_division` from `optimizer.q_adamw.approx_division`,
  seed `train.seed`.
- `muon | q_muon | root | q_root`: a `SplitOptimizer` (one inner optimizer that dispatches
  by parameter) holding Muon/Root for the 2-D transformer-layer matrices (`linear_qkv`,
  `linear_proj`, `linear_fc1`, `linear_fc2` weights) and megatron's AdamW (torch AdamW with
  the same defaults) for everything else — `q_root` and `q_muon` take QAdamW for the rest (the
  paper's full-stack ROOT arm: every optimizer state of the model in 4 bits).

Why one wrapper with a dispatching inner optimizer and not megatron's `ChainedOptimizer` of
two wrappers: `build_optimizer` returns the wrapper object megatron built, so the recipe has
to convert it in place; one wrapper also gives one grad-norm / clipping pass over all params
(exactly megatron's), one set of main params, and no duplicated Float16 bookkeeping.

BF16 grads (`parallel.grad_reduce_in_fp32=false`, q_adamw only): the wrappers hand QAdamW the
BF16 grad buffer's views instead of FP32 copies (bf16_grads.py). The other optimizers get
megatron-core's default FP32 copies of the BF16 grads.

BF16 model params (q_adamw, Float16 / distributed wrapper): QAdamW's fused step also writes each
main param's BF16 model param, and the wrapper's main -> model copy skips the params it wrote
(model_param_write.py).

Checkpoints (`dist_checkpointing`): the inner state is packed (QAdamW's uint8/int codes) or
split across two optimizers, which megatron's mapping of torch-AdamW states onto
`ShardedTensor`s cannot express. Each converted wrapper therefore saves ONE `ShardedObject`
per rank, `optimizer.fullstack_fp4.inner_state`, holding:
    the inner optimizer's `state_dict()` (4-bit codes stay 4-bit), the FP32 main params
    (Float16 / distributed optimizer only: with `FP32Optimizer` they are the model params,
    saved under `model`), the grad scaler, and the layout it was saved with.
Plain optimizer: global shape (PP, TP), replicated over DP (DP rank 0 writes).
Distributed optimizer: global shape (PP, TP, DP) — every DP rank owns a different flat shard.
Resume is exact. The plain optimizer may resume at another DP size (same TP and PP: its state
is replicated over DP). A changed TP size (same PP size) is converted at load for `q_adamw`:
every saved rank's 4-bit moments are decoded into the parameters' whole FP32 moments, cut for
the new layout and encoded again (reshard_state.py; `param_names` in the payload
says which parameter each state belongs to). Any other changed parallel layout (PP size,
distributed optimizer on/off or its DP size at the same TP size, parameter shards) is refused
with an error naming both layouts (`resume_layout_error`).
"""
from __future__ import annotations

from typing import Iterable

import torch
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import FP32Optimizer

from fullstack_fp4.integration.wrappers import (inner_params, main_to_model, megatron_wrappers,
                                                model_main_pairs)
from fullstack_fp4.optim.muon import Muon
from fullstack_fp4.optim.q_adamw import QAdamW
from fullstack_fp4.optim.q_adamw.codecs import CHUNK
from fullstack_fp4.optim.q_adamw.optimizer import PLACE_ATTR, Placement
from fullstack_fp4.optim.root import Root

__all__ = ["convert_optimizer", "SplitOptimizer", "qkv_row_permutation", "is_orthogonal_matrix",
           "STATE_KEY", "OptimizerLayoutError", "resume_layout_error", "place_distributed_shards",
           "canonical_name", "dp_matrix_specs"]

MATRIX_SUFFIXES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight",
                   "linear_fc2.weight")
ORTHOGONAL = ("muon", "q_muon", "root", "q_root")
Q_ORTHOGONAL = ("q_muon", "q_root")   # NVFP4 Newton–Schulz, QAdamW for the rest
STATE_KEY = "optimizer.fullstack_fp4.inner_state"
FORMAT = 1
# torch-AdamW-only keys dropped from a megatron group before it becomes a Muon/Root group.
_ADAM_KEYS = ("betas", "eps", "amsgrad", "maximize", "foreach", "capturable", "differentiable",
              "fused", "decoupled_weight_decay")


class OptimizerLayoutError(RuntimeError):
    """The checkpoint's optimizer state was saved with another parallel layout."""


# ------------------------------------------------------------------------ orthogonal parts
def is_orthogonal_matrix(name: str, p: torch.nn.Parameter) -> bool:
    """The 2-D weights of the transformer layers' linears (attention in/out, MLP in/out)."""
    return p.ndim == 2 and name.endswith(MATRIX_SUFFIXES)


def qkv_row_permutation(num_groups_local: int, heads_per_group: int, head_dim: int):
    """Rows of megatron's fused QKV weight are per query group `[q (heads_per_group·hd) | k (hd)
    | v (hd)]`, groups one after another (attention.py `get_query_key_value_tensors`). Returns
    `(perm, sizes)`: `w[perm]` is `[Q; K; V]` (all groups' q rows, then k, then v) and `sizes`
    the row counts of the three logical matrices."""
    per = (heads_per_group + 2) * head_dim
    q, k, v = [], [], []
    for g in range(num_groups_local):
        base = g * per
        q.append(torch.arange(base, base + heads_per_group * head_dim))
        k.append(torch.arange(base + heads_per_group * head_dim,
                              base + (heads_per_group + 1) * head_dim))
        v.append(torch.arange(base + (heads_per_group + 1) * head_dim, base + per))
    perm = torch.cat(q + k + v)
    nq = num_groups_local * heads_per_group * head_dim
    return perm, [nq, num_groups_local * head_dim, num_groups_local * head_dim]


class SplitOptimizer:
    """An inner optimizer for a megatron wrapper made of torch optimizers over disjoint params.

    `param_groups` is the concatenation of theirs (the same dicts: the trainer's lr / wd writes
    reach them), `step`/`zero_grad` call each, `state_dict` is `{"subs": [...]}`."""

    def __init__(self, subs: list[torch.optim.Optimizer]):
        self.subs = subs
        self.defaults = subs[0].defaults

    @property
    def param_groups(self) -> list[dict]:
        return [g for s in self.subs for g in s.param_groups]

    @property
    def state(self) -> dict:
        return {p: st for s in self.subs for p, st in s.state.items()}

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for s in self.subs:
            s.step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for s in self.subs:
            s.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"subs": [s.state_dict() for s in self.subs],
                "kinds": [type(s).__name__ for s in self.subs]}

    def load_state_dict(self, sd: dict) -> None:
        kinds = [type(s).__name__ for s in self.subs]
        if sd.get("kinds") != kinds:
            raise OptimizerLayoutError(f"optimizer state holds {sd.get('kinds')}, this run "
                                       f"builds {kinds}")
        for s, d in zip(self.subs, sd["subs"]):
            s.load_state_dict(d)

    def __repr__(self):
        return "SplitOptimizer(" + ", ".join(type(s).__name__ for s in self.subs) + ")"


# ------------------------------------------------------------------------ wrapper plumbing
def dp_matrix_specs(wrapper, named) -> list:
    """``[(model param, DPMatrix)]`` for every orthogonalised matrix of the distributed
    optimizer ``wrapper``'s grad buffers — also those of which this DP rank holds no piece —
    in model-parameter order (the same on every DP rank of the stage), with this rank's piece
    (the FP32 main shard) and its range in the flattened matrix (fullstack_fp4/optim/muon.py,
    data parallelism)."""
    from fullstack_fp4.optim.muon import DPMatrix

    in_buffers = {id(p) for b in wrapper.buffers for p in b.param_index_map}
    piece_of = {id(mp): sp for mp, sp in model_main_pairs(wrapper)}
    out = []
    for n, mp in named:
        if id(mp) not in in_buffers or not is_orthogonal_matrix(n, mp):
            continue
        sp = piece_of.get(id(mp))
        if sp is None:
            out.append((mp, DPMatrix(mp.shape, device=mp.device)))
            continue
        rng = wrapper._get_model_param_range_map(mp)["param"]
        out.append((mp, DPMatrix(mp.shape, sp, rng.start, rng.end)))
    return out


def _layout(wrapper) -> dict:
    inner = wrapper.optimizer
    return {"tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(),
            "wrapper": type(wrapper).__name__,
            "inner": repr(inner) if isinstance(inner, SplitOptimizer) else type(inner).__name__,
            "numels": [p.numel() for g in inner.param_groups for p in g["params"]],
            **_placements(inner)}


def _placements(inner) -> dict:
    """QAdamW placements of the inner params (distributed-optimizer shards), if any: a state
    saved with other placements (another chunk grid / seed key) is not this run's state."""
    places = [getattr(p, PLACE_ATTR, None) for g in inner.param_groups for p in g["params"]]
    if not any(pl is not None for pl in places):
        return {}
    return {"q_adamw_places": [None if pl is None else [pl.key, pl.offset, pl.full_numel,
                                                        pl.phase] for pl in places]}


def canonical_name(name: str) -> str:
    """A parameter name relative to the GPT model (without DDP / Float16Module `module.`s)."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _inner_param_names(wrapper, model_chunks) -> list:
    """Model-parameter name (`canonical_name`) of every inner param, in `inner_params` order; a
    distributed-optimizer shard is named after the parameter it is cut from."""
    names = {id(p): canonical_name(n) for c in model_chunks for n, p in c.named_parameters()}
    model_of = main_to_model(wrapper)
    return [names.get(id(model_of[id(p)])) if id(p) in model_of else None
            for p in inner_params(wrapper)]


def parallel_layout(tp: int, pp: int, world: int, distopt: bool) -> str:
    dp = world // max(tp * pp, 1)
    return (f"TP={tp} PP={pp} DP={dp} (world {world}), distributed optimizer "
            f"{'on' if distopt else 'off'}")


def resume_layout_error(meta: dict, optimizer, path: str):
    """One message naming the saved and the current parallel layout if a checkpoint's FP4
    optimizer state (one per-rank object, see the module docstring) cannot be loaded by this
    run's layout; ``None`` when the layouts agree or the optimizer is not converted.

    ``meta``: the checkpoint's meta.json (``world_size`` and the saved ``config``)."""
    if not any(getattr(w, "fp4_converted", False) for w in megatron_wrappers(optimizer)):
        return None
    par = meta.get("config", {}).get("parallel", {})
    saved = (par.get("tensor_model_parallel_size", 1), par.get("pipeline_model_parallel_size", 1),
             meta.get("world_size", 1), bool(par.get("use_distributed_optimizer", False)))
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    now = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
           world, any(isinstance(w, DistributedOptimizer) for w in megatron_wrappers(optimizer)))
    if saved == now:
        return None
    if saved[:2] == now[:2] and not saved[3] and not now[3]:
        # Plain optimizer, same TP and PP: every DP rank holds the whole state of its (TP, PP)
        # shard (saved once, replicated over DP), so a changed DP size reads the same objects.
        return None
    name = meta.get("config", {}).get("optimizer", {}).get("name", "?")
    return (f"checkpoint {path} could not be read: its {name} optimizer state was saved with "
            f"{parallel_layout(*saved)}, this run has {parallel_layout(*now)}; the 4-bit "
            "optimizer state is stored per rank and is converted only across TP sizes "
            "(docs/multi-gpu.md, Resharding) — resume with the saved layout")


def _saves_main_params(wrapper) -> bool:
    return not isinstance(wrapper, FP32Optimizer)


class _ConvertedMixin:
    """state_dict / load_state_dict / sharded_state_dict for a wrapper whose inner optimizer is
    a QAdamW or a SplitOptimizer (see the module docstring for the checkpoint format)."""

    def _fp4_payload(self) -> dict:
        inner = self.optimizer
        main = None
        if _saves_main_params(self):
            main = [p.detach().clone() for g in inner.param_groups for p in g["params"]]
        return {"format": FORMAT, "layout": _layout(self), "inner": inner.state_dict(),
                "main_params": main,
                # model-parameter name of every inner param: lets a resume in another TP size
                # find each state (reshard_state.py); not part of the layout check
                "param_names": getattr(self, "fp4_param_names", None),
                "grad_scaler": self.grad_scaler.state_dict()
                if getattr(self, "grad_scaler", None) else None}

    def state_dict(self, *args, **kwargs):
        return {"fp4_state": self._fp4_payload()}

    def load_state_dict(self, state_dict):
        payload = state_dict["fp4_state"]
        if payload.get("format") != FORMAT:
            raise OptimizerLayoutError(f"optimizer state format {payload.get('format')} is not "
                                       f"{FORMAT}")
        now = _layout(self)
        # The DP size matters only to the distributed optimizer (its flat shards); the plain
        # optimizer's state is replicated over DP, so it may resume at another DP size.
        ignore = () if isinstance(self, DistributedOptimizer) else ("dp",)
        diff = {k: (payload["layout"].get(k), now[k]) for k in now
                if k not in ignore and payload["layout"].get(k) != now[k]}
        if diff:
            raise OptimizerLayoutError(
                "the FP4 optimizer state was saved with another parallel layout / parameter "
                f"sharding (saved vs now: {diff}); it cannot be resharded — resume with the "
                "layout it was saved with")
        self.optimizer.load_state_dict(payload["inner"])
        if payload["main_params"] is not None:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            with torch.no_grad():
                for p, saved in zip(params, payload["main_params"]):
                    p.copy_(saved)
            if isinstance(self, DistributedOptimizer):
                # model params := main shards (bf16 model params get the rounded values the
                # interrupted run had after its last step; fp32 shards are views: no-op).
                self._copy_main_params_to_model_params()
        if payload["grad_scaler"] is not None and getattr(self, "grad_scaler", None):
            self.grad_scaler.load_state_dict(payload["grad_scaler"])

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False,
                           metadata=None, **kwargs):
        pp_rank = ps.get_pipeline_model_parallel_rank()
        tp_rank = ps.get_tensor_model_parallel_rank()
        dp_rank = ps.get_data_parallel_rank()
        pp, tp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
        if isinstance(self, DistributedOptimizer):
            shape, offset, replica = (pp, tp, ps.get_data_parallel_world_size()), \
                (pp_rank, tp_rank, dp_rank), 0
        else:
            shape, offset, replica = (pp, tp), (pp_rank, tp_rank), dp_rank
        data = None if is_loading else self._fp4_payload()
        return {"fp4_state": ShardedObject(STATE_KEY, data, shape, offset, replica_id=replica)}


def _convert_methods(wrapper) -> None:
    """Bind the mixin's checkpoint methods on this wrapper instance (instance attributes take
    precedence over the class's methods; megatron's classes are left untouched)."""
    import types

    for meth in ("_fp4_payload", "state_dict", "load_state_dict", "sharded_state_dict"):
        setattr(wrapper, meth, types.MethodType(getattr(_ConvertedMixin, meth), wrapper))
    wrapper.fp4_converted = True


# ------------------------------------------------------------------------ building
def _over_groups(cls, groups: list[dict], placeholder=(1,), **kw):
    """`cls(groups, **kw)` keeping megatron's group dicts (and their param order, which the
    distributed optimizer's group-index map relies on). Built over leaf placeholders (of shape
    ``placeholder``), then the groups are attached as megatron-core's DistributedOptimizer does
    for its own AdamW: its FP32 main shards are views, which torch's `add_param_group` would
    reject."""
    placeholders = [{**{k: v for k, v in g.items() if k != "params"},
                     "params": [torch.zeros(placeholder)]} for g in groups]
    opt = cls(placeholders, **kw)
    for g, filled in zip(groups, opt.param_groups):
        for k, v in filled.items():
            if k != "params":
                g.setdefault(k, v)
    opt.param_groups = list(groups)
    return opt


def _same_kind(old: torch.optim.Optimizer, groups: list[dict], pieces: bool = False) -> torch.optim.Optimizer:
    """A fresh optimizer of megatron's kind (torch AdamW) with its defaults, over `groups`
    (``pieces``: the distributed optimizer's views, attached after construction)."""
    import inspect

    accepted = inspect.signature(type(old).__init__).parameters
    kw = {k: v for k, v in old.defaults.items() if k in accepted}
    return _over_groups(type(old), groups, **kw) if pieces else type(old)(groups, **kw)


def _q_adamw(groups, cfg) -> QAdamW:
    o = cfg.optimizer
    return _over_groups(QAdamW, groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                        weight_decay=o.weight_decay, min_numel=o.q_adamw.min_numel,
                        seed=cfg.train.seed, approx_division=o.q_adamw.approx_division)


def place_distributed_shards(wrapper, model_chunks) -> list[str]:
    """Tag every FP32 main shard of megatron's DistributedOptimizer with its QAdamW Placement.

    A shard is the piece ``param.view(-1)[start:end]`` that this DP rank owns. The placement
    keys the piece by the model parameter's index in ``model_chunks`` (the same on every DP
    rank), gives its offset in the whole parameter, and anchors the whole parameter's codec
    chunk grid on the grad buffer: chunk boundaries at buffer indices that are multiples of
    1024 (phase = the parameter's buffer start mod 1024; megatron starts params on multiples
    of 64, so blocks and tiles stay whole). The buffer layout does not depend on the DP size
    (param starts padded to 64, bucket ends to lcm(dp, 128[, 2^16])), and with
    ``DistributedDataParallelConfig(pad_buckets_for_high_nccl_busbw=True)`` every bucket is a
    multiple of 2^16 = 1024·64, so for DP <= 64 (powers of two) every DP shard boundary lies on
    the grid: each rank's 4-bit state is exactly its slice of the 1-process state, and a DP=N
    run steps bit for bit as the 1-process run given the same gradients.

    Returns a description of every cut that is NOT on the grid (empty = DP-invariant); such a
    cut splits one 1024-chunk's second-level scale between two ranks (still a valid encoding,
    but the state then depends on the DP size)."""
    keys = {id(p): i for i, p in enumerate(p for c in model_chunks for p in c.parameters())}
    names = {id(p): n for c in model_chunks for n, p in c.named_parameters()}
    off_grid = []
    for mp, sp in model_main_pairs(wrapper):
        rng = wrapper._get_model_param_range_map(mp)["param"]
        gbuf_index = wrapper.model_param_gbuf_map[mp][0]
        start = wrapper.buffers[gbuf_index].param_index_map[mp][0]
        pl = Placement(key=keys[id(mp)], offset=rng.start, full_numel=mp.numel(),
                       phase=start % CHUNK)
        pl.check(sp.numel())
        setattr(sp, PLACE_ATTR, pl)
        for cut in (rng.start, rng.end):
            if 0 < cut < mp.numel() and (start + cut) % CHUNK:
                off_grid.append(f"{names.get(id(mp), '?')}[{cut}]")
    return off_grid


def _coefficients(name: str, choice: str) -> str:
    if choice == "auto":
        return "fp4" if name.startswith("q_") else ("muon" if name == "muon" else "root")
    return {"fitted": "fp4"}.get(choice, choice)


def _orthogonal(groups, cfg, pieces: bool = False):
    name, oc = cfg.optimizer.name, cfg.optimizer.orthogonal
    kw = dict(momentum=oc.momentum, ns_steps=oc.ns_steps,
              ns_precision="nvfp4" if name.startswith("q_") else "bf16",
              ns_coefficients=_coefficients(name, oc.coefficients),
              ns_clip_percentile=oc.clip_percentile, weight_decay=cfg.optimizer.weight_decay,
              ns_nvfp4_terms=oc.nvfp4_terms if name.startswith("q_") else None,
              ns_cuda_graph=oc.cuda_graph)
    cls = Muon if name.endswith("muon") else Root
    if pieces:   # the distributed optimizer's 1-D views: attached after construction (2-D placeholders)
        return _over_groups(cls, groups, placeholder=(1, 1), lr=cfg.optimizer.lr * oc.lr_scale, **kw)
    return cls(groups, lr=cfg.optimizer.lr * oc.lr_scale, **kw)


def tag_fused_matrices(named: Iterable[tuple[str, torch.nn.Parameter]], main_of: dict,
                       model_config, tp_size: int, tp_mode: str = "blockwise",
                       tp_group=None) -> None:
    """Set `ns_split_sizes` (and `ns_row_perm` for QKV) on the main params of fused weights,
    for the local TP shard. With `tp_mode="duplicated"` and TP > 1, also set `ns_tp_axis`
    (megatron's `partition_dim`: 0 column-parallel QKV/fc1, 1 row-parallel proj/fc2) and
    `ns_tp_group` on the main params of the TP-split matrices: the optimizer then gathers each
    logical block over TP and orthogonalises the whole 1-GPU block (fullstack_fp4/optim/muon.py).
    The local blocks concatenated in TP-rank order are the 1-GPU blocks: megatron gives each
    rank whole query groups (QKV) and its own slice of gate and of up (SwiGLU fc1)."""
    if tp_mode not in ("duplicated", "blockwise"):
        raise ValueError(f"tp_mode must be duplicated | blockwise, got {tp_mode!r}")
    for name, p in named:
        main = main_of.get(id(p))
        if main is None:
            continue
        if tp_mode == "duplicated" and tp_size > 1 and is_orthogonal_matrix(name, p):
            if not getattr(p, "tensor_model_parallel", False):
                raise ValueError(f"{name}: not marked tensor_model_parallel at TP={tp_size}; "
                                 "cannot gather it (optimizer.orthogonal.tp_mode=blockwise "
                                 "orthogonalises the local weight)")
            axis = getattr(p, "partition_dim", None)
            if axis not in (0, 1):
                raise ValueError(f"{name}: tensor-parallel weight with partition_dim={axis}")
            if not getattr(p, "allreduce", True):
                raise NotImplementedError(f"{name}: expert-parallel weights with "
                                          "optimizer.orthogonal.tp_mode=duplicated")
            main.ns_tp_axis = axis
            main.ns_tp_group = tp_group if tp_group is not None \
                else ps.get_tensor_model_parallel_group()
        if name.endswith("linear_qkv.weight"):
            ng, nh = model_config.num_query_groups or model_config.num_attention_heads, \
                model_config.num_attention_heads
            if ng % tp_size:
                raise NotImplementedError(
                    f"orthogonal optimizers with num_query_groups={ng} < / not divisible by "
                    f"TP={tp_size} (a TP shard would hold part of a query group)")
            hd = model_config.kv_channels
            perm, sizes = qkv_row_permutation(ng // tp_size, nh // ng, hd)
            if sum(sizes) != p.shape[0]:
                raise ValueError(f"{name}: {p.shape[0]} rows, expected {sum(sizes)} from the "
                                 "attention config")
            main.ns_row_perm, main.ns_split_sizes = perm, sizes
        elif name.endswith("linear_fc1.weight") and model_config.gated_linear_unit:
            main.ns_split_sizes = [p.shape[0] // 2, p.shape[0] // 2]


def _convert_wrapper(wrapper, cfg, model_chunks) -> None:
    name = cfg.optimizer.name
    old = wrapper.optimizer
    if old is None:  # a stub optimizer (no params on this rank)
        return
    groups = old.param_groups
    if old.state:
        raise RuntimeError("convert_optimizer must run before the first step")
    if name == "q_adamw":
        new = _q_adamw(groups, cfg)
        if isinstance(wrapper, DistributedOptimizer):
            off = place_distributed_shards(wrapper, model_chunks)
            if off and ps.get_data_parallel_rank() == 0:
                print(f"[q_adamw] distributed optimizer: {len(off)} shard cut(s) off the "
                      f"1024-entry codec chunk grid (e.g. {off[0]}): the 4-bit state then "
                      "depends on the DP size. Build DDP with "
                      "pad_buckets_for_high_nccl_busbw=True for DP-invariant states.",
                      flush=True)
    else:
        distopt = isinstance(wrapper, DistributedOptimizer)
        tp = ps.get_tensor_model_parallel_world_size()
        model_of = main_to_model(wrapper)
        named = [(n, p) for c in model_chunks for n, p in c.named_parameters()]
        name_of = {id(p): n for n, p in named}
        mats, rest = [], []
        if distopt:
            if name in Q_ORTHOGONAL:   # the rest goes to QAdamW: pieces need their placement
                place_distributed_shards(wrapper, model_chunks)
            dp_mats = dp_matrix_specs(wrapper, named)
            main_of = {id(mp): spec for mp, spec in dp_mats}
        else:
            main_of = {id(model_of[id(m)]): m for g in groups for m in g["params"]}
        for g in groups:
            base = {k: v for k, v in g.items() if k != "params"}
            is_m = [is_orthogonal_matrix(name_of.get(id(model_of[id(m)]), ""), model_of[id(m)])
                    for m in g["params"]]
            pm = [m for m, f in zip(g["params"], is_m) if f]
            pr = [m for m, f in zip(g["params"], is_m) if not f]
            if pm:
                mg = {k: v for k, v in base.items() if k not in _ADAM_KEYS}
                mg["lr_mult"] = base.get("lr_mult", 1.0) * cfg.optimizer.orthogonal.lr_scale
                mg["lr"] = base["lr"] * cfg.optimizer.orthogonal.lr_scale
                mats.append({**mg, "params": pm})
            if pr:
                rest.append({**base, "params": pr})
        if distopt and not mats and dp_mats:
            # no piece of any matrix on this rank: it still joins the optimizer's collectives
            mats = [{**{k: v for k, v in groups[0].items() if k not in ("params",) + _ADAM_KEYS},
                     "params": []}]
        if not mats:
            raise RuntimeError(f"optimizer.name={name}: no transformer-layer matrices found")
        mc = model_chunks[0].config if hasattr(model_chunks[0], "config") else None
        tag_fused_matrices(named, main_of, mc, tp, tp_mode=cfg.optimizer.orthogonal.tp_mode)
        orth = _orthogonal(mats, cfg, pieces=distopt)
        if distopt:
            orth.set_dp_matrices([spec for _, spec in dp_mats], wrapper.data_parallel_group)
        subs = [orth]
        if rest:
            subs.append(_q_adamw(rest, cfg) if name in Q_ORTHOGONAL else _same_kind(old, rest, pieces=distopt))
        new = SplitOptimizer(subs)
    wrapper.optimizer = new
    wrapper.fp4_param_names = _inner_param_names(wrapper, model_chunks)
    _convert_methods(wrapper)


def convert_optimizer(optimizer, cfg, model_chunks) -> None:
    """Replace the inner optimizer of megatron-core's wrapper(s) in place per
    `cfg.optimizer.name` (no-op for `adamw`)."""
    name = cfg.optimizer.name
    if name == "adamw":
        return
    if name not in ("q_adamw",) + ORTHOGONAL:
        raise ValueError(f"unknown optimizer.name {name!r}")
    for w in megatron_wrappers(optimizer):
        _convert_wrapper(w, cfg, model_chunks)
    if name == "q_adamw":
        # BF16 model params: QAdamW's step writes them, megatron's main -> model copy skips them
        from fullstack_fp4.integration.model_param_write import write_model_params_in_step

        write_model_params_in_step(optimizer)
    if name == "q_adamw" and not getattr(cfg.parallel, "grad_reduce_in_fp32", True):
        # BF16 grad buffer: QAdamW reads it in place instead of megatron's FP32 copies
        from fullstack_fp4.integration.bf16_grads import read_bf16_grads_in_place

        read_bf16_grads_in_place(optimizer)
