#!/usr/bin/env python3
"""Prepare the quickstart data: small real corpus, tokenizer, token files, statistics.

    python scripts/prepare_quickstart_data.py [--out data/quickstart]

The larger corpora go through the same steps: build OUT/corpus first, which step 1 then reuses,
e.g. `build_corpus.py --size xl --out data/xl/corpus` and then `--out data/xl`.

Steps, each skipped when its output is already complete and was made from the current inputs
(recorded in OUT/inputs.json), each written under a temporary name and renamed when done, so an
interrupted run is detected and redone:
1. OUT/corpus/: `build_corpus.py --size small` (Shakespeare + Milton, leak-proof split);
2. OUT/tokenizer.model: SentencePiece BPE, vocab 4096, trained on the training side only
   (4096 suits ~10 MB of text: ~2.6M tokens, and the embedding table stays small for a tiny
   model); every training line is used, no sampling, even for the xl corpus (~1.2M lines,
   133 MB: seconds and well under 1 GB of memory);
3. OUT/train_text_document.{bin,idx} and OUT/valid_text_document.{bin,idx} (held-out side),
   each with the .tokenizer.json record of the tokenizer that made it (preprocess_data.py);
4. OUT/stats.json: token/document counts and the unigram entropy (nats/token) of the valid
   tokens, the loss of a model that knows only token frequencies, which the quickstart's
   validation loss must beat.
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from megatron.training.tokenizer import sha256_file  # noqa: E402

VOCAB_SIZE = 4096


def indexed_complete(prefix):
    """True if PREFIX.{bin,idx} exist and the .bin holds exactly the tokens the .idx lists."""
    if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
        return False
    try:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        ds = IndexedDataset(prefix, mmap=False)
        expected = int(ds.sequence_lengths.sum()) * ds.index.dtype_size
        return expected == os.path.getsize(prefix + ".bin") and len(ds) > 0
    except Exception:
        return False


def unigram_entropy(prefix):
    """(entropy in nats/token, token count) of the tokens in PREFIX.bin."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    tokens = np.concatenate([ds[i] for i in range(len(ds))]).astype(np.int64)
    counts = np.bincount(tokens)
    p = counts[counts > 0] / tokens.size
    return float(-(p * np.log(p)).sum()), int(tokens.size)


class Steps:
    """Records which inputs each finished output was made from (OUT/inputs.json)."""

    def __init__(self, out):
        self.path = os.path.join(out, "inputs.json")
        try:
            with open(self.path) as f:
                self.state = json.load(f)
        except (OSError, ValueError):
            self.state = {}

    def fresh(self, step, inputs):
        return self.state.get(step) == inputs

    def done(self, step, inputs):
        self.state[step] = inputs
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.state, f, indent=1)
        os.replace(tmp, self.path)


