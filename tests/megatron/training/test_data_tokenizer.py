"""Training refuses data made with another tokenizer than `data.tokenizer`, with one `error:`
line (exit 2), never a traceback from the embedding and never a silent validation loss.

Two SentencePiece tokenizers of the same text, A (vocabulary 300) and B (400); every prefix is
made with scripts/preprocess_data.py, which records its tokenizer in PREFIX.tokenizer.json.
Data without a record (Megatron-LM's own tools, older data) is checked on its token ids.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.megatron.training import helpers

sys.path.insert(0, os.path.join(helpers.REPO, "scripts"))

WORDS = ("the and of to with from that thou thee king queen lord lady night morning honour fortune "
         "battle mercy gold silver river mountain sword crown heart spirit beauty justice reason "
         "garden winter summer shadow thunder gentle noble bitter sweet ancient golden").split()
RUN = ["model.preset=tiny", "model.num_layers=1", "model.seq_length=32", "train.global_batch_size=2",
       "train.micro_batch_size=2", "train.precision=fp32", "train.iters=2", "train.eval_iters=1",
       "train.eval_interval=2", "train.log_interval=1", "logging.tensorboard=false", 'data.split="100,0,0"']


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """root/{A,B}/tokenizer.model and root/{A,B}/{train,valid}_text_document made with it."""
    import preprocess_data
    import train_tokenizer

    root = tmp_path_factory.mktemp("tok_data")
    rng = random.Random(5)
    files = {}
    for side, n in (("train", 6), ("valid", 3)):
        (root / side).mkdir()
        files[side] = []
        for k in range(n):
            path = root / side / f"{k}.txt"
            path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))) + "."
                                      for _ in range(40)) + "\n", encoding="utf-8")
            files[side].append(str(path))
    for name, vocab in (("A", 300), ("B", 400)):
        model = train_tokenizer.train(files["train"], vocab, str(root / name / "tokenizer"), threads=1)
        for side in ("train", "valid"):
            assert preprocess_data.main(["--input", *files[side], "--tokenizer", model, "--output-prefix",
                                         str(root / name / f"{side}_text_document")]) == 0
    return str(root)


def pretrain(tmp, overrides: list[str]) -> subprocess.CompletedProcess:
    """pretrain_gpt.py on real data (helpers.run's overrides are for mock data)."""
    cmd = [sys.executable, helpers.PRETRAIN, "--config", helpers.base_config(str(tmp)), *RUN,
           f"data.cache_dir={tmp}/cache", f"logging.dir={tmp}/log", *overrides]
    return subprocess.run(cmd, cwd=helpers.REPO, env=helpers.env(), capture_output=True, text=True, timeout=300)


def train(data: str, tmp, path: str, valid: str, tokenizer: str) -> subprocess.CompletedProcess:
    return pretrain(tmp, [f"data.path=[{data}/{path}]", f"data.valid_path=[{data}/{valid}]",
                          f"data.tokenizer={data}/{tokenizer}"])


def one_error(r, *needles: str) -> str:
    out = r.stdout[-2000:] + r.stderr[-3000:]
    assert r.returncode == 2, out
    assert "Traceback" not in r.stderr, out
    errors = helpers.error_lines(r.stderr)
    assert len(errors) == 1, out
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def test_matching_tokenizer_trains_and_every_prefix_has_its_record(data, tmp_path):
    from megatron.training.tokenizer import sha256_file

    sha = sha256_file(os.path.join(data, "B", "tokenizer.model"))
    for side in ("train", "valid"):
        record = os.path.join(data, "B", f"{side}_text_document.tokenizer.json")
        assert os.path.isfile(record)
        with open(record) as f:
            assert json.load(f)["sha256"] == sha   # the check below ran against it, and passed
    r = train(data, tmp_path, "B/train_text_document", "B/valid_text_document", "B/tokenizer.model")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "validation loss at iteration 2" in r.stdout and not helpers.error_lines(r.stderr)


def test_data_path_made_with_another_tokenizer(data, tmp_path):
    """A user's data (B, the bigger vocabulary) trained with data.tokenizer forgotten (A): was an
    IndexError traceback from the embedding, exit 1."""
    one_error(train(data, tmp_path, "B/train_text_document", "A/valid_text_document", "A/tokenizer.model"),
                    "data.path", f"{data}/B/train_text_document", "B/tokenizer.model", "A/tokenizer.model",
                    "vocabulary 400", "vocabulary 300", "data.tokenizer=")


def test_valid_path_made_with_another_tokenizer(data, tmp_path):
    """Training data and data.tokenizer are the user's (B), data.valid_path still the old data
    (A, smaller vocabulary: every id fits): was a validation loss over the wrong tokens, exit 0."""
    one_error(train(data, tmp_path, "B/train_text_document", "A/valid_text_document", "B/tokenizer.model"),
              "data.valid_path", f"{data}/A/valid_text_document", "A/tokenizer.model", "B/tokenizer.model",
              "preprocess_data.py --tokenizer")


def test_data_without_record_with_ids_outside_the_vocabulary(data, tmp_path):
    """Data without a record (as Megatron-LM's tools make it) whose ids exceed the vocabulary:
    one error line naming the prefix, not the embedding's IndexError."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    bare = tmp_path / "bare"
    bare.mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(os.path.join(data, "B", "train_text_document" + ext), bare / ("train_text_document" + ext))
    ds = IndexedDataset(str(bare / "train_text_document"))
    assert max(int(ds[i].max()) for i in range(len(ds))) >= 300   # ids A's vocabulary lacks
    r = pretrain(tmp_path, [f"data.path=[{bare}/train_text_document]", f"data.valid_path=[{data}/A/valid_text_document]",
                            f"data.tokenizer={data}/A/tokenizer.model"])
    one_error(r, "data.path", f"{bare}/train_text_document", "token id", "A/tokenizer.model", "300 ids")


# --- the per-sample guard, in process -------------------------------------------------------------
@pytest.fixture(scope="module")
def dist():
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    yield


def test_ids_outside_the_sampled_windows_stop_at_the_sample(data, dist, tmp_path, monkeypatch):
    """An out-of-range id where the start-up sample does not look is a DataError (a UserError:
    one `error:` line, exit 2) naming the prefix when a batch reads it, before the model sees it."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron.training import data as data_mod
    from megatron.training.batches import micro_batches
    from megatron.training.errors import UserError
    from megatron.training.tokenizer import load_tokenizer

    tok = load_tokenizer(os.path.join(data, "A", "tokenizer.model"))
    prefix = str(tmp_path / "bare")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for k in range(20):
        doc = rng.integers(4, 300, 50).astype(np.uint16)
        if k == 10:
            doc[25] = 377  # one id of B's vocabulary in the middle of the file
        builder.add_document(np.append(doc, np.uint16(tok.eod)), [51])
    builder.finalize(prefix + ".idx")
    cfg = SimpleNamespace(path=[prefix], weights=None, split="100,0,0",
                          valid_path=[os.path.join(data, "A", "valid_text_document")],
                          cache_dir=str(tmp_path / "cache"), tokenizer="A/tokenizer.model",
                          reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    monkeypatch.setattr(data_mod, "SCAN_WINDOWS", 2)     # the start-up sample: the first and
    monkeypatch.setattr(data_mod, "SCAN_TOKENS", 100)    # the last 100 tokens only
    train, _, _ = data_mod.build_datasets(cfg, tokenizer=tok, seq_length=32, seed=0, train_samples=100,
                                          valid_samples=2)
    with pytest.raises(UserError) as e:
        for start in range(0, len(train), 2):
            micro_batches(train, start_sample=start, global_batch=2, micro_batch=2, dp_rank=0, dp_size=1,
                          device="cpu")
    message = str(e.value)
    assert message.startswith(f"data.path: {prefix} holds token id 377, outside the vocabulary of "
                              "data.tokenizer=A/tokenizer.model (300 ids)"), message
    monkeypatch.undo()   # the whole file sampled: the same error at start-up
    with pytest.raises(UserError, match="holds token id 377"):
        data_mod.build_datasets(cfg, tokenizer=tok, seq_length=32, seed=0, train_samples=100, valid_samples=2)
