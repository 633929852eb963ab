"""`make quickstart`: prepare the small real corpus if missing, then train configs/quickstart.yaml.

A tiny Llama-style model (4 layers, width 128) on Shakespeare + Milton, a few hundred steps,
a few minutes on 2 CPU cores (or seconds on a GPU). It resumes if a previous quickstart left
a checkpoint, and ends by comparing the validation loss with the unigram entropy of the
held-out text: a model that learned nothing beyond token frequencies sits at that entropy.
Run again once complete, it trains nothing and prints its summary again; asked for fewer
steps than its checkpoint already has (after the 600-step hint, say), it stops at once with
one `error:` line that gives the command to train on and `make clean-quickstart` (deletes
runs/quickstart and data/quickstart) to start over. Any arguments are config overrides, passed on to
pretrain_gpt.py (e.g. `train.precision=bf16` on a GPU).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data", "quickstart")
RUN = os.path.join(ROOT, "runs", "quickstart")
RUN_TEXT = "runs/quickstart"
CONFIG = "configs/quickstart.yaml"
COMMAND = ".venv/bin/python scripts/quickstart.py"
# overrides that describe how one start continues the previous one, not the run itself: not
# carried into the command that trains on (a stale `checkpoint.load=none` would start over)
_PER_START = ("train.iters", "train.continue_with", "checkpoint.override_scheduler", "checkpoint.load",
              "checkpoint.load_mode", "checkpoint.allow_fresh_start")


def continue_overrides(done_iters: int) -> list[str]:
    """What the closing hint suggests: twice the steps, stated as a longer run (`extend`: the
    rest of the lr decay is stretched to the new length, no lr jump; a finished run stays at
    optimizer.min_lr; megatron/training/continuation.py). Without the statement the resume is
    refused, since train.iters differs from the checkpoint's."""
    return [f"train.iters={2 * done_iters}", "train.continue_with=extend"]


def _command(argv: list[str], overrides: list[str]) -> str:
    """The quickstart command with this start's own overrides (the run's settings, e.g.
    train.precision=bf16) and `overrides` in place of the per-start ones."""
    kept = [a for a in argv if a.split("=", 1)[0] not in _PER_START]
    return " ".join([COMMAND, *kept, *overrides])


def _is_the_quickstart_run(cfg) -> bool:
    """Is this start's checkpoint directory the one `make clean-quickstart` deletes?"""
    return bool(cfg.checkpoint.save_dir) and (os.path.realpath(os.path.join(ROOT, cfg.checkpoint.save_dir))
                                              == os.path.realpath(os.path.join(RUN, "checkpoints")))


def _config(argv: list[str]):
    """The resolved config of this start, or None if it does not load (pretrain_gpt.py then
    reports the problem in its own `error:` line)."""
    from megatron.training.config import load_config
    from megatron.training.errors import UserError

    try:
        return load_config(os.path.join(ROOT, CONFIG), argv)
    except UserError:
        return None


def _newest_checkpoint(save_dir: str | None) -> tuple[str, dict] | tuple[None, None]:
    """(path, meta.json) of the checkpoint `checkpoint.load: auto` resumes (checkpointing.find_latest:
    the newest complete one of save_dir), or (None, None)."""
    if not save_dir or not os.path.isdir(save_dir):
        return None, None
    from megatron.training import cpu_compat

    cpu_compat.import_megatron_core()
    from megatron.training import checkpointing

    path = checkpointing.find_latest(save_dir)
    return (path, checkpointing.check_complete(path)) if path else (None, None)


