"""Config loading and validation: bad keys, bad types, impossible combinations, composition.

In-process and fast; the command line (exit codes, --dry-run) is tests/test_pretrain_cli.py.
"""
from __future__ import annotations

import itertools

import pytest

from megatron.training import recipes
from megatron.training.config import load_config
from megatron.training.config_validate import validate_config
from megatron.training.errors import ConfigError

OK = ["model.preset=tiny", "data.mock=true", "model.vocab_size=256", "model.vocab_size=256"]


def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def config_error(path=None, overrides=()) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides))
    msg = str(e.value)
    assert "\n" not in msg.strip(), f"error should be one line: {msg!r}"
    return msg


# ------------------------------------------------------------------------- baseline
def test_valid_minimal_config_loads():
    cfg = load_config(None, OK)
    assert cfg.model.vocab_size == 256 and cfg.data.mock is True


# ------------------------------------------------------------------------- unknown keys
@pytest.mark.parametrize("override, bad, suggestion", [
    ("train.iter=5", "train.iter", "train.iters"),
    ("train.global_batch=8", "train.global_batch", "train.global_batch_size"),
    ("modle.hidden_size=64", "modle", "model"),
    ("optimizer.q_adamw.min_numl=8", "optimizer.q_adamw.min_numl", "optimizer.q_adamw.min_numel"),
    ("checkpoint.save_dri=/tmp/x", "checkpoint.save_dri", "checkpoint.save_dir"),
])
def test_unknown_key_names_key_and_closest_valid_one(override, bad, suggestion):
    msg = config_error(overrides=OK + [override])
    assert f"'{bad}'" in msg, msg
    assert f"'{suggestion}'" in msg, msg


def test_unknown_key_in_yaml_file(tmp_path):
    path = write(tmp_path / "c.yaml", "model:\n  preset: tiny\n  vocab_size: 256\n  hidden_sise: 64\n"
                                      "data:\n  mock: true\n")
    msg = config_error(path)
    assert "'model.hidden_sise'" in msg and "'model.hidden_size'" in msg, msg


@pytest.mark.parametrize("override, bad, suggestion", [
    ("train.warmup_iters=5", "train.warmup_iters", "optimizer.warmup_iters"),   # not train.eval_iters
    ("optimizer.save_interval=5", "optimizer.save_interval", "checkpoint.save_interval"),
    ("optimizer.min_numel=8", "optimizer.min_numel", "optimizer.q_adamw.min_numel"),
    ("train.q_adamw.min_numel=8", "train.q_adamw", "optimizer.q_adamw"),          # a section misplaced
    ("warmup_iters=5", "warmup_iters", "optimizer.warmup_iters"),                 # no section at all
])
def test_key_in_the_wrong_section_names_where_it_lives(override, bad, suggestion):
    msg = config_error(overrides=OK + [override])
    assert msg == f"unknown config key '{bad}'; did you mean '{suggestion}'?", msg


def test_key_in_the_wrong_section_of_a_yaml_file(tmp_path):
    path = write(tmp_path / "c.yaml", "train:\n  iters: 50\n  warmup_iters: 5\n")
    msg = config_error(path, OK)
    assert msg == "unknown config key 'train.warmup_iters'; did you mean 'optimizer.warmup_iters'?", msg


def _cli(tmp_path, config, *overrides):
    """pretrain_gpt.py --dry-run: (exit code, the stderr lines that start with `error:`, stderr)."""
    import os
    import subprocess
    import sys

    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    env = dict(os.environ, PYTHONPATH=repo, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, os.path.join(repo, "pretrain_gpt.py"), "--config", config, "--dry-run",
                        *overrides], capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120)
    return p.returncode, [ln for ln in p.stderr.splitlines() if ln.startswith("error:")], p.stderr


def test_cli_key_in_the_wrong_section_is_one_error_line(tmp_path):
    config = write(tmp_path / "c.yaml", "model: {preset: tiny, vocab_size: 256}\ndata: {mock: true}\n")
    rc, errors, err = _cli(tmp_path, config, "train.warmup_iters=5")
    assert rc == 2 and errors == ["error: unknown config key 'train.warmup_iters'; "
                                  "did you mean 'optimizer.warmup_iters'?"], err
    assert "Traceback" not in err


# ------------------------------------------------------------------------- duplicate keys
def test_duplicate_key_in_a_yaml_file_names_the_file_the_key_and_both_lines(tmp_path):
    path = write(tmp_path / "c.yaml", "model:\n  preset: tiny\ntrain:\n  iters: 50\n  seed: 3\n  iters: 60\n")
    msg = config_error(path, OK)
    assert msg.startswith(f"config {path}: ") and "'train.iters'" in msg and "lines 4 and 6" in msg, msg


