#!/usr/bin/env python3
"""Train a SentencePiece BPE tokenizer on text files.

    python scripts/train_tokenizer.py --input data/corpus/train/*.txt --vocab-size 4096 \
        --output data/tok/tokenizer          # writes tokenizer.model and tokenizer.vocab

Choices and why:
- BPE with byte fallback: every UTF-8 string is encodable (no <unk> on unseen characters).
- Identity normalisation, no whitespace collapsing, digits split: `detokenize(tokenize(t)) == t`
  exactly, which the data round-trip test relies on.
- Special ids: pad 0, unk 1, bos 2, eos 3; eos is the end-of-document token (`eod`).
- Determinism: inputs are read in the order given (globs sorted), the random seed is fixed
  (`--seed`, via `sentencepiece.set_random_generator_seed`) and every training sentence is used
  (no sampling). The learned pieces do not depend on `--threads` (checked: 1 and 2 threads give
  identical vocabularies); the .model file also records the input and output paths, so compare
  vocabularies, not file bytes, across directories.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile

MAX_LINE_BYTES = 1 << 16  # SentencePiece skips longer lines; paragraphs are far shorter


def expand_inputs(patterns):
    """Files named by `patterns` (paths or globs), sorted within each glob, in order given."""
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise SystemExit(f"error: no file matches {pattern!r}")
        for path in matches:
            if not os.path.isfile(path):
                raise SystemExit(f"error: input file not found: {path}")
            files.append(path)
    return files


def train(files, vocab_size, output_prefix, seed=1234, threads=2):
    """Train the model; returns the path of the written .model file."""
    import sentencepiece as spm

    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    # One concatenated training file, one sentence per non-empty line, so order is fixed.
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", dir=out_dir,
                                     delete=False) as tmp:
        n_lines = 0
        for path in files:
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    line = line.rstrip("\n")
                    if line.strip():
                        tmp.write(line)
                        tmp.write("\n")
                        n_lines += 1
    try:
        if n_lines == 0:
            raise SystemExit("error: the input files contain no text")
        spm.set_random_generator_seed(seed)
        try:
            spm.SentencePieceTrainer.train(
                input=tmp.name,
                model_prefix=output_prefix,
                vocab_size=vocab_size,
                model_type="bpe",
                byte_fallback=True,
                character_coverage=1.0,
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                split_digits=True,
                allow_whitespace_only_pieces=True,
                max_sentencepiece_length=16,
                max_sentence_length=MAX_LINE_BYTES,
                pad_id=0, unk_id=1, bos_id=2, eos_id=3,
                input_sentence_size=0,
                shuffle_input_sentence=False,
                num_threads=threads,
                minloglevel=2,
            )
        except RuntimeError as exc:
            # e.g. "Vocabulary size is too high" for a tiny corpus: one clear line.
            raise SystemExit(f"error: SentencePiece training failed: {exc}") from None
    finally:
        os.unlink(tmp.name)
    return output_prefix + ".model"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="text files or globs")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--output", required=True, help="output prefix: writes PREFIX.model/.vocab")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2,
                   help="training threads (the result does not depend on it)")
    args = p.parse_args(argv)
    if args.vocab_size < 300:
        p.error("--vocab-size must be at least 300 (256 byte pieces + specials + merges)")
    files = expand_inputs(args.input)
    model = train(files, args.vocab_size, args.output, seed=args.seed, threads=args.threads)
    print(f"wrote {model} (vocab {args.vocab_size}, {len(files)} input files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
