"""The corpus split cannot leak: checked on a synthetic corpus with deliberate overlaps.

The audit here re-derives paragraphs, normalised words and 13-grams with its own few lines
(not the builder's helpers) from the files the builder wrote.
"""

import hashlib
import json
import os
import random
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import build_corpus  # noqa: E402
from _corpus.sources import parse_plain_text_bible  # noqa: E402
from _corpus.text import strip_gutenberg  # noqa: E402

SHARED_PARAGRAPH = "Exactly the same paragraph, copied into every single document of the corpus."
SHARED_RUN = "one two three four five six seven eight nine ten eleven twelve thirteen"


def norm_words(text):
    return re.findall(r"[a-z0-9]+", text.lower())


def paras(text):
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def write_corpus(root):
    rng = random.Random(1)
    vocab = [f"w{i}" for i in range(3000)]
    sentence = lambda n: " ".join(rng.choice(vocab) for _ in range(n)) + "."
    for g in range(12):
        folder = root / f"work{g:02d}" if g < 4 else root
        folder.mkdir(exist_ok=True)
        editions = ["a", "b"] if g < 4 else [""]
        base = [sentence(rng.randint(15, 40)) for _ in range(8)]
        for e in editions:
            body = list(base)  # the two editions of a work share their paragraphs
            body.insert(3, SHARED_PARAGRAPH)
            # A paragraph that embeds the shared 13-word run inside otherwise unique words.
            body.insert(5, f"{sentence(5)} {SHARED_RUN} {sentence(5)}")
            body.append(sentence(20))  # unique to this file
            name = f"{e or 'doc'}{g:02d}.txt"
            (folder / name).write_text("\n\n".join(body) + "\n")


def read_side(out, side):
    return {f: (out / side / f).read_text() for f in sorted(os.listdir(out / side))}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    src = root / "src"
    src.mkdir()
    write_corpus(src)
    out = root / "out"
    assert build_corpus.main(["--from-dir", str(src), "--out", str(out),
                              "--heldout-fraction", "0.25", "--seed", "7"]) == 0
    return src, out, json.loads((out / "manifest.json").read_text())


def test_no_shared_document_group_paragraph_or_13gram(built):
    src, out, manifest = built
    train, heldout = read_side(out, "train"), read_side(out, "heldout")
    assert train and heldout
    groups = {e["file"]: e["group"] for e in manifest["files"]}
    assert not ({groups["train/" + f] for f in train} & {groups["heldout/" + f] for f in heldout})
    # Both editions of a work sit on one side.
    for g in range(4):
        sides = {side for side, files in (("t", train), ("h", heldout)) for f in files
                      if f.startswith(f"local-work{g:02d}_")}
        assert len(sides) == 1
    held_paras = {" ".join(norm_words(p)) for t in heldout.values() for p in paras(t)}
    held_grams = set()
    for t in heldout.values():
        w = norm_words(t)
        held_grams.update(tuple(w[i:i + 13]) for i in range(len(w) - 12))
    for text in train.values():
        for p in paras(text):
            w = norm_words(p)
            assert " ".join(w) not in held_paras
            assert not any(tuple(w[i:i + 13]) in held_grams for i in range(len(w) - 12))
    # The deliberate overlaps were dropped from train and kept in held-out.
    assert not any(SHARED_PARAGRAPH in t or SHARED_RUN in t for t in train.values())
    assert all(SHARED_RUN in t for t in heldout.values())
    assert sum(t.count(SHARED_PARAGRAPH) for t in heldout.values()) == 1  # deduplicated
    stats = manifest["leak_filter"]
    assert stats["dropped_same_paragraph"] >= len(train)
    assert stats["dropped_shared_13gram"] >= len(train)
    # Everything else in train survived, once (the editions' identical copies are deduplicated).
    expected = set()
    for f in train:
        rel = f[len("local-"):-len(".txt")].replace("_", "/", 1) if f.startswith("local-work") \
            else f[len("local-"):-len(".txt")]
        text = (src / (rel + ".txt")).read_text()
        expected |= {p for p in paras(text) if p.strip() != SHARED_PARAGRAPH and SHARED_RUN not in p}
    got = [p.strip() for t in train.values() for p in paras(t)]
    assert len(got) == len(set(got)) and set(got) == {p.strip() for p in expected}


def test_manifest_matches_files_and_build_is_deterministic(built, tmp_path):
    src, out, manifest = built
    for e in manifest["files"]:
        data = (out / e["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == e["sha256"] and len(data) == e["bytes"]
    n_files = len(os.listdir(out / "train")) + len(os.listdir(out / "heldout"))
    assert manifest["train"]["documents"] + manifest["heldout"]["documents"] == n_files == 16
    again = tmp_path / "again"
    assert build_corpus.main(["--from-dir", str(src), "--out", str(again),
                              "--heldout-fraction", "0.25", "--seed", "7"]) == 0
    assert json.loads((again / "manifest.json").read_text())["files"] == manifest["files"]
    assert build_corpus.is_complete(str(again))
    (again / manifest["files"][0]["file"]).write_text("truncated")
    assert not build_corpus.is_complete(str(again))


def test_bad_input_is_one_message(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert build_corpus.main(["--from-dir", str(empty), "--out", str(tmp_path / "o")]) == 1
    assert "no .txt files" in capsys.readouterr().err
    (empty / "only.txt").write_text("a single document cannot be split\n")
    assert build_corpus.main(["--from-dir", str(empty), "--out", str(tmp_path / "o")]) == 1
    assert "at least two groups" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        build_corpus.main(["--from-dir", str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    assert exc.value.code == 2


def test_strip_gutenberg():
    raw = ("The Project Gutenberg EBook of X\n\nlicence words\n"
           "*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n\nReal text here.\n\n"
           "<<THIS ELECTRONIC VERSION IS COPYRIGHT 1990 WORLD LIBRARY>>\n\n"
           "My pretext stays.\n\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***\n\nfooter\n")
    assert strip_gutenberg(raw) == "Real text here.\n\nMy pretext stays.\n"


def test_parse_plain_text_bible():
    text = "\n1. In the beginning [was] light. 2. And more.\n3. Third verse.\n1. Next book.\n"
    starts = {1001001: 1, 1001002: 34, 1001003: 47, 2001001: 63}
    ends = {1001001: 33, 1001002: 46, 1001003: 62, 2001001: 76}
    source = (f"bible = Bible(Version.X, {text!r}, {starts!r}, {ends!r}, "
              "{Book.A: {1: 3}, Book.B: {1: 1}}, {Book.A: 'Alpha', Book.B: 'Beta'}, False)")
    books = list(parse_plain_text_bible(source))
    assert books == [(1, "Alpha", "Alpha\n\nIn the beginning was light. And more.\n\n"
                                  "Third verse.\n"),
                     (2, "Beta", "Beta\n\nNext book.\n")]
