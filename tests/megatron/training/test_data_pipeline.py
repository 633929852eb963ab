"""Data round trip: text -> tokenizer -> indexed dataset -> GPTDataset samples -> same text.

The oracles are independent of the code under test: the documents we wrote ourselves, the
SentencePiece processor used directly, and megatron-core's own IndexedDataset reader.
"""

import os
import random
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import sentencepiece
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import preprocess_data  # noqa: E402
import train_tokenizer  # noqa: E402

from megatron.training.tokenizer import TokenizerError, load_tokenizer  # noqa: E402

WORDS = ("the king queen noble lord lady sword crown night day love death honour speak "
         "thou thee art hast doth shall never ever Æsop naïve café 1603 12 o'clock").split()


def make_doc(rng, n_paras):
    paras = []
    for _ in range(n_paras):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))).capitalize()
                 + rng.choice([".", "!", "?", ",", ";"]) for _ in range(rng.randint(1, 4))]
        paras.append(("  " if rng.random() < 0.3 else "") + "\n".join(lines))
    return "\n\n".join(paras) + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    train_docs = [make_doc(rng, rng.randint(3, 30)) for _ in range(24)]
    valid_docs = [make_doc(rng, rng.randint(3, 10)) for _ in range(6)]
    for name, docs in (("train", train_docs), ("valid", valid_docs)):
        (root / name).mkdir()
        for i, d in enumerate(docs):
            (root / name / f"doc{i:02d}.txt").write_text(d, encoding="utf-8")
    model = train_tokenizer.train(sorted(map(str, (root / "train").glob("*.txt"))), 400,
                                  str(root / "tok"))
    tok = load_tokenizer(model)
    for name in ("train", "valid"):
        assert preprocess_data.main([
            "--input", str(root / name / "*.txt"), "--tokenizer", model,
            "--output-prefix", str(root / f"{name}_text_document")]) == 0
    return SimpleNamespace(root=root, model=model, tok=tok, train=train_docs, valid=valid_docs)


def test_tokenizer_interface_and_exact_detokenize(corpus):
    tok = corpus.tok
    sp = sentencepiece.SentencePieceProcessor(model_file=corpus.model)
    assert tok.vocab_size == sp.get_piece_size() == 400
    assert (tok.pad, tok.eod, tok.bos) == (0, 3, 2) and tok.eod == sp.piece_to_id("</s>")
    text = corpus.train[0] + "Unseen: ж 漢 🙂\ttab"
    ids = tok.tokenize(text)
    assert ids == sp.encode(text)
    assert tok.detokenize(ids) == text  # byte fallback + identity normalisation: exact
    assert len(tok.unique_identifiers["sha256"]) == 64


def test_tokenizer_training_is_deterministic(corpus, tmp_path):
    files = sorted(map(str, (corpus.root / "train").glob("*.txt")))
    a = sentencepiece.SentencePieceProcessor(
        model_file=train_tokenizer.train(files, 400, str(tmp_path / "a"), threads=1))
    b = sentencepiece.SentencePieceProcessor(
        model_file=train_tokenizer.train(files, 400, str(tmp_path / "b"), threads=2))
    pieces = lambda s: [(s.id_to_piece(i), s.get_score(i)) for i in range(s.get_piece_size())]
    assert pieces(a) == pieces(b) == pieces(corpus.tok._sp)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        load_tokenizer(str(tmp_path / "missing.model"))
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"this is not a protobuf")
    with pytest.raises(TokenizerError, match="not a valid SentencePiece model"):
        load_tokenizer(str(bad))


