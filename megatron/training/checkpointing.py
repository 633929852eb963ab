"""Checkpoints: megatron-core `dist_checkpointing` for model and optimizer, plus our own state.

Layout of one checkpoint (`<save_dir>/iter_0000100/`):

    dist/                 model + optimizer, `dist_checkpointing` (torch_dist), resharding-capable
    rng/rank_00000.pt     this rank's RNG states
    extra/rank_00000.pt   recipe state that is not a tensor of the model/optimizer (if any)
    meta.json             iteration, consumed samples, resolved config, file manifest (last written)

Atomicity: everything is written to `iter_N.tmp/`, `meta.json` (with the size of every file)
is written last, the directory is renamed to `iter_N/`, and only then is `<save_dir>/latest`
replaced (write-then-`os.replace`). A directory without `meta.json`, or with a file whose size
differs from the manifest, is not a checkpoint: `load: auto` skips it with a warning; an
explicit `load: <path>` to it is an error. The newest `keep_last` checkpoints are kept.

Loading checks the manifest and the model shape recorded in `meta.json` against the config
before touching any tensor, so a damaged or incompatible checkpoint gives one `CheckpointError`
naming the problem. If reading a shard still fails, the error is raised at start-up: the run
exits and nothing trains on a partly loaded model; the checkpoint on disk is never modified.

Another parallel layout: megatron-core reshards the `ShardedTensor`s itself. State whose form
depends on the TP size (LoRA-SVD factors, Q-AdamW's per-rank 4-bit objects) is converted at
load by reshard.py when the TP size changed; what cannot be converted is refused in one line.
"""
from __future__ import annotations

import json
import os
import queue
import re
import shutil

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.strategies import filesystem_async
from torch.distributed.checkpoint.api import CheckpointException

from megatron.training import reshard
from megatron.training.config import to_dict
from megatron.training.errors import CheckpointError

FORMAT_VERSION = 1
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
# Config fields that change the shapes or meaning of saved tensors: must match on resume.
SHAPE_KEYS = {
    "model": ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "position_embedding", "make_vocab_size_divisible_by"),
    "fp4": ("linear", "attention", "bf16_first_layers", "bf16_last_layers"),
    "fp4.lora_svd": ("rank", "beta"),
    "optimizer": ("name",),
}



def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _manifest(root: str) -> dict[str, int]:
    out = {}
    for base, _, files in os.walk(root):
        for name in files:
            full = os.path.join(base, name)
            rel = os.path.relpath(full, root)
            if rel != "meta.json":
                out[rel] = os.path.getsize(full)
    return out


def check_complete(path: str) -> dict:
    """Return meta.json of a complete checkpoint, or raise CheckpointError saying what is wrong."""
    meta_path = os.path.join(path, "meta.json")
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"checkpoint {path} is incomplete (no meta.json: the save was interrupted)")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: meta.json is unreadable ({e})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path}: format version {meta.get('format_version')} "
                              f"is not {FORMAT_VERSION}")
    for rel, size in meta.get("files", {}).items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint {path} is damaged: file {rel} is missing")
        if os.path.getsize(full) != size:
            raise CheckpointError(f"checkpoint {path} is damaged: file {rel} has "
                                  f"{os.path.getsize(full)} bytes, expected {size} (truncated?)")
    return meta


def find_latest(save_dir: str) -> str | None:
    """Newest complete checkpoint under save_dir (the `latest` pointer first), or None."""
    if not save_dir or not os.path.isdir(save_dir):
        return None
    pointer = os.path.join(save_dir, "latest")
    candidates = []
    if os.path.isfile(pointer):
        with open(pointer) as f:
            candidates.append(f.read().strip())
    candidates += sorted((d for d in os.listdir(save_dir) if _ITER_RE.match(d)), reverse=True)
    for name in candidates:
        path = os.path.join(save_dir, name)
        try:
            check_complete(path)
            return path
        except CheckpointError as e:
            if _rank() == 0:
                print(f"[checkpoint] skipping {path}: {e}", flush=True)
    return None


def resolve_load_path(load: str, save_dir: str | None) -> str | None:
    if load == "none":
        return None
    if load == "auto":
        return find_latest(save_dir) if save_dir else None
    if os.path.isfile(os.path.join(load, "meta.json")):
        check_complete(load)
        return load
    if os.path.isdir(load):
        found = find_latest(load)
        if found is None:
            raise CheckpointError(f"checkpoint.load={load}: no complete checkpoint in that directory")
        return found
    raise CheckpointError(f"checkpoint.load={load}: no such checkpoint directory")


