"""Error table for Q-AdamW's moment codecs: direct NVFP4 vs the pipeline, for v and the update.

    python benchmarks/studies/q_adamw_error_table.py                       # synthetic heavy-tailed moments
    python benchmarks/studies/q_adamw_error_table.py --moments real.pt     # + real moments
    python benchmarks/studies/q_adamw_error_table.py --variants            # + tile / guard alternatives
    python benchmarks/studies/q_adamw_error_table.py --seeds 8             # + chunk-scale rules, 8 draws
    python benchmarks/studies/q_adamw_error_table.py --train 300           # + moments of a real run:
        # trains the quickstart model (configs/quickstart.yaml: tiny, data/quickstart corpus)
        # with torch AdamW for 300 steps on CPU, saves its moments (--save-moments), tables them
    python benchmarks/studies/q_adamw_error_table.py --from-checkpoint runs/quickstart/checkpoints/iter_0000300
        # the moments of a finished AdamW run (e.g. `make quickstart`), loaded through the trainer
    python benchmarks/studies/q_adamw_error_table.py --train 100 --device cuda
        # the same with 4 decoder blocks of the 3b preset (bench_blocks.py's shape, seq 4096,
        # bf16 with FP32 master weights, torch fused AdamW) on the quickstart corpus, on a GPU

``--moments FILE.pt``: ``torch.save({name: (exp_avg, exp_avg_sq), ...})`` taken from a real
torch AdamW run (e.g. ``{n: (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])}``); all
tensors are flattened and concatenated per name; the table has one row block per file.

Metrics (all on flat FP32 tensors, FP64 arithmetic for the errors):
* ``v relL2``    ||v̂ − v||₂ / ||v||₂  (dominated by the largest entries)
* ``√v relL2``   ||sqrt(v̂) − sqrt(v)||₂ / ||sqrt(v)||₂ (the scale Adam divides by)
* ``v mean rel`` mean over entries of |v̂ − v| / v  (every entry counts; v == 0 entries skipped)
* ``u relL2``    update u = m / (sqrt(v) + eps): ||û − u|| / ||u|| with exact m, decoded v
* ``u max``      max |û − u| / max |u| (the blow-up an optimizer would feel)
* ``u(m̂,v̂)``   relL2 with both moments decoded
"direct" is fullstack_fp4.nvfp4's quantize (1×16 blocks, one FP32 tensor scale, RTN, 6-rule)
applied to v itself (and to m).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from fullstack_fp4.nvfp4 import quantize  # noqa: E402
from fullstack_fp4.optim.q_adamw.codecs import (decode_exp_avg, decode_exp_avg_sq,  # noqa: E402
                                                encode_exp_avg, encode_exp_avg_sq,
                                                padded_numel, state_bytes_per_param)

EPS = 1e-8


def synthetic_moments(n: int = 1 << 16, steps: int = 100, seed: int = 0, structured=False):
    """Adam EMAs (β 0.9/0.999, no bias correction) of heavy-tailed gradients.

    g_t = σ · (0.2·μ + t₃ noise), σ lognormal per entry (sd 1.5 in log space, ~e^±3 across
    entries) — or, ``structured``, σ = row scale × column scale × lognormal(0.5), a 256-wide
    matrix — with a per-entry drift μ ~ N(0, 1). Student-t with 3 dof gives rare huge gradients,
    as real ones have.
    """
    g = torch.Generator().manual_seed(seed)
    if structured:
        cols = 256
        rows = n // cols
        sr = torch.exp(1.0 * torch.randn(rows, 1, generator=g))
        sc = torch.exp(1.0 * torch.randn(1, cols, generator=g))
        sigma = (sr * sc * torch.exp(0.5 * torch.randn(rows, cols, generator=g))).reshape(-1)
    else:
        sigma = torch.exp(1.5 * torch.randn(n, generator=g))
    sigma = sigma.double() * 1e-3
    mu = torch.randn(n, generator=g, dtype=torch.float64)
    m = torch.zeros(n, dtype=torch.float64)
    v = torch.zeros(n, dtype=torch.float64)
    t3 = torch.distributions.StudentT(3.0)
    for _ in range(steps):
        z = t3.sample((n,)).double()
        grad = sigma * (0.2 * mu + z)
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad * grad
    return m.float(), v.float()


def direct_nvfp4(x: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    npad = -(-n // 16) * 16
    xp = torch.zeros(1, npad, device=x.device)
    xp[0, :n] = x.reshape(-1)
    return quantize(xp, backend="reference").dequantize().reshape(-1)[:n].float()


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def metrics(m, v, m_hat, v_hat):
    u = m.double() / (v.double().sqrt() + EPS)
    u_v = m.double() / (v_hat.double().clamp(min=0).sqrt() + EPS)
    u_mv = m_hat.double() / (v_hat.double().clamp(min=0).sqrt() + EPS)
    nz = v > 0
    return {
        "v relL2": _rel(v_hat, v),
        "√v relL2": _rel(v_hat.double().clamp(min=0).sqrt(), v.double().sqrt()),
        "v mean rel": float(((v_hat.double() - v.double()).abs()[nz] / v.double()[nz]).mean()),
        "u relL2": _rel(u_v, u),
        "u max": float((u_v - u).abs().max() / u.abs().max()),
        "u(m̂,v̂)": _rel(u_mv, u),
    }


def rows_for(m, v, variants: bool, seed: int = 0):
    gen = torch.Generator(device=m.device).manual_seed(seed)
    m_hat = decode_exp_avg(encode_exp_avg(m, generator=gen))
    out = [("direct NVFP4 (v itself, RTN)", metrics(m, v, direct_nvfp4(m), direct_nvfp4(v)),
            "")]
    default = decode_exp_avg_sq(encode_exp_avg_sq(v))
    out.append(('pipeline ("4" rule, tile 64, floor μ/4) [default]', metrics(m, v, m_hat, default),
                f"{state_bytes_per_param(v.numel()):.3f}"))
    v1 = decode_exp_avg_sq(encode_exp_avg_sq(v, tile=32, scale_rule="6"))
    out.append(("pipeline, codec version 1 (6-rule, tile 32)", metrics(m, v, m_hat, v1),
                f"{state_bytes_per_param(v.numel(), 32):.3f}"))
    if variants:
        for tile in (16, 32, 64):
            st = encode_exp_avg_sq(v, tile=tile, with_floor=True)
            b = f"{state_bytes_per_param(v.numel(), tile):.3f}"
            for guard, c in (("none", 0), ("tile_min", 0), ("relative", 0.5),
                             ("relative", 0.25), ("relative", 0.125), ("relative", 0.0625)):
                vh = decode_exp_avg_sq(st, guard=guard, rel_floor=c)
                name = f"tile {tile}, guard {guard}" + (f" {c}·μ" if c else "")
                bb = f"{float(b) + 2 / tile:.3f}" if guard == "tile_min" else b
                out.append((name, metrics(m, v, m_hat, vh), bb))
        st = encode_exp_avg_sq(v, scale_rule="4over6")
        out.append(("tile 64, μ/4, 4/6 on v", metrics(m, v, m_hat, decode_exp_avg_sq(st)), ""))
        st = encode_exp_avg_sq(v, subtract_mean=False)
        out.append(("sqrt+RHT, no mean subtraction (μ = 0, so no floor)",
                    metrics(m, v, m_hat, decode_exp_avg_sq(st)), ""))
        for rule, name in (("nvfp4", "chunk scale M / amax (NVFP4's rule)"),
                           ("pow2", "chunk scale 2^floor(log2(M / amax)) (no division)")):
            gen = torch.Generator(device=m.device).manual_seed(seed)
            mh = decode_exp_avg(encode_exp_avg(m, generator=gen, chunk_rule=rule))
            vh = decode_exp_avg_sq(encode_exp_avg_sq(v, chunk_rule=rule))
            out.append((name + ", m and v", metrics(m, v, mh, vh),
                        f"{state_bytes_per_param(v.numel()):.3f}"))
    return out


RULES = {"reciprocal": "dec = fl(amax · fl(1/M)), enc = fl(1/dec) [default]",
         "nvfp4": "enc = fl(M / amax), dec = fl(1/enc) (NVFP4's tensor-scale rule)",
         "pow2": "enc = 2^floor(log2(M / amax)) (no division)"}


def chunk_rule_means(n: int, seeds: int):
    """Mean over ``seeds`` synthetic draws of m's and sqrt(v)'s relL2 under both chunk-scale
    rules (codecs._quantize_chunked's ``chunk_rule``): one draw's difference between the rules
    is within the draw-to-draw spread."""
    for structured in (False, True):
        acc = {}
        for sd in range(seeds):
            torch.manual_seed(1000 + sd)       # synthetic_moments' Student-t: global RNG
            m, v = synthetic_moments(n, steps=60, seed=sd, structured=structured)
            u = torch.rand(padded_numel(m.numel()), generator=torch.Generator().manual_seed(sd))
            for rule in RULES:
                mh = decode_exp_avg(encode_exp_avg(m, rand=u, chunk_rule=rule))
                vh = decode_exp_avg_sq(encode_exp_avg_sq(v, chunk_rule=rule))
                a = acc.setdefault(rule, [0.0, 0.0])
                a[0] += _rel(mh, m) / seeds
                a[1] += _rel(vh.sqrt(), v.sqrt()) / seeds
        kind = "structured rows×cols×lognormal" if structured else "iid lognormal σ"
        print(f"\n### chunk-scale rules, synthetic ({kind}, {n} entries), mean of {seeds} draws\n")
        print("| chunk scale | m relL2 | √v relL2 |\n|---|---|---|")
        for rule, name in RULES.items():
            print(f"| {name} | {acc[rule][0]:.4f} | {acc[rule][1]:.4f} |")


def _pool(acc):
    """Combine per-tensor metrics into whole-model ones: relL2 = sqrt(Σ err² / Σ ref²) from each
    tensor's relL2 and reference norm; max ratios: the max error over the max reference; mean
    rel: entry-weighted mean."""
    out = {}
    keys = acc[0][2].keys()
    for k in keys:
        if k == "v mean rel":
            num = sum(met[k] * int((v > 0).sum()) for m, v, met in acc)
            out[k] = num / max(sum(int((v > 0).sum()) for m, v, met in acc), 1)
            continue
        if k == "u max":
            # per tensor: max|û−u| / max|u|; pooled: max over tensors of (max|û−u|) / max|u|
            umax = [float((m.double() / (v.double().sqrt() + EPS)).abs().max()) for m, v, _ in acc]
            out[k] = max(met[k] * um for (_, _, met), um in zip(acc, umax)) / max(umax)
            continue
        refs = {"v relL2": lambda m, v: v.double().norm(),
                "√v relL2": lambda m, v: v.double().sqrt().norm(),
                "u relL2": lambda m, v: (m.double() / (v.double().sqrt() + EPS)).norm(),
                "u(m̂,v̂)": lambda m, v: (m.double() / (v.double().sqrt() + EPS)).norm()}
        r = [float(refs[k](m, v)) for m, v, _ in acc]
        err2 = sum((met[k] * ri) ** 2 for (_, _, met), ri in zip(acc, r))
        out[k] = math.sqrt(err2 / max(sum(ri * ri for ri in r), 1e-300))
    return out


def print_table(title, rows):
    keys = list(rows[0][1].keys())
    print(f"\n### {title}\n")
    print("| codec | " + " | ".join(keys) + " | B/param (m+v) |")
    print("|---" * (len(keys) + 2) + "|")
    for name, met, b in rows:
        print(f"| {name} | " + " | ".join(f"{met[k]:.4g}" for k in keys) + f" | {b} |")
    d, p = rows[0][1], rows[1][1]
    print(f"\npipeline vs direct: √v relL2 {100 * (1 - p['√v relL2'] / d['√v relL2']):.1f}% "
          f"lower, v relL2 {100 * (1 - p['v relL2'] / d['v relL2']):.1f}% lower, "
          f"v mean rel {100 * (1 - p['v mean rel'] / d['v mean rel']):.1f}% lower, "
          f"u relL2 {100 * (1 - p['u relL2'] / d['u relL2']):.1f}% lower")


def load_moments(path):
    d = torch.load(path, map_location="cpu")
    for name, (m, v) in d.items():
        yield name, m.reshape(-1).float(), v.reshape(-1).float()


REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
QUICKSTART_DATA = ["data.path=[data/quickstart/train_text_document]",
                   "data.valid_path=[data/quickstart/valid_text_document]", "data.split=100,0,0",
                   "data.tokenizer=data/quickstart/tokenizer.model",
                   "data.cache_dir=data/quickstart/cache"]
TRAIN_CPU = ["model.preset=tiny", "model.seq_length=128", "train.global_batch_size=16",
             "train.micro_batch_size=8", "train.precision=fp32", "optimizer.lr=3e-3",
             "optimizer.min_lr=3e-4", "optimizer.weight_decay=0.1", "optimizer.warmup_iters=30",
             "optimizer.schedule=cosine"]
TRAIN_GPU = ["model.preset=3b", "model.num_layers=4", "model.vocab_size=32000",
             "train.global_batch_size=2", "train.micro_batch_size=2", "train.precision=bf16",
             "optimizer.lr=3e-4", "optimizer.min_lr=3e-5", "optimizer.weight_decay=0.1",
             "optimizer.warmup_iters=20", "optimizer.schedule=cosine"]


def train_moments(steps: int, device: str, seed: int = 1234, checkpoint=None) -> dict:
    """Train with torch AdamW (optimizer.name=adamw, megatron-core's wrapper) for ``steps``
    steps on data/quickstart — or, ``checkpoint`` given, load that AdamW checkpoint (its own
    saved config) without training — and return {param name: (exp_avg, exp_avg_sq)} of the
    inner AdamW (the FP32 main params' moments), on ``device``."""
    os.chdir(REPO)
    from megatron.training.config import load_config
    from megatron.training.trainer import Trainer

    if checkpoint is not None:
        import json

        with open(os.path.join(checkpoint, "meta.json")) as f:
            meta = json.load(f)
        if meta["config"]["optimizer"]["name"] != "adamw":
            raise SystemExit(f"{checkpoint}: optimizer {meta['config']['optimizer']['name']}, "
                             "not adamw (no FP32 moments to read)")
        import tempfile

        import yaml

        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump(meta["config"], f)
        cfg = load_config(f.name, [f"checkpoint.load={checkpoint}", "checkpoint.save_dir=null",
                                   "checkpoint.save_interval=null",
                                   "checkpoint.save_on_exit=false", "logging.dir=null",
                                   "logging.tensorboard=false", "train.eval_iters=0"])
        tr = Trainer(cfg, verbose=False)
        print(f"loaded {checkpoint} (iteration {tr.iteration})")
    else:
        if not os.path.exists("data/quickstart/train_text_document.bin"):
            raise SystemExit("data/quickstart is missing: run scripts/prepare_quickstart_data.py")
        base = TRAIN_CPU if device == "cpu" else TRAIN_GPU
        cfg = load_config(None, base + QUICKSTART_DATA + [
            "optimizer.name=adamw", f"train.iters={steps}", "train.eval_iters=0",
            f"train.log_interval={max(steps // 10, 1)}", f"train.seed={seed}",
            "checkpoint.load=none", "checkpoint.save_dir=null", "checkpoint.save_on_exit=false",
            "logging.dir=null", "logging.tensorboard=false"])
        tr = Trainer(cfg, verbose=True)
        tr.train()
    # inner AdamW's params are FP32 main params; map them to model names through the wrapper
    wrappers = getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])
    name_of = {id(p): n for n, p in tr.gpt.named_parameters()}
    out = {}
    for w in wrappers:
        main_to_model = {}
        if hasattr(w, "float16_groups"):
            for g16, g32 in zip(w.float16_groups, w.fp32_from_float16_groups):
                main_to_model.update({id(m): p for p, m in zip(g16, g32)})
            for g in w.fp32_from_fp32_groups:
                main_to_model.update({id(p): p for p in g})
        inner = w.optimizer
        for g in inner.param_groups:
            for p in g["params"]:
                st = inner.state.get(p, {})
                if "exp_avg" not in st:
                    continue
                model_p = main_to_model.get(id(p), p)
                name = name_of.get(id(model_p), f"param{len(out)}")
                out[name] = (st["exp_avg"].detach().float().to(device).clone(),
                             st["exp_avg_sq"].detach().float().to(device).clone())
    assert out, "no AdamW moments found"
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moments", help="FILE.pt: {name: (exp_avg, exp_avg_sq)} from torch AdamW")
    ap.add_argument("--train", type=int, default=0, metavar="STEPS",
                    help="train with torch AdamW for STEPS steps first and table its moments")
    ap.add_argument("--from-checkpoint", default=None, metavar="DIR",
                    help="read the moments of this AdamW checkpoint (iter_NNNNNNN dir)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="--train: cpu = quickstart tiny model, cuda = 4 blocks of 3b")
    ap.add_argument("--save-moments", default=None,
                    help="--train: where to save the moments (default runs/q_adamw_moments_"
                         "<device>.pt)")
    ap.add_argument("--min-numel", type=int, default=4096,
                    help="real moments: only tensors QAdamW quantizes (numel >= this)")
    ap.add_argument("--variants", action="store_true", help="also tile/guard alternatives")
    ap.add_argument("--n", type=int, default=1 << 16)
    ap.add_argument("--seeds", type=int, default=0,
                    help="also m's and sqrt(v)'s error under both chunk-scale rules, averaged "
                         "over this many synthetic draws")
    args = ap.parse_args(argv)
    real = None
    if args.train or args.from_checkpoint:
        moments = train_moments(args.train, args.device, checkpoint=args.from_checkpoint)
        label = args.from_checkpoint or f"{args.train}-step AdamW run ({args.device})"
        if args.save_moments or args.device == "cpu":
            path = args.save_moments or os.path.join(REPO, "runs",
                                                     f"q_adamw_moments_{args.device}.pt")
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            torch.save({k: (m.cpu(), v.cpu()) for k, (m, v) in moments.items()}, path)
            print(f"saved {len(moments)} moment pairs of an AdamW run to {path}")
        real = (label, [(n, m.reshape(-1), v.reshape(-1)) for n, (m, v) in moments.items()])
    elif args.moments:
        dev = args.device
        real = (args.moments, [(n, m.to(dev), v.to(dev)) for n, m, v in load_moments(args.moments)])
    torch.manual_seed(0)
    for structured in (False, True):
        m, v = synthetic_moments(args.n, structured=structured)
        kind = "structured rows×cols×lognormal" if structured else "iid lognormal σ"
        print_table(f"synthetic ({kind}, t3 gradients, {args.n} entries)",
                    rows_for(m, v, args.variants))
    if args.seeds:
        chunk_rule_means(args.n // 2, args.seeds)
    if real is not None:
        ms, vs = [], []
        for name, m, v in real[1]:
            if m.numel() < args.min_numel:
                continue
            ms.append(m)
            vs.append(v)
        # per tensor (codec state per tensor, as the optimizer does), then concatenated
        rows = None
        for m, v in zip(ms, vs):
            r = rows_for(m, v, args.variants)
            rows = [(nm, met, b, [(m, v, met)]) for nm, met, b in r] if rows is None else \
                [(nm, met0, b, acc + [(m, v, met)]) for (nm, met0, b, acc), (_, met, _) in
                 zip(rows, r)]
        # aggregate: relL2 metrics by energy-weighted pooling of per-tensor errors
        pooled = []
        for nm, _, b, acc in rows:
            pooled.append((nm, _pool(acc), b))
        n = sum(m.numel() for m in ms)
        print_table(f"real moments ({os.path.basename(str(real[0]))}, {len(ms)} tensors "
                    f">= {args.min_numel} entries, {n} entries; each tensor encoded on its own)",
                    pooled)


if __name__ == "__main__":
    main()
