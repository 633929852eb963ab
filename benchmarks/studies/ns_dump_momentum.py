"""Dump real Muon / Root momentum matrices (and what the NS actually sees) from a short training run.

Builds the model and data through ``megatron.training`` (read-only use: ``Trainer`` with
``optimizer.name`` = muon | root | q_muon | q_root, i.e. the project's own optimizer
integration), trains ``--iters`` steps, then saves, for every matrix the orthogonal optimizer
owns, per logical block (``ns_split_sizes`` / ``ns_row_perm``, e.g. fused QKV → q, k, v;
fc1 → gate, up):

  ``<param>.<block>.momentum``  the momentum buffer,
  ``<param>.<block>.ns_input``  the matrix passed to Newton–Schulz (Muon: the Nesterov
                                 look-ahead; Root: the clamped momentum),
  ``<param>.<block>.grad``      the last gradient (main grad, FP32),

as one ``{name: FP32 CPU tensor}`` dict in ``OUT/momentum_iter<N>.pt``, the format
``benchmarks/studies/ns_error_table.py --matrices`` reads.

Usage (CPU, the tiny quickstart model on data/quickstart, ~1 min):
    python benchmarks/studies/ns_dump_momentum.py --out runs/ns_dump --iters 30
GPU, the 3b shapes (4 decoder blocks of the 3b preset, tokenizer of data/quickstart):
    python benchmarks/studies/ns_dump_momentum.py --out runs/ns_dump_3b --iters 30 -- \
        model.preset=3b model.num_layers=4 train.precision=bf16 train.global_batch_size=8 \
        train.micro_batch_size=2 model.seq_length=512
Any ``key=value`` after ``--`` is a config override (megatron.training.config.apply_override).
"""

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron.training.config import load_config  # noqa: E402


def _inner_optimizers(optimizer):
    from fullstack_fp4.integration.wrappers import main_to_model, megatron_wrappers  # noqa: PLC0415
    for wrapper in megatron_wrappers(optimizer):
        inner = wrapper.optimizer
        for sub in getattr(inner, "subs", [inner]):
            yield sub, main_to_model(wrapper)


@torch.no_grad()
def collect(trainer) -> dict:
    from fullstack_fp4.optim.muon import Muon, split_blocks  # noqa: PLC0415
    from fullstack_fp4.optim.root import Root  # noqa: PLC0415
    names = {id(p): n for n, p in trainer.gpt.named_parameters()}
    out = {}
    for opt, main_to_model in _inner_optimizers(trainer.optimizer):
        if not isinstance(opt, (Muon, Root)):
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                st = opt.state.get(p, {})
                if "momentum_buffer" not in st:
                    continue
                name = names.get(id(main_to_model.get(id(p))), f"param{len(out)}")
                m = st["momentum_buffer"].float()
                g = p.grad.float() if p.grad is not None else None
                perm = getattr(p, "ns_row_perm", None)
                if perm is not None:
                    perm = perm.to(m.device)
                    m = m.index_select(0, perm)
                    g = g.index_select(0, perm) if g is not None else None
                g_blocks = split_blocks(g, p) if g is not None else [None] * len(split_blocks(m, p))
                for i, (mb, gb) in enumerate(zip(split_blocks(m, p), g_blocks)):
                    key = f"{name}.{i}"
                    out[f"{key}.momentum"] = mb.cpu().clone()
                    if gb is None:
                        continue
                    out[f"{key}.grad"] = gb.cpu().clone()
                    if isinstance(opt, Muon):
                        d = gb.lerp(mb, group["momentum"]) if group["nesterov"] else mb
                    else:   # Root: Nesterov D = G + μM (or M), clamped at its own 0.9 quantile
                        d = opt._pre_ns(gb + group["momentum"] * mb if group["nesterov"] else mb, group)
                    out[f"{key}.ns_input"] = d.float().cpu().clone()
    return out


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "quickstart.yaml"))
    ap.add_argument("--optimizer", default="muon", choices=["muon", "root", "q_muon", "q_root"])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.chdir(ROOT)
    overrides = [f"optimizer.name={args.optimizer}", f"train.iters={args.iters}",
                 f"train.eval_interval={10 ** 9}", "train.eval_iters=1",
                 f"checkpoint.save_dir={os.path.join(args.out, 'checkpoints')}",
                 "checkpoint.save_interval=null", "checkpoint.load=none",
                 "checkpoint.save_on_exit=false", f"logging.dir={args.out}",
                 "logging.tensorboard=false", *args.overrides]
    if args.optimizer.endswith("muon"):
        overrides.insert(1, "optimizer.lr=0.02")
    cfg = load_config(args.config, overrides)
    from megatron.training.initialize import shutdown  # noqa: PLC0415
    from megatron.training.trainer import Trainer  # noqa: PLC0415
    trainer = Trainer(cfg)
    trainer.train()
    mats = collect(trainer)
    path = os.path.join(args.out, f"momentum_iter{args.iters}.pt")
    torch.save(mats, path)
    print(f"saved {len(mats)} matrices to {path}:")
    for k, v in mats.items():
        print(f"  {k}: {tuple(v.shape)}")
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
