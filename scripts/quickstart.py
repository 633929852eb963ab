"""`make quickstart`: prepare the small real corpus if missing, then train configs/quickstart.yaml.

A tiny Llama-style model (4 layers, width 128) on Shakespeare + Milton, a few hundred steps,
a few minutes on 2 CPU cores (or seconds on a GPU). It resumes if a previous quickstart left
a checkpoint (delete runs/quickstart to start over), and ends by comparing the validation
loss with the unigram entropy of the held-out text: a model that learned nothing beyond
token frequencies sits at that entropy.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data", "quickstart")
RUN = os.path.join(ROOT, "runs", "quickstart")


def continue_overrides(done_iters: int) -> list[str]:
    """What the closing hint suggests: twice the steps, stated as a longer run (`extend`: the
    rest of the lr decay is stretched to the new length, no lr jump; a finished run stays at
    optimizer.min_lr; megatron/training/continuation.py). Without the statement the resume is
    refused, since train.iters differs from the checkpoint's."""
    return [f"train.iters={2 * done_iters}", "train.continue_with=extend"]


def _trained_iters() -> int:
    import yaml

    with open(os.path.join(RUN, "config.yaml")) as f:   # the resolved config of the run just done
        return int(yaml.safe_load(f)["train"]["iters"])


def main(argv: list[str]) -> int:
    os.chdir(ROOT)
    print("== 1/2 data: data/quickstart (corpus, tokenizer, indexed dataset)", flush=True)
    rc = subprocess.call([sys.executable, "scripts/prepare_quickstart_data.py", "--out", DATA])
    if rc != 0:
        print("error: data preparation failed (see above)", file=sys.stderr)
        return rc
    print("== 2/2 train: configs/quickstart.yaml", flush=True)
    rc = subprocess.call([sys.executable, "pretrain_gpt.py", "--config", "configs/quickstart.yaml", *argv])
    if rc != 0:
        return rc
    val = None
    metrics = os.path.join(RUN, "metrics.jsonl")
    with open(metrics) as f:
        for line in f:
            rec = json.loads(line)
            if "val_loss" in rec:
                val = rec["val_loss"]
    with open(os.path.join(DATA, "stats.json")) as f:
        entropy = json.load(f)["valid_unigram_entropy_nats"]
    print(f"\nvalidation loss {val:.3f} nats/token vs unigram entropy of the held-out text {entropy:.3f}"
          f" ({'below' if val < entropy else 'NOT below'} it by {entropy - val:.3f})")
    print(f"checkpoints:  {RUN}/checkpoints  (to train on from there: "
          f"`.venv/bin/python scripts/quickstart.py {' '.join(continue_overrides(_trained_iters()))}`)")
    print(f"metrics:      {metrics}")
    print(f"TensorBoard:  .venv/bin/tensorboard --logdir {RUN}/tensorboard")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
