"""Text primitives shared by the corpus builder: paragraphs, normalised words, 13-grams.

A paragraph is a block of lines separated by one or more blank (whitespace-only) lines. The
normalised form of a paragraph is its lower-cased runs of letters and digits; two paragraphs
that differ only in case, punctuation or spacing normalise to the same word list, which is what
the leak filter compares.
"""

from __future__ import annotations

import hashlib
import re

_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n\s*")
_WORD = re.compile(r"[^\W_]+", re.UNICODE)


def paragraphs(text: str) -> list[str]:
    """Blank-line-separated blocks of `text`, stripped of surrounding blank space."""
    return [p.strip("\n") for p in _BLANK_LINES.split(text.strip()) if p.strip()]


def join_paragraphs(paras: list[str]) -> str:
    """Inverse of `paragraphs` up to blank-line spacing; a file ends with one newline."""
    return "\n\n".join(paras) + "\n" if paras else ""


def words(text: str) -> list[str]:
    """Normalised words: lower-cased runs of Unicode letters/digits."""
    return _WORD.findall(text.lower())


def paragraph_key(text: str) -> str | None:
    """Stable hash of a paragraph's normalised words, or None if it has no words."""
    w = words(text)
    if not w:
        return None
    return hashlib.sha1(" ".join(w).encode("utf-8")).hexdigest()


def ngrams(word_list: list[str], n: int = 13):
    """All consecutive n-word tuples of `word_list` (none if it is shorter than n)."""
    return (tuple(word_list[i:i + n]) for i in range(len(word_list) - n + 1))


_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_GUTENBERG_END = re.compile(r"^\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_OLD_NOTICE = re.compile(r"<<.*?>>", re.S)  # 1990s Gutenberg/World Library copyright notices


def strip_gutenberg(text: str) -> str:
    """Remove Project Gutenberg licence headers/footers and inline notices from `text`.

    Keeps the text between the `*** START OF ... ***` and `*** END OF ... ***` markers when they
    exist, then drops `<<...>>` notices and any paragraph that mentions Project Gutenberg or its
    e-text boilerplate.
    """
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[:end.start()]
    text = _OLD_NOTICE.sub("", text)
    keep = [p for p in paragraphs(text)
            if not re.search(r"project gutenberg|gutenberg\.org|\be-?texts?\b", p, re.I)]
    return join_paragraphs(keep)
