"""scripts/evaluate.py and the cloze task (scripts/_eval/cloze.py).

- Perplexity: a tiny model is trained for a few steps on a toy corpus; evaluate.py (which loads
  only the model tensors of the checkpoint) reports a perplexity that must equal exp(mean NLL)
  computed here from the logits of the same checkpoint loaded by the *trainer's* full resume
  path, on windows cut here from the raw .bin file. The per-item cloze results are checked
  against the same logits.
- Cloze builder: deterministic for a seed; every item is valid against the source text (the
  answer word really ends the passage there) and its token ids are the tokenizer's.
"""
from __future__ import annotations

import glob
import json
import math
import os
import random
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "scripts"))

from _eval import cloze  # noqa: E402

WORDS = ("the and of to with from that this thou thee thine king queen lord lady night morning "
         "honour fortune battle mercy gold silver river mountain sword crown heart spirit beauty "
         "justice reason father mother brother sister garden winter summer shadow thunder "
         "gentle noble bitter sweet ancient golden silent wander follow remember forgive "
         "promise whisper tremble answer").split()
TINY = ["model.preset=tiny", "model.num_layers=2", "model.seq_length=64", "train.global_batch_size=4",
        "train.micro_batch_size=4", "train.precision=fp32", "train.eval_iters=1", "train.eval_interval=2",
        "train.log_interval=1", "logging.tensorboard=false", "optimizer.warmup_iters=1", "optimizer.lr=3e-3",
        "optimizer.min_lr=3e-4", "checkpoint.save_interval=2"]


def _document(rng: random.Random, n_lines: int) -> str:
    lines = []
    for i in range(n_lines):
        if i % 7 == 0:
            lines.append(rng.choice(["KING.", "QUEEN.", "LORD."]))  # speaker names: never answers
        words = [rng.choice(WORDS) for _ in range(rng.randint(5, 11))]
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([",", ".", ";", "!", "?", ":"]))
        if i % 9 == 8:
            lines.append("")
    return "\n".join(lines) + "\n"


def make_toy_data(root: str, seed: int = 7) -> str:
    """A data dir laid out like data/quickstart: tokenizer, train/valid indexed datasets,
    corpus/{train,heldout}/*.txt, stats.json; ``seed`` draws its text. Returns its path."""
    import preprocess_data
    import train_tokenizer

    rng = random.Random(seed)
    for side, n_docs in (("train", 3), ("heldout", 2)):
        os.makedirs(os.path.join(root, "corpus", side), exist_ok=True)
        for k in range(n_docs):
            with open(os.path.join(root, "corpus", side, f"{side}{k}.txt"), "w") as f:
                f.write(_document(rng, 160))
    train_files = sorted(glob.glob(os.path.join(root, "corpus", "train", "*.txt")))
    held = sorted(glob.glob(os.path.join(root, "corpus", "heldout", "*.txt")))
    model = train_tokenizer.train(train_files, 400, os.path.join(root, "tokenizer"), threads=1)
    counts = {}
    for name, files in (("train", train_files), ("valid", held)):
        docs = preprocess_data.iter_file_documents(files, "file", "text")
        _, counts[name] = preprocess_data.write_indexed_dataset(
            docs, model, os.path.join(root, f"{name}_text_document"), append_eod=True, workers=1,
            total=len(files), desc=name)
    with open(os.path.join(root, "stats.json"), "w") as f:
        json.dump({"train_tokens": counts["train"], "valid_tokens": counts["valid"]}, f)
    return root


def env() -> dict:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
             PYTHONPATH=REPO + os.pathsep + e.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def data_overrides(d: str) -> list[str]:
    return [f"data.path=[{d}/train_text_document]", f"data.valid_path=[{d}/valid_text_document]",
            'data.split="100,0,0"', f"data.tokenizer={d}/tokenizer.model", f"data.cache_dir={d}/cache"]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_data(str(tmp_path_factory.mktemp("toy_data")))


@pytest.fixture(scope="module")
def tok(toy):
    from megatron.training.tokenizer import load_tokenizer

    return load_tokenizer(os.path.join(toy, "tokenizer.model"))


