"""The zero-shot cloze task: predict the last word of a held-out passage (LAMBADA-style).

Built once, deterministically, from the held-out documents of a corpus (`corpus/heldout/*.txt`,
never seen in training) into a JSONL file, so every arm is scored on the same items.

An item is a passage of the source text that ends in a word:

    text[char_start:char_end] == context + " " + answer

- `answer`: a word of >= 4 ASCII letters, not all upper-case (Shakespeare's speaker names are
  upper-case and trivially predictable), preceded by one space and followed in the source by
  punctuation (.,;:!?) or a line end, so it really is a whole word that ends the passage.
- `context`: the text before it, starting at a word start, of `min_ctx`..`max_ctx` tokens (the
  length is drawn per item from that range).
- Token ids: `context_ids = tokenize(context)` and, for every choice c,
  `tokenize(context + " " + c) == context_ids + choice_ids[c]` (items whose tokenization is
  not a clean split at the word boundary are skipped), so scoring the ids is scoring the text.
- `choices`: the answer and `n_choices - 1` distractor words drawn from the same document's
  answer-eligible words (different case-insensitively), in a seeded order; `label` is the
  answer's index.

Passages of one document do not overlap. Sampling uses `random.Random(seed)` over the files in
sorted order, so the same inputs give the same file byte for byte.
"""
from __future__ import annotations

import json
import os
import random
import re

from megatron.training.tokenizer import sha256_file

BUILDER_VERSION = 1
WORD_RE = re.compile(r"[A-Za-z]+")
ENDERS = set(".,;:!?\n")


def answer_positions(text: str) -> list[tuple[int, int]]:
    """(start, end) of every word that may end a passage (see module docstring)."""
    out = []
    for m in WORD_RE.finditer(text):
        s, e = m.span()
        w = m.group()
        if len(w) < 4 or w.isupper():
            continue
        if s < 2 or text[s - 1] != " " or text[s - 2].isspace():
            continue
        if e >= len(text) or text[e] not in ENDERS:
            continue
        out.append((s, e))
    return out


def _word_starts(text: str, lo: int, hi: int) -> list[int]:
    """Positions p in [lo, hi) where a word starts (p == 0 or text[p-1] is whitespace)."""
    return [p for p in range(lo, hi) if not text[p].isspace() and (p == 0 or text[p - 1].isspace())]


def _split_ids(tok, context: str, word: str):
    """Ids of `word` after `context`, or None if tokenization does not split at the boundary."""
    ctx = tok.tokenize(context)
    full = tok.tokenize(context + " " + word)
    if full[:len(ctx)] != ctx or len(full) == len(ctx):
        return None
    return full[len(ctx):]


def _context_start(tok, text: str, word_start: int, target: int, max_chars: int) -> int | None:
    """The word start nearest to `word_start` whose context has >= `target` tokens."""
    starts = _word_starts(text, max(0, word_start - max_chars), word_start - 1)
    if not starts:
        return None
    count = lambda p: len(tok.tokenize(text[p:word_start - 1]))  # noqa: E731
    # token count falls (weakly) as the start moves right: binary search the last start >= target
    lo, hi = 0, len(starts) - 1
    if count(starts[0]) < target:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(starts[mid]) >= target:
            lo = mid
        else:
            hi = mid - 1
    return starts[lo]


