"""A recipe refuses a config with `fullstack_fp4.errors.ConfigError` (it never imports the
training layer), and the entry point reports it like any config error of its own: one
`error:` line, exit code 2, no traceback."""
from __future__ import annotations

import subprocess

from tests.megatron.training import helpers


def test_lora_svd_refusal_is_one_error_line_and_exit_2(tmp_path):
    # fp4.lora_svd.beta is checked by the recipe after the model is built
    # (lora_svd_layers.check_supported), not by config_validate
    cmd = helpers.pretrain_cmd(helpers.base_config(str(tmp_path)),
                               ["train.iters=1", "logging.tensorboard=false", "fp4.linear=lora_svd",
                                "fp4.lora_svd.beta=0"])
    p = subprocess.run(cmd, cwd=helpers.REPO, env=helpers.env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert helpers.error_lines(p.stderr) == ["error: fp4.lora_svd.beta must be > 0"], p.stderr[-3000:]
