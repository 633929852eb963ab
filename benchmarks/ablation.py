#!/usr/bin/env python3
"""The recipe ablation: train every arm at one-GPU scale on the real corpus, evaluate, tabulate.

    python benchmarks/ablation.py [--arms bf16,q_adamw,...] [--iters 1000] [--out runs/ablation]
        [--data data/quickstart[,data/large]] [--seeds 1234[,4321,777]]
        [--family-lr muon=3.2e-2,root=4e-3[/MATRIX_LR]]
        [--time-budget SECONDS] [--dry] [--report-only] [--set key=value ...]

Every arm is `configs/ablation/base.yaml` (--config) + the arm's recipe switches (the same
ARMS table as benchmarks/bench_blocks.py and configs/3b_64b/), trained by `pretrain_gpt.py` in a
subprocess with the same data, data order, seed and token budget (train.iters = --iters), in
its own directory OUT/<arm>/ (metrics.jsonl, train.log, checkpoints/). Then:

- `--family-lr FAMILY=LR[/MATRIX_LR],...` trains each arm at its optimizer family's learning
  rate (the best point of benchmarks/lr_sweep.py): the family is read from the arm's
  `optimizer.name` (adamw, q_adamw -> adamw; muon, q_muon -> muon; root, q_root -> root), so an
  FP4 arm runs at its BF16 optimizer's lr (q_adamw and full_stack at adamw's, q_muon and
  full_stack_muon at muon's, q_root and full_stack_root at root's). LR sets `optimizer.lr` and
  `optimizer.min_lr` (the config's min/peak ratio kept); MATRIX_LR, for muon and root, the lr of
  the orthogonalised matrices (`optimizer.orthogonal.lr_scale = MATRIX_LR / LR`; without it
  the matrices take LR too). A family not listed keeps the config's lr, with a one-line note;
  without any --family-lr only Muon's and Root's arms get it (base.yaml's lr is AdamW's tuned
  one). `--family-lr-from
  OUT/lr_sweep.json` takes the value the sweep chose (its lr per family for every corpus);
- an arm whose newest complete checkpoint is at train.iters is complete and not run again;
- an interrupted arm (killed, SIGTERM, --time-budget) resumes from its newest checkpoint
  (checkpoint.load=auto): run the same command again; `--time-budget` sends the running arm
  SIGTERM when the budget is spent (it saves a checkpoint and exits) and starts no new arm;
- an arm whose recipe is not implemented in this release is listed as skipped, with the reason;
- `--jobs N` trains up to N arms at once: at this scale a step is host-bound, so arms side by
  side on one GPU keep most of their speed (with several GPUs visible, each new arm goes to the
  one running the fewest); their losses do not depend on it, their wall times do (the table
  says how many ran at once). An arm that runs out of GPU memory beside others is queued again
  and fewer run at once from then on (an arm of configs/ablation/base.yaml holds ~10.4 GiB of
  an H200, so 14 at once do not fit);
- `--max-restarts N` (as torchrun's): an arm stopped by a CUDA error (e.g. `unspecified launch
  failure`) resumes from its newest checkpoint, up to N times, each restart said in one line;
  any other failure is the arm's own and is not retried;
- a complete arm records that in OUT/<arm>/ablation_run.json, so its folder without
  `checkpoints/` (metrics.jsonl, eval.json, ablation_run.json) still counts as complete: arms
  trained on different machines or sessions are tabulated together by copying those folders
  into one --out and running `--report-only` (the table names the hardware each run recorded
  in its run_info.json, with counts where they differ);
- complete arms are evaluated by scripts/evaluate.py (held-out perplexity, cloze accuracy;
  one process for all of them; cached in OUT/<arm>/eval.json);
- OUT/ablation.md and OUT/ablation.json get the table (final train loss = mean of the last
  --last-k logged losses; validation loss at train.iters; its gap to the bf16 arm in %; held-out
  perplexity; cloze accuracy; tokens; wall time of the training subprocesses, summed over
  sessions), OUT/ablation.png all loss curves (needs matplotlib: `pip install -e .[plots]`).

Several corpora (`--data a,b`) or seeds (`--seeds 1234,4321,777`): every arm is trained on each
corpus at each seed (`train.seed`: the initial weights and the data order), all runs in one pool
of `--jobs`, each in OUT/<corpus>/s<seed>/<arm>/ (<corpus>: the data directory's name). Each
run's gap is taken to the bf16 run of its own corpus and seed (paired: the seed's share of the
loss cancels), and the table gives, per corpus and arm, the mean and sample standard deviation
over the seeds of the validation loss and of that gap, with the mean held-out perplexity and
cloze accuracy, and, where nvfp4_linear is an arm, each arm's mean gap as a share of
nvfp4_linear's (what a lever or LoRA-SVD leaves of it). Each arm's validation loss is also set
against that of the `--paired-with` arm (default nvfp4_linear) of the same corpus and seed: a
lever's effect without the BF16 run's seed-to-seed spread, which at the medium scale exceeds
NVFP4's gap (`--paired-with full_stack`: what the levers do to the full stack). An FP4 arm of Muon or Root (q_muon,
full_stack_muon, q_root, full_stack_root) is also compared, paired the same way, with its
optimizer's BF16 arm when that is an arm too (muon, root): the cost of its FP4 parts at the same
lr. OUT/ablation.json then holds the
per-run rows (with their corpus and seed) and the per-(corpus, arm) `summary`; OUT/ablation.png
the seed-mean validation curves per corpus.
"""
from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, REPO)

import warnings  # noqa: E402

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from bench_blocks import ARMS  # noqa: E402  (one table of arm switches for every script)

DEFAULT_ARMS = ["bf16", "nvfp4_linear", "lora_svd", "q_adamw", "muon", "q_muon", "root", "q_root",
                "q_attn", "full_stack", "full_stack_muon", "full_stack_root"]
PRETRAIN = os.path.join(REPO, "pretrain_gpt.py")
EVALUATE = os.path.join(REPO, "scripts", "evaluate.py")
FAMILY_OF = {"adamw": "adamw", "q_adamw": "adamw", "muon": "muon", "q_muon": "muon",
             "root": "root", "q_root": "root"}          # optimizer.name -> its family
