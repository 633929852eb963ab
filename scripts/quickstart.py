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
    print(f"checkpoints:  {RUN}/checkpoints  (resume: run `make quickstart` again with more iters,"
          f" e.g. `.venv/bin/python scripts/quickstart.py train.iters=600`)")
    print(f"metrics:      {metrics}")
    print(f"TensorBoard:  .venv/bin/tensorboard --logdir {RUN}/tensorboard")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
