"""Checkpoints: megatron-core `dist_checkpointing` for model and optimizer, plus our own state.

Layout of one checkpoint (`<save_dir>/iter_0000100/`):

    dist/                 model + optimizer, `dist_checkpointing` (torch_dist), resharding-capable
    rng/rank_00000.pt     this rank's RNG states
    extra/rank_00000.pt   recipe state that is not a tensor of the model/optimizer (if any)
    meta.json             iteration, consumed samples, resolved config, file manifest (last written)

Atomicity: everything is written to `iter_N.tmp/`, `meta.json` (with the size and CRC-32 of
every file, checkpoint_integrity.py) is written last, the directory is renamed to `iter_N/`, and
only then is `<save_dir>/latest` replaced (write-then-`os.replace`). A directory without
`meta.json`, or with a file whose size or checksum differs from the manifest, is not a
checkpoint: `load: auto` skips it with a warning; an explicit `load: <path>` to it is an error.
`load: auto` takes the newest complete checkpoint found by scanning `iter_N/` directories;
`latest` is written for people and tools but never followed (it could name a damaged, older or
foreign directory). With no loadable checkpoint in a save_dir that holds `iter_N/` directories
or `latest`, `load: auto` is an error unless `checkpoint.allow_fresh_start: true`. A save_dir is
used by one run at a time (save_lock.py).

Pruning (`keep_last`) removes only complete checkpoints, never a damaged directory, and never
the newest checkpoint older than the last applied optimizer step (the newest one the run knows
to be good: the step after it was applied), so a divergence can never leave only diverged
checkpoints. A damaged `iter_N/` the run reaches again is renamed `iter_N.damaged`, not deleted.

Loading checks the manifest and the model shape recorded in `meta.json` (and `train.precision`,
whose optimizer-state form the direct load cannot convert) against the config before touching
any tensor, so a damaged or incompatible checkpoint gives one `CheckpointError`
naming the problem. If reading a shard still fails, the error is raised at start-up: the run
exits and nothing trains on a partly loaded model; the checkpoint on disk is never modified.
A save that fails (a full disk: ENOSPC) removes its own `iter_N.tmp/` and raises one
`CheckpointError`; the checkpoints saved before are untouched.

Another parallel layout: megatron-core reshards the `ShardedTensor`s itself. State whose form
depends on the TP size (LoRA-SVD factors, Q-AdamW's per-rank 4-bit objects) is converted at
load by reshard.py when the TP size changed; what cannot be converted is refused in one line.
"""
from __future__ import annotations

import json
import os
import queue
import shutil

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.strategies import filesystem_async
from torch.distributed.checkpoint.api import CheckpointException

from megatron.training import checkpoint_integrity as integrity
from megatron.training import reshard
from megatron.training.config_schema import to_dict
from megatron.training.errors import CheckpointError

FORMAT_VERSION = 1
_ITER_RE = integrity.ITER_RE
# Config fields that change the shapes or meaning of saved tensors: must match on resume.
SHAPE_KEYS = {
    "model": ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "position_embedding", "make_vocab_size_divisible_by", "vocab_size"),
    "fp4": ("linear", "attention", "bf16_first_layers", "bf16_last_layers", "keep_bf16"),
    "fp4.lora_svd": ("rank", "beta"),
    "optimizer": ("name",),
}



def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


# Checkpoints whose checksums this process has computed (its own saves) or verified: pruning
# and re-saving need not read them again (realpaths; rank 0 only does either).
_VERIFIED: set[str] = set()


def check_complete(path: str, *, content: bool = True) -> dict:
    """Return meta.json of a complete checkpoint, or raise CheckpointError saying what is wrong.
    content=True also verifies every file's CRC-32 (reads the whole checkpoint, once per
    process: a verified checkpoint is remembered)."""
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
    if not isinstance(meta.get("files"), dict) or not isinstance(meta.get("checksums", {}), dict):
        raise CheckpointError(f"checkpoint {path}: meta.json has no file manifest")
    for rel, size in meta["files"].items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint {path} is damaged: file {rel} is missing")
        if os.path.getsize(full) != size:
            raise CheckpointError(f"checkpoint {path} is damaged: file {rel} has "
                                  f"{os.path.getsize(full)} bytes, expected {size} (truncated?)")
    if content and meta.get("checksums") and os.path.realpath(path) not in _VERIFIED:
        bad = integrity.first_mismatch(path, meta["checksums"])
        if bad:
            raise CheckpointError(f"checkpoint {path} is damaged: file {bad} does not match its "
                                  "checksum (its content changed after the save)")
        _VERIFIED.add(os.path.realpath(path))
    return meta


