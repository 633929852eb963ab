"""Continuing from a checkpoint: what may change, how a change must be stated, what is loaded.

**Full resume** (`checkpoint.load_mode: full`, the default) continues the saved run: model,
optimizer, RNG, data position, lr schedule. Before a tensor is read, the settings that say what
the run *is* — its lr schedule, its length, its batch, its data — are compared with the
checkpoint's (meta.json keeps the resolved config and the lr schedule's segments). A
difference the config does not state is refused with one `error:` line that names every key,
old → new, and what to add to continue. Stating it:

* `optimizer.lr`, `min_lr`, `schedule`, `warmup_iters`, `wsd_decay_fraction`, `weight_decay`:
  `checkpoint.override_scheduler=true`. From the resume iteration R the new schedule (by
  absolute iteration, as a fresh run with these settings), reached from the saved curve's lr at
  R in `optimizer.warmup_iters` equal steps (`override` in schedules.py; `warmup_iters: 0`
  switches at once); the new weight decay applies from R.
* `train.iters`, `optimizer.decay_iters` (the decay horizon): `train.continue_with: [extend]`
  (or `override_scheduler`). The rest of the saved decay is stretched to the new horizon
  (`extend` in schedules.py): no lr jump, and the run still ends at min_lr.
* `train.global_batch_size`: `train.continue_with: [new_batch_size]`. The schedule stays in
  optimizer steps; the data continue at the consumed sample count.
* `data.path`, `weights`, `split`, `valid_path`, `mock`, `reset_position_ids`,
  `reset_attention_mask`, `eod_mask_loss`, `model.seq_length`, `train.seed`:
  `train.continue_with: [new_data]`. The new data are read from the consumed sample count on.
* `fp4.bf16_from`, `fp4.linear_scale_rule` (x, w, dy), `fp4.unquantized_operands`:
  `train.continue_with: [new_precision]`. The FP4 numerics change from the resume iteration on
  (megatron/training/precision.py). A fractional `fp4.bf16_from` left as it was follows a new
  `train.iters` (f of the new length) without a statement; the resume reports where its switch
  moves, and when the checkpoint already ran in BF16 and the switch moves past it, that the
  steps up to the new switch run the FP4 recipes again.

The model shape, the FP4 recipes, the optimizer, `train.precision` (unless the checkpoint is
resharded at load) and the tokenizer (vocabulary size and file checksum) are checked by
`checkpointing.check_compatible` and cannot be overridden on a full resume. megatron-core's
`OptimizerParamScheduler` makes the same check (it saves max/min lr, warmup, decay steps and
style, and asserts they match unless told to override or to use the checkpoint's); this one
also covers the run's length, batch and data, and says how to go on.

A checkpoint already at or past `train.iters` is refused first (`nothing_to_train`): nothing
would be trained, and the run's config.yaml would be rewritten to describe a run that never
happened. The one exception is a complete run started again exactly as it was (a requeued job):
it trains nothing and exits 0, as Megatron-LM does. The refusal names a `train.iters` that trains
on from it, with the statements that length and the config's other changes need, checked by
planning that resume (so the advice is never one that fails next or trains nothing). A Trainer
that writes nothing (no save_dir, no logging.dir: a tool reading the checkpoint through this
path) may load it. The lines that report stated changes are printed once the checkpoint has
loaded (`check_resume` returns them), so a resume refused at load time is not announced first.

Why `extend` stretches the rest of the decay rather than keeping the saved horizon. Keeping
the horizon (what Megatron-LM does when `--lr-decay-iters` stays) does not jump either, but
every added step then runs at min_lr, and a run resumed mid-decay still ends its decay at the
old horizon: the added steps never get an annealing phase at their end, and a WSD run decays
at the old place instead of the end — WSD keeps its decay last precisely so that the stable
phase can be lengthened. Stretching keeps the lr at R equal to the saved curve's (no jump),
ends the run at min_lr at its new length as if it had been planned that long, and leaves the
steps before R as they were. A run resumed at or after its old horizon has no decay left to
stretch and stays at min_lr: the quickstart's hint (300 steps done, `train.iters=600
train.continue_with=extend`) trains on at min_lr, 3e-4. Going back up is a new schedule:
`checkpoint.override_scheduler=true` with the new settings ramps to it over warmup_iters.

Data position after `extend`: the run continues at its consumed sample count, but the
training set is rebuilt for `train.iters × global_batch_size` samples, and megatron-core's
sample order over more epochs can differ from the shorter run's after that count (samples
already seen may come again sooner than in a run planned that long from the start).

**Weights only** (`checkpoint.load_mode: weights_only`, with `checkpoint.load: <path>`):
fine-tuning, or starting from an imported Hugging Face model. The model weights come from the
checkpoint (megatron-core reshards them to this run's TP/PP layout); the optimizer state, the
iteration (0), the data position (0), the RNG (`train.seed`) and the lr schedule start fresh,
and none of the schedule or data settings above is compared. The model shape, the FP4 linear
recipe and the tokenizer must match (`optimizer.name` may differ). If `checkpoint.save_dir`
already holds a checkpoint — this fine-tune's own, from an earlier start — that one is
resumed in full instead, so a restarted fine-tune goes on rather than starting over (as
torchtitan's `initial_load_path` is only used when the run's folder has no checkpoint). The
fine-tune needs its own save_dir: the source checkpoint's directory is refused.

**wandb**: the run id is kept in the checkpoint; a resumed run logs into the same wandb run.
"""
from __future__ import annotations