# ----------------------------------------------------------------------------- cloze builder
def check_items(items, files, tok, min_ctx, max_ctx, n_choices):
    texts = {os.path.basename(p): open(p, encoding="utf-8").read() for p in files}
    spans = {}
    for it in items:
        text = texts[it["doc"]]
        s, e = it["char_start"], it["char_end"]
        assert text[s:e] == it["context"] + " " + it["answer"]
        assert text[e] in ".,;:!?\n"  # the word really ends there in the source
        assert s == 0 or text[s - 1].isspace()
        assert it["answer"].isalpha() and len(it["answer"]) >= 4 and not it["answer"].isupper()
        assert tok.tokenize(it["context"]) == it["context_ids"]
        assert min_ctx <= len(it["context_ids"]) <= max_ctx
        assert len(it["choices"]) == n_choices and it["choices"][it["label"]] == it["answer"]
        assert len({c.lower() for c in it["choices"]}) == n_choices
        assert it["choice_ids"][it["label"]] == it["answer_ids"]
        for c, ids in zip(it["choices"], it["choice_ids"]):
            assert tok.tokenize(it["context"] + " " + c) == it["context_ids"] + ids
        for a, b in spans.get(it["doc"], []):
            assert e <= a or b <= s, "passages of one document overlap"
        spans.setdefault(it["doc"], []).append((s, e))


def test_cloze_builder_deterministic_and_valid(toy, tok):
    files = sorted(glob.glob(os.path.join(toy, "corpus", "heldout", "*.txt")))
    kw = dict(n_items=40, seed=5, min_ctx=24, max_ctx=60, n_choices=4)
    a = cloze.build_items(files, tok, **kw)
    b = cloze.build_items(list(reversed(files)), tok, **kw)  # order of the file list is irrelevant
    assert a == b and len(a) == 40
    assert cloze.build_items(files, tok, **{**kw, "seed": 6}) != a
    check_items(a, files, tok, 24, 60, 4)
    assert len({it["label"] for it in a}) > 1  # the answer is not always in the same slot


def test_cloze_file_written_once_and_rebuilt_when_inputs_change(toy, tok, tmp_path):
    files = sorted(glob.glob(os.path.join(toy, "corpus", "heldout", "*.txt")))
    tp = os.path.join(toy, "tokenizer.model")
    kw = dict(n_items=10, seed=1, min_ctx=24, max_ctx=60, n_choices=3)
    path = str(tmp_path / "cloze.jsonl")
    items = cloze.load_or_build(path, files, tok, tp, **kw, log=lambda m: None)
    first = open(path).read()
    assert cloze.read(path)[0] == items
    assert cloze.load_or_build(path, files, tok, tp, **kw, log=lambda m: None) == items
    assert open(path).read() == first
    other = cloze.load_or_build(path, files, tok, tp, **{**kw, "seed": 2}, log=lambda m: None)
    assert other != items and cloze.read(path)[1]["seed"] == 2


@pytest.mark.skipif(not (os.path.isfile(os.path.join(REPO, "data", "quickstart", "tokenizer.model"))
                         and glob.glob(os.path.join(REPO, "data", "quickstart", "corpus", "heldout", "*.txt"))),
                    reason="data/quickstart and its corpus not prepared (scripts/prepare_quickstart_data.py)")
def test_cloze_items_valid_on_quickstart_heldout():
    from megatron.training.tokenizer import load_tokenizer

    d = os.path.join(REPO, "data", "quickstart")
    t = load_tokenizer(os.path.join(d, "tokenizer.model"))
    files = sorted(glob.glob(os.path.join(d, "corpus", "heldout", "*.txt")))
    items = cloze.build_items(files, t, n_items=30, seed=1234)
    assert len(items) == 30
    check_items(items, files, t, 64, 200, 4)


