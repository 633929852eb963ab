"""configs/ablation/: the second scale (medium.yaml) is base.yaml with a larger model, its own
learning rate and nothing else that could move a loss gap (schedule, optimizer, step size,
recipe defaults), and
its header's parameter counts are the closed-form ones (which `--dry-run` checks against the
model megatron-core builds)."""
from __future__ import annotations

import math
import os

from megatron.training.config import load_config
from megatron.training.config_schema import to_dict
from tests.test_configs_3b_64b import flat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIR = os.path.join(REPO, "configs", "ablation")


def test_medium_differs_from_base_in_model_size_and_lr_only():
    base = flat(to_dict(load_config(os.path.join(DIR, "base.yaml"), validate=False)))
    med = flat(to_dict(load_config(os.path.join(DIR, "medium.yaml"), validate=False)))
    diff = {k for k in base if base[k] != med[k]}
    model = {"model.num_layers", "model.hidden_size", "model.ffn_hidden_size", "model.num_attention_heads"}
    # the micro-batch (gradient accumulation, same 64 x 512 tokens a step), the eval cadence, and
    # the paths (ablation.py sets data and run directories on its command line)
    other = {"train.micro_batch_size", "train.eval_interval", "data.path", "data.valid_path", "data.tokenizer",
             "data.cache_dir", "checkpoint.save_dir", "logging.dir"}
    lr = {"optimizer.lr", "optimizer.min_lr"}   # the wider model's own (medium.yaml's comment)
    assert diff == model | other | lr, diff ^ (model | other | lr)
    assert math.isclose(med["optimizer.min_lr"] / med["optimizer.lr"], base["optimizer.min_lr"] / base["optimizer.lr"])
    assert med["train.global_batch_size"] * med["model.seq_length"] == 32768
    assert med["model.hidden_size"] // med["model.num_attention_heads"] == 64   # head dim as base and 3b


def test_medium_sizes_match_its_header():
    """The header comment's parameter counts (megatron.training.model.count_parameters, which
    `pretrain_gpt.py --dry-run` checks against the built model)."""
    from megatron.training.model import count_parameters

    cfg = load_config(os.path.join(DIR, "medium.yaml"), validate=False)
    c = count_parameters(cfg, 4096)
    assert round(c["transformer"] / 1e6, 1) == 75.5 and round(c["total"] / 1e6, 1) == 81.8
    base = count_parameters(load_config(os.path.join(DIR, "base.yaml"), validate=False), 4096)
    assert round(c["transformer"] / base["transformer"], 1) == 3.2
