"""Content checksums of a checkpoint's files, and the save_dir housekeeping that depends on them.

Every file of a checkpoint is listed in its `meta.json` twice: `files` (size in bytes, cheap to
check: catches truncation) and `checksums` (CRC-32 of the content, zlib's: catches flipped or
overwritten bytes; BLAKE2 would be stronger against tampering, which is not the threat here,
and CRC-32 is ~5x faster). Checksums are computed after every rank has written its files, each
rank taking its share of the file list, in a thread pool (zlib releases the GIL on large
buffers), and gathered into rank 0's meta.json; they are verified on load (by rank 0) before a
single tensor is read, so a damaged shard, `dist/.metadata`, RNG or extra file is reported in one
line naming the file instead of loading silently or failing inside torch's unpickler
(tests/megatron/training/test_reliability.py::test_flipped_bytes_are_refused_naming_the_file).

Checkpoints written before checksums existed (no `checksums` key) are checked by size only.
"""
from __future__ import annotations

import os
import re
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor

_CHUNK = 1 << 22
ITER_RE = re.compile(r"^iter_(\d{7,})$")
TMP_RE = re.compile(r"^iter_\d{7,}\.tmp$")
DIVERGED_SUFFIX = ".diverged"


def crc32_file(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                break
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def _files(root: str) -> list[str]:
    out = []
    for base, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(base, name), root)
            if rel not in ("meta.json", "meta.json.part"):
                out.append(rel)
    return sorted(out)


def list_files(root: str) -> list[str]:
    """Every file under root except meta.json, relative, sorted."""
    return _files(root)


def checksums(root: str, rels: list[str]) -> dict[str, str]:
    """{file: CRC-32 hex} of the given files under root, in a thread pool."""
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(rels)))) as pool:
        crcs = list(pool.map(lambda r: crc32_file(os.path.join(root, r)), rels))
    return dict(zip(rels, crcs))


def first_mismatch(root: str, checksums: dict[str, str]) -> str | None:
    """The first file (in sorted order) whose CRC-32 differs from the manifest, or None."""
    rels = sorted(checksums)
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(rels)))) as pool:
        got = list(pool.map(lambda r: crc32_file(os.path.join(root, r)), rels))
    return next((r for r, g in zip(rels, got) if g != checksums[r]), None)


def iteration_dirs(save_dir: str) -> list[tuple[int, str]]:
    """(iteration, name) of every `iter_N` directory (complete or not), newest first."""
    out = []
    for name in os.listdir(save_dir):
        m = ITER_RE.match(name)
        if m and os.path.isdir(os.path.join(save_dir, name)):
            out.append((int(m.group(1)), name))
    return sorted(out, reverse=True)


def clean_stale_tmp(save_dir: str) -> list[str]:
    """Remove `iter_N.tmp/` leftovers of interrupted saves (never a complete checkpoint: a save
    renames its directory only after meta.json is written). Only the holder of the save_dir
    lock may call this. Returns the names removed."""
    removed = []
    for name in sorted(os.listdir(save_dir)):
        if TMP_RE.match(name):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
            removed.append(name)
    return removed


def move_aside(path: str, suffix: str) -> str:
    """Rename a checkpoint directory out of the `iter_N` namespace (never delete it): to
    `<path><suffix>`, or `<path><suffix>.K` when that exists. Returns the new path."""
    dst, k = path + suffix, 1
    while os.path.exists(dst):
        dst, k = f"{path}{suffix}.{k}", k + 1
    os.replace(path, dst)
    return dst
