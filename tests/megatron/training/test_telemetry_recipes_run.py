"""Per-recipe telemetry and fallback in real (tiny, CPU, mock data) runs: every recipe's metrics
appear in metrics.jsonl under the documented names (docs/telemetry.md), and the per-recipe
fallback switches LoRA-SVD and Q-Attn modules to BF16 while optimizer statistics only warn."""
import math
import os

import pytest
import torch

from tests.megatron.training import helpers

LAYERS = 4
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
OPERANDS = ("x", "dy", "wgrad_x", "wgrad_dy")


def test_nvfp4_qattn_qroot_metrics_appear(tmp_path):
    d = str(tmp_path)
    r = helpers.run(helpers.base_config(d), [
        "fp4.linear=nvfp4", "fp4.attention=q_attn", "optimizer.name=q_root", "train.eval_interval=100",
        "logging.quant_stats_interval=1", "train.iters=1", f"logging.dir={d}/log", "checkpoint.load=none"])
    assert r.returncode == 0, r.stderr[-3000:]
    q = helpers.read_quant_records(f"{d}/log")[1]
    want = {f"quant/decoder.layers.{i}.{m}/{t}/rel_err" for i in range(LAYERS) for m in LINEARS
            for t in OPERANDS + ("w",)}
    want |= {f"quant/decoder.layers.{i}.self_attention.core_attention/{t}/rel_err"
             for i in range(LAYERS) for t in ("s", "ds")}
    # q_root: QAdamW on the non-matrix params big enough to be quantized (embedding, output layer)
    want |= {f"quant/optimizer/{p}/{t}" for p in ("embedding.word_embeddings.weight", "output_layer.weight")
             for t in ("m/rel_err", "v/rel_err", "update/rel_err", "v_clamped/frac")}
    assert want <= set(q), sorted(want - set(q))
    ns = [k for k in q if "/ns_" in k]          # one sampled Root matrix per interval
    assert len(ns) == 3 and {k.rsplit("/", 2)[1] for k in ns} == {"ns_step", "ns_orth", "ns_orth_fp32"}, ns
    assert set(q) == want | set(ns), sorted(set(q) - want - set(ns))
    for k, v in q.items():
        assert math.isfinite(v), k
        if k.endswith("/rel_err") and "/optimizer/" not in k:
            assert 0.02 < v < 0.3, (k, v)       # NVFP4 round trips: ~0.08-0.15 here
    assert 0 < q[ns[[k.endswith("ns_step/rel_err") for k in ns].index(True)]] < 0.3


@pytest.mark.long
def test_lora_qattn_qmuon_fallback_per_recipe(tmp_path):
    d = str(tmp_path)
    thresholds = [f"fp4.fallback_threshold{s}=1e-6" for s in ("", "_lora_svd", "_attention", "_optimizer")]
    common = ["fp4.linear=lora_svd", "fp4.lora_svd.rank=8", "fp4.attention=q_attn", "optimizer.name=q_muon",
              "train.eval_interval=100", "logging.quant_stats_interval=1", "fp4.fallback=bf16",
              "fp4.fallback_intervals=1", *thresholds, f"checkpoint.save_dir={d}/ckpt", f"logging.dir={d}/log"]
    r = helpers.run(helpers.base_config(d), common + ["train.iters=2"])
    assert r.returncode == 0, r.stderr[-3000:]
    q = helpers.read_quant_records(f"{d}/log")
    lora = {f"decoder.layers.{i}.{m}" for i in range(LAYERS) for m in LINEARS}
    attn = {f"decoder.layers.{i}.self_attention.core_attention" for i in range(LAYERS)}
    for p in lora:
        for t in OPERANDS + ("w_res",):
            assert 0.02 < q[1][f"quant/{p}/{t}/rel_err"] < 0.3
        assert 0 < q[1][f"quant/{p}/lora_energy/frac"] < 1
    assert all(f"quant/{p}/{t}/rel_err" in q[1] for p in attn for t in ("s", "ds"))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("[fp4.fallback] iteration 1:")]
    bf16 = {ln.split(": ")[1] for ln in lines if ln.endswith("-> BF16")}
    warned = [ln for ln in lines if ln.endswith("-> WARN")]
    assert bf16 == lora | attn, (sorted(bf16), lines)
    # q_muon: optimizer statistics (the sampled NS matrix's; QAdamW's of the rest) have no BF16
    # path -> warnings only, nothing switched
    assert all("optimizer/" in w for w in warned) and any("ns_step" in w for w in warned), lines
    assert any("optimizer/output_layer.weight" in w for w in warned), lines   # QAdamW's rest
    # iteration 2: the switched modules are no longer measured (they run BF16); the optimizer is
    assert all(k.startswith("quant/optimizer/") for k in q[2]) and q[2], sorted(q[2])
    extra = torch.load(os.path.join(d, "ckpt", "iter_0000002", "extra", "rank_00000.pt"), weights_only=False)
    assert set(extra["fp4_fallback"]["bf16_modules"]) == lora | attn
    train, _ = helpers.read_metrics(f"{d}/log")
    assert math.isfinite(train[2]["loss"])     # the BF16 paths (lora_exact, SDPA) train

    # resume: the switches are re-applied from the checkpoint (LoRA-SVD lora_exact, Q-Attn -> SDPA)
    r = helpers.run(helpers.base_config(d), common + ["train.iters=3", "train.continue_with=extend"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"[fp4.fallback] resumed with {len(lora | attn)} module(s) in BF16" in r.stdout, r.stdout[-3000:]
    q = helpers.read_quant_records(f"{d}/log")
    assert q[3] and all(k.startswith("quant/optimizer/") for k in q[3]), sorted(q[3])
    train, _ = helpers.read_metrics(f"{d}/log")
    assert math.isfinite(train[3]["loss"])
