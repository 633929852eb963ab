"""`pretrain_gpt.py --dry-run`: build the whole model on the meta device and count it.

The model is built unsharded (TP = PP = 1) in a one-process world, with no weight
initialisation and no memory: a 3B config dry-runs on a laptop in seconds. The count is
checked against the closed-form count from the shapes. ``WORLD_SIZE`` in the environment is
the layout being checked (config validation refuses one that does not divide), not the world
the dry run builds in: it prints the data-parallel size and gradient-accumulation steps that
layout gets.
"""
from __future__ import annotations

import copy
import os

import torch

from megatron.training.model import build_model, count_parameters, flops_per_token


def describe(cfg) -> str:
    from megatron.training.initialize import initialize

    one = copy.deepcopy(cfg)
    one.parallel.tensor_model_parallel_size = one.parallel.pipeline_model_parallel_size = 1
    world = int(os.environ.get("WORLD_SIZE", "1"))   # validated against the config already
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")   # the dry run's own world: one process
    initialize(one)
    p, t = cfg.parallel, cfg.train
    dp = world // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
    vocab = cfg.model.vocab_size
    if vocab is None:
        from megatron.training.tokenizer import load_tokenizer

        vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
    with torch.device("meta"):
        model = build_model(one, vocab, use_cpu_initialization=True, perform_initialization=False)
    built = sum(p.numel() for p in model.parameters())
    c = count_parameters(cfg, vocab)
    lines = [f"parameters: {built:,} ({built / 1e6:.1f}M)",
             f"  embedding {c['embedding']:,} | transformer {c['transformer']:,} | output layer {c['output_layer']:,}",
             f"  closed-form count {c['total']:,} ({'matches' if c['total'] == built else 'DIFFERS'})",
             f"model FLOPs per token (fwd+bwd): {flops_per_token(cfg, vocab):.3e}",
             f"tokens per step: {t.global_batch_size * cfg.model.seq_length:,}",
             f"layout at WORLD_SIZE={world}: TP {p.tensor_model_parallel_size} x PP "
             f"{p.pipeline_model_parallel_size} x DP {dp}; {t.global_batch_size // (t.micro_batch_size * dp)} "
             f"micro-batch(es) of {t.micro_batch_size} per rank per step",
             f"fp4.linear={cfg.fp4.linear} fp4.attention={cfg.fp4.attention} optimizer.name={cfg.optimizer.name}"]
    return "\n".join(lines)
