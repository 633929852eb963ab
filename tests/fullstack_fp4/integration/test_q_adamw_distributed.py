"""Q-AdamW inside megatron-core's distributed optimizer: 2 gloo CPU processes (DP=2) step bit
for bit as 1 process (DP=1), on a tiny GPTModel built by the trainer.

Both runs are the same config (distributed optimizer, fp32, q_adamw) and only the world size
differs. Gradients are written straight into megatron's grad buffers (`param.main_grad`), the
same numbers in every process — a deterministic function of the parameter name and the step,
heavy-tailed — so the optimizer is what is compared (a real backward pass reduces the two
micro-batches in another order at DP=2, which is megatron's business, not the optimizer's).
Oracle: the 1-process run. Compared: every full model parameter after each step (megatron
all-gathers the shards into the params) and the 4-bit states — DP=2's pieces, concatenated in
parameter order, must be the 1-process state byte for byte (codes, E4M3 scales, chunk scales,
tile means).

The trainer builds the DDP buffers of a q_adamw run with the distributed optimizer with
`pad_buckets_for_high_nccl_busbw=True` (buckets a multiple of 2^16, so every DP shard boundary
lies on QAdamW's 1024-entry chunk grid); the test runs the trainer's own config, so it checks
that too. See fullstack_fp4/integration/optimizers.py `place_distributed_shards`.
"""
from __future__ import annotations

import os
import zlib

import pytest
import torch

from tests.megatron.training import helpers

STEPS = 3
LR, WD = 2e-3, 0.1
TINY = ["model.preset=tiny", "model.seq_length=32", "model.vocab_size=256", "data.mock=true",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_iters=1",
        "logging.tensorboard=false", "train.grad_clip=0", "checkpoint.load=none",
        "train.precision=fp32", "optimizer.name=q_adamw", "optimizer.q_adamw.min_numel=1024",
        "parallel.use_distributed_optimizer=true"]


def _grad(name: str, shape, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 31 + step)
    x = torch.randn(shape, generator=g)
    return x * torch.exp(1.5 * torch.randn(shape, generator=g)) * 1e-2


def _worker(rank: int, world: int, init: str, out: str):
    helpers.join_gloo(rank, world, init)
    torch.set_num_threads(1)
    import megatron.training.trainer as trainer_mod
    from megatron.training.config import load_config
    from megatron.training.optimizer import apply_schedule

    cfg = load_config(None, TINY)
    cfg.logging.dir = None
    tr = trainer_mod.Trainer(cfg, verbose=False)
    from fullstack_fp4.optim.q_adamw.optimizer import PLACE_ATTR
    from fullstack_fp4.optim.q_adamw.state import unpack_state
    from fullstack_fp4.optim.q_adamw.codecs import decode_exp_avg, decode_exp_avg_sq

    named = [(n, p) for n, p in tr.model.named_parameters() if p.requires_grad]
    params_per_step = []
    for step in range(1, STEPS + 1):
        apply_schedule(tr.optimizer, LR, WD)
        for n, p in named:
            p.main_grad.copy_(_grad(n, p.shape, step))
        tr.optimizer.step()
        params_per_step.append({n: p.detach().clone() for n, p in named})
    w = tr.optimizer.chained_optimizers[0] if hasattr(tr.optimizer, "chained_optimizers") \
        else tr.optimizer
    inner = w.optimizer
    pieces = []
    for g in inner.param_groups:
        for sp in g["params"]:
            pl = getattr(sp, PLACE_ATTR)
            st = inner.state[sp]
            rec = {"key": pl.key, "offset": pl.offset, "numel": sp.numel(),
                   "full": pl.full_numel, "phase": pl.chunk_phase(),
                   "state": {k: v.clone() for k, v in st.items() if k != "step"}}
            if "exp_avg_codes" in st:
                m, v = unpack_state(st, sp.numel(), pl.chunk_phase())
                rec["m"], rec["v"] = decode_exp_avg(m), decode_exp_avg_sq(v)
            pieces.append(rec)
    torch.save({"params": params_per_step, "pieces": pieces},
               os.path.join(out, f"w{world}_r{rank}.pt"))
    from megatron.training.initialize import shutdown
    shutdown()


def _assemble(pieces: list[dict]) -> dict:
    """key -> (concatenated state tensors, decoded m, decoded v) over the pieces by offset."""
    by = {}
    for rec in pieces:
        by.setdefault(rec["key"], []).append(rec)
    out = {}
    for key, recs in by.items():
        recs.sort(key=lambda r: r["offset"])
        assert sum(r["numel"] for r in recs) == recs[0]["full"]
        st = {k: torch.cat([r["state"][k] for r in recs]) for k in recs[0]["state"]}
        dec = [torch.cat([r[x] for r in recs]) for x in ("m", "v")] if "m" in recs[0] else None
        out[key] = (st, dec, recs)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("qadamw_dp"))
    helpers.spawn_gloo(_worker, [(1, (out,)), (2, (out,))], timeout=240)
    return {k: torch.load(os.path.join(out, f"{k}.pt")) for k in ("w1_r0", "w2_r0", "w2_r1")}


def test_dp2_params_equal_one_process_bit_for_bit(runs):
    one, a, b = runs["w1_r0"], runs["w2_r0"], runs["w2_r1"]
    for step in range(STEPS):
        for name, p1 in one["params"][step].items():
            assert torch.equal(a["params"][step][name], p1), (step + 1, name)
            assert torch.equal(b["params"][step][name], p1), (step + 1, name)
    # the parameters moved
    first = one["params"][0]
    assert any(not torch.equal(first[n], one["params"][-1][n]) for n in first)


def test_dp2_states_are_slices_of_the_one_process_state(runs):
    one = _assemble(runs["w1_r0"]["pieces"])
    two = _assemble(runs["w2_r0"]["pieces"] + runs["w2_r1"]["pieces"])
    assert one.keys() == two.keys()
    cut_quantized = 0
    for key, (st1, dec1, recs1) in one.items():
        st2, dec2, recs2 = two[key]
        assert len(recs1) == 1                       # 1 process: whole parameters
        if len(recs2) > 1 and dec1 is not None:
            cut_quantized += 1
        assert st1.keys() == st2.keys()
        for k in st1:
            assert torch.equal(st1[k], st2[k]), (key, k)
        if dec1 is not None:
            assert torch.equal(dec1[0], dec2[0]) and torch.equal(dec1[1], dec2[1])
    # the DP=2 shard boundary does cut a quantized (4-bit state) parameter
    assert cut_quantized >= 1