def _lookup(tree: dict, dotted: str) -> dict:
    for part in dotted.split("."):
        tree = tree.get(part, {}) if isinstance(tree, dict) else {}
    return tree


def check_compatible(meta: dict, cfg, path: str) -> None:
    saved = meta.get("config", {})
    now = to_dict(cfg)
    diffs = []
    for section, keys in SHAPE_KEYS.items():
        for k in keys:
            a, b = _lookup(saved, section).get(k), _lookup(now, section)[k]
            if a != b:
                diffs.append(f"{section}.{k}: checkpoint {a!r}, config {b!r}")
    if diffs:
        raise CheckpointError(f"checkpoint {path} does not match this config: " + "; ".join(diffs))


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        state["tracker"] = get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state_dict(model, optimizer, *, is_loading: bool) -> dict:
    model_sd = model.sharded_state_dict()
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                      metadata=optimizer_metadata(optimizer))}


def optimizer_metadata(optimizer) -> dict:
    # dp_reshardable: the layout megatron-core's distributed optimizer can save on any device.
    return {"distrib_optim_sharding_type": "dp_reshardable"}


def save_checkpoint(save_dir: str, iteration: int, *, model, optimizer, train_state: dict, cfg,
                    keep_last: int, extra: dict | None = None) -> str:
    """Save atomically; returns the final directory. Collective: every rank calls it."""
    final = os.path.join(save_dir, iter_dir_name(iteration))
    tmp = final + ".tmp"
    rank = _rank()
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
        os.makedirs(os.path.join(tmp, "rng"))
        os.makedirs(os.path.join(tmp, "extra"))
        os.makedirs(os.path.join(tmp, "dist"))
    _barrier()
    _in_process_results_queue()
    dist_checkpointing.save(_sharded_state_dict(model, optimizer, is_loading=False), os.path.join(tmp, "dist"))
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{rank:05d}.pt"))
    if extra:
        torch.save(extra, os.path.join(tmp, "extra", f"rank_{rank:05d}.pt"))
    _barrier()
    if rank == 0:
        meta = {"format_version": FORMAT_VERSION, "iteration": iteration, **train_state,
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "config": to_dict(cfg), "files": _manifest(tmp)}
        with open(os.path.join(tmp, "meta.json.part"), "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(tmp, "meta.json.part"), os.path.join(tmp, "meta.json"))
        if os.path.isdir(final):  # re-saving the same iteration (e.g. exit right after a save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        with open(os.path.join(save_dir, "latest.part"), "w") as f:
            f.write(iter_dir_name(iteration))
        os.replace(os.path.join(save_dir, "latest.part"), os.path.join(save_dir, "latest"))
        _prune(save_dir, keep_last)
    _barrier()
    return final


def _in_process_results_queue() -> None:
    """Give megatron-core's checkpoint writer a plain in-process queue for its write results.

    `dist_checkpointing.save` is synchronous here: the writer's function runs in this process
    and puts its results into a queue that the same process reads back in the finalize step.
    megatron-core 0.16.1 nevertheless makes that queue a `multiprocessing` Manager's queue in
    a *spawned* server process (`filesystem_async._get_write_results_queue`, which its async
    saves need), once per process: a second Python interpreter per rank that re-imports the
    launch script, ~3 s on a 2-core CPU, at every run's first save. A `queue.Queue` is all a
    synchronous save needs. Set only while nothing else has made the queue."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _prune(save_dir: str, keep_last: int) -> None:
    done = sorted(d for d in os.listdir(save_dir) if _ITER_RE.match(d))
    for name in done[:-keep_last]:
        shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def _prepare_distributed_optimizers(optimizer) -> list:
    """megatron-core's DistributedOptimizer can only describe (and load) a state that exists:
    give a fresh one dummy states first. Returns the distributed optimizers found."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    found = [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if isinstance(o, DistributedOptimizer)]
    for opt in found:
        if not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()
    return found


def _restore_adam_steps(dist_opts, state: dict) -> None:
    """The dp_reshardable layout keeps AdamW's step only in param_groups; the dummy init left
    step = 1 in every per-parameter state, so put the saved step back."""
    groups = state.get("optimizer", {}).get("param_groups") or []
    step = next((g["step"] for g in groups if "step" in g), None)
    if step is None:
        return
    for opt in dist_opts:
        for st in opt.optimizer.state.values():
            if "step" in st:
                st["step"] = torch.tensor(float(step), dtype=st["step"].dtype, device=st["step"].device)


def _last_line(e: BaseException) -> str:
    """The innermost message of a (possibly multi-line, multi-rank) exception text."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[-1] if lines else repr(e))[:300]


def _distopt_switch_error(meta: dict, cfg, path: str) -> str | None:
    """megatron-core's AdamW keeps its state in one form with the distributed optimizer (flat
    per-DP-rank buckets, ``dp_reshardable``) and in another without it (per-parameter tensors),
    and reads neither form into the other: refuse the switch before a tensor is read, with the
    setting that resumes (the FP4 optimizers' own states are handled by resume_layout_error /
    reshard, which convert them)."""
    saved = _lookup(meta.get("config", {}), "parallel").get("use_distributed_optimizer")
    now = cfg.parallel.use_distributed_optimizer
    if cfg.optimizer.name != "adamw" or saved is None or bool(saved) == bool(now):
        return None
    return (f"checkpoint {path} was saved with parallel.use_distributed_optimizer={str(saved).lower()} "
            f"and this run has {str(now).lower()}: megatron-core's AdamW state is stored in another form "
            "for each and is not converted — resume with "
            f"parallel.use_distributed_optimizer={str(saved).lower()}")


@torch.no_grad()
def load_checkpoint(path: str, *, model, optimizer, cfg) -> dict:
    """Load model, optimizer and RNG from `path`; returns meta (iteration, consumed samples...)."""
    meta = check_complete(path)
    check_compatible(meta, cfg, path)
    from fullstack_fp4.integration.optimizers import resume_layout_error

    # Another TP size with layout-dependent FP4 state (LoRA-SVD factors, Q-AdamW's per-rank
    # object): converted at load through the layout-free form (reshard.py). Anything else the
    # FP4 optimizers cannot read directly is refused before a tensor is read.
    resharding = reshard.needs_reshard(meta, cfg)
    if resharding:
        why_not = reshard.unsupported_reason(meta, cfg, optimizer)
        if why_not:
            s = reshard.saved_layout(meta)
            raise CheckpointError(
                f"checkpoint {path} could not be read: it was saved at TP={s.tp} PP={s.pp}, this "
                f"run has TP={ps.get_tensor_model_parallel_world_size()} "
                f"PP={ps.get_pipeline_model_parallel_world_size()}, and {why_not} "
                "(docs/multi-gpu.md, Resharding) — resume with the saved layout")
    else:
        layout_error = resume_layout_error(meta, optimizer, path) or _distopt_switch_error(meta, cfg, path)
        if layout_error:
            raise CheckpointError(layout_error)
    rank = _rank()
    rng_file = os.path.join(path, "rng", f"rank_{rank:05d}.pt")
    try:
        if resharding:
            reshard.load_resharded(path, meta, model=model, optimizer=optimizer, cfg=cfg)
        else:
            dist_opts = _prepare_distributed_optimizers(optimizer)
            sharded = _sharded_state_dict(model, optimizer, is_loading=True)
            state = dist_checkpointing.load(sharded, os.path.join(path, "dist"))
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            _restore_adam_steps(dist_opts, state["optimizer"])
    except CheckpointError as e:
        if resharding and not str(e).startswith("checkpoint "):
            raise CheckpointError(f"checkpoint {path} could not be resharded: {e}") from None
        raise
    except (Exception, CheckpointException) as e:  # unreadable or missing shard: report, never continue
        # (torch.distributed.checkpoint's CheckpointException derives from BaseException)
        raise CheckpointError(f"checkpoint {path} could not be read ({type(e).__name__}): {_last_line(e)}; "
                              "was it saved with another parallel layout or optimizer?") from None
    same_world = meta.get("world_size") == (dist.get_world_size() if dist.is_initialized() else 1)
    if same_world and os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    extra_file = os.path.join(path, "extra", f"rank_{rank:05d}.pt")
    meta["extra"] = torch.load(extra_file, weights_only=False) if os.path.isfile(extra_file) else {}
    return meta
