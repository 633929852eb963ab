"""Muon / Root inside megatron-core's distributed optimizer: 2 gloo CPU processes (DP=2, the
distributed optimizer: each rank holds flat pieces of the matrices) step bit for bit as 1
process with the plain optimizer (whole matrices), on a tiny GPTModel built by the trainer.

Oracle: the 1-process plain-optimizer run (fullstack_fp4/optim/muon.py without pieces).
Gradients are written straight into megatron's grad buffers (`param.main_grad`), the same
numbers in every process (a deterministic function of the parameter name and step), so the
optimizer is what is compared. Compared: every full model parameter after each step (megatron
all-gathers the shards into the params). Checked too: a DP shard boundary does cut a matrix
(so the all-reduce of the pieces is exercised) and the parameters move.

`root` and `muon` (Nesterov momentum; the rest on torch AdamW) each run; `q_muon` (NVFP4
Newton–Schulz) in one run, its matrices compared (its rest is QAdamW, whose 4-bit state follows
the DP shard grid: tests/fullstack_fp4/integration/test_q_adamw_distributed.py). And
TP=2 × DP=2 (`root`, `tp_mode: duplicated`: the summed pieces are gathered over TP) against
TP=2 with the plain optimizer.
"""
from __future__ import annotations

import os
import zlib

import pytest
import torch

from tests.megatron.training import helpers

pytestmark = [pytest.mark.slow, pytest.mark.long]   # multi-process runs, ~40 s a module: make test-all
STEPS = 2
MATRICES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
LR, WD = 2e-3, 0.1
# 3 layers: with 4 the DP=2 shard boundary falls between layers 1 and 2 (the buffer is nearly
# symmetric), cutting no matrix; with 3 it cuts one of layer 1's
TINY = ["model.preset=tiny", "model.num_layers=3", "model.seq_length=32", "model.vocab_size=256", "data.mock=true",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_iters=1",
        "logging.tensorboard=false", "train.grad_clip=0", "checkpoint.load=none",
        "train.precision=fp32"]


def _grad(name: str, shape, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 31 + step)
    return torch.randn(shape, generator=g) * 1e-2


def _worker(rank: int, world: int, init: str, opt: str, out: str, tp: int = 1, distopt: bool | None = None):
    helpers.join_gloo(rank, world, init)
    torch.set_num_threads(1)
    import megatron.training.trainer as trainer_mod
    from megatron.training.config import load_config
    from megatron.training.optimizer import apply_schedule

    distopt = world // tp > 1 if distopt is None else distopt
    cfg = load_config(None, TINY + [f"optimizer.name={opt}", f"parallel.use_distributed_optimizer={str(distopt).lower()}",
                                    f"parallel.tensor_model_parallel_size={tp}"])
    cfg.logging.dir = None
    tr = trainer_mod.Trainer(cfg, verbose=False)
    named = [(n, p) for n, p in tr.model.named_parameters() if p.requires_grad]
    tp_rank = rank % tp            # megatron's rank order: TP fastest
    params_per_step = []
    for step in range(1, STEPS + 1):
        apply_schedule(tr.optimizer, LR, WD)
        for n, p in named:   # a TP shard's gradient: a function of its name and TP rank
            p.main_grad.copy_(_grad(f"{n}@tp{tp_rank}" if tp > 1 else n, p.shape, step))
        tr.optimizer.step()
        params_per_step.append({n: p.detach().clone() for n, p in named})
    cuts = 0
    if distopt:
        w = tr.optimizer.chained_optimizers[0] if hasattr(tr.optimizer, "chained_optimizers") \
            else tr.optimizer
        orth = w.optimizer.subs[0]
        cuts = sum(1 for m in orth.dp_matrices
                   if m.piece is not None and (m.start > 0 or m.end < m.numel))
    torch.save({"params": params_per_step, "cuts": cuts},
               os.path.join(out, f"{opt}_tp{tp}_w{world}_r{rank}.pt" if tp > 1 else f"{opt}_w{world}_r{rank}.pt"))
    from megatron.training.initialize import shutdown
    shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("orth_dp"))
    jobs = [(w, (opt, out)) for opt in ("root", "muon", "q_muon") for w in (1, 2)]
    helpers.spawn_gloo(_worker, jobs, timeout=400)
    return {f"{o}_w{w}_r{r}": torch.load(os.path.join(out, f"{o}_w{w}_r{r}.pt"))
            for o in ("root", "muon", "q_muon") for w, rs in ((1, (0,)), (2, (0, 1))) for r in rs}


@pytest.mark.parametrize("opt", ["root", "muon", "q_muon"])
def test_dp2_distributed_optimizer_equals_one_process_plain(runs, opt):
    one, a, b = runs[f"{opt}_w1_r0"], runs[f"{opt}_w2_r0"], runs[f"{opt}_w2_r1"]
    matrices_only = opt == "q_muon"
    compared = 0
    for step in range(STEPS):
        for name, p1 in one["params"][step].items():
            if matrices_only and not any(k in name for k in MATRICES):
                continue
            compared += 1
            assert torch.equal(a["params"][step][name], p1), (opt, step + 1, name)
            assert torch.equal(b["params"][step][name], p1), (opt, step + 1, name)
    assert compared >= STEPS * 4 * 3   # every matrix of the 3 layers, each step
    first = one["params"][0]
    moved = [n for n in first if "linear_fc1.weight" in n and not torch.equal(first[n], one["params"][-1][n])]
    assert moved, "the matrices must move"
    # a shard boundary cuts at least one matrix on some rank: the pieces were summed over DP
    assert a["cuts"] + b["cuts"] >= 1


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """TP=2 × DP=2 with the distributed optimizer (4 processes) against TP=2 with the plain
    optimizer (2 processes; the TP=2 plain step equals one process, tests of
    tp_mode=duplicated): the same TP rank gets the same gradients in both."""
    out = str(tmp_path_factory.mktemp("orth_tp_dp"))
    helpers.spawn_gloo(_worker, [(2, ("root", out, 2, False)), (4, ("root", out, 2, True))], timeout=400)
    return {f"w{w}_r{r}": torch.load(os.path.join(out, f"root_tp2_w{w}_r{r}.pt"))
            for w, rs in ((2, (0, 1)), (4, (0, 1, 2, 3))) for r in rs}


def test_tp2_dp2_distributed_optimizer_equals_tp2_plain(tp_runs):
    for r in range(4):
        ref, run = tp_runs[f"w2_r{r % 2}"], tp_runs[f"w4_r{r}"]
        for step in range(STEPS):
            for name, p1 in ref["params"][step].items():
                assert torch.equal(run["params"][step][name], p1), (r, step + 1, name)
    assert sum(tp_runs[f"w4_r{r}"]["cuts"] for r in range(4)) >= 1
