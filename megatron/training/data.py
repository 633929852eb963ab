"""Train/valid/test datasets over megatron-core's indexed datasets, and batch collation.

`build_datasets` turns the `data` section of the config into megatron-core `GPTDataset`s (or
`BlendedDataset`s of them) through `BlendedMegatronDatasetBuilder` + `GPTDatasetConfig`:

- `path` (+ optional `weights`, equal when None) with `split` ("98,2,0"): every split is carved,
  document-wise, out of the same prefixes (megatron's `blend` + `split`).
- `valid_path` set: validation reads those prefixes instead (megatron's `blend_per_split`), so
  held-out text prepared by `scripts/build_corpus.py` stays held out; training then reads *all*
  documents of `path` and `split` is not used to carve anything (megatron forbids `split` with
  `blend_per_split`). Test data then comes from nowhere: `test_samples` must be 0.

torch.distributed must be initialised (gloo on CPU is fine); every rank builds its own index
(`is_built_on_rank` is always True), cached under `cache_dir` when given.

Every prefix must have been tokenized with `data.tokenizer` (token ids mean nothing under
another tokenizer): `scripts/preprocess_data.py` writes `PREFIX.tokenizer.json` (the tokenizer's
sha256, vocabulary size and end-of-document id; megatron-core reads only PREFIX.bin/.idx and
never looks at it), and a prefix whose record names another tokenizer is one `DataError`.
Prefixes without a record (Megatron-LM's own tools, older data) are checked on their ids alone:
a bounded sample at start-up, then every sample as it is read (`check_tokenizer`, `IdGuard`).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Sequence

import numpy as np
import torch

from megatron.training.errors import DataError

_DATASET_LOGGERS = ("megatron.core.datasets",)

TOKENIZER_RECORD = ".tokenizer.json"  # PREFIX + this: which tokenizer made PREFIX.bin/.idx


def _check_prefixes(prefixes: Sequence[str], what: str) -> None:
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise ValueError(
                    f"data.{what}: dataset file not found: {prefix + ext} "
                    f"(make it with scripts/preprocess_data.py --output-prefix {prefix})"
                )
        check_bin_matches_idx(prefix, what)


def _index_header(prefix: str) -> tuple[type, int, int]:
    """(token dtype, sequences, documents) from the 34-byte header of PREFIX.idx; ValueError when
    it is not a megatron indexed-dataset index (version 1)."""
    import struct

    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    with open(prefix + ".idx", "rb") as f:
        header = f.read(34)
    try:
        if len(header) < 34 or header[:9] != _INDEX_HEADER or struct.unpack("<Q", header[9:17])[0] != 1:
            raise ValueError("bad header")
        n_seq, n_doc = struct.unpack("<QQ", header[18:34])
        return DType.dtype_from_code(header[17]), n_seq, n_doc
    except (KeyError, struct.error):
        raise ValueError("bad header") from None


def check_bin_matches_idx(prefix: str, what: str = "path") -> None:
    """The `.idx` must be a well-formed megatron index whose size matches its counts, and the
    `.bin` exactly as long as the index says (end of the last document = its pointer + its
    length × the token size): a truncated `.bin` would crash at a data-dependent step, a
    foreign `.idx` would train silently on the wrong document map
    (tests/megatron/training/test_reliability.py::test_bin_idx_mismatch_is_one_error_line).
    Reads the header and two numbers of the index; no token is read."""
    import numpy as np

    idx, binf = prefix + ".idx", prefix + ".bin"
    fix = f"rebuild both with scripts/preprocess_data.py --output-prefix {prefix}"
    idx_size, bin_size = os.path.getsize(idx), os.path.getsize(binf)
    try:
        dtype, n_seq, n_doc = _index_header(prefix)
    except ValueError:
        raise ValueError(f"data.{what}: {idx} is not a megatron indexed-dataset index; {fix}") from None
    token_size = np.dtype(dtype).itemsize
    expected_idx = 34 + n_seq * (4 + 8) + n_doc * 8
    if idx_size != expected_idx:
        raise ValueError(f"data.{what}: {idx} has {idx_size} bytes but its header describes {n_seq} "
                         f"sequences and {n_doc} document boundaries ({expected_idx} bytes); {fix}")
    end = 0
    if n_seq:
        last_len = int(np.fromfile(idx, dtype=np.int32, count=1, offset=34 + (n_seq - 1) * 4)[0])
        last_ptr = int(np.fromfile(idx, dtype=np.int64, count=1, offset=34 + n_seq * 4 + (n_seq - 1) * 8)[0])
        end = last_ptr + last_len * token_size
    if bin_size != end:
        raise ValueError(f"data.{what}: {binf} has {bin_size} bytes but {idx} ends its last document "
                         f"at byte {end}: the two files do not belong together (truncated or "
                         f"mismatched); {fix}")


# --- which tokenizer made the tokens -----------------------------------------------------------
def tokenizer_record(tokenizer) -> dict:
    """What `PREFIX.tokenizer.json` holds: the tokenizer file (absolute path, for messages), the
    sha256 of its bytes (its identity: `unique_identifiers["sha256"]` of load_tokenizer's
    tokenizers, i.e. `sha256_file` of the .model / tokenizer.json / TikToken file), vocabulary
    size and end-of-document id."""
    return {"tokenizer": os.path.abspath(tokenizer.path), "sha256": tokenizer.unique_identifiers["sha256"],
            "vocab_size": int(tokenizer.vocab_size), "eod": int(tokenizer.eod)}


def write_tokenizer_record(prefix: str, tokenizer) -> str:
    """Write PREFIX.tokenizer.json (under a temporary name, then renamed); returns its path."""
    path = prefix + TOKENIZER_RECORD
    with open(path + ".tmp", "w") as f:
        json.dump(tokenizer_record(tokenizer), f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)
    return path


def read_tokenizer_record(prefix: str, what: str = "path") -> dict | None:
    """PREFIX.tokenizer.json as a dict, None when there is none; DataError when unreadable."""
    path = prefix + TOKENIZER_RECORD
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
        if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
            raise ValueError("no sha256")
    except (OSError, ValueError) as exc:  # JSON and Unicode decode errors are ValueErrors
        raise DataError(f"data.{what}: {path} is not a readable tokenizer record ({exc}); make the "
                        f"data again with scripts/preprocess_data.py --output-prefix {prefix}") from None
    return record


def _shown(path: str, like: str) -> str:
    """The absolute `path` as the user writes paths: relative to the working directory when
    `like` (a path from the config) is relative and `path` lies below it, else absolute."""
    rel = os.path.relpath(path)
    return path if os.path.isabs(like) or rel.startswith("..") else rel


def _retokenize(configured: str) -> str:
    return f"tokenize its text again with scripts/preprocess_data.py --tokenizer {configured}"


def _out_of_range(what: str, prefix: str, token: int, configured: str, vocab_size: int) -> DataError:
    return DataError(f"data.{what}: {prefix} holds token id {token}, outside the vocabulary of "
                     f"data.tokenizer={configured} ({vocab_size} ids): it was made with another "
                     f"tokenizer; set data.tokenizer to that one, or {_retokenize(configured)}")


# Prefixes without a record are checked on their ids, in two stages. Reading every token at
# start-up is no option (64B tokens are 128 GB of uint16, read again on every rank of every
# run), so:
# 1. start-up: SCAN_WINDOWS evenly spaced windows of SCAN_TOKENS tokens of each such .bin
#    (1M tokens, at most 4 MB read: milliseconds). Data made with another, larger tokenizer has
#    out-of-range ids nearly everywhere, so the usual mistake (data.tokenizer forgotten) stops
#    before the model is built, and for data.valid_path before the first evaluation, which may
#    come hours into the run. Every rank reads the same windows, so every rank stops.
# 2. every sample as it is read (IdGuard): the guarantee that no id reaches the embedding
#    out of range. One min and max over seq_length+1 ids in host memory, microseconds beside
#    the step's forward and backward. An id found there stops only the rank that read it (the
#    others wait in a collective until torchrun ends them), as any error mid-run does.
SCAN_WINDOWS, SCAN_TOKENS = 8, 1 << 17


def scan_token_ids(prefix: str) -> tuple[int, int] | None:
    """(min, max) token id over SCAN_WINDOWS evenly spaced windows of SCAN_TOKENS tokens of
    PREFIX.bin (all of it when it is smaller), None when it holds no token."""
    dtype = np.dtype(_index_header(prefix)[0])   # check_bin_matches_idx has checked the header
    n = os.path.getsize(prefix + ".bin") // dtype.itemsize
    if n == 0:
        return None
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r", shape=(n,))
    lo, hi = None, None
    for start in sorted({int(s) for s in np.linspace(0, max(0, n - SCAN_TOKENS), SCAN_WINDOWS)}):
        window = tokens[start:start + SCAN_TOKENS]
        lo = int(window.min()) if lo is None else min(lo, int(window.min()))
        hi = int(window.max()) if hi is None else max(hi, int(window.max()))
    del tokens
    return lo, hi


def check_tokenizer(data_cfg, tokenizer) -> None:
    """Every prefix of data.path and data.valid_path was made with `tokenizer`: its
    PREFIX.tokenizer.json names the same sha256, or, without a record, the sampled ids
    (scan_token_ids) lie inside its vocabulary. Raises DataError naming the prefix."""
    configured = getattr(data_cfg, "tokenizer", None) or tokenizer.path
    sha = tokenizer.unique_identifiers["sha256"]
    prefixes = [("path", p) for p in data_cfg.path]
    prefixes += [("valid_path", p) for p in (getattr(data_cfg, "valid_path", None) or [])]
    records = [(what, prefix, read_tokenizer_record(prefix, what)) for what, prefix in prefixes]
    for what, prefix, record in records:  # data.path first: its tokenizer is the one meant
        if record is None or record["sha256"] == sha:
            continue
        made_with = record.get("tokenizer", "?")
        same_file = os.path.abspath(configured) == made_with
        if what == "path":
            fix = f"set data.tokenizer={_shown(made_with, configured)}, or {_retokenize(configured)}"
        else:
            fix = (f"validation data must be made with the training tokenizer: {_retokenize(configured)} "
                   "into a new --output-prefix and name that in data.valid_path")
        raise DataError(
            f"data.{what}: {prefix} was tokenized with {_shown(made_with, configured)} (vocabulary "
            f"{record.get('vocab_size', '?')}, sha256 {record['sha256'][:12]}), but data.tokenizer is "
            f"{configured} (vocabulary {tokenizer.vocab_size}, sha256 {sha[:12]}"
            f"{'; the file has changed since' if same_file else ''}): {fix}")
    for what, prefix, record in records:
        ids = scan_token_ids(prefix) if record is None else None
        if ids is not None and (ids[0] < 0 or ids[1] >= tokenizer.vocab_size):
            bad = ids[0] if ids[0] < 0 else ids[1]
            raise _out_of_range(what, prefix, bad, configured, tokenizer.vocab_size)


class IdGuard(torch.utils.data.Dataset):
    """A dataset whose samples are checked to hold only ids of the tokenizer's vocabulary
    (see the comment above SCAN_WINDOWS): an id outside is a DataError naming the prefix, where
    the embedding would fail with an IndexError deep in the forward. Indexing and len() are the
    wrapped dataset's; other attributes are read through to it."""

    def __init__(self, dataset, *, vocab_size: int, what: str, configured: str):
        self.dataset, self.vocab_size, self.what, self.configured = dataset, vocab_size, what, configured

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx):
        sample = self.dataset[idx]
        tokens, labels = sample["tokens"], sample["labels"]
        (lo_t, hi_t), (lo_l, hi_l) = torch.aminmax(tokens), torch.aminmax(labels)   # one pass each
        lo, hi = min(int(lo_t), int(lo_l)), max(int(hi_t), int(hi_l))
        if lo < 0 or hi >= self.vocab_size:
            source = self.dataset
            if "dataset_id" in sample:  # a BlendedDataset: the sample came from one of its datasets
                source = source.datasets[int(sample["dataset_id"])]
            raise _out_of_range(self.what, getattr(source, "dataset_path", "?"), lo if lo < 0 else hi,
                                self.configured, self.vocab_size)
        return sample

    def __getattr__(self, name):
        if name == "dataset":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _num_documents(prefix: str) -> int:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return len(IndexedDataset(prefix, mmap=True).sequence_lengths)