@pytest.mark.parametrize("text, key, lines", [
    ("train: {iters: 50}\ntrain: {seed: 3}\n", "train", "lines 1 and 2"),              # a whole section
    ("optimizer:\n  q_adamw: {min_numel: 8, min_numel: 9}\n", "optimizer.q_adamw.min_numel", "lines 2 and 2"),
    ("fp4:\n  keep_bf16:\n    - {a: 1, a: 2}\n", "fp4.keep_bf16[0].a", "lines 3 and 3"),
])
def test_duplicate_keys_anywhere_in_the_file(tmp_path, text, key, lines):
    msg = config_error(write(tmp_path / "c.yaml", text), OK)
    assert f"'{key}' is given twice" in msg and lines in msg, msg


def test_base_keys_overridden_by_the_child_and_merge_keys_are_not_duplicates(tmp_path):
    import yaml

    from megatron.training.config import UniqueKeyLoader

    write(tmp_path / "base.yaml", "train:\n  iters: 50\n  seed: 3\n")
    child = write(tmp_path / "child.yaml", "base: base.yaml\ntrain:\n  iters: 60\n")
    cfg = load_config(child, OK)
    assert cfg.train.iters == 60 and cfg.train.seed == 3
    # a key brought in by a `<<: *anchor` merge is meant to be overridden
    doc = yaml.load("a: &c {iters: 10, seed: 4}\nb:\n  <<: *c\n  iters: 20\n", Loader=UniqueKeyLoader)
    assert doc["b"] == {"iters": 20, "seed": 4}


def test_duplicate_key_in_an_override_value():
    msg = config_error(overrides=OK + ["train={iters: 5, iters: 6}"])
    assert "'train.iters' is given twice" in msg, msg
    assert load_config(None, OK + ["train.iters=5", "train.iters=6"]).train.iters == 6  # the CLI: last one wins


def test_cli_duplicate_key_is_one_error_line(tmp_path):
    config = write(tmp_path / "c.yaml", "model: {preset: tiny, vocab_size: 256}\ndata: {mock: true}\n"
                                        "train:\n  iters: 50\n  iters: 60\n")
    rc, errors, err = _cli(tmp_path, config)
    assert rc == 2 and len(errors) == 1, err
    assert errors[0] == (f"error: config {config}: key 'train.iters' is given twice, on lines 4 and 5: "
                         "keep one (YAML would silently use the last)"), err
    assert "Traceback" not in err


# ------------------------------------------------------------------------- wrong types
@pytest.mark.parametrize("override, key", [
    ("train.iters=abc", "train.iters"),
    ("train.seed=1.5", "train.seed"),
    ("train.micro_batch_size=[1, 2]", "train.micro_batch_size"),
    ("data.mock=maybe", "data.mock"),
    ("optimizer.lr=fast", "optimizer.lr"),
    ("train=5", "train"),
])
def test_wrong_type_names_the_key(override, key):
    msg = config_error(overrides=OK + [override])
    assert key in msg, msg


def test_integral_float_is_an_int():
    assert load_config(None, OK + ["train.iters=100.0"]).train.iters == 100


def test_scientific_notation_yaml_string_is_a_float(tmp_path):
    # PyYAML (YAML 1.1) reads `1e-3` (no dot) as the string "1e-3"; the schema must still give 0.001.
    path = write(tmp_path / "c.yaml", "optimizer:\n  lr: 1e-3\n  min_lr: 1e-5\n")
    cfg = load_config(path, OK)
    assert isinstance(cfg.optimizer.lr, float) and cfg.optimizer.lr == 0.001
    assert cfg.optimizer.min_lr == 1e-5
    cfg = load_config(None, OK + ["optimizer.lr=2e-4"])
    assert isinstance(cfg.optimizer.lr, float) and cfg.optimizer.lr == 2e-4


# ------------------------------------------------------------------------- impossible combinations
def test_hidden_not_divisible_by_heads():
    msg = config_error(overrides=OK + ["model.hidden_size=130"])
    assert "model.hidden_size" in msg and "model.num_attention_heads" in msg, msg


def test_heads_not_divisible_by_query_groups():
    msg = config_error(overrides=OK + ["model.num_query_groups=3"])
    assert "model.num_attention_heads" in msg and "model.num_query_groups" in msg, msg


