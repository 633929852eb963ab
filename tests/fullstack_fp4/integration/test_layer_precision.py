"""Per-module precision by pattern (`fp4.keep_bf16`, with `fp4.bf16_first_layers` /
`bf16_last_layers` as shorthands; megatron/training/precision.py) on a tiny GPTModel, in
process on CPU.

Oracles: the class of every module of the built model against a by-hand list of what each
pattern names; the shorthands against the equivalent explicit patterns; `count_parameters`
against the built LoRA-SVD model's own parameter count; the refusals by their messages and,
through pretrain_gpt.py, one `error:` line and exit code 2.
"""
from __future__ import annotations

import pytest
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from fullstack_fp4.integration.lora_svd_layers import (LoRASVDColumnParallelLinear,
                                                       LoRASVDRowParallelLinear)
from fullstack_fp4.integration.nvfp4_linear_layers import (NVFP4ColumnParallelLinear,
                                                           NVFP4RowParallelLinear)
from fullstack_fp4.integration.q_attn_core_attention import QAttnCoreAttention
from megatron.training import precision
from megatron.training.config import ConfigError, load_config
from megatron.training.sdpa_attention import SDPACoreAttention
from tests.megatron.training import helpers

TINY = ["model.preset=tiny", "model.seq_length=32", "model.vocab_size=256", "data.mock=true",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_iters=0",
        "logging.tensorboard=false", "checkpoint.load=none", "train.iters=2",
        "train.precision=fp32"]
LAYERS = 4
SLOTS = ("self_attention.linear_qkv", "self_attention.linear_proj", "self_attention.core_attention",
         "mlp.linear_fc1", "mlp.linear_fc2")

_dist = pytest.fixture(scope="module", autouse=True)(helpers.in_process_megatron)


def _modules(overrides):
    from megatron.training.trainer import Trainer

    cfg = load_config(None, TINY + overrides)
    cfg.logging.dir = None
    tr = Trainer(cfg, verbose=False)
    return cfg, tr, {n.split("decoder.", 1)[1]: m for n, m in tr.model.named_modules()
                     if ".decoder.layers." in f".{n}" and n.split(".")[-1] in
                     ("linear_qkv", "linear_proj", "core_attention", "linear_fc1", "linear_fc2")}


def _is_bf16(slot, m) -> bool:
    if slot.endswith("core_attention"):
        return type(m) is SDPACoreAttention
    return type(m) in (ColumnParallelLinear, RowParallelLinear)


def _is_fp4(slot, m, linear) -> bool:
    if slot.endswith("core_attention"):
        return type(m) is QAttnCoreAttention
    col, row = ((NVFP4ColumnParallelLinear, NVFP4RowParallelLinear) if linear == "nvfp4"
                else (LoRASVDColumnParallelLinear, LoRASVDRowParallelLinear))
    return type(m) is (col if slot.endswith(("linear_qkv", "linear_fc1")) else row)


@pytest.mark.parametrize("linear", ["nvfp4", "lora_svd"])
def test_patterns_keep_exactly_the_named_modules_in_bf16(linear):
    cfg, tr, mods = _modules([f"fp4.linear={linear}", "fp4.lora_svd.rank=8", "fp4.attention=q_attn",
                              "fp4.keep_bf16=[decoder.layers.0.*, '*.linear_fc2']"])
    # by hand: every slot of layer 0, and linear_fc2 of layers 1..3
    kept = {f"layers.0.{s}" for s in SLOTS} | {f"layers.{i}.mlp.linear_fc2" for i in range(1, LAYERS)}
    assert len(mods) == LAYERS * len(SLOTS)
    for name, m in mods.items():
        slot = name.split(".", 2)[2]
        if name in kept:
            assert _is_bf16(slot, m), (name, type(m).__name__)
        else:
            assert _is_fp4(slot, m, linear), (name, type(m).__name__)
    if linear == "lora_svd":   # the factors exist only on the FP4 linears, and the count knows it
        from megatron.training.model import count_parameters

        n_factors = sum(1 for n, _ in tr.model.named_parameters() if n.endswith("lora_l1"))
        assert n_factors == LAYERS * 4 - len([k for k in kept if "core_attention" not in k])
        built = sum(p.numel() for p in tr.gpt.parameters())
        assert count_parameters(cfg, 256)["total"] == built