def test_hugging_face_and_tiktoken_tokenizers_match_their_libraries(corpus, tmp_path):
    """tokenizer.json (a byte-level BPE trained here) and a TikToken vocabulary through
    megatron-core's classes; oracles: the `tokenizers` and `tiktoken` libraries called directly."""
    import base64
    import json

    tokenizers = pytest.importorskip("tokenizers")
    tiktoken = pytest.importorskip("tiktoken")
    pytest.importorskip("transformers")
    from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import _PATTERN_TIKTOKEN_V2

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train_from_iterator(corpus.train, tokenizers.trainers.BpeTrainer(
        vocab_size=350, special_tokens=["<pad>", "<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    (tmp_path / "hf").mkdir()
    bpe.save(str(tmp_path / "hf" / "tokenizer.json"))
    text = corpus.valid[0] + "Unseen: ж 漢"
    for path in (tmp_path / "hf" / "tokenizer.json", tmp_path / "hf"):   # the file or its folder
        tok = load_tokenizer(str(path))
        assert tok.tokenize(text) == bpe.encode(text).ids
        assert tok.detokenize(tok.tokenize(text)) == text
        assert tok.vocab_size == 350 and tok.eod == bpe.token_to_id("<|endoftext|>") and tok.pad == -1
        assert len(tok.unique_identifiers["sha256"]) == 64

    merges = [b"th", b"he", b"the", b" the", b"ng", b"ki", b"king"]
    vocab = [{"rank": i, "token_bytes": base64.b64encode(m).decode(), "token_str": ""}
             for i, m in enumerate([bytes([b]) for b in range(256)] + merges)]
    (tmp_path / "tik.json").write_text(json.dumps(vocab))
    tok = load_tokenizer(str(tmp_path / "tik.json"))
    ref = tiktoken.Encoding(name="ref", pat_str=_PATTERN_TIKTOKEN_V2,
                            mergeable_ranks={base64.b64decode(v["token_bytes"]): v["rank"] for v in vocab},
                            special_tokens={})
    assert tok.tokenize(text) == [i + 1000 for i in ref.encode(text)]   # 1000 special ids first
    assert tok.vocab_size == 1000 + len(vocab) and tok.eod == 2         # </s>
    assert tok.detokenize(tok.tokenize(text)) == text

    (tmp_path / "other.json").write_text('{"vocab": 3}')
    with pytest.raises(TokenizerError, match="neither a Hugging Face tokenizer.json nor a TikToken"):
        load_tokenizer(str(tmp_path / "other.json"))
    with pytest.raises(TokenizerError, match="directory without tokenizer.model or tokenizer.json"):
        load_tokenizer(str(tmp_path))
    # another name: the loader would read the folder's tokenizer.json instead, so it is refused
    (tmp_path / "hf" / "mine.json").write_text((tmp_path / "hf" / "tokenizer.json").read_text())
    with pytest.raises(TokenizerError, match="name it tokenizer.json"):
        load_tokenizer(str(tmp_path / "hf" / "mine.json"))


def test_indexed_dataset_round_trip(corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(corpus.root / "train_text_document"))
    assert len(ds) == len(corpus.train)
    assert ds.index.dtype == np.uint16
    sp = sentencepiece.SentencePieceProcessor(model_file=corpus.model)
    for stored, text in zip((ds[i] for i in range(len(ds))), corpus.train):
        assert stored.tolist() == sp.encode(text) + [sp.eos_id()]
        assert sp.decode(stored[:-1].tolist()) == text


def test_doc_boundaries_jsonl_and_blank_line(tmp_path, corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    (tmp_path / "d.jsonl").write_text('{"text": "one doc"}\n\n{"text": "two\\n\\ndocs"}\n')
    (tmp_path / "b.txt").write_text("block one\nstill one\n\n\nblock two\n")
    for name, extra, expected in (("j", ["--input", str(tmp_path / "d.jsonl")],
                                   ["one doc", "two\n\ndocs"]),
                                  ("b", ["--input", str(tmp_path / "b.txt"),
                                         "--doc-boundary", "blank-line"],
                                   ["block one\nstill one", "block two"])):
        prefix = str(tmp_path / name)
        assert preprocess_data.main(extra + ["--tokenizer", corpus.model,
                                             "--output-prefix", prefix]) == 0
        ds = IndexedDataset(prefix)
        assert [corpus.tok.detokenize(ds[i][:-1]) for i in range(len(ds))] == expected


def test_preprocess_errors_are_one_line(tmp_path, corpus, capsys):
    out = str(tmp_path / "o")
    cases = [
        (["--input", str(tmp_path / "missing.txt"), "--tokenizer", corpus.model],
         "input file not found"),
        (["--input", str(tmp_path / "*.nomatch"), "--tokenizer", corpus.model], "no file matches"),
        (["--input", str(corpus.root / "train" / "doc00.txt"), "--tokenizer",
          str(tmp_path / "nope.model")], "tokenizer model not found"),
    ]
    (tmp_path / "empty.txt").write_text("")
    cases.append((["--input", str(tmp_path / "empty.txt"), "--tokenizer", corpus.model],
                  "empty corpus"))
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    cases.append((["--input", str(tmp_path / "bad.jsonl"), "--tokenizer", corpus.model],
                  "no field 'text'"))
    for argv, message in cases:
        assert preprocess_data.main(argv + ["--output-prefix", out]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
        assert not os.path.exists(out + ".bin") and not os.path.exists(out + ".idx")
    # As a process: non-zero exit, one message, no traceback.
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "preprocess_data.py"),
                           "--input", str(tmp_path / "missing.txt"), "--tokenizer",
                           corpus.model, "--output-prefix", out],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert "input file not found" in proc.stderr and "Traceback" not in proc.stderr


# --- megatron-core GPTDataset through build_datasets ---------------------------------------
@pytest.fixture(scope="module")
def dist():
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)  # no TCP port
    yield


def data_cfg(corpus, **kw):
    base = dict(path=[str(corpus.root / "train_text_document")], weights=None, split="90,10,0",
                valid_path=None, cache_dir=str(corpus.root / "cache"), tokenizer=corpus.model,
                num_workers=0, reset_position_ids=False, reset_attention_mask=False,
                eod_mask_loss=False)
    base.update(kw)
    return SimpleNamespace(**base)


def assert_windows_of(samples, docs, tok):
    """Each sample's token stream, cut at EOD, is whole documents between partial ends."""
    encoded = [tok.tokenize(d) for d in docs]
    whole = {tuple(e) for e in encoded}
    as_text = [tok.detokenize(e) for e in encoded]
    for s in samples:
        stream = s["tokens"].tolist() + [s["labels"][-1].item()]
        assert s["labels"][:-1].tolist() == stream[1:-1]
        pieces, cur = [], []
        for t in stream:
            if t == tok.eod:
                pieces.append(cur)
                cur = []
            else:
                cur.append(t)
        pieces.append(cur)
        for i, piece in enumerate(pieces):
            if 0 < i < len(pieces) - 1:
                assert tuple(piece) in whole
            elif piece:
                text = tok.detokenize(piece)
                assert any(text in d for d in as_text)


def test_build_datasets_samples_come_from_documents(corpus, dist):
    from megatron.training.data import batch_from_samples, build_datasets

    train, valid, test = build_datasets(data_cfg(corpus), tokenizer=corpus.tok, seq_length=64,
                                        seed=3, train_samples=40, valid_samples=8)
    assert test is None and len(train) >= 40 and len(valid) >= 8
    assert_windows_of([train[i] for i in range(40)], corpus.train, corpus.tok)
    batch = batch_from_samples([train[i] for i in range(4)])
    assert {k: tuple(v.shape) for k, v in batch.items()} == {
        k: (4, 64) for k in ("tokens", "labels", "loss_mask", "position_ids")}
    assert batch["position_ids"][0].tolist() == list(range(64))


def test_build_datasets_valid_path_reads_only_heldout(corpus, dist):
    from megatron.training.data import build_datasets

    cfg = data_cfg(corpus, valid_path=[str(corpus.root / "valid_text_document")],
                   path=[str(corpus.root / "train_text_document")] * 2, weights=[1.0, 3.0])
    train, valid, _ = build_datasets(cfg, tokenizer=corpus.tok, seq_length=32, seed=1,
                                     train_samples=30, valid_samples=10)
    assert_windows_of([valid[i] for i in range(10)], corpus.valid, corpus.tok)
    assert_windows_of([train[i] for i in range(30)], corpus.train, corpus.tok)


def test_build_datasets_resets_with_eod(corpus, dist):
    from megatron.training.data import build_datasets

    cfg = data_cfg(corpus, reset_position_ids=True, eod_mask_loss=True)
    train, _, _ = build_datasets(cfg, tokenizer=corpus.tok, seq_length=64, seed=0,
                                 train_samples=20, valid_samples=2)
    for i in range(20):
        s = train[i]
        eods = (s["tokens"] == corpus.tok.eod).nonzero().flatten().tolist()
        assert all(s["loss_mask"][j] == 0 for j in eods)
        for j in eods:
            if j + 1 < 64:
                assert s["position_ids"][j + 1] == 0


def test_build_datasets_errors(corpus, dist, tmp_path):
    from megatron.training.data import build_datasets

    kw = dict(tokenizer=corpus.tok, seq_length=32, seed=0, train_samples=4, valid_samples=2)
    missing = str(tmp_path / "nothing_here")
    with pytest.raises(ValueError, match="nothing_here.bin"):
        build_datasets(data_cfg(corpus, path=[missing]), **kw)
    with pytest.raises(ValueError, match="nothing_here"):
        build_datasets(data_cfg(corpus, valid_path=[missing]), **kw)
    with pytest.raises(ValueError, match="weights"):
        build_datasets(data_cfg(corpus, weights=[1.0, 2.0]), **kw)
    with pytest.raises(ValueError, match="valid split"):
        build_datasets(data_cfg(corpus, split="100,0,0"), **kw)