import dataclasses
import json
import os

from megatron.training.config_schema import OptimizerConfig
from megatron.training.errors import CheckpointError, ConfigError
from megatron.training.schedules import LRSchedule, Setting

INTENTS = ("extend", "new_data", "new_batch_size", "new_precision")
LOAD_MODES = ("full", "weights_only")
SCHEDULE_KEYS = ("optimizer.lr", "optimizer.min_lr", "optimizer.schedule", "optimizer.warmup_iters",
                 "optimizer.wsd_decay_fraction", "optimizer.weight_decay")
HORIZON_KEYS = ("train.iters", "optimizer.decay_iters")
BATCH_KEYS = ("train.global_batch_size",)
DATA_KEYS = ("data.path", "data.weights", "data.split", "data.valid_path", "data.mock", "data.reset_position_ids",
             "data.reset_attention_mask", "data.eod_mask_loss", "model.seq_length", "train.seed")
PRECISION_KEYS = ("fp4.bf16_from", "fp4.linear_scale_rule.x", "fp4.linear_scale_rule.w", "fp4.linear_scale_rule.dy",
                  "fp4.unquantized_operands")
_MISSING = object()


# ------------------------------------------------------------------------- config rules
def check_config(cfg) -> None:
    """The continuation keys' own rules (called by config_validate)."""
    c, t = cfg.checkpoint, cfg.train
    if c.load_mode not in LOAD_MODES:
        raise ConfigError(f"checkpoint.load_mode must be one of {', '.join(LOAD_MODES)}; got '{c.load_mode}'")
    bad = [v for v in t.continue_with if v not in INTENTS]
    if bad or len(set(t.continue_with)) != len(t.continue_with):
        raise ConfigError(f"train.continue_with takes distinct values from {', '.join(INTENTS)}; "
                          f"got {t.continue_with}")
    if c.override_scheduler and "extend" in t.continue_with:
        raise ConfigError("checkpoint.override_scheduler=true and train.continue_with=extend both say how the "
                          "lr continues: override_scheduler takes the new schedule (ramped from the current lr), "
                          "extend stretches the saved decay; keep one")
    if c.load_mode == "weights_only" and c.load in ("auto", "none"):
        raise ConfigError("checkpoint.load_mode=weights_only needs checkpoint.load=<checkpoint directory> "
                          f"(the weights to start from); got checkpoint.load={c.load}")