ORTHOGONAL_FAMILIES = ("muon", "root")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma list from: {', '.join(ARMS)}")
    p.add_argument("--iters", type=int, default=1000, help="steps per arm (x 32,768 tokens with the base config)")
    p.add_argument("--out", default="runs/ablation")
    p.add_argument("--config", default=os.path.join(REPO, "configs", "ablation", "base.yaml"))
    p.add_argument("--data", default="data/quickstart",
                   help="dir with train/valid_text_document, tokenizer.model, corpus/heldout/; a comma "
                        "list: every arm on each corpus")
    p.add_argument("--seeds", default="", help="comma list of train.seed values, every arm at each "
                                              "(default: the config's seed, one run an arm)")
    p.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE", help="extra overrides for every arm")
    p.add_argument("--family-lr", default="", metavar="FAMILY=LR[/MATRIX_LR],...",
                   help="each arm at its optimizer family's lr (adamw | muon | root), e.g. "
                        "adamw=2e-3,muon=2e-3,root=4e-3/8e-3 (MATRIX_LR: the orthogonal groups')")
    p.add_argument("--family-lr-from", default="", metavar="LR_SWEEP_JSON",
                   help="--family-lr as chosen by benchmarks/lr_sweep.py (its OUT/lr_sweep.json)")
    p.add_argument("--nproc", type=int, default=1, help="GPUs per arm (torchrun when > 1)")
    p.add_argument("--jobs", type=int, default=1,
                   help="arms trained at the same time (small, host-bound models share a GPU; several "
                        "GPUs: spread over them); numbers unchanged, wall times then include the sharing")
    p.add_argument("--time-budget", type=float, default=0, help="seconds of training for this invocation (0: none)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="times an arm stopped by a CUDA error resumes from its newest checkpoint (default 0)")
    p.add_argument("--paired-with", default="nvfp4_linear", metavar="ARM",
                   help="the table's paired column: every other arm but bf16 against this arm's run of "
                        "the same corpus and seed (validation loss)")
    p.add_argument("--last-k", type=int, default=10, help="final train loss = mean of the last k logged losses")
    p.add_argument("--ppl-tokens", type=int, default=0, help="held-out tokens for perplexity (0: all)")
    p.add_argument("--cloze-items", type=int, default=500)
    p.add_argument("--no-eval", action="store_true", help="train only; the table shows no perplexity/cloze")
    p.add_argument("--dry", action="store_true", help="print the commands, run nothing")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: evaluate the complete arms found in --out and write the table "
                        "(e.g. after arms were trained side by side on several GPUs into one --out)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- per arm
def data_overrides(d: str) -> list[str]:
    return [f"data.path=[{d}/train_text_document]", f"data.valid_path=[{d}/valid_text_document]",
            'data.split="100,0,0"', f"data.tokenizer={d}/tokenizer.model", f"data.cache_dir={d}/cache"]


class UsageError(ValueError):
    """Bad command-line input: one `error:` line, exit 2."""


def parse_floats(text: str, what: str) -> list[float]:
    """A comma list of positive, finite, distinct numbers (a grid)."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        try:
            v = float(item)
        except ValueError:
            raise UsageError(f"{what}: {item!r} is not a number") from None
        if not 0 < v < float("inf"):
            raise UsageError(f"{what}: {item!r} must be a positive, finite number")
        out.append(v)
    if len(set(out)) != len(out):
        raise UsageError(f"{what} lists a value twice: {text}")
    return out


def parse_family_lr(text: str) -> dict[str, tuple[float, float | None]]:
    """``adamw=2e-3,root=4e-3/8e-3`` -> {family: (lr, matrix lr or None)}."""
    out = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        fam, sep, val = item.partition("=")
        if not sep or fam not in ("adamw",) + ORTHOGONAL_FAMILIES:
            raise UsageError(f"--family-lr: {item!r} is not FAMILY=LR with FAMILY one of adamw, muon, root")
        if fam in out:
            raise UsageError(f"--family-lr: {fam} given twice")
        lr, _, mlr = val.partition("/")
        if mlr and fam not in ORTHOGONAL_FAMILIES:
            raise UsageError(f"--family-lr: {item!r}: a matrix lr (/MATRIX_LR) is for muon and root only")
        (lr_v,) = parse_floats(lr, f"--family-lr {fam}")
        out[fam] = (lr_v, parse_floats(mlr, f"--family-lr {fam} matrix lr")[0] if mlr else None)
    return out


def family_lr_from(path: str) -> str:
    """The ``--family-lr`` value benchmarks/lr_sweep.py chose (``tuned.family_lr`` of its JSON)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--family-lr-from {path}: cannot read it as JSON ({e.__class__.__name__}: {e})") from None
    if not isinstance(doc, dict) or doc.get("table") != "lr_sweep":
        raise UsageError(f"--family-lr-from {path}: not the lr_sweep.json of benchmarks/lr_sweep.py")
    value = (doc.get("tuned") or {}).get("family_lr")
    if value is None:
        raise UsageError(f"--family-lr-from {path}: a sweep tabulated without its choice (an older "
                         "lr_sweep.py): run lr_sweep.py again with the same arguments and --report-only")
    if not value:
        raise UsageError(f"--family-lr-from {path}: the sweep chose no lr yet (no arm's grid is complete "
                         "on every corpus: see its lr_sweep.md)")
    return value


def parse_seeds(text: str, what: str) -> list[int]:
    """A comma list of distinct integer seeds (empty text: none)."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        try:
            out.append(int(item))
        except ValueError:
            raise UsageError(f"{what}: {item!r} is not an integer seed") from None
    if len(set(out)) != len(out):
        raise UsageError(f"{what} lists a seed twice")
    return out


DATA_FILES = ("train_text_document.bin", "valid_text_document.bin", "tokenizer.model")


def parse_corpora(text: str, check_files: bool = True) -> dict[str, str]:
    """{corpus name: data directory} of a comma list of data directories; the name is the
    directory's own (so two directories of one name are refused). ``check_files``: each must
    hold the token files and tokenizer that scripts/prepare_quickstart_data.py writes."""
    corpora = {}
    for d in (t.strip() for t in text.split(",") if t.strip()):
        missing = [f for f in DATA_FILES if not os.path.isfile(os.path.join(d, f))]
        if missing and check_files:
            raise UsageError(f"--data {d}: missing {', '.join(missing)} (scripts/prepare_quickstart_data.py)")
        name = os.path.basename(os.path.normpath(d))
        if name in corpora:
            raise UsageError(f"--data: two directories named {name!r}")
        corpora[name] = d
    if not corpora:
        raise UsageError("--data is empty")
    return corpora


class Run:
    """One training run of the ablation: an arm on a corpus at a seed (None: the config's).
    ``name`` is its directory under --out and its key everywhere else: the arm itself for one
    corpus at one seed, else <corpus>/s<seed>/<arm> (<corpus>/<arm> at the config's seed)."""

    def __init__(self, arm: str, corpus: str, data: str, seed: int | None, grid: bool):
        self.arm, self.corpus, self.data, self.seed = arm, corpus, data, seed
        self.name = (arm if not grid else
                     f"{corpus}/{arm}" if seed is None else f"{corpus}/s{seed}/{arm}")

    @property
    def group(self) -> tuple[str, int | None]:
        """Runs of one group share corpus and seed: their gaps are taken to the group's bf16."""
        return self.corpus, self.seed


def plan_runs(arms: list[str], corpora: dict[str, str], seeds: list[int]) -> list[Run]:
    """Every arm on every corpus at every seed, ordered corpus, seed, arm: the runs compared with
    each other (one corpus and seed) start one after another, so a spent --time-budget tends to
    leave whole groups unstarted rather than one arm of every group."""
    grid = len(corpora) > 1 or len(seeds) > 1
    return [Run(arm, corpus, data, seed, grid)
            for corpus, data in corpora.items() for seed in (seeds or [None]) for arm in arms]


def family_of(switches: list[str]) -> str:
    """The optimizer family of an arm's switches (the last `optimizer.name=` wins; adamw when none)."""
    name = "adamw"
    for s in switches:
        if s.startswith("optimizer.name="):
            name = s.split("=", 1)[1]
    return FAMILY_OF.get(name, name)


def lr_overrides(family: str, lr: float, matrix_lr: float | None, min_ratio: float) -> list[str]:
    """Overrides that train ``family`` at peak ``lr`` (min_lr at ``min_ratio`` of it) and, for an
    orthogonal family, its matrices at ``matrix_lr`` (default: ``lr``)."""
    out = [f"optimizer.lr={lr:.6g}", f"optimizer.min_lr={lr * min_ratio:.6g}"]
    if family in ORTHOGONAL_FAMILIES:
        out.append(f"optimizer.orthogonal.lr_scale={(matrix_lr or lr) / lr:.6g}")
    return out


def arm_switches(arm: str, args) -> list[str]:
    """The arm's recipe switches (``args.switches`` overrides ARMS: lr_sweep's named points) plus
    its family's lr from --family-lr."""
    own = getattr(args, "switches", None) or {}
    sw = list(own[arm]) if arm in own else list(ARMS[arm])
    fam_lr = getattr(args, "family_lrs", None) or {}
    fam = family_of(sw)
    if fam in fam_lr:
        sw += lr_overrides(fam, *fam_lr[fam], args.min_lr_ratio)
    return sw


def arm_data(arm: str, args) -> str:
    return (getattr(args, "data_of", None) or {}).get(arm, args.data)


def arm_overrides(arm: str, args) -> list[str]:
    rd = os.path.join(args.out, arm)
    return (data_overrides(arm_data(arm, args)) + arm_switches(arm, args) + list(args.set)
            + [f"train.iters={args.iters}", f"checkpoint.save_dir={rd}/checkpoints", f"logging.dir={rd}",
               "checkpoint.load=auto"])


def min_lr_ratio(config: str) -> float:
    """optimizer.min_lr / optimizer.lr of the base config (kept when the lr is moved)."""
    from megatron.training.config import load_config

    o = load_config(config, validate=False).optimizer
    return o.min_lr / o.lr


def train_cmd(arm: str, args) -> list[str]:
    tail = [PRETRAIN, "--config", args.config, *arm_overrides(arm, args)]
    if args.nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                str(args.nproc), *tail]
    return [sys.executable, *tail]


def checkpoint_state(save_dir: str) -> dict | None:
    """meta.json of the newest complete checkpoint in save_dir, or None."""
    from megatron.training.checkpointing import check_complete, find_latest

    path = find_latest(save_dir)
    return None if path is None else {**check_complete(path), "path": path}


def read_metrics(logdir: str) -> tuple[dict[int, float], dict[int, float]]:
    """(train loss by iter, val loss by iter); a resumed run re-logs some iterations: last wins."""
    train, val = {}, {}
    path = os.path.join(logdir, "metrics.jsonl")
    if not os.path.isfile(path):
        return train, val
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            if "val_loss" in rec:
                val[rec["iter"]] = rec["val_loss"]
            elif rec.get("loss") is not None:
                train[rec["iter"]] = rec["loss"]
    return train, val


def _state_path(args, arm):
    return os.path.join(args.out, arm, "ablation_run.json")


def load_state(args, arm) -> dict:
    try:
        with open(_state_path(args, arm)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"wall_s": 0.0, "sessions": []}


def save_state(args, arm, state) -> None:
    p = _state_path(args, arm)
    with open(p + ".tmp", "w") as f:
        json.dump(state, f, indent=1)
    os.replace(p + ".tmp", p)


class ArmRun:
    """One arm's training subprocess: started at once, polled, stopped by SIGTERM on a budget.

    Several can run side by side (``--jobs``): at the ablation's scale a step is host-bound
    (Python and kernel launches), so arms sharing one GPU each keep most of their own speed.
    Their numbers do not depend on it (same data, seed, kernels); their wall times do, so the
    table says how many ran at once."""

    def __init__(self, arm: str, args, gpu: str | None = None):
        self.arm, self.args, self.gpu = arm, args, gpu
        self.rd = os.path.join(args.out, arm)
        os.makedirs(self.rd, exist_ok=True)
        cmd = train_cmd(arm, args)
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        self.t0 = time.time()
        self.log = open(os.path.join(self.rd, "train.log"), "a")
        self.log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n")
        self.log.flush()
        self.log_start = self.log.tell()     # where this session's output begins
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.stopped_at = None
        self.rc = None
        self.peers = 1       # the most arms training at once while this one ran (itself included)

    def poll(self) -> bool:
        """True once the subprocess has exited (a stopped one that ignores SIGTERM for 600 s is
        killed)."""
        if self.rc is None:
            self.rc = self.proc.poll()
            if self.rc is None and self.stopped_at is not None and time.time() - self.stopped_at > 600:
                self.proc.kill()
                self.rc = self.proc.wait()
        return self.rc is not None

    def stop(self) -> None:
        if self.stopped_at is None and self.rc is None:
            print(f"[ablation] {self.arm}: time budget spent, SIGTERM (the run saves a checkpoint)", flush=True)
            self.proc.send_signal(signal.SIGTERM)
            self.stopped_at = time.time()

    def session_log(self) -> str:
        """What this session's subprocess wrote to the arm's train.log."""
        try:
            with open(os.path.join(self.rd, "train.log"), "rb") as f:
                f.seek(self.log_start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def out_of_memory(self) -> bool:
        """Whether this session ended in a CUDA allocation failure."""
        text = self.session_log()
        return any(m in text for m in OOM_MARKERS)

    def cuda_error(self) -> str | None:
        """The first CUDA error this session's log reports (``CUDA error: ...``), or None."""
        m = re.search(r"CUDA error: [^\n]*", self.session_log())
        return m.group(0).strip() if m else None

    def finish(self) -> str:
        """Record the session; 'complete', 'interrupted' or 'failed: ...'."""
        self.log.close()
        wall = time.time() - self.t0
        state = load_state(self.args, self.arm)
        state["wall_s"] += wall
        state["sessions"].append({"start": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.t0)),
                                  "wall_s": wall, "rc": self.rc, "stopped_by_budget": self.stopped_at is not None,
                                  "jobs": self.peers})
        meta = checkpoint_state(os.path.join(self.rd, "checkpoints"))
        done = bool(meta and meta["iteration"] >= self.args.iters)
        if done:
            # what the table needs once the checkpoint is gone (results copied elsewhere)
            state["completed"] = {"iteration": meta["iteration"], "train_iters": self.args.iters}
        save_state(self.args, self.arm, state)
        if done:
            return "complete"
        if self.rc == 0 or self.stopped_at is not None:
            return "interrupted"
        return f"failed: exit code {self.rc}, see {os.path.join(self.rd, 'train.log')}"


# what a run that could not get GPU memory leaves in its log: PyTorch's allocator, and NCCL's
# own allocations (its error when the card is full while it sets up a collective)
OOM_MARKERS = ("CUDA out of memory", "OutOfMemoryError", "Failed to CUDA calloc")


def visible_gpus() -> list[str]:
    """The GPUs the arms may use, as CUDA_VISIBLE_DEVICES entries (that variable's own list when
    set, else 0..n-1); empty without CUDA."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return listed[:n] if listed else [str(i) for i in range(n)]


def pick_gpu(gpus: list[str], busy: list[str | None]) -> str | None:
    """The GPU running the fewest arms (the first such), or None (no GPU, or one: leave the
    environment alone)."""
    if len(gpus) < 2:
        return None
    return min(gpus, key=lambda g: busy.count(g))


def run_arms(todo: list[tuple[str, dict | None]], args, deadline: float | None, status: dict,
             more=None) -> None:
    """Train the arms in ``todo`` (``(arm, its checkpoint meta or None)``, in order), at most
    ``args.jobs`` at a time, until each is complete, interrupted or failed, or the time budget
    is spent (running arms get SIGTERM and save a checkpoint; arms not started yet are not
    run). Fills ``status``. With several GPUs visible, each new arm goes to the GPU running the
    fewest (CUDA_VISIBLE_DEVICES). ``more(arm)``, if given, is called when an arm ends and
    returns further ``(arm, meta)`` to train (lr_sweep.py: a point's extra seeds once its
    grid is done), queued behind the others.

    An arm that fails for want of GPU memory while others ran beside it is not a failed arm but
    too many at once: it goes back to the front of the queue, and from then on at most as many
    arms run at once as were left running when it failed (printed once per lowering). Alone on
    its GPU, such a failure is the arm's own. An arm stopped by a CUDA error is queued again, from
    its newest checkpoint, up to ``args.max_restarts`` times."""
    pending, running = list(todo), []
    restarts: dict[str, int] = {}
    jobs = args.jobs
    gpus = visible_gpus() if args.jobs > 1 and todo else []   # several GPUs: spread the arms
    while pending or running:
        budget_spent = deadline is not None and time.time() >= deadline
        while pending and len(running) < jobs and not budget_spent:
            arm, meta = pending.pop(0)
            what = f"resuming at step {meta['iteration']}" if meta else "starting"
            print(f"[ablation] {arm}: {what} -> {args.iters} steps", flush=True)
            running.append(ArmRun(arm, args, pick_gpu(gpus, [r.gpu for r in running])))
        for r in running:
            r.peers = max(r.peers, len(running))
        if budget_spent:
            for r in running:
                r.stop()
            for arm, meta in pending:
                status[arm] = "not run: time budget spent" + (f" (at step {meta['iteration']})" if meta else "")
                print(f"[ablation] {arm}: {status[arm]}", flush=True)
            pending = []
        for r in [r for r in running if r.poll()]:
            running.remove(r)
            st = r.finish()
            ckpt = os.path.join(args.out, r.arm, "checkpoints")
            retriable = st.startswith("failed") and not budget_spent
            oom = retriable and r.out_of_memory()
            if oom and r.peers > 1:
                jobs = max(1, min(jobs, len(running)))
                print(f"[ablation] {r.arm}: out of GPU memory beside {r.peers - 1} other run(s); "
                      f"queued again, at most {jobs} at once from now on", flush=True)
                pending.insert(0, (r.arm, checkpoint_state(ckpt)))
                continue
            fault = r.cuda_error() if retriable and not oom else None
            if fault and restarts.get(r.arm, 0) < args.max_restarts:
                restarts[r.arm] = restarts.get(r.arm, 0) + 1
                meta = checkpoint_state(ckpt)
                print(f"[ablation] {r.arm}: stopped by {fault}; restart {restarts[r.arm]} of "
                      f"{args.max_restarts}, from step {meta['iteration'] if meta else 0}", flush=True)
                pending.insert(0, (r.arm, meta))
                continue
            if st == "interrupted":
                m = checkpoint_state(ckpt)
                st = f"interrupted at step {m['iteration'] if m else 0}: run again to resume"
            status[r.arm] = st
            print(f"[ablation] {r.arm}: {st}", flush=True)
            if more is not None:
                pending += more(r.arm)
        if running:
            time.sleep(0.5)


def kept_result(args, arm) -> bool:
    """An arm completed at --iters whose checkpoint is not here (the results were copied on
    without it: metrics.jsonl, eval.json, ablation_run.json): the table can still use it."""
    done = load_state(args, arm).get("completed") or {}
    return done.get("train_iters") == args.iters and done.get("iteration", 0) >= args.iters


def evaluate_arms(arms: list[str], args) -> dict[str, dict]:
    """Evaluate complete arms whose OUT/<arm>/eval.json is missing or stale; returns all results."""
    results, todo = {}, []
    for arm in arms:
        path = os.path.join(args.out, arm, "eval.json")
        try:
            with open(path) as f:
                res = json.load(f)
            if (res.get("iteration") == args.iters and res.get("ppl_tokens_arg") == args.ppl_tokens
                    and res["cloze"]["items"] <= args.cloze_items):
                results[arm] = res
                continue
        except (OSError, ValueError, KeyError):
            pass
        todo.append(arm)
    if not todo:
        return results
    tmp = os.path.join(args.out, "eval_batch.json")
    cmd = [sys.executable, EVALUATE, "--data", args.data, "--out", tmp, "--ppl-tokens", str(args.ppl_tokens),
           "--cloze-items", str(args.cloze_items)]
    for arm in todo:
        cmd += ["--checkpoint", f"{arm}={os.path.join(args.out, arm, 'checkpoints')}"]
    print(f"[ablation] evaluating {', '.join(todo)}: {shlex.join(cmd)}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    with open(os.path.join(args.out, "eval.log"), "a") as f:
        f.write(p.stderr)
    if p.returncode != 0:
        print(f"[ablation] evaluation failed (exit {p.returncode}): {p.stderr.strip().splitlines()[-1:]}", flush=True)
        return results
    with open(tmp) as f:
        batch = json.load(f)
    for arm, res in batch["results"].items():
        res = {**res, "ppl_tokens_arg": args.ppl_tokens, "eval_meta": batch["meta"]}
        with open(os.path.join(args.out, arm, "eval.json"), "w") as f:
            json.dump(res, f, indent=1)
        results[arm] = res
    os.remove(tmp)
    return results


# ----------------------------------------------------------------------------- table
def summarize(runs: list[Run], status: dict, evals: dict, args, cfgs: dict) -> list[dict]:
    """One row a run; its gaps are to the bf16 run of its group (same corpus and seed)."""
    rows = []
    for run in runs:
        name, cfg = run.name, cfgs.get(run.name)
        tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length if cfg else 0
        rd = os.path.join(args.out, name)
        train, val = read_metrics(rd)
        last = [train[i] for i in sorted(train) if i <= args.iters][-args.last_k:]
        ev = evals.get(name, {})
        state = load_state(args, name) if os.path.isdir(rd) else None
        done = status[name] == "complete"
        rows.append({
            "arm": run.arm, "run": name, "corpus": run.corpus,
            "seed": run.seed if run.seed is not None else (cfg.train.seed if cfg else None),
            "status": status[name], "overrides": arm_switches(name, args),
            "final_train_loss": sum(last) / len(last) if last and done else None,
            "train_loss_points": len(last),
            "val_loss": val.get(args.iters) if done else None,
            "best_val_loss": min((v for i, v in val.items() if i <= args.iters), default=None),
            "heldout_perplexity": ev.get("heldout", {}).get("perplexity"),
            "heldout_tokens": ev.get("heldout", {}).get("tokens"),
            "cloze_greedy_accuracy": ev.get("cloze", {}).get("greedy_accuracy"),
            "cloze_choice_accuracy": ev.get("cloze", {}).get("choice_accuracy"),
            "cloze_items": ev.get("cloze", {}).get("items"),
            "tokens": args.iters * tokens_per_step if done else None,
            "wall_s": state["wall_s"] if state else None,
            # the most arms that shared the device with this one in any of its sessions
            "jobs": max((s.get("jobs", 1) for s in state["sessions"]), default=1) if state else 1,
            "curve": {"train": sorted(train.items()), "val": sorted(val.items())},
        })
    by_group = {(run.corpus, run.seed, run.arm): r for run, r in zip(runs, rows)}
    for run, r in zip(runs, rows):
        b = by_group.get((*run.group, "bf16"))
        r["val_gap_pct"] = _pct_over(r, b, "val_loss")
        r["train_gap_pct"] = _pct_over(r, b, "final_train_loss")
        # An FP4 arm of an orthogonal optimizer against that optimizer in BF16 (q_muon and
        # full_stack_muon against muon, same lr, corpus and seed): the cost of its FP4 parts alone.
        peer = optimizer_peer(run.arm, r["overrides"])
        r["optimizer_peer"] = peer
        r["val_gap_vs_optimizer_pct"] = _pct_over(r, by_group.get((*run.group, peer)) if peer else None)
        # Every other arm against the --paired-with arm (nvfp4_linear) of its group: a lever's
        # effect paired by seed, free of the BF16 run's own seed-to-seed spread (which can exceed
        # the gap itself).
        n = by_group.get((*run.group, args.paired_with)) if run.arm not in ("bf16", args.paired_with) else None
        r["val_vs_paired_pct"] = _pct_over(r, n)
    return rows


def _pct_over(r: dict, ref: dict | None, key: str = "val_loss") -> float | None:
    """100 (r − ref) / ref of ``key``; None without a reference run or when either lacks the value."""
    ok = ref is not None and ref[key] is not None and r[key] is not None
    return 100.0 * (r[key] - ref[key]) / ref[key] if ok else None


def optimizer_peer(arm: str, switches: list[str]) -> str | None:
    """The BF16 arm of ``arm``'s orthogonal optimizer family (``muon``, ``root``), when ``arm`` is
    another arm of that family; None for the AdamW family, whose BF16 arm is the baseline."""
    fam = family_of(switches)
    return fam if fam in ORTHOGONAL_FAMILIES and fam in ARMS and arm != fam else None


def _mean_std(values: list) -> tuple[float | None, float | None]:
    v = [x for x in values if x is not None]
    return (statistics.fmean(v) if v else None, statistics.stdev(v) if len(v) > 1 else None)


def aggregate(rows: list[dict]) -> list[dict]:
    """Per (corpus, arm): mean and sample standard deviation over its complete seeds of the
    validation loss and of the paired gap to bf16, the per-seed gaps, and the seed means of the
    other columns."""
    out = []
    for corpus in dict.fromkeys(r["corpus"] for r in rows):
        for arm in dict.fromkeys(r["arm"] for r in rows if r["corpus"] == corpus):
            all_runs = [r for r in rows if (r["corpus"], r["arm"]) == (corpus, arm)]
            mine = [r for r in all_runs if r["status"] == "complete"]
            val_m, val_s = _mean_std([r["val_loss"] for r in mine])
            gap_m, gap_s = _mean_std([r["val_gap_pct"] for r in mine])
            peer_m, peer_s = _mean_std([r.get("val_gap_vs_optimizer_pct") for r in mine])
            nv_m, nv_s = _mean_std([r.get("val_vs_paired_pct") for r in mine])
            out.append({
                "corpus": corpus, "arm": arm, "runs": len(all_runs), "complete": len(mine),
                "seeds": [r["seed"] for r in mine],
                "val_loss_mean": val_m, "val_loss_std": val_s,
                "val_gap_pct_mean": gap_m, "val_gap_pct_std": gap_s,
                "val_gap_pct_by_seed": {str(r["seed"]): r["val_gap_pct"] for r in mine
                                        if r["val_gap_pct"] is not None},
                "optimizer_peer": next((r.get("optimizer_peer") for r in all_runs), None),
                "val_gap_vs_optimizer_pct_mean": peer_m, "val_gap_vs_optimizer_pct_std": peer_s,
                "val_vs_paired_pct_mean": nv_m, "val_vs_paired_pct_std": nv_s,
                "val_vs_paired_pct_by_seed": {str(r["seed"]): r["val_vs_paired_pct"] for r in mine
                                              if r.get("val_vs_paired_pct") is not None},
                "final_train_loss_mean": _mean_std([r["final_train_loss"] for r in mine])[0],
                "heldout_perplexity_mean": _mean_std([r["heldout_perplexity"] for r in mine])[0],
                "cloze_greedy_accuracy_mean": _mean_std([r["cloze_greedy_accuracy"] for r in mine])[0],
                "cloze_choice_accuracy_mean": _mean_std([r["cloze_choice_accuracy"] for r in mine])[0],
                "tokens": next((r["tokens"] for r in mine), None),
                "wall_s_mean": _mean_std([r["wall_s"] for r in mine])[0],
                "jobs": max((r["jobs"] for r in mine), default=1),
            })
    # An arm's gap as a share of the plain NVFP4 linear's on the same corpus (ratio of the seed
    # means): what a lever or LoRA-SVD leaves of NVFP4's gap (the paper's LoRA-SVD: 0.61/1.40).
    nv = {a["corpus"]: a["val_gap_pct_mean"] for a in out if a["arm"] == "nvfp4_linear"}
    for a in out:
        ref = nv.get(a["corpus"])
        ok = ref and a["val_gap_pct_mean"] is not None and a["arm"] != "bf16"
        a["share_of_nvfp4_gap"] = a["val_gap_pct_mean"] / ref if ok else None
    return out


def _f(x, fmt):
    return "—" if x is None else format(x, fmt)


def _family_lr_note(header: dict) -> str:
    return f" (lr per optimizer family: {header['family_lr']})" if header.get("family_lr") else ""


def markdown(rows: list[dict], args, header: dict) -> str:
    lines = [f"Ablation: {header['model']}; {header['tokens_per_step']:,} tokens/step x {args.iters} steps "
             f"= {args.iters * header['tokens_per_step'] / 1e6:.1f}M tokens per arm "
             f"({header['epochs']:.1f} epochs of {header['train_tokens'] / 1e6:.2f}M training tokens); "
             f"data `{args.data}`; seed {header['seed']}.",
             f"Device: {header['device']}; commit {header['git_commit'][:10]}; {header['date']}; "
             f"command `{header['command']}`{_family_lr_note(header)}.",
             f"Final train loss: mean of the last {args.last_k} logged losses; gap: (arm − bf16) / bf16 of "
             "the validation loss; cloze: greedy = the greedy continuation reproduces the word, "
             "k-way = the word outscores the other candidates (scripts/evaluate.py).", "",
             "| arm | final train loss | val loss | gap vs bf16 (val) | held-out ppl | cloze acc (greedy) | "
             "cloze acc (k-way) | tokens | wall time |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "complete":
            lines.append(f"| {r['arm']} | {r['status']} |" + " |" * 7)
            continue
        gap = "0 (baseline)" if r["arm"] == "bf16" else (_f(r["val_gap_pct"], "+.2f") + "%"
                                                        if r["val_gap_pct"] is not None else "—")
        wall = "—" if r["wall_s"] is None else f"{r['wall_s'] / 60:.1f} min"
        if r["wall_s"] is not None and r["jobs"] > 1:
            wall += f" ({r['jobs']} arms at once)"
        lines.append(f"| {r['arm']} | {_f(r['final_train_loss'], '.4f')} | {_f(r['val_loss'], '.4f')} | {gap} | "
                     f"{_f(r['heldout_perplexity'], '.2f')} | {_f(r['cloze_greedy_accuracy'], '.3f')} | "
                     f"{_f(r['cloze_choice_accuracy'], '.3f')} | {r['tokens'] / 1e6:.1f}M | {wall} |")
    return "\n".join(lines) + "\n"


def pyplot(missing: str):
    """matplotlib.pyplot on the Agg backend, or None (after printing ``missing``) without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(missing, flush=True)
        return None
    return plt


def save_figure(plt, fig, title: str, path: str) -> bool:
    """Title, tight layout, ``path`` at 120 dpi, figure closed; True (the plot functions' result)."""
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _pm(m, sd, fmt, unit=""):
    if m is None:
        return "—"
    return format(m, fmt) + unit + ("" if sd is None else " ± " + format(sd, fmt.lstrip("+")) + unit)


def _by_seed(pcts: dict) -> str:
    return ", ".join(f"{g:+.2f}" for g in pcts.values())


def markdown_grid(summary: list[dict], args, header: dict) -> str:
    """The several-corpora / several-seeds table: a section per corpus, a row per arm."""
    lines = [f"Ablation: {header['model']}; {header['tokens_per_step']:,} tokens/step x {args.iters} steps "
             f"= {args.iters * header['tokens_per_step'] / 1e6:.1f}M tokens per run; seeds "
             f"{', '.join(map(str, header['seeds']))}.",
             f"Device: {header['device']}; commit {header['git_commit'][:10]}; {header['date']}; "
             f"command `{header['command']}`{_family_lr_note(header)}.",
             "Gap: (arm − bf16) / bf16 of the validation loss at the last step, bf16 of the same corpus "
             "and seed; mean ± sample standard deviation over the seeds (val loss likewise); share of "
             "nvfp4_linear's gap: the arm's mean gap over nvfp4_linear's on that corpus; the other "
             f"columns are seed means. Final train loss: mean of the last {args.last_k} logged losses; "
             "cloze: scripts/evaluate.py (greedy; k-way)."]
    peers = any(a["optimizer_peer"] for a in summary)
    paired = any(a["val_vs_paired_pct_mean"] is not None for a in summary)
    if peers:
        lines[-1] += (" Gap vs its optimizer: an FP4 arm of Muon or Root against that optimizer's BF16 "
                      "arm (same lr, corpus and seed), mean ± sd over the seeds.")
    if paired:
        lines[-1] += (f" Vs {args.paired_with}: (arm − {args.paired_with}) / {args.paired_with} of the "
                      "validation loss, same corpus and seed, mean ± sd (per seed).")
    cols = ["arm", "seeds", "final train loss", "val loss", "gap vs bf16 (val)", "gap per seed",
            *(["gap vs its optimizer (val)"] if peers else []), "share of nvfp4_linear's gap",
            *([f"vs {args.paired_with} (val)"] if paired else []),
            "held-out ppl", "cloze acc (greedy)", "cloze acc (k-way)", "wall time"]
    for corpus, c in header["corpora"].items():
        lines += ["", f"### {corpus}", "",
                  f"Data `{c['data']}`: {c['train_tokens'] / 1e6:.2f}M training tokens, "
                  f"{c['epochs']:.2f} epochs a run.", "",
                  "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for a in (a for a in summary if a["corpus"] == corpus):
            seeds = f"{a['complete']}" + ("" if a["complete"] == a["runs"] else f" of {a['runs']}")
            if not a["complete"]:
                lines.append(f"| {a['arm']} | {seeds} |" + " |" * (len(cols) - 2))
                continue
            gap = ("0 (baseline)" if a["arm"] == "bf16"
                   else _pm(a["val_gap_pct_mean"], a["val_gap_pct_std"], "+.2f", "%"))
            per_seed = _by_seed(a["val_gap_pct_by_seed"]) if a["arm"] != "bf16" else ""
            vs_peer = ("" if not a["optimizer_peer"] else
                       _pm(a["val_gap_vs_optimizer_pct_mean"], a["val_gap_vs_optimizer_pct_std"], "+.2f", "%")
                       + f" vs {a['optimizer_peer']}")
            vs_nv = ("" if a["val_vs_paired_pct_mean"] is None else
                     _pm(a["val_vs_paired_pct_mean"], a["val_vs_paired_pct_std"], "+.2f", "%")
                     + f" ({_by_seed(a['val_vs_paired_pct_by_seed'])})")
            wall = "—" if a["wall_s_mean"] is None else f"{a['wall_s_mean'] / 60:.1f} min"
            if a["wall_s_mean"] is not None and a["jobs"] > 1:
                wall += f" ({a['jobs']} at once)"
            cells = [a["arm"], seeds, _f(a["final_train_loss_mean"], ".4f"),
                     _pm(a["val_loss_mean"], a["val_loss_std"], ".4f"), gap, per_seed,
                     *([vs_peer] if peers else []), _f(a["share_of_nvfp4_gap"], ".2f"),
                     *([vs_nv] if paired else []),
                     _f(a["heldout_perplexity_mean"], ".2f"), _f(a["cloze_greedy_accuracy_mean"], ".3f"),
                     _f(a["cloze_choice_accuracy_mean"], ".3f"), wall]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_grid(rows: list[dict], path: str, tokens_per_step: int, title: str) -> bool:
    """A panel per corpus: each arm's validation loss, the mean over its complete seeds at the
    iterations every one of them logged."""
    plt = pyplot("[ablation] matplotlib is not installed: no loss-curve PNG (pip install -e .[plots])")
    if plt is None:
        return False
    corpora = list(dict.fromkeys(r["corpus"] for r in rows))
    fig, axes = plt.subplots(1, len(corpora), figsize=(6.5 * len(corpora), 4.5), squeeze=False)
    for ax, corpus in zip(axes[0], corpora):
        for arm in dict.fromkeys(r["arm"] for r in rows if r["corpus"] == corpus):
            curves = [dict(r["curve"]["val"]) for r in rows
                      if (r["corpus"], r["arm"]) == (corpus, arm) and r["status"] == "complete"]
            its = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if its:
                ax.plot([i * tokens_per_step / 1e6 for i in its],
                        [statistics.fmean(c[i] for c in curves) for i in its], "o-", ms=3,
                        label=f"{arm} (n={len(curves)})")
        ax.set_xlabel("tokens (M)")
        ax.set_ylabel("validation loss (seed mean)")
        ax.set_title(corpus)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(plt, fig, title, path)


def plot(rows: list[dict], path: str, tokens_per_step: int, title: str) -> bool:
    plt = pyplot("[ablation] matplotlib is not installed: no loss-curve PNG (pip install -e .[plots])")
    if plt is None:
        return False
    fig, ax = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in rows:
        tr, va = r["curve"]["train"], r["curve"]["val"]
        if tr:
            line, = ax[0].plot([i * tokens_per_step / 1e6 for i, _ in tr], [v for _, v in tr], lw=1, label=r["arm"])
            if va:
                ax[1].plot([i * tokens_per_step / 1e6 for i, _ in va], [v for _, v in va], "o-", ms=3,
                           color=line.get_color(), label=r["arm"])
    for a, name in zip(ax, ("train loss", "validation loss")):
        a.set_xlabel("tokens (M)")
        a.set_ylabel(name)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    return save_figure(plt, fig, title, path)


def train_tokens_of(data: str) -> int | None:
    """Training tokens of a data directory (its stats.json), or None."""
    try:
        with open(os.path.join(data, "stats.json")) as f:
            return json.load(f).get("train_tokens")
    except (OSError, ValueError):
        return None


def device_name(args, names: list[str]) -> str:
    """The hardware that trained the runs OUT/<name>, read from their run_info.json, not this
    machine's: a table made with --report-only from runs copied in names where they ran. Runs
    trained on different hardware give each name with its count; a run that predates the
    recorded name gives its torch device ("cuda:0")."""
    counts: collections.Counter = collections.Counter()
    for n in names:
        try:
            with open(os.path.join(args.out, n, "run_info.json")) as f:
                info = json.load(f)
        except (OSError, ValueError):
            continue
        name = info.get("device_name") or info.get("device")
        if name:
            counts[name] += 1
    if len(counts) <= 1:
        return next(iter(counts), "?")
    return ", ".join(f"{k} ({v} run{'s' if v > 1 else ''})" for k, v in counts.most_common())


def main(argv=None) -> int:
    args = parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    try:
        unknown = [a for a in arms if a not in ARMS]
        if unknown:
            raise UsageError(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
        if args.paired_with not in ARMS:
            raise UsageError(f"--paired-with {args.paired_with}: not an arm; choose from {', '.join(ARMS)}")
        if args.iters <= 0:
            raise UsageError("--iters must be positive")
        if args.jobs < 1 or (args.jobs > 1 and args.nproc > 1):
            raise UsageError("--jobs must be >= 1, and 1 when --nproc > 1 (torchrun arms each take their GPUs)")
        if args.max_restarts < 0:
            raise UsageError("--max-restarts must be >= 0")
        if args.family_lr_from:
            if args.family_lr:
                raise UsageError("give --family-lr or --family-lr-from, not both")
            args.family_lr = family_lr_from(args.family_lr_from)
        args.family_lrs = parse_family_lr(args.family_lr)
        seeds = parse_seeds(args.seeds, "--seeds")
        if seeds and any(o.startswith("train.seed=") for o in args.set):
            raise UsageError("--seeds and --set train.seed=... both set the seed: give one")
        corpora = parse_corpora(args.data, check_files=not (args.dry or args.report_only))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # without --family-lr the config's lr (configs/ablation/base.yaml: AdamW's tuned one) needs no
    # note for AdamW's arms; every family left out of a given --family-lr gets one
    listed = set(args.family_lrs) if args.family_lrs else {"adamw"}
    untuned = sorted({family_of(ARMS[a]) for a in arms} - listed)
    if untuned:
        print(f"[ablation] no lr given for the {', '.join(untuned)} family: its arms train at the config's lr "
              "(a family's own: --family-lr, or --family-lr-from a sweep's lr_sweep.json)", flush=True)
    runs = plan_runs(arms, corpora, seeds)
    grid = len(corpora) > 1 or len(seeds) > 1
    if not grid:
        args.data = next(iter(corpora.values()))
    args.switches = {r.name: list(ARMS[r.arm]) + ([f"train.seed={r.seed}"] if r.seed is not None else [])
                     for r in runs}
    args.data_of = {r.name: r.data for r in runs}
    args.min_lr_ratio = min_lr_ratio(args.config) if args.family_lrs else 1.0
    from megatron.training.config import load_config
    from megatron.training.errors import UserError

    cfgs, status = {}, {}
    for r in runs:
        try:
            cfgs[r.name] = load_config(args.config, arm_overrides(r.name, args))
        except UserError as e:
            status[r.name] = f"skipped: {e}"
    if not cfgs:
        for r in runs:
            print(f"[ablation] {r.name}: {status[r.name]}")
        print("error: no runnable arm", file=sys.stderr)
        return 2
    if args.dry:
        for r in runs:
            print(f"# {r.name}: {status[r.name]}" if r.name in status else shlex.join(train_cmd(r.name, args)))
        for corpus, data in corpora.items():
            ev = [sys.executable, EVALUATE, "--data", data, "--ppl-tokens", str(args.ppl_tokens),
                  "--cloze-items", str(args.cloze_items)]
            for r in runs:
                if r.corpus == corpus and r.name in cfgs:
                    ev += ["--checkpoint", f"{r.name}={os.path.join(args.out, r.name, 'checkpoints')}"]
            print(shlex.join(ev))
        return 0
    os.makedirs(args.out, exist_ok=True)
    deadline = time.time() + args.time_budget if args.time_budget > 0 else None
    todo = []
    for r in runs:
        arm = r.name
        if arm in status:
            print(f"[ablation] {arm}: {status[arm]}", flush=True)
            continue
        meta = checkpoint_state(os.path.join(args.out, arm, "checkpoints"))
        if meta and meta["config"]["train"]["iters"] != args.iters:
            status[arm] = (f"error: {args.out}/{arm} holds a run with train.iters="
                           f"{meta['config']['train']['iters']}, not {args.iters}: use another --out")
        elif meta and meta["iteration"] >= args.iters:
            status[arm] = "complete"
            print(f"[ablation] {arm}: complete ({meta['path']}), skipping", flush=True)
            continue
        elif not meta and kept_result(args, arm):
            status[arm] = "complete"
            print(f"[ablation] {arm}: complete (results kept, no checkpoint), skipping", flush=True)
            continue
        elif args.report_only:
            status[arm] = "not run (--report-only)" + (f": checkpoint at step {meta['iteration']}" if meta else "")
        else:
            todo.append((arm, meta))
            continue
        print(f"[ablation] {arm}: {status[arm]}", flush=True)
    run_arms(todo, args, deadline, status)
    evals = {}
    if not args.no_eval:
        for corpus, data in corpora.items():   # evaluate.py reads one corpus's held-out text
            done = [r.name for r in runs if r.corpus == corpus and status[r.name] == "complete"]
            if done:
                evals.update(evaluate_arms(done, _with_data(args, data)))

    cfg = next(iter(cfgs.values()))
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
    rows = summarize(runs, status, evals, args, cfgs)
    # FULLSTACK_COMMIT, when set, wins: a `git archive` copy run inside another checkout would
    # otherwise report the enclosing checkout's HEAD
    commit = (os.environ.get("FULLSTACK_COMMIT")
              or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=REPO).stdout.strip() or "unknown")
    m = cfg.model
    header = {"model": f"{m.num_layers} layers, hidden {m.hidden_size}, FFN {m.ffn_hidden_size}, "
                       f"{m.num_attention_heads} heads / {m.num_query_groups} KV groups, seq {m.seq_length}",
              "tokens_per_step": tokens_per_step,
              "device": device_name(args, [r.name for r in runs if status[r.name] == "complete"]),
              "git_commit": commit, "date": time.strftime("%Y-%m-%d"),
              "command": shlex.join(["python", "benchmarks/ablation.py",
                                     *(argv if argv is not None else sys.argv[1:])])}
    if args.family_lr:
        header["family_lr"] = args.family_lr   # resolved, also when read from --family-lr-from
    title = f"ablation: {header['model']}, {args.iters * tokens_per_step / 1e6:.0f}M tokens per arm"
    if grid:
        header["seeds"] = seeds or [cfg.train.seed]
        header["corpora"] = {}
        for corpus, data in corpora.items():
            tt = train_tokens_of(data)
            header["corpora"][corpus] = {"data": data, "train_tokens": tt or 0,
                                         "epochs": args.iters * tokens_per_step / tt if tt else 0.0}
        summary = aggregate(rows)
        table = markdown_grid(summary, args, header)
        doc = {"meta": {**header, "iters": args.iters, "config": args.config, "last_k": args.last_k,
                        "paired_with": args.paired_with}, "summary": summary, "rows": rows}
        plot_grid(rows, os.path.join(args.out, "ablation.png"), tokens_per_step, title)
    else:
        train_tokens = train_tokens_of(args.data)
        header.update({"train_tokens": train_tokens or 0, "seed": cfg.train.seed,
                       "epochs": args.iters * tokens_per_step / train_tokens if train_tokens else 0.0})
        table = markdown(rows, args, header)
        doc = {"meta": {**header, "iters": args.iters, "config": args.config, "data": args.data,
                        "last_k": args.last_k}, "rows": rows}
        plot(rows, os.path.join(args.out, "ablation.png"), tokens_per_step, title)
    with open(os.path.join(args.out, "ablation.md"), "w") as f:
        f.write(table)
    with open(os.path.join(args.out, "ablation.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(table)
    pending = [n for n, st in status.items() if st != "complete" and not st.startswith("skipped")]
    return 1 if any(status[n].startswith(("failed", "error")) for n in pending) else 0


def _with_data(args, data: str):
    a = copy.copy(args)
    a.data = data
    return a


if __name__ == "__main__":
    sys.exit(main())