def build_items(files: list[str], tok, *, n_items: int = 500, seed: int = 1234, min_ctx: int = 64,
                max_ctx: int = 200, n_choices: int = 4) -> list[dict]:
    rng = random.Random(seed)
    docs = []
    for path in sorted(files):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        pos = answer_positions(text)
        vocab = sorted({text[s:e] for s, e in pos})
        docs.append((os.path.basename(path), text, pos, vocab))
    pool = [(d, i) for d, (_, _, pos, _) in enumerate(docs) for i in range(len(pos))]
    rng.shuffle(pool)
    taken: dict[int, list[tuple[int, int]]] = {}
    items = []
    for d, i in pool:
        if len(items) >= n_items:
            break
        name, text, pos, vocab = docs[d]
        ws, we = pos[i]
        target = rng.randint(min_ctx, max_ctx)
        start = _context_start(tok, text, ws, target, max_chars=12 * max_ctx)
        if start is None:
            continue
        if any(start < e and s < we for s, e in taken.get(d, [])):
            continue  # overlaps a passage already taken
        context, answer = text[start:ws - 1], text[ws:we]
        ctx_ids = tok.tokenize(context)
        if not min_ctx <= len(ctx_ids) <= max_ctx:
            continue
        ans_ids = _split_ids(tok, context, answer)
        if ans_ids is None:
            continue
        distractors, choice_ids = [], [ans_ids]
        tries = 0
        while len(distractors) < n_choices - 1 and tries < 50:
            tries += 1
            w = vocab[rng.randrange(len(vocab))]
            if w.lower() == answer.lower() or w.lower() in {x.lower() for x in distractors}:
                continue
            ids = _split_ids(tok, context, w)
            if ids is not None:
                distractors.append(w)
                choice_ids.append(ids)
        if len(distractors) < n_choices - 1:
            continue
        order = list(range(n_choices))
        rng.shuffle(order)
        choices = [([answer] + distractors)[k] for k in order]
        ids = [choice_ids[k] for k in order]
        taken.setdefault(d, []).append((start, we))
        items.append({"id": len(items), "doc": name, "char_start": start, "char_end": we,
                      "context": context, "answer": answer, "context_ids": ctx_ids,
                      "answer_ids": ans_ids, "choices": choices, "choice_ids": ids,
                      "label": order.index(0)})
    return items


def build_meta(files, tokenizer_path, **params) -> dict:
    return {"builder_version": BUILDER_VERSION, **params,
            "tokenizer_sha256": sha256_file(tokenizer_path),
            "sources": {os.path.basename(p): sha256_file(p) for p in sorted(files)}}


def write(path: str, items: list[dict], meta: dict) -> None:
    """Atomic: items to PATH, meta to PATH.meta.json (written first; both via temp + rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    meta = {**meta, "n_items_built": len(items)}
    for target, text in ((path + ".meta.json", json.dumps(meta, indent=1) + "\n"),
                         (path, "".join(json.dumps(it) + "\n" for it in items))):
        with open(target + ".tmp", "w") as f:
            f.write(text)
        os.replace(target + ".tmp", target)


def read(path: str) -> tuple[list[dict], dict]:
    with open(path) as f:
        items = [json.loads(line) for line in f if line.strip()]
    meta_path = path + ".meta.json"
    meta = json.load(open(meta_path)) if os.path.isfile(meta_path) else {}
    return items, meta


def load_or_build(path: str, heldout_files: list[str], tok, tokenizer_path: str, *, n_items: int,
                  seed: int, min_ctx: int, max_ctx: int, n_choices: int, rebuild: bool = False,
                  log=print) -> list[dict]:
    """The task in `path`; built (and written) when missing, stale or `rebuild`."""
    params = dict(n_items=n_items, seed=seed, min_ctx=min_ctx, max_ctx=max_ctx, n_choices=n_choices)
    if not heldout_files:
        raise ValueError("no held-out documents to build the cloze task from")
    want = build_meta(heldout_files, tokenizer_path, **params)
    if os.path.isfile(path) and not rebuild:
        items, meta = read(path)
        have = {k: v for k, v in meta.items() if k != "n_items_built"}
        if have == want:
            return items
        log(f"[cloze] {path} was built from other inputs or parameters: rebuilding")
    items = build_items(heldout_files, tok, **params)
    if not items:
        raise ValueError("the held-out documents gave no cloze item")
    write(path, items, want)
    log(f"[cloze] wrote {len(items)} items to {path}")
    return items