# ------------------------------------------------------------------------- run state
@dataclasses.dataclass
class RunState:
    """What a run carries from checkpoint to checkpoint besides tensors: its lr schedule
    (segments, schedules.py) and its wandb run id."""
    schedule: LRSchedule
    wandb_run_id: str | None = None

    @classmethod
    def fresh(cls, cfg) -> "RunState":
        """A new run. Collective when wandb is on (rank 0's new run id goes to every rank)."""
        return cls(LRSchedule.fresh(cfg.optimizer, cfg.train.iters), _new_wandb_run_id(cfg))

    def lr(self, iteration: int) -> float:
        return self.schedule.lr(iteration)

    def record(self) -> dict:
        """The entries kept in meta.json."""
        rec = {"lr_schedule": self.schedule.to_record()}
        if self.wandb_run_id:
            rec["wandb_run_id"] = self.wandb_run_id
        return rec


def _new_wandb_run_id(cfg) -> str | None:
    lg = cfg.logging
    if not lg.wandb or lg.wandb_mode == "disabled":
        return None
    import uuid

    import torch.distributed as dist

    box = [uuid.uuid4().hex[:12]]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


# ------------------------------------------------------------------------- which checkpoint
def resolve_load(c) -> tuple[str | None, bool]:
    """(checkpoint to load, weights only?). Collective (checkpointing.resolve_for_run)."""
    from megatron.training import checkpointing

    fresh_ok = getattr(c, "allow_fresh_start", False)
    if c.load_mode != "weights_only":
        return checkpointing.resolve_for_run(c.load, c.save_dir, allow_fresh_start=fresh_ok), False
    if c.save_dir:
        source_dir = c.load if not os.path.isfile(os.path.join(c.load, "meta.json")) else os.path.dirname(
            os.path.abspath(c.load))
        if os.path.realpath(source_dir) == os.path.realpath(c.save_dir):
            raise CheckpointError(f"checkpoint.load_mode=weights_only: checkpoint.save_dir ({c.save_dir}) is the "
                                  f"directory of the checkpoint it starts from ({c.load}); give the new run its "
                                  "own checkpoint.save_dir")
        own = checkpointing.resolve_for_run("auto", c.save_dir, allow_fresh_start=fresh_ok)
        if own is not None:
            _print(f"[checkpoint] {c.save_dir} already holds this run's checkpoint {own}: resuming it in full "
                   f"(checkpoint.load_mode=weights_only applies to the first start only; {c.load} is not read)")
            return own, False
    return checkpointing.resolve_for_run(c.load, None, allow_fresh_start=False), True


def _print(msg: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


# ------------------------------------------------------------------------- full resume
def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


def _norm(key: str, v):
    """Values that mean the same compare equal: paths normalised, split as proportions."""
    if v is None or v is _MISSING:
        return v
    if key in ("data.path", "data.valid_path") and isinstance(v, list):
        return [os.path.normpath(str(p)) for p in v]
    if key == "data.split" and isinstance(v, str):
        try:
            nums = [float(x) for x in v.split(",")]
            total = sum(nums)
            return [x / total for x in nums] if total > 0 else v
        except ValueError:
            return v
    if key == "data.weights" and isinstance(v, list):
        total = sum(float(x) for x in v)
        return [float(x) / total for x in v] if total > 0 else v
    return v


def _fmt(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if v is None:
        return "null"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def changed_keys(saved_cfg: dict, now_cfg: dict, keys) -> list[tuple[str, object, object]]:
    """(key, old, new) for each key whose value differs; a key the checkpoint lacks is skipped."""
    out = []
    for key in keys:
        old, new = _get(saved_cfg, key), _get(now_cfg, key)
        if old is _MISSING or new is _MISSING:
            continue
        if key == "optimizer.wsd_decay_fraction" and "wsd" not in (_get(saved_cfg, "optimizer.schedule"),
                                                                   _get(now_cfg, "optimizer.schedule")):
            continue  # only the wsd schedule reads it
        if _norm(key, old) != _norm(key, new):
            out.append((key, old, new))
    return out


def saved_schedule(meta: dict, cfg) -> LRSchedule:
    """The lr schedule the checkpoint's run followed: its recorded segments, or (a checkpoint
    without them) the plain schedule of its config."""
    if meta.get("lr_schedule"):
        return LRSchedule.from_record(meta["lr_schedule"])
    saved = meta.get("config") or {}
    o, t = saved.get("optimizer"), saved.get("train")
    if not isinstance(o, dict) or not isinstance(t, dict) or "iters" not in t:
        return LRSchedule.fresh(cfg.optimizer, cfg.train.iters)
    known = {f.name for f in dataclasses.fields(OptimizerConfig)} - {"q_adamw", "orthogonal"}
    return LRSchedule.fresh(OptimizerConfig(**{k: v for k, v in o.items() if k in known}), int(t["iters"]))


def _unstated(meta: dict, cfg):
    """The changed keys by kind (schedule, horizon, batch, data, precision), whether
    checkpoint.override_scheduler=true is needed, and the train.continue_with values needed but
    not given."""
    from megatron.training.config_schema import to_dict

    saved_cfg, now_cfg = meta.get("config") or {}, to_dict(cfg)
    intents, override = set(cfg.train.continue_with), bool(cfg.checkpoint.override_scheduler)
    sched = changed_keys(saved_cfg, now_cfg, SCHEDULE_KEYS)
    horizon = changed_keys(saved_cfg, now_cfg, HORIZON_KEYS)
    batch = changed_keys(saved_cfg, now_cfg, BATCH_KEYS)
    data = changed_keys(saved_cfg, now_cfg, DATA_KEYS)
    prec = changed_keys(saved_cfg, now_cfg, PRECISION_KEYS)
    need_override = bool(sched) and not override   # override also covers a changed horizon
    need = set()
    if horizon and not override and not sched:
        need.add("extend")
    if batch:
        need.add("new_batch_size")
    if data:
        need.add("new_data")
    if prec:
        need.add("new_precision")
    return sched, horizon, batch, data, prec, need_override, need - intents


def _with(cfg, *, iters: int, continue_with: list[str], override: bool):
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, iters=iters, continue_with=list(continue_with)),
        checkpoint=dataclasses.replace(cfg.checkpoint, override_scheduler=override))