def find_latest(save_dir: str) -> str | None:
    """Newest complete checkpoint among save_dir's `iter_N/` directories, or None. The `latest`
    pointer is not followed: the newest complete checkpoint is the one to resume from, and a
    pointer could name an older, a damaged or another run's directory."""
    if not save_dir or not os.path.isdir(save_dir):
        return None
    for _, name in integrity.iteration_dirs(save_dir):
        path = os.path.join(save_dir, name)
        try:
            check_complete(path)
            return path
        except CheckpointError as e:
            print(f"[checkpoint] skipping {path}: {e}", flush=True)
    return None


def _holds_checkpoints(save_dir: str) -> bool:
    """Does save_dir hold what once was a checkpoint (`iter_N/` directories or `latest`)?"""
    return os.path.isdir(save_dir) and (bool(integrity.iteration_dirs(save_dir))
                                        or os.path.lexists(os.path.join(save_dir, "latest")))


def resolve_load_path(load: str, save_dir: str | None, *, allow_fresh_start: bool = False) -> str | None:
    if load == "none":
        return None
    if load == "auto":
        if not save_dir:
            return None
        found = find_latest(save_dir)
        if found is None and not allow_fresh_start and _holds_checkpoints(save_dir):
            raise CheckpointError(
                f"checkpoint.load=auto: {save_dir} holds checkpoints but none is loadable (see the "
                "lines above); nothing was changed on disk. Repair or move them, load one "
                "explicitly, or set checkpoint.allow_fresh_start=true to start from iteration 0")
        return found
    if os.path.isfile(os.path.join(load, "meta.json")):
        check_complete(load)
        return load
    if os.path.isdir(load):
        found = find_latest(load)
        if found is None:
            raise CheckpointError(f"checkpoint.load={load}: no complete checkpoint in that directory")
        return found
    raise CheckpointError(f"checkpoint.load={load}: no such checkpoint directory")


def resolve_for_run(load: str, save_dir: str | None, *, allow_fresh_start: bool) -> str | None:
    """resolve_load_path on global rank 0 only (it reads and checksums the whole checkpoint),
    its answer or error broadcast: every rank loads the same checkpoint or raises the same
    error. Collective."""
    verdict = [None, None]
    if _rank() == 0:
        try:
            verdict[0] = resolve_load_path(load, save_dir, allow_fresh_start=allow_fresh_start)
        except CheckpointError as e:
            verdict[1] = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[1]:
        raise CheckpointError(verdict[1])
    return verdict[0]


def _lookup(tree: dict, dotted: str) -> dict:
    for part in dotted.split("."):
        tree = tree.get(part, {}) if isinstance(tree, dict) else {}
    return tree


def effective_shape_value(section: str, key: str, value, tokenizer: dict | None):
    """The value a shape key stands for: `model.vocab_size` unset means the tokenizer's size
    (what the model is built with); an empty or absent `fp4.keep_bf16` is no pattern."""
    if (section, key) == ("model", "vocab_size") and value is None and tokenizer:
        return tokenizer.get("vocab_size")
    if (section, key) == ("fp4", "keep_bf16"):
        return list(value or [])
    return value


def _converted_at_load(meta: dict, cfg) -> bool:
    """Will load_checkpoint convert this checkpoint through the layout-free form
    (reshard.needs_reshard) instead of reading its optimizer state as saved? Outside a run
    (no parallel state) the answer is no: the direct load is the one checked."""
    return ps.model_parallel_is_initialized() and reshard.needs_reshard(meta, cfg)