def test_shorthands_are_the_same_map_as_their_patterns():
    f = load_config(None, TINY + ["fp4.linear=nvfp4", "fp4.attention=q_attn", "fp4.bf16_first_layers=1",
                                  "fp4.bf16_last_layers=1"])
    p = load_config(None, TINY + ["fp4.linear=nvfp4", "fp4.attention=q_attn",
                                  "fp4.keep_bf16=[decoder.layers.0.*, decoder.layers.3.*]"])
    want = {f"decoder.layers.{i}.{s}" for i in (0, 3) for s in SLOTS}
    assert precision.bf16_module_names(f) == precision.bf16_module_names(p) == want
    # both together: the union
    both = load_config(None, TINY + ["fp4.linear=nvfp4", "fp4.bf16_first_layers=1",
                                     "fp4.keep_bf16=['*.linear_qkv']"])
    assert precision.bf16_module_names(both) == (
        {f"decoder.layers.0.{s}" for s in SLOTS if "core_attention" not in s}
        | {f"decoder.layers.{i}.self_attention.linear_qkv" for i in range(LAYERS)})


def test_shorthand_builds_bf16_blocks():
    _, _, mods = _modules(["fp4.linear=nvfp4", "fp4.bf16_last_layers=1"])
    for name, m in mods.items():
        slot = name.split(".", 2)[2]
        if slot.endswith("core_attention"):
            continue
        assert (_is_bf16(slot, m) if name.startswith("layers.3.") else _is_fp4(slot, m, "nvfp4")), name


@pytest.mark.parametrize("overrides, differ", [
    (["fp4.linear=lora_svd", "fp4.bf16_first_layers=1", "fp4.bf16_last_layers=1"], True),
    (["fp4.linear=lora_svd", "fp4.keep_bf16=[decoder.layers.2.mlp.linear_fc1]"], True),
    (["fp4.linear=lora_svd"], False),
    (["fp4.linear=lora_svd", "fp4.keep_bf16=['*.linear_fc2']"], False),                  # alike in every layer
    (["fp4.linear=lora_svd", "fp4.attention=q_attn", "fp4.keep_bf16=[decoder.layers.0.self_attention.core_attention]"],
     False),                                                                               # Q-Attn holds no state
    (["fp4.linear=nvfp4", "fp4.attention=q_attn", "fp4.bf16_first_layers=1", "fp4.bf16_last_layers=1"], False),
])
def test_layers_differ_in_state_follows_the_built_layers(overrides, differ):
    """Per-layer checkpoint keys exactly where the built layers hold different parameters
    (LoRA-SVD's factors in some layers only); everything else keeps megatron-core's stacked
    keys, so its checkpoints are unchanged. Oracle: the built model's parameter names, by layer."""
    cfg, tr, _ = _modules(overrides + ["fp4.lora_svd.rank=8"])
    per_layer = {}
    for name, _ in tr.gpt.named_parameters():
        if name.startswith("decoder.layers."):
            i, rest = name[len("decoder.layers."):].split(".", 1)
            per_layer.setdefault(int(i), set()).add(rest)
    assert len(per_layer) == LAYERS
    built_differ = len({frozenset(v) for v in per_layer.values()}) > 1
    assert precision.layers_differ_in_state(cfg) == built_differ == differ
    assert tr.gpt.config.hetereogenous_dist_checkpoint == differ
    keys = tr.gpt.sharded_state_dict().values()
    assert any(k.key.startswith("decoder.layers.0.") for k in keys if hasattr(k, "key")) == differ


@pytest.mark.parametrize("overrides, message", [
    (["fp4.linear=nvfp4", "fp4.keep_bf16=[decoder.layers.4.*]"],
     r"fp4.keep_bf16 pattern 'decoder.layers.4.\*' matches no FP4 module; the FP4 modules of this "
     r"config are decoder.layers.\{0..3\}.\{self_attention.linear_qkv, self_attention.linear_proj, "
     r"mlp.linear_fc1, mlp.linear_fc2\}"),
    (["fp4.linear=nvfp4", "fp4.keep_bf16=['*.core_attention']"], "'\\*.core_attention' matches no FP4 module"),
    (["fp4.attention=q_attn", "fp4.keep_bf16=['*.linear_fc1']"], "linear_fc1' matches no FP4 module"),
    (["fp4.keep_bf16=['*']"], r"none \(every recipe of fp4.linear / fp4.attention is bf16\)"),
    (["fp4.linear=nvfp4", "fp4.keep_bf16=['decoder.layers.0']"], "matches no FP4 module"),
    (["fp4.linear=nvfp4", "fp4.keep_bf16=['']"], "list of non-empty patterns"),
])
def test_pattern_refusals(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, TINY + overrides)


def test_bad_pattern_is_one_error_line_and_exit_2(tmp_path):
    r = helpers.run(helpers.base_config(str(tmp_path)), ["fp4.linear=nvfp4", "fp4.keep_bf16=[decoder.layer.0.*]",
                                                         "train.iters=1", "checkpoint.load=none"])
    assert r.returncode == 2, r.stderr[-2000:]
    lines = helpers.error_lines(r.stderr)
    assert len(lines) == 1 and "'decoder.layer.0.*' matches no FP4 module" in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
