"""LoRA-SVD realignment inside megatron-core's distributed optimizer: 2 gloo CPU processes
(DP=2, masters and Adam moments sharded) give the parameters of 1 process with the plain
(non-distributed) optimizer, step for step, across two realignments.

Same pattern as test_q_adamw_distributed.py: gradients are written straight into megatron's
grad buffers (`param.main_grad`), the same numbers in every process (a deterministic function
of the parameter name and the step), so what is compared is the optimizer step plus the
realignment (`recipes.after_optimizer_step`) with its moment transfer. Oracle: the 1-process
run with `parallel.use_distributed_optimizer=false`, whose realignment is tested against
FP64 oracles in test_lora_svd_megatron.py.
"""
from __future__ import annotations

import os
import zlib

import pytest
import torch

from tests.megatron.training import helpers

STEPS, INTERVAL = 5, 2   # realignments after steps 2 and 4; steps 3 and 5 use the moved moments
LR, WD = 2e-3, 0.1
ROUTES = ("projected", "dense")
TINY = ["model.preset=tiny", "model.seq_length=32", "model.vocab_size=256", "data.mock=true",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_iters=1",
        "logging.tensorboard=false", "train.grad_clip=0", "checkpoint.load=none",
        "train.precision=fp32", "optimizer.name=adamw", "fp4.linear=lora_svd",
        "fp4.lora_svd.rank=4", f"fp4.lora_svd.realign_interval={INTERVAL}"]


def _grad(name: str, shape, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 31 + step)
    return torch.randn(shape, generator=g) * 1e-2


def _worker(rank: int, world: int, init: str, out: str, distributed: bool, route: str):
    helpers.join_gloo(rank, world, init)
    torch.set_num_threads(1)
    from megatron.training import recipes
    from megatron.training.config import load_config
    from megatron.training.optimizer import apply_schedule
    from megatron.training.trainer import Trainer

    cfg = load_config(None, TINY + [f"parallel.use_distributed_optimizer={str(distributed).lower()}",
                                    f"fp4.lora_svd.route={route}"])
    cfg.logging.dir = None
    tr = Trainer(cfg, verbose=False)
    named = [(n, p) for n, p in tr.model.named_parameters() if p.requires_grad]
    every = list(tr.model.named_parameters())
    per_step = []
    for step in range(1, STEPS + 1):
        apply_schedule(tr.optimizer, LR, WD)
        for n, p in named:
            p.main_grad.copy_(_grad(n, p.shape, step))
        tr.optimizer.step()
        recipes.after_optimizer_step([tr.model], tr.optimizer, cfg, step)
        per_step.append({n: p.detach().clone() for n, p in every})
    torch.save(per_step, os.path.join(out, f"{route}_{'dist' if distributed else 'plain'}_w{world}_r{rank}.pt"))
    from megatron.training.initialize import shutdown
    shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("lora_dp"))
    # both backward routes: their realignments treat the moments differently (lora_svd_layers.py)
    helpers.spawn_gloo(_worker, [(1, (out, False, r)) for r in ROUTES] + [(2, (out, True, r)) for r in ROUTES])
    return {(r, k): torch.load(os.path.join(out, f"{r}_{k}.pt"))
            for r in ROUTES for k in ("plain_w1_r0", "dist_w2_r0", "dist_w2_r1")}


@pytest.mark.long   # three gloo processes per route, ~25 s: make test-all
@pytest.mark.parametrize("route", ["projected", "dense"])
def test_lora_svd_dp2_distributed_optimizer_matches_one_process(runs, route):
    one, a, b = (runs[(route, k)] for k in ("plain_w1_r0", "dist_w2_r0", "dist_w2_r1"))
    lora_l2 = [n for n in one[0] if n.endswith("lora_l2")]
    assert lora_l2
    for step in range(STEPS):
        for name, p1 in one[step].items():
            # both DP ranks hold the same whole parameters, bit for bit
            assert torch.equal(a[step][name], b[step][name]), (step + 1, name)
            torch.testing.assert_close(a[step][name], p1, rtol=1e-5, atol=1e-6,
                                       msg=f"step {step + 1} {name}")
    # the realignments did happen (L2 changed after steps 2 and 4, not after 1 and 3)
    for n in lora_l2:
        assert torch.equal(one[0][n], one[0][n]) and torch.equal(one[1][n], one[2][n])
        assert not torch.equal(one[0][n], one[1][n]) and not torch.equal(one[2][n], one[3][n])