def test_global_batch_not_divisible_by_micro_times_dp():
    cfg = load_config(None, OK + ["train.global_batch_size=4", "train.micro_batch_size=4"], validate=False)
    validate_config(cfg, world_size=1)  # 4 % (4 x 1) == 0: fine with one process
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, world_size=2)  # 4 % (4 x 2) != 0
    msg = str(e.value)
    assert "train.global_batch_size" in msg and "train.micro_batch_size" in msg, msg
    # with TP=2 the two processes are one data-parallel replica: fine again
    cfg.parallel.tensor_model_parallel_size = 2
    validate_config(cfg, world_size=2)


def test_world_size_not_divisible_by_model_parallel():
    cfg = load_config(None, OK + ["parallel.tensor_model_parallel_size=2"], validate=False)
    with pytest.raises(ConfigError):
        validate_config(cfg, world_size=3)


def test_unknown_recipe_name_is_an_error():
    msg = config_error(overrides=OK + ["fp4.linear=bogus"])
    assert "fp4.linear" in msg and "bogus" in msg, msg
    msg = config_error(overrides=OK + ["optimizer.name=sgd"])
    assert "optimizer.name" in msg and "sgd" in msg, msg


def _unimplemented():
    names = itertools.chain((("fp4.linear", n) for n in recipes.LINEAR),
                            (("fp4.attention", n) for n in recipes.ATTENTION),
                            (("optimizer.name", n) for n in recipes.OPTIMIZERS))
    return [(k, n) for k, n in names if (k, n) not in recipes.IMPLEMENTED]


def test_recipe_in_schema_but_not_implemented_is_a_clear_error():
    todo = _unimplemented()
    if not todo:
        pytest.skip("every recipe of the schema is implemented")
    for key, name in todo:
        reason = recipes.unavailable_reason(key, name)
        assert reason, (key, name)
        msg = config_error(overrides=OK + [f"{key}={name}"])
        assert key in msg and f"'{name}'" in msg and reason in msg, msg


def test_implemented_recipes_validate():
    for key, name in recipes.IMPLEMENTED:
        load_config(None, OK + [f"{key}={name}"])


def test_mock_data_needs_vocab_size():
    msg = config_error(overrides=["model.preset=tiny", "data.mock=true"])
    assert "model.vocab_size" in msg, msg


def test_real_data_needs_paths():
    msg = config_error(overrides=["model.preset=tiny"])
    assert "data.path" in msg, msg


# ------------------------------------------------------------------------- presets
def test_preset_fills_unset_fields_only():
    # 3b from the issue: 28 layers, hidden 3072, FFN 8192, 24 heads, 8 KV groups, seq 4096.
    cfg = load_config(None, ["model.preset=3b", "data.mock=true", "model.vocab_size=32000"])
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups,
            m.seq_length) == (28, 3072, 8192, 24, 8, 4096)
    cfg = load_config(None, ["model.preset=3b", "data.mock=true", "model.vocab_size=32000",
                             "model.num_layers=2", "model.seq_length=256"])
    assert cfg.model.num_layers == 2 and cfg.model.seq_length == 256 and cfg.model.hidden_size == 3072


def test_unknown_preset():
    msg = config_error(overrides=["model.preset=tinny", "data.mock=true", "model.vocab_size=8"])
    assert "model.preset" in msg and "'tiny'" in msg, msg


def test_no_preset_and_no_shape_is_an_error():
    msg = config_error(overrides=["data.mock=true", "model.vocab_size=8"])
    assert "model." in msg and "preset" in msg, msg


# ------------------------------------------------------------------------- composition
def test_base_chain_and_override_precedence(tmp_path):
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "grand.yaml",
          "model: {preset: tiny, vocab_size: 256}\ndata: {mock: true}\n"
          "train: {iters: 10, seed: 1, eval_iters: 3}\noptimizer: {lr: 1.0e-3, min_lr: 1.0e-5}\n")
    # relative to the file that names it
    write(tmp_path / "sub" / "parent.yaml", "base: grand.yaml\ntrain: {iters: 20, seed: 2}\n")
    child = write(tmp_path / "child.yaml", "base: sub/parent.yaml\ntrain: {iters: 30}\n")
    cfg = load_config(child, [])
    assert cfg.train.iters == 30          # child file beats its bases
    assert cfg.train.seed == 2            # parent beats grandparent
    assert cfg.train.eval_iters == 3      # a sibling key of the base survives the merge
    assert cfg.optimizer.lr == 1e-3 and cfg.model.vocab_size == 256
    cfg = load_config(child, ["train.iters=40", "train.seed=5"])
    assert cfg.train.iters == 40 and cfg.train.seed == 5 and cfg.train.eval_iters == 3  # CLI beats all


