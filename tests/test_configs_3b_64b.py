"""configs/3b_64b/: every arm loads and validates (or is skipped with the reason when its
recipe has not landed), differs from base.yaml only in its recipe switches (plus its own run
directories and, for Root and Muon, the lr their family's rule gives), matches
benchmarks/bench_blocks.py's ARMS, describes a 64B-token run whose layout is valid for 64 GPUs;
one arm dry-runs to the 3B parameter count; the launcher's usage/command."""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

from megatron.training import recipes
from megatron.training.config import load_config, to_dict
from megatron.training.config_validate import validate_config

REPO = os.path.abspath(os.path.dirname(os.path.dirname(__file__)))
DIR = os.path.join(REPO, "configs", "3b_64b")
ARM_NAMES = ["bf16", "nvfp4_linear", "lora_svd", "q_adamw", "root", "q_root", "q_attn", "full_stack",
             "full_stack_root", "full_stack_muon"]
RECIPE_KEYS = {"fp4.linear", "fp4.attention", "optimizer.name"}


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def unimplemented(cfg) -> str | None:
    for key in sorted(RECIPE_KEYS):
        section, name = key.split(".")
        reason = recipes.unavailable_reason(key, getattr(getattr(cfg, section), name))
        if reason:
            return f"{key}={getattr(getattr(cfg, section), name)} {reason}"
    return None


def test_one_file_per_arm():
    names = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(DIR, "*.yaml")))
    assert names == sorted(ARM_NAMES + ["base"])


@pytest.mark.parametrize("arm", ARM_NAMES)
def test_arm_differs_from_base_only_in_recipe_switches(arm):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from ablation import FAMILY_OF
    from bench_blocks import ARMS

    path = os.path.join(DIR, f"{arm}.yaml")
    raw = load_config(path, validate=False)
    reason = unimplemented(raw)
    if reason:
        pytest.skip(f"{arm}: {reason}")
    cfg = load_config(path)  # validates (world size 1 from the environment)
    base = flat(to_dict(load_config(os.path.join(DIR, "base.yaml"))))
    mine = flat(to_dict(cfg))
    diff = {k for k in base if base[k] != mine[k]}
    family = FAMILY_OF[mine["optimizer.name"]]
    lr_keys = {"optimizer.lr", "optimizer.min_lr", "optimizer.orthogonal.lr_scale"} if family != "adamw" else set()
    assert diff - RECIPE_KEYS - lr_keys == {"checkpoint.save_dir", "logging.dir"}, diff
    if family != "adamw":
        # docs/optimizers.md, "From the ablation model to 3B": the family's swept lr relative to
        # AdamW's (sweep: AdamW 2e-3, Root 4e-3, Muon 3.2e-2, matrices at the rest's lr) times the
        # AdamW anchor; Muon's matrices sqrt(3072 / 512) higher for its 1/sqrt(fan-in) update RMS
        ratio = {"root": 4e-3 / 2e-3, "muon": 3.2e-2 / 2e-3}[family]
        scale = {"root": 1.0, "muon": round((3072 / 512) ** 0.5, 2)}[family]
        assert mine["optimizer.lr"] == pytest.approx(base["optimizer.lr"] * ratio)
        assert mine["optimizer.min_lr"] / mine["optimizer.lr"] == pytest.approx(
            base["optimizer.min_lr"] / base["optimizer.lr"])
        assert mine["optimizer.orthogonal.lr_scale"] == pytest.approx(scale)
    assert mine["checkpoint.save_dir"] == f"runs/3b_64b/{arm}/checkpoints"
    assert mine["logging.dir"] == f"runs/3b_64b/{arm}"
    # the switches are exactly bench_blocks.py's arm of the same name (bf16 = all defaults)
    want = {"fp4.linear": "bf16", "fp4.attention": "bf16", "optimizer.name": "adamw"}
    for item in ARMS[arm]:
        k, v = item.split("=", 1)
        want[k] = v
    assert {k: mine[k] for k in RECIPE_KEYS} == want
    validate_config(cfg, world_size=64)  # the written-out layout: 64 GPUs


