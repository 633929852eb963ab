"""`fp4.bf16_from` (megatron/training/precision.py): the switch point, exact resume across it,
and the validation of its values.

Oracles: the quantized functions themselves, counted per step in process (the NVFP4 linear,
LoRA-SVD's NVFP4 W_res GEMMs and Q-Attn are called in every step before the switch and in
none from it); an uninterrupted run's losses, bit for bit, for runs stopped before and after
the switch and resumed; the refusals by their messages and exit code 2.
"""
from __future__ import annotations

import os

import pytest

from megatron.training import precision
from megatron.training.config import ConfigError, load_config
from tests.megatron.training import helpers

TINY = ["model.preset=tiny", "model.seq_length=32", "model.vocab_size=256", "data.mock=true",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_iters=0",
        "logging.tensorboard=false", "checkpoint.load=none", "optimizer.lr=3e-3",
        "optimizer.warmup_iters=0", "train.precision=fp32"]

_dist = pytest.fixture(scope="module", autouse=True)(helpers.in_process_megatron)


def _cfg(*overrides):
    return load_config(None, TINY + list(overrides))


# ------------------------------------------------------------------ values and validation
@pytest.mark.parametrize("value, iters, step", [
    ("2", 4, 2), ("4", 4, 4), ("1", 10, 1), ("0.9", 1000, 900), ("0.29", 100, 29),
    ("0.5", 5, 2), ("1.0", 7, 7), ("0.7", 10, 7)])
def test_switch_step(value, iters, step):
    cfg = _cfg("fp4.linear=nvfp4", f"fp4.bf16_from={value}", f"train.iters={iters}")
    assert precision.switch_step(cfg) == step


@pytest.mark.parametrize("overrides, message", [
    (["fp4.linear=nvfp4", "fp4.bf16_from=0"], r"fp4.bf16_from=0 must lie in \[1, train.iters=4\]"),
    (["fp4.linear=nvfp4", "fp4.bf16_from=5"], r"fp4.bf16_from=5 must lie in \[1, train.iters=4\]"),
    (["fp4.linear=nvfp4", "fp4.bf16_from=1.5"], r"must lie in \(0, 1\] as a fraction"),
    (["fp4.linear=nvfp4", "fp4.bf16_from=-0.5"], r"must lie in \(0, 1\] as a fraction"),
    (["fp4.linear=nvfp4", "fp4.bf16_from=0.1"], "is before the first step"),
    (["fp4.linear=nvfp4", "fp4.bf16_from=soon"], "must be an integer or a number"),
    (["fp4.linear=nvfp4", "fp4.bf16_from=true"], "must be an integer or a number"),
    (["fp4.bf16_from=2"], "both are bf16 here"),
])
def test_bad_values_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg("train.iters=4", *overrides)


@pytest.mark.parametrize("overrides, rules", [
    (["fp4.linear=nvfp4", "fp4.linear_scale_rule=4over6"], {"x": "4over6", "w": "4over6", "dy": "4over6"}),
    (["fp4.linear=lora_svd", "fp4.linear_scale_rule.w=4over6", "fp4.fallback=bf16"],
     {"x": "6", "w": "4over6", "dy": "6"}),
])
def test_4over6_with_quant_stats_validates(overrides, rules):
    """The telemetry measures each operand with its own scale rule, so it (and the fallback it
    drives) goes with 4over6."""
    cfg = _cfg("train.iters=4", "logging.quant_stats_interval=10", *overrides)
    assert precision.scale_rules(cfg) == rules and cfg.logging.quant_stats_interval == 10


def test_bad_value_is_one_error_line_and_exit_2(tmp_path):
    r = helpers.run(helpers.base_config(str(tmp_path)), ["fp4.linear=nvfp4", "fp4.bf16_from=1.5",
                                                         "train.iters=2", "checkpoint.load=none"])
    assert r.returncode == 2, r.stderr[-2000:]
    lines = helpers.error_lines(r.stderr)
    assert len(lines) == 1 and "fp4.bf16_from=1.5" in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------ the switch point
def _count_quantized_calls(monkeypatch, trainer):
    """Every call of a quantized function, tagged with the trainer's steps done at the time."""
    import fullstack_fp4.integration.lora_svd_layers as lora_layers
    import fullstack_fp4.integration.nvfp4_linear_layers as nvfp4_layers
    import fullstack_fp4.integration.q_attn_core_attention as q_attn_layer
    import fullstack_fp4.linear.lora_svd as lora_svd

    calls = []

    def counted(kind, fn):
        def wrapper(*args, **kwargs):
            calls.append((kind, trainer.iteration))
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(nvfp4_layers, "nvfp4_linear", counted("nvfp4", nvfp4_layers.nvfp4_linear))
    monkeypatch.setattr(q_attn_layer, "q_attention", counted("q_attn", q_attn_layer.q_attention))
    # LoRA-SVD's W_res GEMMs: NVFP4 inside lora_svd_linear unless exact (the BF16 path)
    monkeypatch.setattr(lora_svd, "nvfp4_linear_forward",
                        counted("lora_svd", lora_svd.nvfp4_linear_forward))
    assert lora_layers.lora_svd_linear is lora_svd.lora_svd_linear
    return calls