def train_on_overrides(meta: dict, cfg, path: str) -> list[str] | None:
    """For a checkpoint at or past this config's train.iters: the overrides that train on from
    it — a train.iters past its iteration (its own run's length if that run is unfinished, else
    twice its iteration, as the quickstart's hint) and the statements that this length and the
    config's other changes need. Checked by planning the resume with them; None if that fails
    (then no concrete command is suggested)."""
    r = int(meta.get("iteration", 0))
    saved_iters = _get(meta.get("config") or {}, "train.iters")
    targets = ([saved_iters] if isinstance(saved_iters, int) and saved_iters > r else []) + [max(2 * r, r + 1)]
    for target in targets:
        intents, override = list(cfg.train.continue_with), bool(cfg.checkpoint.override_scheduler)
        trial = _with(cfg, iters=target, continue_with=intents, override=override)
        *_, need_override, missing = _unstated(meta, trial)
        if need_override:   # a changed lr schedule: the new one from R (it covers the length too)
            override, intents = True, [v for v in intents if v != "extend"]
            trial = _with(cfg, iters=target, continue_with=intents, override=True)
            missing = _unstated(meta, trial)[-1]
        intents = [v for v in INTENTS if v in set(intents) | missing]
        trial = _with(cfg, iters=target, continue_with=intents, override=override)
        try:
            check_config(trial)
            plan_resume(meta, trial, path)
        except (CheckpointError, ConfigError):
            continue
        # every key of how this start continues, given or not: the list stands on its own
        return ([f"train.iters={target}"] + ([continue_with_override(intents)] if intents else [])
                + (["checkpoint.override_scheduler=true"] if override else []))
    return None


