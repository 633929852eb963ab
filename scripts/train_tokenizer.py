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

import glob
import os
import re
import sys
import tempfile

MAX_LINE_BYTES = 1 << 16  # SentencePiece skips longer lines; paragraphs are far shorter
MIN_VOCAB = 300  # 256 byte pieces + 4 specials + a few merges


class InputError(SystemExit):
    """Bad input: main() prints it as one `error:` line on stderr and exits 2. A SystemExit whose
    code is that line, so a caller of train() that catches SystemExit (prepare_quickstart_data.py)
    still gets the message."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")


def expand_inputs(patterns):
    """Files named by `patterns` (paths or globs), sorted within each glob, in order given."""
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise InputError(f"no file matches {pattern!r}")
        for path in matches:
            if not os.path.isfile(path):
                raise InputError(f"input file not found: {path}")
            files.append(path)
    return files


def _plain(message: str, vocab_size: int) -> str:
    """SentencePiece's failure in plain words (its text is `INTERNAL: src/....cc(744) [check] ...`)."""
    m = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", message)
    if m:
        most = int(m.group(2))
        hint = (f"try --vocab-size {most} or less, or give more text" if most >= MIN_VOCAB
                else f"give more text (--vocab-size cannot go below {MIN_VOCAB})")
        return (f"the text has only {most} distinct pieces (bytes, special tokens and merges): "
                f"--vocab-size {vocab_size} is too large; {hint}")
    m = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", message)
    if m:
        return (f"--vocab-size {vocab_size} is too small: the text needs at least {m.group(2)} pieces "
                "for its characters alone")
    detail = re.sub(r"^\w+: \S+\(\d+\) (\[[^\]]*\] )?", "", " ".join(message.split()))
    return f"SentencePiece could not train on this text: {detail}"


def train(files, vocab_size, output_prefix, seed=1234, threads=2):
    """Train the model; returns the path of the written .model file. Bad input raises InputError
    (a SystemExit), and leaves nothing behind: no temporary file, no folder this call created."""
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    made = _make_dirs(out_dir)
    try:
        return _train(files, vocab_size, output_prefix, out_dir, seed, threads)
    except BaseException:
        for d in made:   # a failed run leaves no folder it created (deepest first; only if empty)
            try:
                os.rmdir(d)
            except OSError:
                break
        raise


def _make_dirs(out_dir: str) -> list:
    """Create out_dir and its missing parents; returns those it created, deepest first."""
    made, d = [], out_dir
    while not os.path.exists(d):
        made.append(d)
        d = os.path.dirname(d)
    if not os.path.isdir(d):
        raise InputError(f"--output: {d} is not a directory")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise InputError(f"--output: cannot create {out_dir} ({e.strerror})") from None
    return made


def _train(files, vocab_size, output_prefix, out_dir, seed, threads):
    import sentencepiece as spm

    # One concatenated training file, one sentence per non-empty line, so order is fixed.
    try:
        tmp = tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", dir=out_dir, delete=False)
    except OSError as e:
        raise InputError(f"--output: cannot write in {out_dir} ({e.strerror})") from None
    try:
        with tmp:
            n_lines = 0
            for path in files:
                try:
                    f = open(path, encoding="utf-8", errors="replace")
                except OSError as e:
                    raise InputError(f"cannot read input file {path} ({e.strerror})") from None
                with f:
                    for line in f:
                        line = line.rstrip("\n")
                        if line.strip():
                            tmp.write(line)
                            tmp.write("\n")
                            n_lines += 1
        if n_lines == 0:
            raise InputError("the input files contain no text")
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
            # e.g. "Vocabulary size too high" for a tiny corpus: one line in plain words.
            raise InputError(_plain(str(exc), vocab_size)) from None
    finally:
        os.unlink(tmp.name)
    return output_prefix + ".model"


def main(argv=None):
    from megatron.training.errors import ArgumentParser  # one `error:` line, exit 2

    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="text files or globs")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--output", required=True, help="output prefix: writes PREFIX.model/.vocab")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2,
                   help="training threads (the result does not depend on it)")
    args = p.parse_args(argv)
    try:
        if args.vocab_size < MIN_VOCAB:
            raise InputError(f"--vocab-size must be at least {MIN_VOCAB} (256 byte pieces + specials + merges)")
        files = expand_inputs(args.input)
        model = train(files, args.vocab_size, args.output, seed=args.seed, threads=args.threads)
    except InputError as e:
        print(e.code, file=sys.stderr, flush=True)
        return 2
    print(f"wrote {model} (vocab {args.vocab_size}, {len(files)} input files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
