"""Process-level set-up: device, torch.distributed, megatron-core parallel state, seeds.

Works under `torchrun` (reads RANK / WORLD_SIZE / LOCAL_RANK) and as a plain `python`
process (a world of one). NCCL on GPUs, gloo on CPU, where `cpu_compat` redirects
megatron-core's CUDA entry points.
"""
from __future__ import annotations

import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron.training import cpu_compat


def initialize(cfg) -> torch.device:
    """Initialise distributed state once; returns the device this rank trains on."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        cpu_compat.enable()
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=30)
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            # plain `python pretrain_gpt.py` (or torchrun with one process): a world of one
            # needs no rendezvous, so its store is in memory, not on a TCP port (a port found
            # free here and bound later could be taken meanwhile by another process)
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(cfg.parallel.tensor_model_parallel_size,
                                     cfg.parallel.pipeline_model_parallel_size)
    set_seed(cfg.train.seed)
    return device


def set_seed(seed: int) -> None:
    # Different seeds per pipeline stage (different layers), same across data-parallel ranks
    # (identical initial weights); megatron's tracker offsets the tensor-parallel streams.
    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # On CPU the CUDA RNG tracker cannot exist; the inference tracker is a null context.
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not torch.cuda.is_available())


def shutdown() -> None:
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