def check_compatible(meta: dict, cfg, path: str, tokenizer: dict | None = None) -> None:
    """Refuse a checkpoint whose shapes, tokenizer or (on a direct load) train.precision differ
    from this run's. `tokenizer`: this
    run's {"vocab_size", "crc32"} (of the tokenizer file; None for mock data), compared with the
    one saved in meta.json when both exist."""
    saved = meta.get("config", {})
    now = to_dict(cfg)
    tok_saved, tok_now = meta.get("tokenizer"), tokenizer
    diffs = []
    for section, keys in SHAPE_KEYS.items():
        for k in keys:
            a = effective_shape_value(section, k, _lookup(saved, section).get(k), tok_saved)
            b = effective_shape_value(section, k, _lookup(now, section)[k], tok_now)
            if (section, k) == ("model", "vocab_size") and (a is None or b is None):
                continue   # a side sized by a tokenizer not known here: the tokenizer check decides
            if a != b:
                diffs.append(f"{section}.{k}: checkpoint {a!r}, config {b!r}")
    if tok_saved is not None and tok_now is not None:
        for k in ("vocab_size", "crc32"):
            if tok_saved.get(k) != tok_now.get(k):
                diffs.append(f"tokenizer {k}: checkpoint {tok_saved.get(k)!r}, this run {tok_now.get(k)!r}")
    hint = ""
    precision = _lookup(saved, "train").get("precision")
    if precision is not None and precision != cfg.train.precision and not _converted_at_load(meta, cfg):
        # The direct load reads the optimizer state in the form it was saved, and that form
        # depends on the precision: bf16 params come with megatron-core's FP32 master copies
        # (Float16OptimizerWithFloat16Params, or the distributed optimizer's bf16 buckets), fp32
        # params are their own masters (FP32Optimizer). Neither is read into the other (a
        # KeyError on optimizer.state.fp32_param..., or the FP4 optimizers' wrapper check), so
        # refuse before a tensor is read. A checkpoint resharded at load (reshard.py) goes through
        # FP32 masters, which either precision takes.
        diffs.append(f"train.precision: checkpoint {precision!r}, config {cfg.train.precision!r}")
        hint = (f" (a full resume keeps the optimizer state, whose form depends on train.precision: resume with "
                f"train.precision={precision}, or start a new run from its weights with checkpoint.load={path} "
                "checkpoint.load_mode=weights_only, which takes another precision, and its own checkpoint.save_dir)")
    if diffs:
        raise CheckpointError(f"checkpoint {path} does not match this config: " + "; ".join(diffs) + hint)