def nothing_to_train(meta: dict, cfg, path: str, *, train_on: str = "set {overrides}",
                     start_over: str = "give it its own checkpoint.save_dir and logging.dir (from scratch, or "
                                       "from this checkpoint's weights with checkpoint.load={path} "
                                       "checkpoint.load_mode=weights_only)") -> str | None:
    """The one-line refusal of a full resume from a checkpoint already at or past train.iters,
    with the ways out; None when there is something to train. Such a run would train nothing
    and only rewrite config.yaml and run_info.json in its directories, which would then no
    longer describe the newest checkpoint. A Trainer that writes nothing (checkpoint.save_dir
    and logging.dir unset) is a tool reading the checkpoint through the resume path
    (scripts/export_merged_checkpoint.py, the evaluation oracles): not refused. `train_on`
    (with `{overrides}`) and `start_over` say the ways out in the caller's terms
    (scripts/quickstart.py: its own command, `make clean-quickstart`)."""
    r = int(meta.get("iteration", 0))
    if cfg.train.iters > r or not (cfg.checkpoint.save_dir or cfg.logging.dir):
        return None
    saved_iters = _get(meta.get("config") or {}, "train.iters")
    sched, horizon, batch, data, prec, _, _ = _unstated(meta, cfg)
    if cfg.train.iters == r == saved_iters and not (sched or horizon or batch or data or prec):
        return None   # a complete run started again as it was (a requeued job): done, exit 0
    overrides = train_on_overrides(meta, cfg, path)
    run = ("" if not isinstance(saved_iters, int) else f" (its run was planned for {saved_iters} steps)"
           if saved_iters > r else " (its run is complete)")
    if overrides:
        how = train_on.replace("{overrides}", " ".join(overrides))
        if sched or batch or data or prec:
            how += f" (it also states this config's other changes: {_changes(sched + batch + data + prec)})"
    else:   # no single command plans cleanly (e.g. warmup past 2R): the rule, not a command
        how = (f"set train.iters above {r}, with train.continue_with=extend where it differs from the "
               "checkpoint's")
    return (f"checkpoint {path} is already at iteration {r}{run} and train.iters is {cfg.train.iters}: "
            f"nothing to train. To train on from it, {how}; to start a new run instead, "
            f"{start_over.replace('{path}', path)}")


def plan_resume(meta: dict, cfg, path: str) -> tuple[RunState, list[str]]:
    """The run state to continue with and the lines that report the stated changes; or one
    CheckpointError naming the unstated ones and how to state them. A checkpoint at or past
    train.iters is refused first (nothing_to_train): any statement advised for the other
    changes would then lead to a run that trains nothing."""
    r = int(meta.get("iteration", 0))
    done = nothing_to_train(meta, cfg, path)
    if done:
        raise CheckpointError(done)
    intents, override = set(cfg.train.continue_with), bool(cfg.checkpoint.override_scheduler)
    sched, horizon, batch, data, prec, need_override, missing = _unstated(meta, cfg)
    if need_override or missing:
        unstated = (sched + horizon if need_override else horizon if "extend" in missing else [])
        unstated += (batch if "new_batch_size" in missing else []) + (data if "new_data" in missing else [])
        unstated += prec if "new_precision" in missing else []
        keep = (intents | missing) - ({"extend"} if need_override else set())
        add, why = [], []
        if need_override:
            add.append("checkpoint.override_scheduler=true")
            why.append(f"the new lr schedule from iteration {r}, reached from the current lr over "
                       "optimizer.warmup_iters steps")
        if missing or keep != intents:
            add.append(continue_with_override([v for v in INTENTS if v in keep]))
            texts = {"extend": "extend: the rest of the lr decay stretched to the new train.iters, no lr jump",
                     "new_data": f"new_data: the new data read from sample {meta.get('consumed_samples', 0)} on",
                     "new_batch_size": "new_batch_size: the lr schedule stays in steps",
                     "new_precision": f"new_precision: the new FP4 numerics from iteration {r} on"}
            why += [texts[v] for v in INTENTS if v in missing]
        back = "; or put the old values back"
        saved_iters = _get(meta.get("config") or {}, "train.iters")
        if isinstance(saved_iters, int) and saved_iters <= r and any(k == "train.iters" for k, _, _ in unstated):
            # the old length trains nothing more: not a way to go on
            back = ("; or put the old values back but train.iters (its run is complete)"
                    if len(unstated) > 1 else "")
        raise CheckpointError(
            f"checkpoint {path} (iteration {r}) was trained with other settings: {_changes(unstated)}. To "
            f"continue it, set {' '.join(add)} ({'; '.join(why)}){back}; or start a new run from its weights "
            "with checkpoint.load_mode=weights_only and its own checkpoint.save_dir")

    schedule = saved_schedule(meta, cfg)
    new = Setting.from_config(cfg.optimizer, cfg.train.iters)
    lines = []
    if override and new != schedule.setting:
        before = schedule.lr(r)
        schedule = schedule.then(r, new, "override")
        how = (f"reached over {new.warmup_iters} steps (optimizer.warmup_iters)" if new.warmup_iters > 0
               else "at once (optimizer.warmup_iters=0)")
        lines.append(f"[checkpoint] checkpoint.override_scheduler=true: {_changes(sched + horizon)}; from iteration "
                     f"{r} the lr goes from {before:.4e} (the saved schedule's) to the new schedule ({new.at(r):.4e} "
                     f"there), {how}")
    elif horizon and new.decay_iters != schedule.setting.decay_iters:
        old = schedule.setting
        start = max(r, new.warmup_iters)
        if new.decay_iters <= start < old.decay_iters:
            raise CheckpointError(
                f"checkpoint {path} (iteration {r}): train.continue_with=extend needs a decay horizon after the "
                f"resume point; {_changes(horizon)} puts it at {new.decay_iters} — give train.iters (or "
                f"optimizer.decay_iters) > {start}")
        schedule = schedule.then(r, new, "extend")
        if old.decay_iters <= start:
            what = f"the saved decay ended at iteration {old.decay_iters}: the lr stays at {schedule.lr(r):.4e}"
        else:
            what = (f"the rest of the decay is stretched from iteration {start} to {new.decay_iters} "
                    f"(lr at {r}: {schedule.lr(r):.4e}, as saved)")
        lines.append(f"[checkpoint] train.continue_with=extend: {_changes(horizon)}; {what}")
    elif horizon:
        lines.append(f"[checkpoint] {_changes(horizon)}: the lr decay horizon (optimizer.decay_iters) is unchanged")
    if batch:
        lines.append(f"[checkpoint] train.continue_with=new_batch_size: {_changes(batch)}; the lr schedule stays in "
                     "optimizer steps")
    if data:
        lines.append(f"[checkpoint] train.continue_with=new_data: {_changes(data)}; read from sample "
                     f"{meta.get('consumed_samples', 0)} on")
    if prec:
        lines.append(f"[checkpoint] train.continue_with=new_precision: {_changes(prec)}; from iteration {r} on")
    moved = _switch_moved(meta, cfg, r)
    if moved:
        lines.append(moved)
    state = RunState(schedule, meta.get("wandb_run_id"))
    return state, lines


