"""Deterministic batches: sample index -> micro-batch, so a resume continues exactly.

The global batch of step t holds dataset samples [t·G, (t+1)·G) (G = global batch size);
data-parallel rank r takes the contiguous slice [r·G/D, (r+1)·G/D) of it, cut into
micro-batches. Position in the data is therefore just `consumed_samples`, stored in the
checkpoint. The dataset's own shuffling (megatron-core `GPTDataset`, seeded) gives the order.
"""
from __future__ import annotations

import numpy as np
import torch


class MockTokens(torch.utils.data.Dataset):
    """Random tokens, a pure function of (seed, index): benchmarks and dry runs need no files."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.n, self.s, self.v, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> dict:
        g = np.random.default_rng([self.seed, idx])
        t = torch.from_numpy(g.integers(0, self.v, self.s + 1, dtype=np.int64))
        return {"tokens": t[:-1], "labels": t[1:], "loss_mask": torch.ones(self.s),
                "position_ids": torch.arange(self.s)}


def collate(samples: list[dict]) -> dict:
    out = {}
    for k in ("tokens", "labels", "loss_mask", "position_ids"):
        out[k] = torch.stack([torch.as_tensor(s[k]) for s in samples])
    out["tokens"] = out["tokens"].long()
    out["labels"] = out["labels"].long()
    out["position_ids"] = out["position_ids"].long()
    out["loss_mask"] = out["loss_mask"].float()
    return out


def micro_batches(dataset, *, start_sample: int, global_batch: int, micro_batch: int, dp_rank: int,
                  dp_size: int, device) -> list[dict]:
    """The micro-batches of one global batch for this data-parallel rank."""
    per_rank = global_batch // dp_size
    first = start_sample + dp_rank * per_rank
    out = []
    for m in range(per_rank // micro_batch):
        lo = first + m * micro_batch
        batch = collate([dataset[(lo + i) % len(dataset)] for i in range(micro_batch)])
        out.append({k: v.to(device, non_blocking=True) for k, v in batch.items()})
    return out