def _check_split_nonempty(config, sizes) -> None:
    """Every prefix must give each requested split at least one document.

    megatron-core loops forever looking for epochs when a split of a prefix holds no tokens
    (`GPTDataset._get_num_epochs`), so this is checked first, with megatron's own rounding of
    the split matrix into document ranges.
    """
    if config.blend_per_split is not None:
        for name, blend, wanted in zip(("path", "valid_path"), config.blend_per_split, sizes):
            for prefix in (blend[0] if blend and wanted else []):
                if _num_documents(prefix) == 0:
                    raise ValueError(f"data.{name}: {prefix} holds no documents")
        return
    for prefix in config.blend[0]:
        n = _num_documents(prefix)
        for split_name, bounds, wanted in zip(("train", "valid", "test"), config.split_matrix,
                                              sizes):
            if not wanted:
                continue
            docs = 0 if bounds is None else (
                int(round(bounds[1] * float(n))) - int(round(bounds[0] * float(n))))
            if docs <= 0:
                raise ValueError(
                    f"data.split {config.split!r} leaves the {split_name} split of {prefix} "
                    f"({n} documents) empty: give it a larger share, add documents, or set "
                    "data.valid_path")


def _blend(prefixes, weights, what):
    prefixes = list(prefixes)
    if not prefixes:
        raise ValueError(f"data.{what} is empty: name at least one dataset prefix")
    _check_prefixes(prefixes, what)
    if weights is None:
        weights = [1.0] * len(prefixes) if len(prefixes) > 1 else None
    else:
        weights = [float(w) for w in weights]
        if len(weights) != len(prefixes):
            raise ValueError(f"data.weights has {len(weights)} entries but data.{what} has "
                             f"{len(prefixes)} prefixes")
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError("data.weights must be non-negative with a positive sum")
    return prefixes, weights