def prepare(out, log=print):
    import build_corpus
    import preprocess_data
    import train_tokenizer

    t_start = time.time()
    os.makedirs(out, exist_ok=True)
    steps = Steps(out)
    corpus = os.path.join(out, "corpus")

    # 1. corpus
    if build_corpus.is_complete(corpus):
        log(f"[1/4] corpus: {corpus} is complete, skipping")
    else:
        log(f"[1/4] corpus: building the small corpus into {corpus}")
        build_corpus.build(corpus, size="small", log=lambda m: log("      " + m))
    corpus_id = sha256_file(os.path.join(corpus, "manifest.json"))

    # 2. tokenizer (trained on the training side only)
    model = os.path.join(out, "tokenizer.model")
    train_files = sorted(glob.glob(os.path.join(corpus, "train", "*.txt")))
    heldout_files = sorted(glob.glob(os.path.join(corpus, "heldout", "*.txt")))
    tok_inputs = {"corpus": corpus_id, "vocab_size": VOCAB_SIZE}
    if os.path.isfile(model) and steps.fresh("tokenizer", tok_inputs):
        log(f"[2/4] tokenizer: {model} is up to date, skipping")
    else:
        log(f"[2/4] tokenizer: training SentencePiece BPE, vocab {VOCAB_SIZE}, "
            f"on {len(train_files)} files")
        t = time.time()
        tmp_prefix = os.path.join(out, "tokenizer.tmp")
        train_tokenizer.train(train_files, VOCAB_SIZE, tmp_prefix)
        os.replace(tmp_prefix + ".vocab", os.path.join(out, "tokenizer.vocab"))
        os.replace(tmp_prefix + ".model", model)
        steps.done("tokenizer", tok_inputs)
        log(f"      done in {time.time() - t:.1f} s")
    tok_id = sha256_file(model)

    # 3. token files
    for name, files in (("train", train_files), ("valid", heldout_files)):
        prefix = os.path.join(out, f"{name}_text_document")
        inputs = {"corpus": corpus_id, "tokenizer": tok_id}
        # token files without their tokenizer record (PREFIX.tokenizer.json) are made again
        recorded = os.path.isfile(prefix + ".tokenizer.json")
        if indexed_complete(prefix) and recorded and steps.fresh(name, inputs):
            log(f"[3/4] {name}: {prefix}.bin/.idx is complete, skipping")
            continue
        log(f"[3/4] {name}: tokenizing {len(files)} documents into {prefix}.bin/.idx")
        docs = preprocess_data.iter_file_documents(files, "file", "text")
        n_docs, n_tok = preprocess_data.write_indexed_dataset(
            docs, model, prefix, append_eod=True, workers=2, total=len(files), desc=name)
        steps.done(name, inputs)
        log(f"      {n_docs} documents, {n_tok} tokens")

    # 4. statistics
    stats_path = os.path.join(out, "stats.json")
    stats_inputs = {"tokenizer": tok_id, "valid": sha256_file(
        os.path.join(out, "valid_text_document.bin"))}
    if os.path.isfile(stats_path) and steps.fresh("stats", stats_inputs):
        log(f"[4/4] stats: {stats_path} is up to date, skipping")
    else:
        entropy, n_valid = unigram_entropy(os.path.join(out, "valid_text_document"))
        _, n_train = unigram_entropy(os.path.join(out, "train_text_document"))
        with open(os.path.join(corpus, "manifest.json")) as f:
            manifest = json.load(f)
        stats = {
            "vocab_size": VOCAB_SIZE,
            "train_tokens": n_train,
            "valid_tokens": n_valid,
            "train_documents": manifest["train"]["documents"],
            "valid_documents": manifest["heldout"]["documents"],
            "train_bytes": manifest["train"]["bytes"],
            "valid_bytes": manifest["heldout"]["bytes"],
            "valid_unigram_entropy_nats": entropy,
            "valid_unigram_entropy_bits": entropy / math.log(2),
            "note": "unigram entropy of the valid tokens (EOD included), in nats per token: "
                    "the loss of a model that predicts every token by its frequency alone",
        }
        tmp = stats_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(stats, f, indent=1)
        os.replace(tmp, stats_path)
        steps.done("stats", stats_inputs)
        log(f"[4/4] stats: {n_train} train / {n_valid} valid tokens; valid unigram entropy "
            f"{entropy:.3f} nats/token -> {stats_path}")
    log(f"quickstart data ready in {out} ({time.time() - t_start:.1f} s)")


def main(argv=None):
    from megatron.training.errors import ArgumentParser  # one `error:` line, exit 2

    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="data/quickstart")
    args = p.parse_args(argv)
    from _corpus.sources import SourceError
    from preprocess_data import InputError

    from megatron.training.tokenizer import TokenizerError

    try:
        prepare(args.out)
    except (SourceError, InputError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except SystemExit as exc:  # train_tokenizer/preprocess report bad input this way
        if exc.code not in (0, None):
            print(exc.code if isinstance(exc.code, str) else "error", file=sys.stderr)
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