# ----------------------------------------------------------------------------- evaluate.py
ORACLE = r"""
import json, sys
import numpy as np, torch
from megatron.training.config import load_config
from megatron.training.trainer import Trainer
args = json.loads(sys.argv[1])
cfg = load_config(args["config"], args["overrides"])
tr = Trainer(cfg, verbose=False)           # the trainer's own resume path (model + optimizer + RNG)
assert tr.iteration == args["iters"], tr.iteration
gpt = tr.gpt.eval()
s = cfg.model.seq_length
stream = torch.from_numpy(np.fromfile(args["valid_bin"], dtype=np.uint16).astype(np.int64))
def logits(ids):
    x = torch.tensor([ids])
    with torch.no_grad():
        return gpt(x, torch.arange(len(ids)).unsqueeze(0), None)[0].double()
nll, n = 0.0, 0
for i in range((len(stream) - 1) // s):
    lp = torch.log_softmax(logits(stream[i * s:(i + 1) * s].tolist()), -1)
    y = stream[i * s + 1:(i + 1) * s + 1]
    nll -= lp[torch.arange(s), y].sum().item(); n += s
items = [json.loads(l) for l in open(args["cloze"])]
greedy, lps = [], []
for it in items:
    row = []
    for k, ans in enumerate(it["choice_ids"]):
        ctx = it["context_ids"][-(s - len(ans)):]
        lg = logits(ctx + ans)
        pos = torch.arange(len(ctx) - 1, len(ctx) - 1 + len(ans))
        row.append(torch.log_softmax(lg, -1)[pos, torch.tensor(ans)].sum().item())
        if k == it["label"]:
            greedy.append(bool((lg[pos].argmax(-1) == torch.tensor(ans)).all()))
    lps.append(row)
json.dump({"nll": nll, "n": n, "greedy": greedy, "logprobs": lps}, open(args["out"], "w"))
"""


def test_evaluate_perplexity_and_cloze_match_independent_oracle(toy, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  preset: tiny\n")
    ckpt = str(tmp_path / "ckpt")
    overrides = TINY + data_overrides(toy) + ["train.iters=3", f"checkpoint.save_dir={ckpt}",
                                              f"logging.dir={tmp_path}/log"]
    p = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), "--config", str(cfg), *overrides],
                       cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]

    out = str(tmp_path / "eval.json")
    p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "evaluate.py"), "--checkpoint", f"toy={ckpt}",
                        "--data", toy, "--cloze-items", "12", "--cloze-min-ctx", "24", "--cloze-max-ctx", "60",
                        "--batch-size", "3", "--per-item", "--out", out],
                       cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.load(open(out))["results"]["toy"]
    assert res["iteration"] == 3 and res["checkpoint"].endswith("iter_0000003")
    assert os.path.isfile(os.path.join(toy, "cloze.jsonl"))

    oracle = str(tmp_path / "oracle.json")
    args = {"config": str(cfg), "iters": 3, "valid_bin": os.path.join(toy, "valid_text_document.bin"),
            "cloze": os.path.join(toy, "cloze.jsonl"), "out": oracle,
            "overrides": overrides + [f"checkpoint.load={ckpt}/iter_0000003", "checkpoint.save_dir=null",
                                      "checkpoint.save_interval=null", "logging.dir=null"]}
    p = subprocess.run([sys.executable, "-c", ORACLE, json.dumps(args)], cwd=REPO, env=env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    o = json.load(open(oracle))

    h = res["heldout"]
    assert h["tokens"] == o["n"] and h["seq_length"] == 64
    assert h["perplexity"] == pytest.approx(math.exp(o["nll"] / o["n"]), rel=1e-5)
    assert h["mean_nll"] == pytest.approx(o["nll"] / o["n"], rel=1e-5)
    assert 1.0 < h["perplexity"] < 512  # a trained model beats the uniform distribution

    c = res["cloze"]
    items = [json.loads(line) for line in open(os.path.join(toy, "cloze.jsonl"))]
    assert c["items"] == len(items) == 12
    per = c["per_item"]
    assert [x["greedy_correct"] for x in per] == o["greedy"]
    for x, row in zip(per, o["logprobs"]):
        assert x["logprobs"] == pytest.approx(row, rel=1e-4, abs=1e-4)
    assert c["greedy_accuracy"] == pytest.approx(sum(o["greedy"]) / 12)
    want = sum(max(range(len(r)), key=r.__getitem__) == it["label"] for r, it in zip(o["logprobs"], items)) / 12
    assert c["choice_accuracy"] == pytest.approx(want)

    # Perplexity only (--cloze-items 0), on the same indexed dataset named by --valid-prefix with
    # a data dir that has no tokenizer, no held-out text and no cloze file; then on the held-out
    # *text files* that dataset was made from, tokenized by evaluate.py with the checkpoint's
    # tokenizer: the same token stream, so the same numbers.
    empty = tmp_path / "empty"
    empty.mkdir()
    held = sorted(glob.glob(os.path.join(toy, "corpus", "heldout", "*.txt")))
    for extra in (["--valid-prefix", os.path.join(toy, "valid_text_document")], ["--text", *held]):
        p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "evaluate.py"), "--checkpoint", ckpt,
                            "--data", str(empty), "--cloze-items", "0", "--batch-size", "3", *extra],
                           cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        r = next(iter(json.loads(p.stdout)["results"].values()))
        assert r["cloze"] is None and r["heldout"] == h
    assert not os.listdir(empty)


