"""benchmarks/smoke_3b_64b.sh on the CPU, at a tiny width: an arm's own YAML runs its steps (the
full-stack Root arm exercises LoRA-SVD, Q-Root + Q-AdamW and Q-Attn); its first loss is that of
an untrained model, ln(vocab); a failing arm and an unknown arm give their exit codes."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

from tests.scripts.test_evaluate import REPO, env

SMOKE = os.path.join(REPO, "benchmarks", "smoke_3b_64b.sh")
TINY = ["model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.seq_length=64", "model.vocab_size=512", "fp4.lora_svd.rank=8"]


def smoke(args, logdir):
    e = dict(env(), LOGDIR=str(logdir), STEPS="2", LAYERS="2", PYTHON=sys.executable)
    return subprocess.run(["bash", SMOKE, *args], cwd=REPO, env=e, capture_output=True, text=True, timeout=600)


def test_smoke_runs_an_arm_from_its_yaml_and_reports_failures(tmp_path):
    p = smoke(["full_stack_root", "--", *TINY], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(r"^full_stack_root +ok ", p.stdout, re.M), p.stdout
    log = open(tmp_path / "full_stack_root.log").read()
    cfg = log.split("---- resolved config ----", 1)[1]
    for switch in ("linear: lora_svd", "attention: q_attn", "name: q_root", "num_layers: 2"):
        assert switch in cfg, switch        # the arm's own file, with the depth the script set
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", log)]
    assert len(losses) == 2 and abs(losses[0] - math.log(512)) < 0.1, log[-2000:]
    line = re.search(r"^full_stack_root +ok .*$", p.stdout, re.M).group(0)
    assert float(re.search(r"lm loss: (\S+)", line).group(1)) == losses[-1], line   # whole, exponent kept
    # peak memory is logged on a GPU only
    assert re.search(r"step ms: [0-9.]+ \| lm loss: \S+( \| peak mem \(GiB\): [0-9.]+)?$", line), line

    p = smoke(["bf16", "--", *TINY, "optimizer.lr=-1"], tmp_path)
    assert p.returncode == 1 and re.search(r"^bf16 +FAILED", p.stdout, re.M), p.stdout + p.stderr

    p = smoke(["nope"], tmp_path)
    assert p.returncode == 2 and "no arm 'nope'" in p.stderr