@pytest.mark.parametrize("linear", ["nvfp4", "lora_svd"])
def test_quantized_path_before_the_switch_step_and_not_from_it(monkeypatch, capsys, linear):
    from megatron.training.trainer import Trainer

    cfg = _cfg(f"fp4.linear={linear}", "fp4.lora_svd.rank=8", "fp4.attention=q_attn",
               "train.iters=4", "fp4.bf16_from=0.5", "train.eval_interval=100", "train.log_interval=1")
    cfg.logging.dir = None
    tr = Trainer(cfg, verbose=False)
    calls = _count_quantized_calls(monkeypatch, tr)
    tr.train()
    per_step = {k: sorted({it for kind, it in calls if kind == k}) for k in (linear, "q_attn")}
    # steps done 0 and 1 (the first two steps) quantized, steps 3 and 4 (done 2, 3) not at all
    assert per_step == {linear: [0, 1], "q_attn": [0, 1]}, per_step
    # 4 layers x 4 linears (and 4 attentions) per micro-batch, 2 micro-batches a step
    assert sum(1 for k, it in calls if k == linear and it == 0) == 4 * 4 * 2
    assert sum(1 for k, it in calls if k == "q_attn" and it == 0) == 4 * 2
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("[precision]")]
    assert lines == ["[precision] iteration 2: fp4.bf16_from=0.5 of train.iters=4: steps 3..4 run in "
                     "BF16 (20 FP4 module(s) switched)"], lines
    assert tr.iteration == 4


# ------------------------------------------------------------------ resume across the switch
SCHEDULE = ["fp4.linear=lora_svd", "fp4.lora_svd.rank=8", "fp4.attention=q_attn", "fp4.bf16_from=3",
            "train.iters=6", "train.eval_interval=3"]


def _losses(logdir):
    train, val = helpers.read_metrics(logdir)
    return {i: r["loss"] for i, r in train.items()}, val


def test_resume_across_the_switch_is_exact(tmp_path):
    d = str(tmp_path)
    cfg = helpers.base_config(d)
    straight = helpers.start(cfg, SCHEDULE + [f"logging.dir={d}/straight", "checkpoint.load=none"],
                             log=f"{d}/straight.txt")
    # stopped before the switch (2 steps) and after it (4 steps), each resumed to the end
    stopped = {}
    for stop in (2, 4):
        ck = [f"checkpoint.save_dir={d}/ck{stop}", f"logging.dir={d}/run{stop}"]
        r = helpers.run(cfg, SCHEDULE + ck + [f"train.exit_interval={stop}"])
        assert r.returncode == 0, r.stderr[-3000:]
        assert ("[precision]" in r.stdout) == (stop > 3), r.stdout[-2000:]
        r = helpers.run(cfg, SCHEDULE + ck)
        assert r.returncode == 0, r.stderr[-3000:]
        stopped[stop] = r.stdout
    rc, text = helpers.finish(straight)
    assert rc == 0, text[-3000:]
    assert text.count("[precision] iteration 3:") == 1, text[-3000:]
    # resumed before the switch: it switches on reaching step 3; after it: before its first step
    assert "[precision] iteration 3: fp4.bf16_from=3" in stopped[2], stopped[2][-2000:]
    assert "[precision] iteration 4: fp4.bf16_from=3: steps 4..6 run in BF16" in stopped[4], stopped[4][-2000:]
    assert "[fp4.fallback]" not in stopped[4]
    want_train, want_val = _losses(f"{d}/straight")
    assert sorted(want_train) == list(range(1, 7))
    for stop in (2, 4):
        got_train, got_val = _losses(f"{d}/run{stop}")
        assert got_train == want_train, (stop, got_train, want_train)
        assert got_val == want_val, (stop, got_val, want_val)
    # scripts/evaluate.py rebuilds a checkpoint in the precision it trained in: NVFP4 and Q-Attn
    # at step 2 (before the switch), BF16 at step 6
    _evaluate_uses_the_checkpoints_precision(d)


def _evaluate_uses_the_checkpoints_precision(d):
    import importlib
    import sys

    import torch

    import fullstack_fp4.integration.q_attn_core_attention as q_attn_layer
    import fullstack_fp4.linear.lora_svd as lora_svd

    sys.path.insert(0, os.path.join(helpers.REPO, "scripts"))
    evaluate = importlib.import_module("evaluate")
    mp = pytest.MonkeyPatch()
    calls = []
    try:
        for mod, name in ((lora_svd, "nvfp4_linear_forward"), (q_attn_layer, "q_attention")):
            real = getattr(mod, name)
            mp.setattr(mod, name, lambda *a, _r=real, _n=name, **k: (calls.append(_n), _r(*a, **k))[1])
        tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        for ckpt, quantized in (("iter_0000002", True), ("iter_0000006", False)):
            calls.clear()
            # device None: load_model initialises megatron in this process (once) and picks it
            logits_fn, _, _ = evaluate.load_model(os.path.join(d, "ck2", ckpt), tokenizer_path=None)
            assert torch.isfinite(logits_fn(tokens)).all()
            assert (sorted(set(calls)) == ["nvfp4_linear_forward", "q_attention"]) == quantized, (ckpt, calls)
            assert quantized or not calls
    finally:
        mp.undo()


