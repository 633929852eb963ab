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
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import torch

_DATASET_LOGGERS = ("megatron.core.datasets",)


def _check_prefixes(prefixes: Sequence[str], what: str) -> None:
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise ValueError(
                    f"data.{what}: dataset file not found: {prefix + ext} "
                    f"(make it with scripts/preprocess_data.py --output-prefix {prefix})"
                )
        check_bin_matches_idx(prefix, what)


def check_bin_matches_idx(prefix: str, what: str = "path") -> None:
    """The `.idx` must be a well-formed megatron index whose size matches its counts, and the
    `.bin` exactly as long as the index says (end of the last document = its pointer + its
    length × the token size): a truncated `.bin` would crash at a data-dependent step, a
    foreign `.idx` would train silently on the wrong document map
    (tests/megatron/training/test_reliability.py::test_bin_idx_mismatch_is_one_error_line).
    Reads the header and two numbers of the index; no token is read."""
    import struct

    import numpy as np
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    idx, binf = prefix + ".idx", prefix + ".bin"
    fix = f"rebuild both with scripts/preprocess_data.py --output-prefix {prefix}"
    idx_size, bin_size = os.path.getsize(idx), os.path.getsize(binf)
    try:
        with open(idx, "rb") as f:
            header = f.read(34)
        if len(header) < 34 or header[:9] != _INDEX_HEADER or struct.unpack("<Q", header[9:17])[0] != 1:
            raise ValueError("bad header")
        token_size = DType.size(DType.dtype_from_code(header[17]))
        n_seq, n_doc = struct.unpack("<QQ", header[18:34])
    except (ValueError, KeyError, struct.error):
        raise ValueError(f"data.{what}: {idx} is not a megatron indexed-dataset index; {fix}") from None
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
    match (check_bin_matches_idx), and when a split that was asked for samples has no documents.
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
    sizes = [train_samples, valid_samples, test_samples]
    _check_split_nonempty(config, sizes)
    for name in _DATASET_LOGGERS:  # megatron logs every index build at INFO; keep warnings
        logging.getLogger(name).setLevel(logging.WARNING)
    builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config)
    datasets = builder.build()
    out = []
    for split_name, wanted, ds in zip(("train", "valid", "test"), sizes, datasets):
        if wanted and (ds is None or len(ds) == 0):
            raise ValueError(f"the {split_name} split is empty: check data.split "
                             f"({data_cfg.split!r}) and the dataset sizes")
        out.append(ds if wanted else None)
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
