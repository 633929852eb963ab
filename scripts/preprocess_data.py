#!/usr/bin/env python3
"""Tokenize text into megatron-core's indexed dataset (PREFIX.bin + PREFIX.idx).

    python scripts/preprocess_data.py --input 'data/corpus/train/*.txt' \
        --tokenizer data/tok/tokenizer.model --output-prefix data/mine/train_text_document
    python scripts/preprocess_data.py --input my.txt --doc-boundary blank-line \
        --tokenizer my_hf_tokenizer/tokenizer.json --output-prefix data/mine/train_text_document
    python scripts/preprocess_data.py --input docs.jsonl --json-key text ...
    python scripts/preprocess_data.py --hf-dataset NAME --hf-split train --hf-text-field text ...

What one document is (`--doc-boundary`):
- `auto` (default): one document per JSONL line for `.jsonl`/`.json` files (field `--json-key`),
  one document per file otherwise;
- `file`: each input file is one document;
- `blank-line`: each block separated by one or more blank lines is a document;
- `jsonl`: each non-empty line is a JSON object whose `--json-key` field is the document.

Each document becomes one item followed by `end_document`; with `--append-eod` (on by default)
the tokenizer's end-of-document id is appended, which is what GPTDataset's `eod` masks and
position resets key on. The tokenizer is any that `megatron.training.tokenizer.load_tokenizer`
reads: a SentencePiece `.model`, a Hugging Face `tokenizer.json` (or a folder with either), a
TikToken vocabulary. Bad input is one `error:` line and exit code 2. Tokens are stored as uint16 when the vocabulary has fewer than 65500
entries, else int32. Output is written under temporary names and renamed when complete (.bin
first, .idx last), so an interrupted run never leaves a pair that looks finished.

PREFIX.tokenizer.json, written last, records the tokenizer that made the tokens (its file,
sha256, vocabulary size and end-of-document id; megatron-core's readers ignore it): training
refuses a prefix made with a tokenizer other than `data.tokenizer`
(megatron.training.data.check_tokenizer).
"""

from __future__ import annotations

import glob
import json
import os
import sys

UINT16_VOCAB_LIMIT = 65500


class InputError(Exception):
    """Bad input; main() prints it as one line and exits 2."""


def expand_inputs(patterns):
    """Existing files named by `patterns` (paths or globs; glob matches sorted)."""
    files = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matches:
                raise InputError(f"no file matches {pattern!r}")
            files.extend(matches)
        elif os.path.isfile(pattern):
            files.append(pattern)
        else:
            raise InputError(f"input file not found: {pattern}")
    return files


def _read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def iter_file_documents(files, boundary, json_key):
    """Yield document strings from local files according to `boundary` (see module doc)."""
    for path in files:
        mode = boundary
        if mode == "auto":
            mode = "jsonl" if path.endswith((".jsonl", ".json")) else "file"
        if mode == "file":
            yield _read(path)
        elif mode == "blank-line":
            block = []
            for line in _read(path).split("\n"):
                if line.strip():
                    block.append(line)
                elif block:
                    yield "\n".join(block)
                    block = []
            if block:
                yield "\n".join(block)
        elif mode == "jsonl":
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise InputError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
                    if not isinstance(record, dict) or json_key not in record:
                        raise InputError(f"{path}:{lineno}: no field {json_key!r}")
                    yield str(record[json_key])
        else:
            raise InputError(f"unknown --doc-boundary {boundary!r}")


def iter_hf_documents(name, split, field, config_name=None):
    """Yield documents from a Hugging Face `datasets` source (imported only here)."""
    try:
        import datasets  # optional dependency
    except ImportError:
        raise InputError(
            "--hf-dataset needs the optional package `datasets` (pip install -e .[datasets])"
        ) from None
    try:
        ds = datasets.load_dataset(name, config_name, split=split)
    except Exception as exc:  # network, unknown name, unknown split: one line
        raise InputError(f"could not load Hugging Face dataset {name!r} split {split!r}: {exc}")
    if field not in ds.column_names:
        raise InputError(f"dataset {name!r} has no field {field!r} (fields: {ds.column_names})")
    for record in ds:
        yield str(record[field])


# --- tokenization (optionally in worker processes) ------------------------------------------
_TOKENIZER = None


def _init_worker(model_path):
    """A SentencePiece model is loaded alone in a worker (importing megatron.core costs seconds
    per process); any other tokenizer through `load_tokenizer`."""
    global _TOKENIZER
    if model_path.endswith(".model") and os.path.isfile(model_path):
        import sentencepiece

        _TOKENIZER = sentencepiece.SentencePieceProcessor(model_file=model_path).encode
    else:
        sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from megatron.training.tokenizer import load_tokenizer

        _TOKENIZER = load_tokenizer(model_path).tokenize