def _switch_moved(meta: dict, cfg, r: int) -> str | None:
    """The line reporting that a fractional fp4.bf16_from, unchanged, switches at another step
    because train.iters changed (None if it does not move)."""
    saved = meta.get("config") or {}
    f, saved_iters = _get(saved, "fp4.bf16_from"), _get(saved, "train.iters")
    if (not isinstance(f, float) or f != cfg.fp4.bf16_from or not isinstance(saved_iters, int)
            or saved_iters == cfg.train.iters):
        return None
    from megatron.training import precision

    old = precision.switch_step(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, iters=saved_iters)))
    new = precision.switch_step(cfg)
    if old == new:
        return None
    line = (f"[precision] fp4.bf16_from={f} follows train.iters {saved_iters} → {cfg.train.iters}: the switch to "
            f"BF16 moves from after step {old} to after step {new}")
    if old <= r < new:
        line += (f"; the checkpoint (iteration {r}) has run in BF16 since step {old + 1}, so steps {r + 1}..{new} "
                 f"run the FP4 recipes again (fp4.bf16_from={old} with train.continue_with=new_precision stays in BF16)")
    return line


def continue_with_override(values: list[str]) -> str:
    """The command-line override stating `values` (quoted when a shell would glob the brackets)."""
    if len(values) == 1:
        return f"train.continue_with={values[0]}"
    return f"'train.continue_with=[{','.join(values)}]'"


def _changes(items) -> str:
    return ", ".join(f"{k} {_fmt(a)} → {_fmt(b)}" for k, a, b in items)


