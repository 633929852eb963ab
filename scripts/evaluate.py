#!/usr/bin/env python3
"""Evaluate checkpoints: perplexity on held-out data and zero-shot cloze accuracy, as JSON.

    python scripts/evaluate.py --checkpoint runs/ablation/bf16/checkpoints [--checkpoint NAME=PATH ...]
        [--data data/quickstart] [--out eval.json] [--ppl-tokens N] [--cloze-items 500]
    python scripts/evaluate.py --checkpoint runs/my_text/checkpoints --valid-prefix data/my/valid_text_document \
        --cloze-items 0                                   # perplexity only, on any indexed dataset
    python scripts/evaluate.py --checkpoint runs/my_text/checkpoints --text notes.txt more.txt \
        --cloze-items 0                                   # perplexity of text files
    python scripts/evaluate.py --build-cloze-only [--data data/quickstart]

A checkpoint is one of ours (`iter_NNNNNNN/` with `meta.json` + `dist/`, or a save_dir: its
newest complete checkpoint). The model is rebuilt from the config recorded in `meta.json` (same
recipes: an NVFP4 arm is evaluated with its NVFP4 forward, or in BF16 past its
`fp4.bf16_from` switch step), unsharded (TP = PP = 1, one
process), in its training precision (BF16 under megatron's Float16Module, or FP32), and only
its model tensors are read from `dist/` (megatron-core dist_checkpointing; any TP/DP layout).

The tokenizer (for `--text` and the cloze task) is `--tokenizer`, else the one the (first)
checkpoint was trained with (its `data.tokenizer`) where that file exists, else
DATA/tokenizer.model; any tokenizer
`megatron.training.tokenizer.load_tokenizer` reads. A checkpoint trained with another tokenizer
(by content hash) is refused.

(a) Perplexity on the held-out split (`--valid-prefix`, default DATA/valid_text_document), or
    on text files (`--text`, tokenized here: each file one document, or per `--doc-boundary`
    as scripts/preprocess_data.py splits them, end-of-document token appended):
    its documents concatenated in index order (end-of-document tokens included, as stored),
    cut into non-overlapping windows of the model's training sequence length s; window i
    feeds tokens [i·s, (i+1)·s) and is scored on the next token at every position, so every
    token after the first is predicted once, with the context restarting at each window (as
    in validation loss). Over the first `--ppl-tokens` predicted tokens (whole windows; 0:
    all). perplexity = exp(mean NLL), NLL from FP32 log-softmax over the model's (padded)
    output vocabulary, as the training loss.
(b) Cloze (scripts/_eval/cloze.py; `--cloze-items 0` skips it): DATA/cloze.jsonl, built once from the held-out documents
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
from megatron.training.tokenizer import sha256_file  # noqa: E402


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
    if tokenizer_path and cfg.data.tokenizer:
        from megatron.training.tokenizer import TokenizerError, load_tokenizer

        try:
            trained = load_tokenizer(cfg.data.tokenizer).unique_identifiers["sha256"]
        except TokenizerError:
            trained = None  # the training tokenizer is not on this machine: nothing to compare
        if trained is not None and trained != load_tokenizer(tokenizer_path).unique_identifiers["sha256"]:
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
    # fp4.bf16_from: a checkpoint past the switch step is evaluated as it trained, in BF16
    from megatron.training.precision import PrecisionSchedule

    PrecisionSchedule(cfg, log=False).apply([gpt], int(meta.get("iteration", 0)))

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


def text_stream(files: list[str], tok, boundary: str = "file"):
    """Token ids of text files as one stream: documents per `boundary` (preprocess_data.py's
    split), each followed by the end-of-document token, as preprocess_data.py stores them."""
    import numpy as np
    import preprocess_data

    try:
        paths = preprocess_data.expand_inputs(files)
        ids = []
        for doc in preprocess_data.iter_file_documents(paths, boundary, "text"):
            t = tok.tokenize(doc)
            if t:
                ids += list(t) + [tok.eod]
    except preprocess_data.InputError as e:
        raise ValueError(str(e)) from None
    if not ids:
        raise ValueError(f"--text {' '.join(files)}: no text to score")
    return np.asarray(ids, dtype=np.int64)


def perplexity(logits_fn, stream, *, max_tokens: int = 0, batch_size: int = 8) -> dict:
    import torch

    s = logits_fn.seq_length
    n_windows = (len(stream) - 1) // s
    if max_tokens:
        n_windows = min(n_windows, max(1, math.ceil(max_tokens / s)))
    if n_windows == 0:
        raise ValueError(f"the evaluation text has {len(stream)} tokens, fewer than one window of "
                         f"{s + 1} (the model's sequence length + 1): give more text")
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
    from megatron.training.errors import ArgumentParser  # one `error:` line, exit 2

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", action="append", default=[], metavar="[NAME=]PATH",
                   help="checkpoint dir or save_dir; repeat for several (one process, one cloze file)")
    p.add_argument("--data", default="data/quickstart",
                   help="data dir with valid_text_document, tokenizer.model, corpus/heldout/")
    p.add_argument("--valid-prefix", help="held-out indexed dataset (default DATA/valid_text_document)")
    p.add_argument("--text", nargs="+", metavar="FILE", help="score these text files instead of --valid-prefix")
    p.add_argument("--doc-boundary", default="file", choices=["file", "blank-line", "jsonl"],
                   help="--text: what one document is (as in preprocess_data.py)")
    p.add_argument("--tokenizer", help="default: the checkpoint's data.tokenizer, else DATA/tokenizer.model")
    p.add_argument("--heldout-dir", help="held-out text documents (default DATA/corpus/heldout)")
    p.add_argument("--cloze", help="cloze task JSONL (default DATA/cloze.jsonl; built if missing)")
    p.add_argument("--cloze-items", type=int, default=500, help="0: perplexity only, no cloze task")
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


def _checkpoint_tokenizer(spec: str) -> str | None:
    """data.tokenizer of the checkpoint `spec` names (without building anything)."""
    from megatron.training import checkpointing

    path = spec.split("=", 1)[1] if "=" in spec and not os.path.exists(spec) else spec
    ckpt = checkpointing.resolve_load_path(path, None)
    if ckpt is None:
        return None
    return (checkpointing.check_complete(ckpt).get("config", {}).get("data") or {}).get("tokenizer")


def _check_heldout_tokenizer(valid_prefix: str, tok_path: str | None, tok) -> None:
    """The held-out tokens were made with the tokenizer the model is scored with, where
    preprocess_data.py recorded theirs (PREFIX.tokenizer.json): ids of another tokenizer give a
    perplexity that means nothing. UserError otherwise."""
    from megatron.training.data import read_tokenizer_record
    from megatron.training.errors import UserError
    from megatron.training.tokenizer import load_tokenizer

    record = read_tokenizer_record(valid_prefix, "valid_path")
    if record is None or tok_path is None:
        return
    if record["sha256"] != (tok or load_tokenizer(tok_path)).unique_identifiers["sha256"]:
        raise UserError(f"--valid-prefix {valid_prefix} was tokenized with {record.get('tokenizer', '?')}, "
                        f"not with {tok_path}, the tokenizer the model is scored with: tokenize the held-out "
                        f"text again with scripts/preprocess_data.py --tokenizer {tok_path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    d = args.data
    valid_prefix = None if args.text else (args.valid_prefix or os.path.join(d, "valid_text_document"))
    heldout_dir = args.heldout_dir or os.path.join(d, "corpus", "heldout")
    cloze_path = args.cloze or os.path.join(d, "cloze.jsonl")
    use_cloze = args.cloze_items > 0 or args.build_cloze_only
    if not args.checkpoint and not args.build_cloze_only:
        print("error: give --checkpoint (or --build-cloze-only)", file=sys.stderr)
        return 2
    if args.text and args.valid_prefix:
        print("error: give --text or --valid-prefix, not both", file=sys.stderr)
        return 2
    if args.cloze_items < 0:
        print("error: --cloze-items must be >= 0 (0: perplexity only)", file=sys.stderr)
        return 2
    from megatron.training.errors import UserError
    from megatron.training.initialize import shutdown
    from megatron.training.tokenizer import TokenizerError, load_tokenizer, tokenizer_kind

    try:
        tok_path = args.tokenizer
        if tok_path is None and args.checkpoint:
            tok_path = _checkpoint_tokenizer(args.checkpoint[0])
            if tok_path is not None and not os.path.exists(tok_path):
                tok_path = None
        if tok_path is None and os.path.isfile(os.path.join(d, "tokenizer.model")):
            tok_path = os.path.join(d, "tokenizer.model")
        tok = None
        if use_cloze or args.text:
            if tok_path is None:
                raise UserError("no tokenizer: the checkpoint names none (data.tokenizer); give --tokenizer")
            tok = load_tokenizer(tok_path)
        items = []
        if use_cloze:
            files = sorted(glob.glob(os.path.join(heldout_dir, "*.txt")))
            if not files:
                raise ValueError(f"no held-out documents to build the cloze task from ({heldout_dir}/*.txt; "
                                 "--heldout-dir names them, --cloze-items 0 skips the cloze task)")
            items = cloze_task.load_or_build(
                cloze_path, files, tok, tokenizer_kind(tok_path)[1], n_items=args.cloze_items,
                seed=args.cloze_seed, min_ctx=args.cloze_min_ctx, max_ctx=args.cloze_max_ctx,
                n_choices=args.cloze_choices, rebuild=args.rebuild_cloze,
                log=lambda m: print(m, file=sys.stderr, flush=True))
        if args.build_cloze_only:
            print(json.dumps({"cloze": cloze_path, "items": len(items)}))
            return 0
        if args.text:
            stream = text_stream(args.text, tok, args.doc_boundary)
        else:
            for ext in (".bin", ".idx"):
                if not os.path.isfile(valid_prefix + ext):
                    raise UserError(f"held-out split not found: {valid_prefix + ext} (--valid-prefix names "
                                    "an indexed dataset, --text scores text files)")
            _check_heldout_tokenizer(valid_prefix, tok_path, tok)
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
                   "cloze": score_cloze(logits_fn, items, per_item=args.per_item) if items else None}
            res["eval_seconds"] = time.time() - t0
            results[name] = res
            line = (f"[evaluate] {name}: perplexity {res['heldout']['perplexity']:.3f} over "
                    f"{res['heldout']['tokens']} tokens")
            if items:
                line += (f", cloze greedy {res['cloze']['greedy_accuracy']:.3f}, "
                         f"choice {res['cloze']['choice_accuracy']:.3f} ({len(items)} items)")
            print(line, file=sys.stderr, flush=True)
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
                    "valid_prefix": valid_prefix, "text": args.text, "tokenizer": tok_path,
                    "cloze": cloze_path if items else None,
                    "cloze_sha256": sha256_file(cloze_path) if items else None},
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
