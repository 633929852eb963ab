"""Quantization telemetry and the BF16 fallback inside real (tiny, CPU) NVFP4 runs."""
import os

import pytest
import torch

from tests.megatron.training import helpers

NVFP4 = ["fp4.linear=nvfp4", "train.eval_interval=100"]
N_LINEARS = 4 * 4  # tiny preset: 4 layers x (qkv, proj, fc1, fc2)


def test_quant_stats_logged_every_interval(tmp_path):
    d = str(tmp_path)
    r = helpers.run(helpers.base_config(d), NVFP4 + [
        "logging.quant_stats_interval=2", "train.iters=4", f"logging.dir={d}/log", "checkpoint.load=none"])
    assert r.returncode == 0, r.stderr[-3000:]
    q = helpers.read_quant_records(f"{d}/log")
    assert sorted(q) == [2, 4]
    for it, stats in q.items():
        assert len(stats) == 5 * N_LINEARS, sorted(stats)
        for k, v in stats.items():
            path, tensor = k[len("quant/"):-len("/rel_err")].rsplit("/", 1)
            assert k.endswith("/rel_err") and tensor in ("x", "w", "dy", "wgrad_x", "wgrad_dy") \
                and path.startswith("decoder.layers."), k
            assert 0.05 < v < 0.2, (k, v)  # NVFP4 on Gaussian-like operands: ~0.09-0.14


@pytest.mark.long
def test_forced_fallback_switches_saves_and_survives_resume(tmp_path):
    d = str(tmp_path)
    common = NVFP4 + ["logging.quant_stats_interval=2", "fp4.fallback=bf16", "fp4.fallback_threshold=1e-6",
                      "fp4.fallback_intervals=1", f"checkpoint.save_dir={d}/ckpt", f"logging.dir={d}/log"]
    r = helpers.run(helpers.base_config(d), common + ["train.iters=2"])
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("[fp4.fallback]")]
    assert len(lines) == N_LINEARS and all("-> BF16" in ln and "iteration 2" in ln for ln in lines), lines
    q = helpers.read_quant_records(f"{d}/log")
    assert sorted(q) == [2]  # the interval that triggered the switch was measured in NVFP4
    extra = torch.load(os.path.join(d, "ckpt", "iter_0000002", "extra", "rank_00000.pt"), weights_only=False)
    switched = extra["fp4_fallback"]["bf16_modules"]
    assert len(switched) == N_LINEARS and "decoder.layers.0.mlp.linear_fc1" in switched
    assert sorted(extra["fallback_policy"]["triggered"]) == sorted(switched)
    assert "guard" in extra

    # Resume to iteration 4: the modules stay in BF16, so telemetry (which measures NVFP4 linears
    # only) has nothing to report at iteration 4, and nothing switches again.
    r = helpers.run(helpers.base_config(d), common + ["train.iters=4", "train.continue_with=extend"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"[fp4.fallback] resumed with {N_LINEARS} module(s) in BF16" in r.stdout, r.stdout[-3000:]
    assert not [ln for ln in r.stdout.splitlines() if ln.startswith("[fp4.fallback] iteration")]
    q = helpers.read_quant_records(f"{d}/log")
    assert sorted(q) == [2], sorted(q)
    train, _ = helpers.read_metrics(f"{d}/log")
    assert 4 in train and train[4]["loss"] == train[4]["loss"]  # finite: the BF16 path trains


def test_fallback_config_validation():
    import pytest

    from megatron.training.config import load_config
    from megatron.training.errors import ConfigError

    ok = ["model.preset=tiny", "data.mock=true", "model.vocab_size=256", "fp4.linear=nvfp4"]
    cfg = load_config(None, ok + ["logging.quant_stats_interval=10", "fp4.fallback=bf16"])
    assert cfg.fp4.fallback_threshold == 0.25 and cfg.fp4.fallback_intervals == 3
    # any FP4 recipe can be watched now (attention / optimizer alone too)
    load_config(None, ok[:3] + ["logging.quant_stats_interval=10", "fp4.fallback=warn", "fp4.attention=q_attn"])
    load_config(None, ok[:3] + ["logging.quant_stats_interval=10", "fp4.fallback=warn", "optimizer.name=q_adamw"])
    load_config(None, ok[:3] + ["logging.quant_stats_interval=10"])  # telemetry alone is fine on any recipe
    for bad, words in [
        (["fp4.fallback=warn"], ("fp4.fallback", "quant_stats_interval")),
        (["fp4.fallback=bf16", "logging.quant_stats_interval=5", "fp4.linear=bf16"], ("FP4 recipe", "fp4.linear")),
        (["fp4.fallback_threshold=0"], ("fp4.fallback_threshold",)),
        (["fp4.fallback_threshold_attention=-1"], ("fp4.fallback_threshold_attention",)),
        (["fp4.fallback_threshold_lora_svd=0"], ("fp4.fallback_threshold_lora_svd",)),
        (["fp4.fallback_threshold_optimizer=0"], ("fp4.fallback_threshold_optimizer",)),
        (["logging.quant_stats_blocks=0"], ("logging.quant_stats_blocks",)),
        (["fp4.fallback_intervals=0"], ("fp4.fallback_intervals",)),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(None, ok + bad)
        assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.long
def test_two_rank_fallback_agrees(tmp_path):
    # Data parallel 2: the per-rank stats are all-reduced (MAX) before the policy acts, so both
    # ranks switch the same modules; only rank 0 prints.
    d = str(tmp_path)
    r = helpers.run(helpers.base_config(d), NVFP4 + [
        "logging.quant_stats_interval=1", "fp4.fallback=bf16", "fp4.fallback_threshold=0.12",
        "fp4.fallback_intervals=1", "train.iters=1", f"checkpoint.save_dir={d}/ckpt", f"logging.dir={d}/log"],
        nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("[fp4.fallback]")]
    mods = [torch.load(os.path.join(d, "ckpt", "iter_0000001", "extra", f"rank_{k:05d}.pt"),
                       weights_only=False)["fp4_fallback"]["bf16_modules"] for k in (0, 1)]
    assert mods[0] == mods[1] and len(lines) == len(mods[0]) > 0, (lines, mods)
    q = helpers.read_quant_records(f"{d}/log")[1]
    worst = {k[len("quant/"):].rsplit("/", 2)[0] for k, v in q.items() if v > 0.12}
    assert worst == set(mods[0])