def _encode(text):
    return _TOKENIZER(text)


def token_dtype(vocab_size):
    """uint16 when every id fits comfortably, else int32 (megatron-core's convention)."""
    import numpy as np

    return np.uint16 if vocab_size < UINT16_VOCAB_LIMIT else np.int32


def write_indexed_dataset(documents, model_path, output_prefix, append_eod=True, workers=1,
                          total=None, desc="tokenizing"):
    """Tokenize `documents` into OUTPUT_PREFIX.{bin,idx} and record the tokenizer in
    OUTPUT_PREFIX.tokenizer.json; returns (n_docs, n_tokens)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from tqdm import tqdm

    from megatron.training.data import TOKENIZER_RECORD, write_tokenizer_record
    from megatron.training.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    dtype = token_dtype(tokenizer.vocab_size)
    eod = tokenizer.eod
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    tmp_prefix = output_prefix + ".tmp"
    builder = IndexedDatasetBuilder(tmp_prefix + ".bin", dtype=dtype)
    n_docs = n_tokens = 0

    def consume(token_lists):
        nonlocal n_docs, n_tokens
        for ids in tqdm(token_lists, total=total, desc=desc, unit="doc", file=sys.stderr):
            if len(ids) == 0:
                continue  # an empty document adds nothing, not even an EOD
            if append_eod:
                ids = list(ids) + [eod]
            builder.add_document(np.asarray(ids, dtype=dtype), [len(ids)])
            n_docs += 1
            n_tokens += len(ids)

    try:
        if workers > 1:
            import multiprocessing as mp

            with mp.get_context("spawn").Pool(workers, _init_worker, (model_path,)) as pool:
                consume(pool.imap(_encode, documents, chunksize=16))
        else:
            consume(tokenizer.tokenize(d) for d in documents)
        if n_docs == 0:
            raise InputError("the input contains no documents (empty corpus)")
        builder.finalize(tmp_prefix + ".idx")
        # a record left by an earlier run goes first: interrupted from here on, the new tokens
        # have no record (checked on their ids in training), never a record of another tokenizer
        if os.path.exists(output_prefix + TOKENIZER_RECORD):
            os.unlink(output_prefix + TOKENIZER_RECORD)
        os.replace(tmp_prefix + ".bin", output_prefix + ".bin")
        os.replace(tmp_prefix + ".idx", output_prefix + ".idx")
        write_tokenizer_record(output_prefix, tokenizer)
    finally:
        for ext in (".bin", ".idx"):
            if os.path.exists(tmp_prefix + ext):
                os.unlink(tmp_prefix + ext)
    return n_docs, n_tokens


def build_parser():
    from megatron.training.errors import ArgumentParser  # one `error:` line, exit 2

    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", help="text/JSONL files or globs")
    src.add_argument("--hf-dataset", help="Hugging Face dataset name (needs `datasets`)")
    p.add_argument("--hf-config", default=None, help="Hugging Face dataset config name")
    p.add_argument("--hf-split", default="train")
    p.add_argument("--hf-text-field", default="text")
    p.add_argument("--json-key", default="text", help="JSONL field holding the text")
    p.add_argument("--doc-boundary", default="auto",
                   choices=["auto", "file", "blank-line", "jsonl"])
    p.add_argument("--tokenizer", required=True,
                   help="SentencePiece .model, Hugging Face tokenizer.json (or a folder with either), "
                        "or a TikToken vocabulary .json")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--append-eod", dest="append_eod", action="store_true", default=True,
                   help="append the end-of-document token to each document (default)")
    p.add_argument("--no-append-eod", dest="append_eod", action="store_false")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    from megatron.training.tokenizer import TokenizerError, load_tokenizer

    try:
        if args.workers < 1:
            raise InputError("--workers must be >= 1")
        load_tokenizer(args.tokenizer)  # fail early, before reading any input
        if args.input:
            files = expand_inputs(args.input)
            docs = iter_file_documents(files, args.doc_boundary, args.json_key)
            total = len(files) if args.doc_boundary in ("auto", "file") and not any(
                f.endswith((".jsonl", ".json")) for f in files) else None
        else:
            docs = iter_hf_documents(args.hf_dataset, args.hf_split, args.hf_text_field,
                                     args.hf_config)
            total = None
        n_docs, n_tokens = write_indexed_dataset(
            docs, args.tokenizer, args.output_prefix, args.append_eod, args.workers, total)
    except (InputError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output_prefix}.bin/.idx/.tokenizer.json: {n_docs} documents, {n_tokens} tokens")
    return 0


if __name__ == "__main__":
    # Running as a script puts scripts/ first on sys.path; the repo root holds `megatron/`.
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
