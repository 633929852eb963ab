"""The leak-proof train/held-out split.

1. Whole groups go to one side (a group = every document that shares text: a play in both
   editions, a Bible book in every translation). Per stratum (the group name before "/":
   shakespeare, bible, ...), groups are sorted by name, shuffled with
   `random.Random(f"{seed}/{stratum}")`, and taken into held-out until it holds at least
   `heldout_fraction` of that stratum's bytes (at least one group, never all of them). Seeding
   per stratum keeps its split the same whatever else is in the corpus, so the small corpus's
   held-out plays are held out in the large corpus too.
2. Every training paragraph is dropped whose normalised hash equals that of a held-out paragraph,
   or any of whose normalised-word 13-grams occurs anywhere in the held-out documents (13-grams
   are taken over each held-out document's whole word stream, so they also span paragraph breaks).
3. Within each side, exact repeats of a paragraph (normalised, at least `min_dedup_words` words)
   after its first occurrence are dropped.
"""

from __future__ import annotations

import random
from collections import defaultdict

from .sources import Document
from .text import join_paragraphs, ngrams, paragraph_key, paragraphs, words

NGRAM = 13


def stratum(group: str) -> str:
    """Groups are named `<stratum>/<key>` (shakespeare/hamlet, bible/01); the split is per stratum."""
    return group.split("/", 1)[0]


def split_groups(docs: list[Document], heldout_fraction: float, seed: int):
    """(train_docs, heldout_docs): whole groups per side, chosen per stratum (see module doc)."""
    by_stratum = defaultdict(lambda: defaultdict(int))  # stratum -> group -> bytes
    for d in docs:
        by_stratum[stratum(d.group)][d.group] += len(d.text.encode("utf-8"))
    heldout_groups = set()
    for name in sorted(by_stratum):
        sizes = by_stratum[name]
        groups = sorted(sizes)
        random.Random(f"{seed}/{name}").shuffle(groups)
        total, taken = sum(sizes.values()), 0
        for g in groups[:-1]:  # never hold out every group; a lone group trains
            heldout_groups.add(g)
            taken += sizes[g]
            if taken >= heldout_fraction * total:
                break
    train = [d for d in docs if d.group not in heldout_groups]
    heldout = [d for d in docs if d.group in heldout_groups]
    return train, heldout


def heldout_fingerprints(heldout: list[Document], n: int = NGRAM):
    """(paragraph hashes, n-gram hashes) of the held-out documents."""
    para_keys, gram_keys = set(), set()
    for d in heldout:
        for p in paragraphs(d.text):
            k = paragraph_key(p)
            if k:
                para_keys.add(k)
        gram_keys.update(hash(g) for g in ngrams(words(d.text), n))
    return para_keys, gram_keys


def filter_leaks(train: list[Document], heldout: list[Document], n: int = NGRAM):
    """Drop leaking training paragraphs (module doc, step 2); returns (docs, stats)."""
    para_keys, gram_keys = heldout_fingerprints(heldout, n)
    out, stats = [], {"paragraphs_kept": 0, "dropped_same_paragraph": 0,
                      "dropped_shared_13gram": 0, "documents_emptied": 0}
    for d in train:
        keep = []
        for p in paragraphs(d.text):
            if paragraph_key(p) in para_keys:
                stats["dropped_same_paragraph"] += 1
            elif any(hash(g) in gram_keys for g in ngrams(words(p), n)):
                stats["dropped_shared_13gram"] += 1
            else:
                keep.append(p)
        stats["paragraphs_kept"] += len(keep)
        if keep:
            out.append(Document(d.name, d.group, d.source, join_paragraphs(keep)))
        else:
            stats["documents_emptied"] += 1
    return out, stats


def dedupe_paragraphs(docs: list[Document], min_words: int = 8):
    """Drop repeats of long paragraphs after their first occurrence; returns (docs, n_dropped)."""
    seen, dropped, out = set(), 0, []
    for d in docs:
        keep = []
        for p in paragraphs(d.text):
            w = words(p)
            if len(w) >= min_words:
                k = paragraph_key(p)
                if k in seen:
                    dropped += 1
                    continue
                seen.add(k)
            keep.append(p)
        if keep:
            out.append(Document(d.name, d.group, d.source, join_paragraphs(keep)))
    return out, dropped


def leak_check(train: list[Document], heldout: list[Document], n: int = NGRAM) -> dict:
    """Independent audit of a finished split: counts of shared groups, paragraphs, n-grams."""
    para_keys, gram_keys = heldout_fingerprints(heldout, n)
    shared_par = shared_gram = 0
    for d in train:
        for p in paragraphs(d.text):
            if paragraph_key(p) in para_keys:
                shared_par += 1
            if any(hash(g) in gram_keys for g in ngrams(words(p), n)):
                shared_gram += 1
    groups = {d.group for d in train} & {d.group for d in heldout}
    return {"shared_groups": len(groups), "shared_paragraphs": shared_par,
            "paragraphs_with_shared_13gram": shared_gram}