def test_base_is_the_64b_token_run():
    cfg = load_config(os.path.join(DIR, "base.yaml"))
    m, t, o, p = cfg.model, cfg.train, cfg.optimizer, cfg.parallel
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups) == \
        (28, 3072, 8192, 24, 8)
    assert m.seq_length == 4096 and m.vocab_size == 32000
    tokens = t.iters * t.global_batch_size * m.seq_length
    assert 64e9 <= tokens < 64e9 + t.global_batch_size * m.seq_length  # the first step count >= 64B
    assert (o.lr, o.min_lr, o.schedule, o.beta1, o.beta2, o.weight_decay) == (3e-4, 3e-5, "cosine", 0.9, 0.95, 0.1)
    assert 0 < o.warmup_iters < t.iters // 10 and t.grad_clip == 1.0 and t.precision == "bf16"
    assert cfg.checkpoint.save_interval == 1000 and cfg.checkpoint.load == "auto"
    assert p.pipeline_model_parallel_size == 1
    dp = 64 // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
    assert t.global_batch_size % (t.micro_batch_size * dp) == 0


def test_dry_run_bf16_arm_is_3b():
    """As docs/reproduction.md checks a layout: WORLD_SIZE=64 and no launcher (no RANK, no
    rendezvous). The dry run builds in a world of one and reports the 64-GPU layout."""
    e = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    e["WORLD_SIZE"] = "64"
    p = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), "--config",
                        "configs/3b_64b/bf16.yaml", "--dry-run", "data.mock=true"],
                       cwd=REPO, env=e, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    n = int(re.search(r"^parameters: ([\d,]+)", p.stdout, re.M).group(1).replace(",", ""))
    # closed form (Llama-style, untied embeddings, vocab 32000 = 250 x 128, no padding)
    h, f, L, heads, groups, v = 3072, 8192, 28, 24, 8, 32000
    d = h // heads
    per_layer = h * (heads + 2 * groups) * d + heads * d * h + 3 * h * f + 2 * h
    assert n == L * per_layer + h + 2 * v * h
    assert 2.9e9 < n < 3.2e9
    assert "tokens per step: 2,097,152" in p.stdout
    assert "layout at WORLD_SIZE=64: TP 1 x PP 1 x DP 64; 4 micro-batch(es) of 2" in p.stdout  # 512 / (2 x 64)


LAUNCH = os.path.join(REPO, "scripts", "launch_multinode.sh")


def test_launcher_usage_and_command():
    p = subprocess.run(["bash", LAUNCH, "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "NNODES" in p.stdout and "MASTER_ADDR" in p.stdout
    assert subprocess.run(["bash", LAUNCH], capture_output=True, text=True).returncode == 2
    e = dict(os.environ, NNODES="8", NODE_RANK="3", MASTER_ADDR="node001", GPUS_PER_NODE="8", DRY_RUN="1",
             PYTHON="python3")
    e.pop("MASTER_PORT", None)  # an in-process test may have set it (a world of one); the default is under test
    p = subprocess.run(["bash", LAUNCH, "configs/3b_64b/full_stack.yaml", "train.iters=10"], cwd=REPO, env=e,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    cmd = p.stdout.split()
    assert cmd[:3] == ["python3", "-m", "torch.distributed.run"]
    for flag, value in (("--nnodes", "8"), ("--node-rank", "3"), ("--nproc-per-node", "8"),
                        ("--master-addr", "node001"), ("--master-port", "29500"),
                        ("--config", "configs/3b_64b/full_stack.yaml")):
        assert cmd[cmd.index(flag) + 1] == value
    assert cmd[-1] == "train.iters=10" and cmd[cmd.index("--config") - 1].endswith("pretrain_gpt.py")
    bad = dict(e, MASTER_ADDR="")
    p = subprocess.run(["bash", LAUNCH, "configs/3b_64b/bf16.yaml"], cwd=REPO, env=bad, capture_output=True, text=True)
    assert p.returncode == 2 and "MASTER_ADDR" in p.stderr
    p = subprocess.run(["bash", LAUNCH, "configs/3b_64b/bf16.yaml"], cwd=REPO, env=dict(e, NODE_RANK="8"),
                       capture_output=True, text=True)
    assert p.returncode == 2 and "NODE_RANK" in p.stderr