def build_gpt_config(data_cfg, *, tokenizer, seq_length: int, seed: int):
    """The `GPTDatasetConfig` for `data_cfg` (see module docstring for path/valid_path/split)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    train_blend = _blend(data_cfg.path, getattr(data_cfg, "weights", None), "path")
    common = dict(
        random_seed=seed,
        sequence_length=seq_length,
        tokenizer=tokenizer,
        path_to_cache=getattr(data_cfg, "cache_dir", None),
        reset_position_ids=bool(data_cfg.reset_position_ids),
        reset_attention_mask=bool(data_cfg.reset_attention_mask),
        eod_mask_loss=bool(data_cfg.eod_mask_loss),
        create_attention_mask=False,  # causal attention builds its own mask
        mid_level_dataset_surplus=0.005,
    )
    valid_path = getattr(data_cfg, "valid_path", None)
    if valid_path:
        valid_blend = _blend(valid_path, None, "valid_path")
        return GPTDatasetConfig(blend_per_split=[train_blend, valid_blend, None], **common)
    return GPTDatasetConfig(blend=train_blend, split=data_cfg.split, **common)


def build_datasets(data_cfg, *, tokenizer, seq_length: int, seed: int, train_samples: int,
                   valid_samples: int, test_samples: int = 0):
    """(train, valid, test) datasets with at least the requested samples each (None if 0).

    Raises ValueError naming the file when a prefix's .bin/.idx is missing or the two do not
    match (check_bin_matches_idx), when a prefix was made with another tokenizer
    (check_tokenizer: a DataError), and when a split that was asked for samples has no
    documents. Each dataset comes wrapped in IdGuard: reading a sample that holds an id outside
    the tokenizer's vocabulary is a DataError naming its prefix.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset

    if not torch.distributed.is_initialized():
        raise RuntimeError("build_datasets needs torch.distributed initialised (gloo on CPU)")
    if getattr(data_cfg, "valid_path", None) and test_samples:
        raise ValueError("data.valid_path is set, so there is no test split: use test_samples=0")
    config = build_gpt_config(data_cfg, tokenizer=tokenizer, seq_length=seq_length, seed=seed)
    check_tokenizer(data_cfg, tokenizer)
    sizes = [train_samples, valid_samples, test_samples]
    _check_split_nonempty(config, sizes)
    for name in _DATASET_LOGGERS:  # megatron logs every index build at INFO; keep warnings
        logging.getLogger(name).setLevel(logging.WARNING)
    builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config)
    datasets = builder.build()
    out = []
    configured = getattr(data_cfg, "tokenizer", None) or tokenizer.path
    for split_name, wanted, ds in zip(("train", "valid", "test"), sizes, datasets):
        if wanted and (ds is None or len(ds) == 0):
            raise ValueError(f"the {split_name} split is empty: check data.split "
                             f"({data_cfg.split!r}) and the dataset sizes")
        what = "valid_path" if split_name == "valid" and config.blend_per_split is not None else "path"
        out.append(IdGuard(ds, vocab_size=tokenizer.vocab_size, what=what, configured=configured)
                   if wanted else None)
    return tuple(out)


def batch_from_samples(samples):
    """Stack GPTDataset samples into a micro-batch: tokens, labels, loss_mask, position_ids.

    Each output is [micro_batch, seq]; tokens/labels/position_ids int64, loss_mask float32.
    """
    if not samples:
        raise ValueError("batch_from_samples needs at least one sample")
    return {
        "tokens": torch.stack([s["tokens"] for s in samples]).long(),
        "labels": torch.stack([s["labels"] for s in samples]).long(),
        "loss_mask": torch.stack([s["loss_mask"] for s in samples]).float(),
        "position_ids": torch.stack([s["position_ids"] for s in samples]).long(),
    }


collate = batch_from_samples  # the name torch.utils.data.DataLoader(collate_fn=...) users expect