def refusal(argv: list[str]) -> str | None:
    """Why this start would train nothing (its checkpoint is already at or past train.iters:
    megatron/training/continuation.py's refusal, worded with the quickstart's commands), or None.
    Checked before anything runs or is written."""
    cfg = _config(argv)
    if cfg is None or cfg.checkpoint.load != "auto":
        return None
    path, meta = _newest_checkpoint(cfg.checkpoint.save_dir)
    if meta is None:
        return None
    if int(meta.get("iteration", 0)) < cfg.train.iters:
        return None
    # what pretrain_gpt.py would refuse first (another shape or precision), so that the command
    # advised below is one that then trains
    from megatron.training import checkpointing, continuation
    from megatron.training.errors import CheckpointError

    try:
        checkpointing.check_compatible(meta, cfg, path)
    except CheckpointError as e:
        return str(e)
    start_over = (f"run `make clean-quickstart` (it deletes {RUN_TEXT} and data/quickstart), then `make quickstart`"
                  if _is_the_quickstart_run(cfg) else "give it its own checkpoint.save_dir and logging.dir")
    return continuation.nothing_to_train(meta, cfg, path, train_on=f"run `{_command(argv, ['{overrides}'])}`",
                                         start_over=start_over)


def _call(cmd: list[str]) -> int:
    """subprocess.call, except on Ctrl-C: the child is in the same process group and gets the
    SIGINT itself (the trainer then saves a checkpoint and exits 0), so wait for it.
    subprocess.call would kill it 0.25 s later, in the middle of that save."""
    p = subprocess.Popen(cmd)
    while True:
        try:
            return p.wait()
        except KeyboardInterrupt:
            continue


def main(argv: list[str]) -> int:
    os.chdir(ROOT)
    why = refusal(argv)
    if why:
        print(f"error: {why}", file=sys.stderr, flush=True)
        return 2
    print("== 1/2 data: data/quickstart (corpus, tokenizer, indexed dataset)", flush=True)
    rc = _call([sys.executable, "scripts/prepare_quickstart_data.py", "--out", DATA])
    if rc != 0:
        print("error: data preparation failed (see above)", file=sys.stderr)
        return rc
    print(f"== 2/2 train: {CONFIG}", flush=True)
    rc = _call([sys.executable, "pretrain_gpt.py", "--config", CONFIG, *argv])
    if rc != 0:
        return rc
    summary(argv)
    return 0


def summary(argv: list[str]) -> None:
    """Where the results are, how the validation loss compares with the unigram entropy, and
    the command that goes on: the same one if the run stopped early (SIGTERM, exit_interval),
    else twice the steps stated as a longer run."""
    cfg = _config(argv)
    if cfg is None:
        return
    log_dir, save_dir = cfg.logging.dir, cfg.checkpoint.save_dir
    val, at = None, None
    metrics = os.path.join(log_dir, "metrics.jsonl") if log_dir else None
    if metrics and os.path.isfile(metrics):
        with open(metrics) as f:
            for line in f:
                rec = json.loads(line)
                if "val_loss" in rec:
                    val, at = rec["val_loss"], rec["iter"]
    if val is not None:
        with open(os.path.join(DATA, "stats.json")) as f:
            entropy = json.load(f)["valid_unigram_entropy_nats"]
        print(f"\nvalidation loss {val:.3f} nats/token at iteration {at} vs unigram entropy of the held-out text "
              f"{entropy:.3f} ({'below' if val < entropy else 'NOT below'} it by {entropy - val:.3f})")
    else:
        print("\nno validation loss yet (the run stopped before its first evaluation)")
    path, meta = _newest_checkpoint(save_dir)
    if meta is not None:
        done = int(meta["iteration"])
        if done >= cfg.train.iters:
            how = f"to train on from there: `{_command(argv, continue_overrides(done))}`"
        else:
            how = (f"stopped at iteration {done} of {cfg.train.iters}; to finish it: "
                   f"`{_command(argv, [f'train.iters={cfg.train.iters}'])}`")
        if _is_the_quickstart_run(cfg):
            how += "; to start over: `make clean-quickstart`"
        print(f"checkpoints:  {save_dir}  ({how})")
    if metrics:
        print(f"metrics:      {metrics}")
    if log_dir and cfg.logging.tensorboard:
        print(f"TensorBoard:  .venv/bin/tensorboard --logdir {os.path.join(log_dir, 'tensorboard')}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
