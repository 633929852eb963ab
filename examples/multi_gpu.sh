#!/usr/bin/env bash
# Several processes with torchrun: data parallelism (default) or tensor parallelism.
#   bash examples/multi_gpu.sh 2          # DP=2
#   bash examples/multi_gpu.sh 2 tp       # TP=2
# With GPUs this uses NCCL, one GPU per process; without, gloo on the CPU (same code path).
set -euo pipefail
N=${1:-2}
MODE=${2:-dp}
EXTRA=()
[ "$MODE" = tp ] && EXTRA=(parallel.tensor_model_parallel_size=$N)
.venv/bin/python -m torch.distributed.run --nproc-per-node "$N" pretrain_gpt.py \
    --config configs/quickstart.yaml train.iters=50 train.global_batch_size=16 train.micro_batch_size=4 \
    checkpoint.load=none checkpoint.save_dir=runs/multi_$MODE/checkpoints logging.dir=runs/multi_$MODE "${EXTRA[@]}"