def tokenizer_identity(path: str, vocab_size: int) -> dict:
    """What check_compatible compares on resume: the vocabulary size and the CRC-32 of the
    tokenizer file (a directory's tokenizer.model or tokenizer.json)."""
    if os.path.isdir(path):
        path = next((os.path.join(path, n) for n in ("tokenizer.model", "tokenizer.json")
                     if os.path.isfile(os.path.join(path, n))), path)
    crc = integrity.crc32_file(path) if os.path.isfile(path) else None
    return {"vocab_size": int(vocab_size), "crc32": crc}


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
                    keep_last: int, extra: dict | None = None, protect_before: int | None = None) -> str:
    """Save atomically; returns the final directory. Collective: every rank calls it.
    protect_before: pruning keeps the newest complete checkpoint older than this iteration
    (the trainer passes its last applied step: see the module docstring)."""
    final = os.path.join(save_dir, iter_dir_name(iteration))
    tmp = final + ".tmp"
    rank = _rank()
    failure = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
            for sub in ("rng", "extra", "dist"):
                os.makedirs(os.path.join(tmp, sub))
        except OSError as e:
            failure = e
    _raise_if_any_failed(failure, tmp, final)
    _in_process_results_queue()
    try:
        dist_checkpointing.save(_sharded_state_dict(model, optimizer, is_loading=False), os.path.join(tmp, "dist"))
        torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{rank:05d}.pt"))
        if extra:
            torch.save(extra, os.path.join(tmp, "extra", f"rank_{rank:05d}.pt"))
    except (Exception, CheckpointException) as e:  # ENOSPC, EIO, quota: surfaces as OSError/RuntimeError
        failure = e
    _raise_if_any_failed(failure, tmp, final)
    checksums, failure = _shared_checksums(tmp)
    _raise_if_any_failed(failure, tmp, final)
    if rank == 0:
        try:
            sizes = {rel: os.path.getsize(os.path.join(tmp, rel)) for rel in checksums}
            meta = {"format_version": FORMAT_VERSION, "iteration": iteration, **train_state,
                    "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                    "config": to_dict(cfg), "files": sizes, "checksums": checksums}
            with open(os.path.join(tmp, "meta.json.part"), "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(os.path.join(tmp, "meta.json.part"), os.path.join(tmp, "meta.json"))
            _install(tmp, final)
        except OSError as e:
            failure = e
        if failure is None:   # the checkpoint is complete: what follows is bookkeeping
            try:
                with open(os.path.join(save_dir, "latest.part"), "w") as f:
                    f.write(iter_dir_name(iteration))
                os.replace(os.path.join(save_dir, "latest.part"), os.path.join(save_dir, "latest"))
                _prune(save_dir, keep_last, protect_before)
            except OSError as e:   # `latest` is never followed on load; pruning is retried next save
                print(f"[checkpoint] saved {final}, but could not update {save_dir}/latest or prune "
                      f"older checkpoints: {e}", flush=True)
    _raise_if_any_failed(failure, tmp, final)
    return final


def _shared_checksums(tmp: str) -> tuple[dict[str, str], BaseException | None]:
    """CRC-32 of every file of the save, each rank reading its share of rank 0's file list
    (one file in world_size); rank 0 gets them all. Collective."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    names = [integrity.list_files(tmp) if _rank() == 0 else None]
    if world > 1:
        dist.broadcast_object_list(names, src=0)
    try:
        mine, failure = integrity.checksums(tmp, names[0][_rank()::world]), None
    except OSError as e:
        mine, failure = {}, e
    if world == 1:
        return mine, failure
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    merged = {}
    for part in parts:
        merged.update(part)
    return merged, failure


def _raise_if_any_failed(failure, tmp: str, final: str) -> None:
    """Collective: if any rank's part of the save failed, rank 0 removes the partial `tmp`
    (our own half-written files, which could keep a full disk full) and every rank raises
    one CheckpointError; the checkpoints saved before are untouched."""
    flag = torch.tensor([1.0 if failure is not None else 0.0])
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        for part in (os.path.join(os.path.dirname(final), "latest.part"),):
            if os.path.isfile(part):
                os.remove(part)
    why = f"{type(failure).__name__}: {exception_brief(failure)}" if failure is not None else "failed on another rank"
    # a write error (ENOSPC, EIO, quota) is the disk's; anything else (e.g. megatron-core
    # refusing the state's sharding) is not, and the disk advice would send one astray
    inner = _rank_failure(failure) or failure
    fix = ("free disk space or change checkpoint.save_dir, then resume"
           if inner is None or isinstance(inner, OSError) else "resume from them once the cause is fixed")
    raise CheckpointError(f"could not save checkpoint {final} ({why}); the partial save was removed "
                          f"and the checkpoints saved before are untouched — {fix}")


def _install(tmp: str, final: str) -> None:
    """Rename the finished `tmp` to `final`. An existing `final` (the same iteration saved
    again, e.g. a resume that reached it anew) is replaced only after the new one is in
    place, and is deleted only if it was a complete checkpoint: a damaged one is moved to
    `iter_N.damaged` and kept."""
    if not os.path.isdir(final):
        os.replace(tmp, final)
        _VERIFIED.add(os.path.realpath(final))
        return
    try:
        check_complete(final)
        damaged = False
    except CheckpointError:
        damaged = True
    _VERIFIED.discard(os.path.realpath(final))
    old = integrity.move_aside(final, ".damaged" if damaged else ".old")
    os.replace(tmp, final)
    _VERIFIED.add(os.path.realpath(final))
    if damaged:
        print(f"[checkpoint] {final} was damaged: kept as {old}", flush=True)
    else:
        shutil.rmtree(old, ignore_errors=True)


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


def set_aside_diverged(save_dir: str | None, last_applied: int) -> str | None:
    """After a divergence: checkpoints holding the parameters of the last applied step or
    later (iteration >= last_applied; that step is the one after which every update was
    skipped, the likely destructive one) are renamed `iter_N.diverged` (kept for inspection,
    out of `load: auto`'s and pruning's way). Returns the newest complete checkpoint left
    (the one to resume from), or None. Collective: rank 0 renames, every rank gets the path."""
    answer = [None]
    if _rank() == 0 and save_dir and os.path.isdir(save_dir):
        for it, name in integrity.iteration_dirs(save_dir):
            if it >= last_applied:
                _VERIFIED.discard(os.path.realpath(os.path.join(save_dir, name)))
                moved = integrity.move_aside(os.path.join(save_dir, name), integrity.DIVERGED_SUFFIX)
                print(f"[guard] {os.path.join(save_dir, name)} holds diverged parameters: kept as {moved}",
                      flush=True)
        for _, name in integrity.iteration_dirs(save_dir):
            try:
                check_complete(os.path.join(save_dir, name), content=False)
                answer[0] = os.path.join(save_dir, name)
                break
            except CheckpointError:
                continue
        pointer = os.path.join(save_dir, "latest")
        if answer[0]:
            with open(pointer + ".part", "w") as f:
                f.write(os.path.basename(answer[0]))
            os.replace(pointer + ".part", pointer)
        elif os.path.isfile(pointer):
            os.remove(pointer)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(answer, src=0)
    return answer[0]


def _prune(save_dir: str, keep_last: int, protect_before: int | None = None) -> None:
    """Delete complete checkpoints beyond the newest `keep_last`, except the newest one older
    than `protect_before`. Damaged or incomplete directories are never deleted and not
    counted (checksums verified once per process: the run's own saves are verified by
    construction, an older run's checkpoints are read once)."""
    complete = []
    for it, name in integrity.iteration_dirs(save_dir):
        try:
            check_complete(os.path.join(save_dir, name))
            complete.append((it, name))
        except CheckpointError:
            pass
    keep = {name for _, name in complete[:keep_last]}
    if protect_before is not None:
        older = [name for it, name in complete if it < protect_before]
        keep.update(older[:1])
    for _, name in complete:
        if name not in keep:
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


def _rank_failure(e) -> BaseException | None:
    """The first failed rank's own exception inside torch.distributed.checkpoint's
    `CheckpointException` (``failures``: rank -> (exception, traceback)); None for any other."""
    failures = getattr(e, "failures", None) if isinstance(e, CheckpointException) else None
    inner = next(iter(failures.values()), None) if failures else None
    inner = inner[0] if isinstance(inner, tuple) else inner
    return inner if isinstance(inner, BaseException) else None


def exception_brief(e: BaseException, limit: int = 500) -> str:
    """One line saying what went wrong, for an ``error:`` line (the exception's type is the
    caller's to add). torch.distributed.checkpoint's `CheckpointException` (one traceback per
    failed rank) gives the first failed rank's own exception, ``Type: message``; any other
    text that carries a traceback gives its last line (the innermost error). Every other
    message keeps its head, where the message says what failed (megatron-core's
    ``Invalid access pattern for ShardedTensor(key=...)`` is followed by a multi-line tensor
    whose last line is only ``[[0]]], dtype=torch.int32)``): its lines joined, whitespace
    collapsed, cut after ``limit`` characters."""
    inner = _rank_failure(e)
    if inner is not None:
        return f"{type(inner).__name__}: {exception_brief(inner, limit)}"
    text = str(e)
    if "Traceback (most recent call last)" in text:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        text = lines[-1]
    text = " ".join(text.split()) or repr(e)
    return text if len(text) <= limit else text[:limit - 1] + "…"


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
def load_checkpoint(path: str, *, model, optimizer, cfg, tokenizer: dict | None = None,
                    verified: bool = False) -> dict:
    """Load model, optimizer and RNG from `path`; returns meta (iteration, consumed samples...).
    verified: the checksums were checked already (resolve_for_run), check sizes only."""
    meta = check_complete(path, content=not verified)
    check_compatible(meta, cfg, path, tokenizer)
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
        raise CheckpointError(f"checkpoint {path} could not be read ({type(e).__name__}): {exception_brief(e)}; "
                              "was it saved with another parallel layout or optimizer?") from None
    same_world = meta.get("world_size") == (dist.get_world_size() if dist.is_initialized() else 1)
    extra_file = os.path.join(path, "extra", f"rank_{rank:05d}.pt")
    reading = rng_file
    try:
        if same_world and os.path.isfile(rng_file):
            _set_rng_state(torch.load(rng_file, weights_only=False))
        reading = extra_file
        meta["extra"] = torch.load(extra_file, weights_only=False) if os.path.isfile(extra_file) else {}
    except Exception as e:  # unpickling garbage raises anything (UnpicklingError, UnicodeDecodeError, ...)
        raise CheckpointError(f"checkpoint {path} could not be read: {os.path.relpath(reading, path)} "
                              f"({type(e).__name__}: {exception_brief(e)})") from None
    return meta