def check_resume(path: str, cfg, fresh: RunState) -> tuple[RunState, list[str]]:
    """Compare checkpoint `path` with this run's config before any tensor is read (see the
    module docstring); returns the run state to continue with and the lines that report the
    stated changes, for the caller to print once the checkpoint has loaded (`print_notes`): a
    resume refused at load time is then not announced first. Every rank reads the same
    meta.json and takes the same decision."""
    from megatron.training import checkpointing

    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: meta.json is unreadable ({e})") from None
    checkpointing.check_compatible(meta, cfg, path)   # the shape errors come first
    state, lines = plan_resume(meta, cfg, path)
    if state.wandb_run_id is None:
        state.wandb_run_id = fresh.wandb_run_id
    return state, lines


def print_notes(lines: list[str]) -> None:
    """Print check_resume's lines (rank 0)."""
    for line in lines:
        _print(line)


# ------------------------------------------------------------------------- weights only
def _check_weights_compatible(meta: dict, cfg, path: str, tokenizer: dict | None) -> None:
    from megatron.training import checkpointing, reshard
    from megatron.training.config_schema import to_dict

    saved, now = meta.get("config") or {}, to_dict(cfg)
    tok = meta.get("tokenizer")
    # What must match is the parameter set: the model's shape, and which linears carry LoRA-SVD
    # factors. A fine-tune may take another optimizer (its state starts fresh) and another
    # precision where the parameters are the same (bf16 / nvfp4 linears, bf16 / q_attn).
    lora = "lora_svd" in (_get(saved, "fp4.linear"), _get(now, "fp4.linear"))
    diffs = []
    for section, keys in checkpointing.SHAPE_KEYS.items():
        if section == "optimizer" or (section.startswith("fp4") and not lora):
            continue
        for k in keys:
            if section == "fp4" and k == "attention":
                continue
            a, b = _get(saved, f"{section}.{k}"), _get(now, f"{section}.{k}")
            if a is _MISSING:
                continue
            a = checkpointing.effective_shape_value(section, k, a, tok)
            b = checkpointing.effective_shape_value(section, k, b, tokenizer)
            if a != b:
                diffs.append(f"{section}.{k}: checkpoint {_fmt(a)}, config {_fmt(b)}")
    if tok and tokenizer:
        for k in ("vocab_size", "crc32"):
            if tok.get(k) != tokenizer.get(k):
                diffs.append(f"tokenizer {k}: checkpoint {tok.get(k)!r}, this run {tokenizer.get(k)!r}")
    if diffs:
        raise CheckpointError(f"checkpoint {path} cannot start this run (checkpoint.load_mode=weights_only): "
                              + "; ".join(diffs))
    if cfg.fp4.linear == "lora_svd" and reshard.saved_layout(meta).tp != cfg.parallel.tensor_model_parallel_size:
        raise CheckpointError(f"checkpoint {path}: LoRA-SVD factors saved at TP={reshard.saved_layout(meta).tp} "
                              f"cannot start a TP={cfg.parallel.tensor_model_parallel_size} run weights-only; use "
                              "the saved TP size, or a merged dense checkpoint (scripts/export_merged_checkpoint.py)")


def load_weights(path: str, *, model, optimizer, cfg, tokenizer: dict | None = None) -> dict:
    """Load only the model weights of checkpoint `path` (any TP/PP layout megatron-core can
    reshard) and hand them to the optimizer's master copies; returns its meta.json."""
    import torch
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron.training import checkpointing

    meta = checkpointing.check_complete(path, content=False)   # contents: checked by resolve_for_run
    _check_weights_compatible(meta, cfg, path, tokenizer)
    try:
        with torch.no_grad():
            state = dist_checkpointing.load({"model": model.sharded_state_dict()}, os.path.join(path, "dist"))
            model.load_state_dict(state["model"])
    except (Exception, CheckpointException) as e:   # CheckpointException derives from BaseException
        raise CheckpointError(f"checkpoint {path}: its model weights could not be read ({type(e).__name__}: "
                              f"{checkpointing.exception_brief(e)})") from None
    # megatron-core's mixed-precision optimizers keep FP32 master copies made from the weights
    # they were built with: refresh them from the loaded ones (FP32 runs: a no-op)
    optimizer.reload_model_params()
    _print(f"[checkpoint] weights loaded from {path} (iteration {meta.get('iteration')} of that run); optimizer, "
           "data position and lr schedule start fresh at iteration 0 (checkpoint.load_mode=weights_only)")
    return meta