@pytest.mark.long
def test_evaluate_errors_are_one_line(toy, tmp_path):
    cases = [(["--checkpoint", str(tmp_path / "nope"), "--data", toy, "--cloze-items", "0"], "no such checkpoint"),
             (["--checkpoint", "x", "--text", "a.txt", "--valid-prefix", "b"], "not both"),
             (["--checkpoint", "x", "--cloze-items", "-1"], "--cloze-items must be >= 0"),
             (["--build-cloze-only", "--data", toy, "--heldout-dir", str(tmp_path)], "--cloze-items 0 skips")]
    for argv, message in cases:
        p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "evaluate.py"), *argv],
                           cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
        errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
        assert p.returncode == 2 and len(errors) == 1 and message in errors[0], (argv, p.stderr[-2000:])
        assert "Traceback" not in p.stderr


@pytest.mark.long   # preprocess, train and evaluate end to end, ~25 s (make test-all)
def test_hugging_face_tokenizer_json_preprocess_train_evaluate(toy, tmp_path):
    """A Hugging Face tokenizer.json (a byte-level BPE trained here with `tokenizers`, no
    network) through preprocessing, training and evaluation. Oracles: the `tokenizers` library
    called directly for the stored ids; the perplexity of the text files tokenized at evaluation
    equals that of the indexed dataset preprocessed from them."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    import preprocess_data
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    train_files = sorted(glob.glob(os.path.join(toy, "corpus", "train", "*.txt")))
    held = sorted(glob.glob(os.path.join(toy, "corpus", "heldout", "*.txt")))
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=420, special_tokens=["<pad>", "</s>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train(train_files, trainer)
    tok_json = str(tmp_path / "tok" / "tokenizer.json")
    os.makedirs(os.path.dirname(tok_json))
    bpe.save(tok_json)
    eos = bpe.token_to_id("</s>")

    d = tmp_path / "data"
    for name, files in (("train", train_files), ("valid", held)):
        assert preprocess_data.main(["--input", *files, "--tokenizer", tok_json,
                                     "--output-prefix", str(d / f"{name}_text_document")]) == 0
    ds = IndexedDataset(str(d / "valid_text_document"))
    for i, path in enumerate(held):
        assert ds[i].tolist() == bpe.encode(open(path, encoding="utf-8").read()).ids + [eos]

    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  preset: tiny\n")
    ckpt = str(tmp_path / "ckpt")
    overrides = TINY + [f"data.path=[{d}/train_text_document]", f"data.valid_path=[{d}/valid_text_document]",
                        'data.split="100,0,0"', f"data.tokenizer={tok_json}", f"data.cache_dir={d}/cache",
                        "train.iters=2", f"checkpoint.save_dir={ckpt}"]
    p = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), "--config", str(cfg), *overrides],
                       cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "validation loss at iteration 2" in p.stdout
    results = []
    for extra in (["--valid-prefix", str(d / "valid_text_document")], ["--text", *held]):
        p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "evaluate.py"), "--checkpoint", ckpt,
                            "--data", str(d), "--cloze-items", "0", *extra],
                           cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        out = json.loads(p.stdout)
        assert out["meta"]["tokenizer"] == tok_json  # the checkpoint's own tokenizer
        results.append(next(iter(out["results"].values()))["heldout"])
    assert results[0] == results[1] and 1.0 < results[0]["perplexity"] < 420
    # held-out tokens made with another tokenizer (the toy corpus's SentencePiece, recorded by
    # preprocess_data beside them): one error line, no perplexity of meaningless ids
    p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "evaluate.py"), "--checkpoint", ckpt,
                        "--valid-prefix", f"{toy}/valid_text_document", "--cloze-items", "0"],
                       cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "was tokenized with" in errors[0], p.stderr[-2000:]


def test_bad_tokenizer_is_one_error_line_in_every_mode(toy, tmp_path):
    import preprocess_data

    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  preset: tiny\n")
    data = [f"data.path=[{toy}/train_text_document]", f"data.valid_path=[{toy}/valid_text_document]",
            'data.split="100,0,0"']
    runs = {"dry-run": [os.path.join(REPO, "pretrain_gpt.py"), "--config", str(cfg), "--dry-run"],
            "train": [os.path.join(REPO, "pretrain_gpt.py"), "--config", str(cfg), "train.iters=1"]}
    for tokenizer, message in ((str(tmp_path / "missing.model"), "tokenizer model not found"),
                               (str(bad), "neither a Hugging Face tokenizer.json nor a TikToken")):
        for mode, argv in runs.items():
            p = subprocess.run([sys.executable, *argv, *data, f"data.tokenizer={tokenizer}"], cwd=REPO, env=env(),
                               capture_output=True, text=True, timeout=300)
            errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
            assert p.returncode == 2 and len(errors) == 1 and message in errors[0], (mode, p.stderr[-2000:])
            assert "Traceback" not in p.stderr
        assert preprocess_data.main(["--input", *glob.glob(os.path.join(toy, "corpus", "train", "*.txt")),
                                     "--tokenizer", tokenizer, "--output-prefix", str(tmp_path / "x")]) == 2


def test_train_on_your_text_with_one_input_file(toy, tmp_path):
    """examples/train_on_your_text.sh on a folder holding one input.txt: its paragraphs become
    the documents, training validates on some of them, and the evaluate line it prints runs."""
    src = tmp_path / "mine"
    src.mkdir()
    text = "\n\n".join(open(p, encoding="utf-8").read()
                        for p in sorted(glob.glob(os.path.join(toy, "corpus", "train", "*.txt"))))
    (src / "input.txt").write_text(text)
    e = env()
    e.update(PY=sys.executable, OUT=str(tmp_path / "out"), RUN=str(tmp_path / "run"), VOCAB="400")
    p = subprocess.run(["bash", os.path.join(REPO, "examples", "train_on_your_text.sh"), str(src),
                        "model.num_layers=2", "model.seq_length=32", "train.iters=2", "train.eval_interval=2",
                        "train.eval_iters=1", "train.global_batch_size=4", "train.micro_batch_size=4",
                        "train.log_interval=1", "logging.tensorboard=false", "checkpoint.save_interval=null"],
                       cwd=REPO, env=e, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "--doc-boundary blank-line" in p.stdout
    n_docs = int(p.stdout.split(" documents,")[0].rsplit(" ", 1)[1])
    n_paragraphs = len([b for b in text.split("\n\n") if b.strip()])
    assert n_docs == n_paragraphs > 4
    assert "validation loss at iteration 2" in p.stdout
    cmd = p.stdout.strip().splitlines()[-1].split("evaluate: ", 1)[1].split()
    q = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert q.returncode == 0, q.stderr[-3000:]
    assert next(iter(json.loads(q.stdout)["results"].values()))["heldout"]["perplexity"] > 1.0
