"""`pretrain_gpt.py` as a user runs it: bad input is one `error:` line and exit code 2 (no
traceback); `--dry-run` prints the resolved config and a parameter count that matches the
closed-form count of the shapes."""
from __future__ import annotations

import re
import subprocess
import sys

from tests.megatron.training import helpers


def run(args, timeout=180):
    return subprocess.run([sys.executable, helpers.PRETRAIN, *args], cwd=helpers.REPO, env=helpers.env(),
                          capture_output=True, text=True, timeout=timeout)


def assert_one_error(p, *needles):
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    errs = helpers.error_lines(p.stderr)
    assert len(errs) == 1, p.stderr[-3000:]
    for n in needles:
        assert n in errs[0], errs[0]
    return errs[0]


def test_bad_config_file_exits_2_with_one_error_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  preset: tiny\n  vocab_size: 256\ndata: {mock: true}\ntrain:\n  iter: 5\n")
    assert_one_error(run(["--config", str(bad)]), "'train.iter'", "'train.iters'")


def test_invalid_yaml_exits_2_with_one_error_line(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    assert_one_error(run(["--config", str(broken)]), "not valid YAML")


def closed_form_parameters(L, h, f, heads, groups, vocab, divisible_by=128):
    """Llama-style GPT: untied embeddings, no biases, RMSNorm weights only, SwiGLU (3 matrices)."""
    d = h // heads
    v = -(-vocab // divisible_by) * divisible_by
    qkv = h * (heads + 2 * groups) * d
    out_proj = heads * d * h
    mlp = h * 2 * f + f * h
    norms = 2 * h
    return L * (qkv + out_proj + mlp + norms) + h + 2 * v * h


def test_bf16_grad_buffer_with_fp32_params_exits_2_with_one_error_line(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  preset: tiny\n  vocab_size: 256\ndata: {mock: true}\n")
    assert_one_error(run(["--config", str(cfg), "train.precision=fp32", "parallel.grad_reduce_in_fp32=false"]),
                     "parallel.grad_reduce_in_fp32=false needs train.precision=bf16")


def test_dry_run_3b_parameter_count():
    p = run(["--config", "configs/presets/3b.yaml", "--dry-run", "data.mock=true"])
    assert p.returncode == 0, p.stderr[-3000:]
    m = re.search(r"^parameters: ([\d,]+)", p.stdout, re.M)
    assert m, p.stdout
    # 3b from the issue: 28 layers, hidden 3072, FFN 8192, 24 heads, 8 KV groups; vocab 32000
    assert int(m.group(1).replace(",", "")) == closed_form_parameters(28, 3072, 8192, 24, 8, 32000)
    assert "DIFFERS" not in p.stdout
    assert re.search(r"hidden_size: 3072\b", p.stdout)  # the resolved config is printed
    assert re.search(r"num_layers: 28\b", p.stdout)


def test_command_line_errors_are_one_error_line():
    """argparse's own errors (a missing --config, an option it does not know, as a user types
    `--train.iters=5` for `train.iters=5`) printed a usage block and `pretrain_gpt.py: error: ...`:
    now the one `error:` line of every other bad input. --help still prints the usage."""
    for args, needle in (([], "--config"), (["--config", "configs/quickstart.yaml", "--train.iters=5"],
                                            "unrecognized arguments: --train.iters=5")):
        p = run(args)
        assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: "), p.stderr
        assert_one_error(p, needle, "--help")
    p = run(["--help"])
    assert p.returncode == 0 and p.stdout.startswith("usage: pretrain_gpt.py")
