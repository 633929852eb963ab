"""scripts/preprocess_data.py records the tokenizer that made the tokens in PREFIX.tokenizer.json.

Oracles: hashlib over the tokenizer file's bytes and the `sentencepiece` processor called
directly; megatron-core's IndexedDataset still reads the prefix with the record beside it.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

import pytest
import sentencepiece

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import preprocess_data  # noqa: E402
import train_tokenizer  # noqa: E402

TEXT = ("the king and the queen spoke of honour and fortune in the garden at night; "
        "thou shalt remember the golden river and the silent mountain. ")


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    files = []
    for i in range(4):
        path = root / f"doc{i}.txt"
        path.write_text(" ".join(TEXT.split()[i:] + TEXT.split()[:i]) * (5 + i) + "\n", encoding="utf-8")
        files.append(str(path))
    models = [train_tokenizer.train(files, n, str(root / f"tok{n}"), threads=1) for n in (300, 320)]
    return files, models


def _record(prefix: str) -> dict:
    with open(prefix + ".tokenizer.json") as f:
        return json.load(f)


def test_preprocess_records_the_tokenizer(texts, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    files, (model, other) = texts
    prefix = str(tmp_path / "out" / "train_text_document")
    assert preprocess_data.main(["--input", *files, "--tokenizer", model, "--output-prefix", prefix]) == 0
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    with open(model, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    assert _record(prefix) == {"tokenizer": os.path.abspath(model), "sha256": sha,
                               "vocab_size": sp.get_piece_size(), "eod": sp.eos_id()}
    assert sp.get_piece_size() == 300 and sp.eos_id() == 3
    assert sorted(os.listdir(tmp_path / "out")) == [
        "train_text_document.bin", "train_text_document.idx", "train_text_document.tokenizer.json"]
    ds = IndexedDataset(prefix)   # megatron-core reads the prefix as before
    assert ds[0].tolist() == sp.encode(open(files[0], encoding="utf-8").read()) + [sp.eos_id()]

    # made again with another tokenizer: the record follows the tokens
    assert preprocess_data.main(["--input", *files, "--tokenizer", other, "--output-prefix", prefix]) == 0
    with open(other, "rb") as f:
        assert _record(prefix)["sha256"] == hashlib.sha256(f.read()).hexdigest() != sha
    assert _record(prefix)["vocab_size"] == 320

    # a run that fails (no documents) leaves the tokens and their record as they were
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    before = _record(prefix)
    assert preprocess_data.main(["--input", str(empty), "--tokenizer", model, "--output-prefix", prefix]) == 2
    assert _record(prefix) == before


def test_write_indexed_dataset_with_workers_records_the_tokenizer(texts, tmp_path):
    """The library path (prepare_quickstart_data.py's step 3, tokenizer worker processes)."""
    files, (model, _) = texts
    prefix = str(tmp_path / "valid_text_document")
    docs = preprocess_data.iter_file_documents(files, "file", "text")
    preprocess_data.write_indexed_dataset(docs, model, prefix, append_eod=True, workers=2, total=len(files))
    with open(model, "rb") as f:
        assert _record(prefix)["sha256"] == hashlib.sha256(f.read()).hexdigest()