def test_list_of_bases_applies_in_order(tmp_path):
    write(tmp_path / "a.yaml", "train: {iters: 1, seed: 11}\n")
    write(tmp_path / "b.yaml", "train: {iters: 2}\n")
    top = write(tmp_path / "top.yaml", "base: [a.yaml, b.yaml]\n")
    cfg = load_config(top, OK)
    assert cfg.train.iters == 2 and cfg.train.seed == 11


@pytest.mark.parametrize("files", [
    {"a.yaml": "base: b.yaml\n", "b.yaml": "base: a.yaml\n"},
    {"a.yaml": "base: a.yaml\n"},
    {"a.yaml": "base: b.yaml\n", "b.yaml": "base: c.yaml\n", "c.yaml": "base: a.yaml\n"},
])
def test_base_loop_is_an_error(tmp_path, files):
    for name, text in files.items():
        write(tmp_path / name, text)
    msg = config_error(str(tmp_path / "a.yaml"), OK)
    assert "base" in msg and "loop" in msg, msg


def test_diamond_bases_are_not_a_loop(tmp_path):
    write(tmp_path / "common.yaml", "train: {seed: 7}\n")
    write(tmp_path / "x.yaml", "base: common.yaml\n")
    write(tmp_path / "y.yaml", "base: common.yaml\n")
    top = write(tmp_path / "top.yaml", "base: [x.yaml, y.yaml]\n")
    assert load_config(top, OK).train.seed == 7


def test_missing_base_and_bad_yaml(tmp_path):
    msg = config_error(write(tmp_path / "a.yaml", "base: nope.yaml\n"), OK)
    assert "nope.yaml" in msg, msg
    config_error(write(tmp_path / "b.yaml", "model: [unclosed\n"), OK)
    config_error(write(tmp_path / "c.yaml", "- just\n- a list\n"), OK)
    config_error(str(tmp_path / "absent.yaml"), OK)


def test_malformed_override():
    config_error(overrides=OK + ["train.iters"])
    config_error(overrides=OK + ["train.iters.deeper=3"])


def test_orthogonal_nvfp4_terms_is_validated_and_reaches_the_optimizer():
    import torch

    from fullstack_fp4.integration.optimizers import _orthogonal

    with pytest.raises(ConfigError, match="nvfp4_terms must be 1, 2 or 3; got 4"):
        load_config(None, ["model.preset=tiny", "data.mock=true", "model.vocab_size=256", "optimizer.name=q_root", "optimizer.orthogonal.nvfp4_terms=4"])
    w = torch.nn.Parameter(torch.randn(32, 16))
    for name, terms, expect in (("q_root", 1, 1), ("q_muon", 3, 3), ("root", 1, None)):
        cfg = load_config(None, ["model.preset=tiny", "data.mock=true", "model.vocab_size=256", f"optimizer.name={name}",
                                 f"optimizer.orthogonal.nvfp4_terms={terms}"])
        opt = _orthogonal([{"params": [w]}], cfg)
        assert opt.param_groups[0]["ns_nvfp4_terms"] == expect, name


# ------------------------------------------------------------------------- BF16 grad buffer
def test_grad_reduce_in_fp32_defaults_to_fp32_buffers():
    assert load_config(None, OK).parallel.grad_reduce_in_fp32 is True


def test_bf16_grad_buffer_with_fp32_params_is_refused():
    # megatron gives the grad buffers the params' dtype: the switch could not take effect
    msg = config_error(overrides=OK + ["train.precision=fp32", "parallel.grad_reduce_in_fp32=false"])
    assert msg == ("parallel.grad_reduce_in_fp32=false needs train.precision=bf16 (with fp32 params "
                   "the grad buffers are fp32 anyway)")


@pytest.mark.parametrize("name", recipes.OPTIMIZERS)
@pytest.mark.parametrize("distopt", ["false", "true"])
def test_bf16_grad_buffer_is_accepted_with_every_optimizer(name, distopt):
    # q_adamw reads it in place; the others get megatron-core's FP32 copies (its default)
    cfg = load_config(None, OK + ["train.precision=bf16", "parallel.grad_reduce_in_fp32=false",
                                  f"optimizer.name={name}", f"parallel.use_distributed_optimizer={distopt}"])
    assert cfg.parallel.grad_reduce_in_fp32 is False
