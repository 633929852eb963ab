#!/usr/bin/env python3
"""Evaluate checkpoints: held-out perplexity and zero-shot cloze accuracy, as JSON.

    python scripts/evaluate.py --checkpoint runs/ablation/bf16/checkpoints [--checkpoint NAME=PATH ...]
        [--data data/quickstart] [--out eval.json] [--ppl-tokens N] [--cloze-items 500]
    python scripts/evaluate.py --build-cloze-only [--data data/quickstart]

A checkpoint is one of ours (`iter_NNNNNNN/` with `meta.json` + `dist/`, or a save_dir: its
newest complete checkpoint). The model is rebuilt from the config recorded in `meta.json` (same
recipes: an NVFP4 arm is evaluated with its NVFP4 forward), unsharded (TP = PP = 1, one
process), in its training precision (BF16 under megatron's Float16Module, or FP32), and only
its model tensors are read from `dist/` (megatron-core dist_checkpointing; any TP/DP layout).

(a) Perplexity on the held-out split (`--valid-prefix`, default DATA/valid_text_document):
    its documents concatenated in index order (end-of-document tokens included, as stored),
    cut into non-overlapping windows of the model's training sequence length s; window i
    feeds tokens [i·s, (i+1)·s) and is scored on the next token at every position, so every
    token after the first is predicted once, with the context restarting at each window (as
    in validation loss). Over the first `--ppl-tokens` predicted tokens (whole windows; 0:
    all). perplexity = exp(mean NLL), NLL from FP32 log-softmax over the model's (padded)
    output vocabulary, as the training loss.
(b) Cloze (scripts/_eval/cloze.py): DATA/cloze.jsonl, built once from the held-out documents
    (DATA/corpus/heldout/*.txt) with a fixed seed and reused by every arm. Two scores:
    - greedy accuracy (the headline number): the model's greedy continuation of the passage
      reproduces every token of the answer word (teacher-forced argmax at each answer position,
      which equals greedy decoding while the prefix is right). Whether the word would then go
      on is not checked (LAMBADA convention).
    - choice accuracy: the answer has the highest summed log-probability among the item's
      `n_choices` candidate words from the same document (chance = 1/n_choices).
    A context longer than s - len(word) tokens is cut from the left.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, REPO)

import warnings  # noqa: E402

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from _eval import cloze as cloze_task  # noqa: E402


# ----------------------------------------------------------------------------- model loading
def load_model(path: str, *, tokenizer_path: str | None, device=None):
    """(model callable tokens[b,s] -> logits[b,s,V] float32, cfg, meta) for a checkpoint."""
    import copy

    import torch

    from megatron.training import cpu_compat

    cpu_compat.import_megatron_core()  # without CUDA: no TorchInductor import (cpu_compat)
    from megatron.core import dist_checkpointing
    from megatron.core.transformer.module import Float16Module

    from megatron.training import checkpointing
    from megatron.training.config import from_dict
    from megatron.training.config_schema import RunConfig
    from megatron.training.errors import CheckpointError
    from megatron.training.initialize import initialize
    from megatron.training.model import build_model

    ckpt = checkpointing.resolve_load_path(path, None)
    if ckpt is None:
        raise CheckpointError(f"no checkpoint at {path}")
    meta = checkpointing.check_complete(ckpt)
    cfg = from_dict(RunConfig, copy.deepcopy(meta["config"]), prefix="")
    # one unsharded process; keep the padded vocabulary of the TP size it was trained with
    cfg.model.make_vocab_size_divisible_by *= cfg.parallel.tensor_model_parallel_size
    cfg.parallel.tensor_model_parallel_size = cfg.parallel.pipeline_model_parallel_size = 1
    cfg.parallel.use_distributed_optimizer = False
    dev = initialize(cfg) if device is None else device
    vocab = cfg.model.vocab_size
    if tokenizer_path and cfg.data.tokenizer and os.path.isfile(cfg.data.tokenizer):
        if cloze_task.sha256_file(cfg.data.tokenizer) != cloze_task.sha256_file(tokenizer_path):
            raise CheckpointError(f"checkpoint {ckpt} was trained with tokenizer {cfg.data.tokenizer}, "
                                  f"which differs from {tokenizer_path}")
    if vocab is None:
        from megatron.training.tokenizer import load_tokenizer

        vocab = load_tokenizer(tokenizer_path or cfg.data.tokenizer).vocab_size
    gpt = build_model(cfg, vocab)
    module = Float16Module(gpt.config, gpt) if cfg.train.precision == "bf16" else gpt
    module.to(dev)
    try:
        state = dist_checkpointing.load({"model": gpt.sharded_state_dict()}, os.path.join(ckpt, "dist"))
        gpt.load_state_dict(state["model"])
    except Exception as e:
        raise CheckpointError(f"checkpoint {ckpt} could not be read: {type(e).__name__}: {e}") from None
    module.eval()

    @torch.no_grad()
    def logits_fn(tokens):
        tokens = tokens.to(dev)
        pos = torch.arange(tokens.shape[1], device=dev).unsqueeze(0).expand_as(tokens)
        return module(tokens, pos, None).float()

    logits_fn.seq_length = cfg.model.seq_length
    logits_fn.device = dev
    return logits_fn, cfg, {**meta, "path": ckpt}


# ----------------------------------------------------------------------------- perplexity
def heldout_stream(prefix: str):
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix, mmap=True)
    return np.concatenate([np.asarray(ds[i], dtype=np.int64) for i in range(len(ds))])


def perplexity(logits_fn, stream, *, max_tokens: int = 0, batch_size: int = 8) -> dict:
    import torch

    s = logits_fn.seq_length
    n_windows = (len(stream) - 1) // s
    if max_tokens:
        n_windows = min(n_windows, max(1, math.ceil(max_tokens / s)))
    if n_windows == 0:
        raise ValueError(f"the held-out split has {len(stream)} tokens, fewer than one window of {s + 1}")
    data = torch.from_numpy(stream[:n_windows * s + 1])
    total, count = 0.0, 0
    for b0 in range(0, n_windows, batch_size):
        idx = range(b0, min(n_windows, b0 + batch_size))
        x = torch.stack([data[i * s:(i + 1) * s] for i in idx])
        y = torch.stack([data[i * s + 1:(i + 1) * s + 1] for i in idx]).to(logits_fn.device)
        logp = torch.log_softmax(logits_fn(x), dim=-1)
        total += -logp.gather(-1, y.unsqueeze(-1)).sum().item()
        count += y.numel()
    mean = total / count
    return {"tokens": count, "windows": n_windows, "seq_length": s, "mean_nll": mean,
            "perplexity": math.exp(mean)}


# ----------------------------------------------------------------------------- cloze
def score_cloze(logits_fn, items: list[dict], *, batch_size: int = 32, per_item: bool = False) -> dict:
    import torch

    s = logits_fn.seq_length
    seqs = []  # (item index, choice index, ids, first answer position, answer ids)
    for n, it in enumerate(items):
        for c, ans in enumerate(it["choice_ids"]):
            ctx = it["context_ids"][-(s - len(ans)):] if len(ans) < s else []
            seqs.append((n, c, ctx + ans, len(ctx), ans))
    logprob = [[0.0] * len(it["choice_ids"]) for it in items]
    greedy = [False] * len(items)
    for b0 in range(0, len(seqs), batch_size):
        batch = seqs[b0:b0 + batch_size]
        width = max(len(ids) for _, _, ids, _, _ in batch)
        x = torch.zeros(len(batch), width, dtype=torch.long)
        for r, (_, _, ids, _, _) in enumerate(batch):
            x[r, :len(ids)] = torch.tensor(ids)  # right padding: causal attention never sees it
        logits = logits_fn(x)
        logp = torch.log_softmax(logits, dim=-1)
        for r, (n, c, ids, start, ans) in enumerate(batch):
            at = torch.arange(start - 1, start - 1 + len(ans), device=logits.device)
            tgt = torch.tensor(ans, device=logits.device)
            logprob[n][c] = logp[r, at, tgt].sum().item()
            if c == items[n]["label"]:
                greedy[n] = bool((logits[r, at].argmax(-1) == tgt).all())
    choice = [max(range(len(lp)), key=lambda k: lp[k]) for lp in logprob]
    out = {"items": len(items), "n_choices": len(items[0]["choice_ids"]) if items else 0,
           "greedy_accuracy": sum(greedy) / len(items),
           "choice_accuracy": sum(ch == it["label"] for ch, it in zip(choice, items)) / len(items)}
    if per_item:
        out["per_item"] = [{"id": it["id"], "greedy_correct": g, "choice": ch, "logprobs": lp}
                           for it, g, ch, lp in zip(items, greedy, choice, logprob)]
    return out


# ----------------------------------------------------------------------------- CLI
def _git_commit() -> str:
    # FULLSTACK_COMMIT names the commit of a `git archive` copy (see benchmarks/ablation.py)
    if os.environ.get("FULLSTACK_COMMIT"):
        return os.environ["FULLSTACK_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    except OSError:
        return ""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", action="append", default=[], metavar="[NAME=]PATH",
                   help="checkpoint dir or save_dir; repeat for several (one process, one cloze file)")
    p.add_argument("--data", default="data/quickstart",
                   help="data dir with valid_text_document, tokenizer.model, corpus/heldout/")
    p.add_argument("--valid-prefix", help="held-out indexed dataset (default DATA/valid_text_document)")
    p.add_argument("--tokenizer", help="default DATA/tokenizer.model")
    p.add_argument("--heldout-dir", help="held-out text documents (default DATA/corpus/heldout)")
    p.add_argument("--cloze", help="cloze task JSONL (default DATA/cloze.jsonl; built if missing)")
    p.add_argument("--cloze-items", type=int, default=500)
    p.add_argument("--cloze-seed", type=int, default=1234)
    p.add_argument("--cloze-min-ctx", type=int, default=64)
    p.add_argument("--cloze-max-ctx", type=int, default=200)
    p.add_argument("--cloze-choices", type=int, default=4)
    p.add_argument("--rebuild-cloze", action="store_true")
    p.add_argument("--build-cloze-only", action="store_true", help="build the cloze file and exit")
    p.add_argument("--ppl-tokens", type=int, default=0, help="held-out tokens to score (0: all)")
    p.add_argument("--batch-size", type=int, default=8, help="perplexity windows per forward")
    p.add_argument("--per-item", action="store_true", help="include per-item cloze results")
    p.add_argument("--out", help="write the JSON here (it is always printed)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    d = args.data
    valid_prefix = args.valid_prefix or os.path.join(d, "valid_text_document")
    tok_path = args.tokenizer or os.path.join(d, "tokenizer.model")
    heldout_dir = args.heldout_dir or os.path.join(d, "corpus", "heldout")
    cloze_path = args.cloze or os.path.join(d, "cloze.jsonl")
    if not args.checkpoint and not args.build_cloze_only:
        print("error: give --checkpoint (or --build-cloze-only)", file=sys.stderr)
        return 2
    from megatron.training.errors import UserError
    from megatron.training.initialize import shutdown
    from megatron.training.tokenizer import TokenizerError, load_tokenizer

    try:
        tok = load_tokenizer(tok_path)
        files = sorted(glob.glob(os.path.join(heldout_dir, "*.txt")))
        items = cloze_task.load_or_build(
            cloze_path, files, tok, tok_path, n_items=args.cloze_items, seed=args.cloze_seed,
            min_ctx=args.cloze_min_ctx, max_ctx=args.cloze_max_ctx, n_choices=args.cloze_choices,
            rebuild=args.rebuild_cloze, log=lambda m: print(m, file=sys.stderr, flush=True))
        if args.build_cloze_only:
            print(json.dumps({"cloze": cloze_path, "items": len(items)}))
            return 0
        for ext in (".bin", ".idx"):
            if not os.path.isfile(valid_prefix + ext):
                raise UserError(f"held-out split not found: {valid_prefix + ext}")
        stream = heldout_stream(valid_prefix)
        results = {}
        for spec in args.checkpoint:
            name, path = spec.split("=", 1) if "=" in spec and not os.path.exists(spec) else (None, spec)
            t0 = time.time()
            logits_fn, cfg, meta = load_model(path, tokenizer_path=tok_path)
            name = name or os.path.basename(os.path.normpath(meta["path"]))
            res = {"checkpoint": meta["path"], "iteration": meta["iteration"],
                   "recipes": {"fp4.linear": cfg.fp4.linear, "fp4.attention": cfg.fp4.attention,
                               "optimizer.name": cfg.optimizer.name},
                   "precision": cfg.train.precision,
                   "heldout": perplexity(logits_fn, stream, max_tokens=args.ppl_tokens,
                                         batch_size=args.batch_size),
                   "cloze": score_cloze(logits_fn, items, per_item=args.per_item)}
            res["eval_seconds"] = time.time() - t0
            results[name] = res
            print(f"[evaluate] {name}: perplexity {res['heldout']['perplexity']:.3f} over "
                  f"{res['heldout']['tokens']} tokens, cloze greedy {res['cloze']['greedy_accuracy']:.3f}, "
                  f"choice {res['cloze']['choice_accuracy']:.3f} ({len(items)} items)", file=sys.stderr, flush=True)
            del logits_fn
    except (UserError, TokenizerError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        shutdown()
    import torch

    out = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "git_commit": _git_commit(), "argv": sys.argv,
                    "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "valid_prefix": valid_prefix, "tokenizer": tok_path, "cloze": cloze_path,
                    "cloze_sha256": cloze_task.sha256_file(cloze_path)},
           "results": results}
    text = json.dumps(out, indent=1)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".tmp", "w") as f:
            f.write(text + "\n")
        os.replace(args.out + ".tmp", args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