def test_a_longer_resumed_run_switches_at_its_own_fraction(tmp_path):
    """What the schedule switched is not saved as a telemetry fallback: a run continued to a new
    length (train.continue_with=extend) runs FP4 again until f of the new length."""
    import os

    import torch

    d = str(tmp_path)
    cfg = helpers.base_config(d)
    run = ["fp4.linear=nvfp4", "fp4.attention=q_attn", "fp4.bf16_from=0.75", "train.eval_interval=100",
           f"checkpoint.save_dir={d}/ck", f"logging.dir={d}/log", "checkpoint.save_interval=4"]
    r = helpers.run(cfg, run + ["train.iters=4"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[precision] iteration 3:" in r.stdout, r.stdout[-2000:]
    extra = torch.load(os.path.join(d, "ck", "iter_0000004", "extra", "rank_00000.pt"), weights_only=False)
    assert extra["fp4_fallback"]["bf16_modules"] == []
    r = helpers.run(cfg, run + ["train.iters=8", "train.continue_with=extend"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[fp4.fallback]" not in r.stdout, r.stdout[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("[precision]")]
    # announced at the resume, then switched after step 6
    assert len(lines) == 2 and "steps 5..6 run the FP4 recipes again" in lines[0], lines
    assert lines[1].startswith("[precision] iteration 6: "), lines


# ------------------------------------------------------------------ full_stack_levers
@pytest.mark.long   # several training runs end to end (make test-all)
def test_full_stack_levers_saves_and_resumes_exactly(tmp_path):
    """bench_blocks' `full_stack_levers` arm (LoRA-SVD, Q-AdamW, Q-Attn, the first and the last
    block in BF16, the last steps in BF16). The BF16 blocks carry no LoRA-SVD factors, so the
    layers hold different parameters: megatron-core's stacked per-layer keys refused the save
    ("Invalid access pattern for ShardedTensor(key='decoder.layers.self_attention.linear_proj.
    lora_l2'"); such a model is saved under per-layer keys (precision.layers_differ_in_state).
    Oracle: the uninterrupted run's losses, bit for bit, resumed before the switch (iter 2) and
    after it (iter 4)."""
    from torch.distributed.checkpoint import FileSystemReader

    from benchmarks.bench_blocks import ARMS

    d = str(tmp_path)
    cfg = helpers.base_config(d)
    # the arm's overrides, on the tiny model: the switch after step 3 of 6; Q-AdamW's 4-bit
    # moments on every matrix of this size (its default min_numel keeps them in FP32 here)
    run = ARMS["full_stack_levers"] + ["fp4.bf16_from=0.5", "train.iters=6", "train.eval_interval=3",
                                       "fp4.lora_svd.rank=8", "optimizer.q_adamw.min_numel=1024"]
    ck = [f"checkpoint.save_dir={d}/ck", "checkpoint.save_interval=2", "checkpoint.keep_last=5"]
    straight = helpers.start(cfg, run + [f"logging.dir={d}/straight", "checkpoint.load=none"],
                             log=f"{d}/straight.txt")
    r = helpers.run(cfg, run + ck + [f"logging.dir={d}/from4", "train.exit_interval=4"])
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = [helpers.start(cfg, run + ck + [f"logging.dir={d}/from4"], log=f"{d}/from4.txt"),
               helpers.start(cfg, run + [f"checkpoint.load={d}/ck/iter_0000002", f"checkpoint.save_dir={d}/ck2",
                                         f"logging.dir={d}/from2"], log=f"{d}/from2.txt")]
    # the BF16 blocks (0 and 3) carry no factors, blocks 1 and 2 carry theirs, each under its own keys
    keys = FileSystemReader(f"{d}/ck/iter_0000002/dist").read_metadata().state_dict_metadata
    for i in range(4):
        for slot in precision.LINEAR_SLOTS:
            assert (f"decoder.layers.{i}.{slot}.lora_l2" in keys) == (i in (1, 2)), (i, slot)
            assert f"decoder.layers.{i}.{slot}.weight" in keys
    outs = [helpers.finish(p) for p in (straight, *resumed)]
    for rc, text in outs:
        assert rc == 0, text[-3000:]
    assert "resumed from" in outs[1][1] and "resumed from" in outs[2][1]
    want_train, want_val = _losses(f"{d}/straight")
    assert sorted(want_train) == list(range(1, 7)) and sorted(want_val) == [3, 6]
    assert len(set(want_train.values())) == 6
    got_train, got_val = _losses(f"{d}/from4")
    assert got_train == want_train and got_val == want_val
    got_train, got_val = _losses(f"{d}/from2")
    assert got_train == {i: want_train[i] for i in range(3, 7)} and got_val == want_val
