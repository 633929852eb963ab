#!/usr/bin/env bash
# Multi-node launcher for pretrain_gpt.py through torchrun (one invocation per node).
usage() {
    cat <<'USAGE'
usage: [NNODES=N] [NODE_RANK=R] [MASTER_ADDR=HOST] [MASTER_PORT=29500] [GPUS_PER_NODE=8] \
       scripts/launch_multinode.sh CONFIG.yaml [section.key=value ...]

Runs on EVERY node, with the same CONFIG and overrides and its own NODE_RANK (0..NNODES-1):
    torchrun --nnodes NNODES --node-rank NODE_RANK --nproc-per-node GPUS_PER_NODE \
             --master-addr MASTER_ADDR --master-port MASTER_PORT \
             pretrain_gpt.py --config CONFIG.yaml [overrides]

environment
  NNODES         number of nodes (default 1)
  NODE_RANK      this node's rank, 0..NNODES-1 (default 0; node 0 hosts the rendezvous)
  MASTER_ADDR    address of node 0, reachable from every node (required when NNODES > 1)
  MASTER_PORT    free TCP port on node 0 (default 29500)
  GPUS_PER_NODE  processes per node, one per GPU (default: nvidia-smi's GPU count, else 8)
  PYTHON         interpreter (default: .venv/bin/python if present, else python3)
  DRY_RUN=1      print the command instead of running it

World size = NNODES x GPUS_PER_NODE; data-parallel size = world / (TP x PP) from the config.
Example, 64 GPUs for the 3B / 64B-token BF16 arm (run on each of the 8 nodes):
    NNODES=8 NODE_RANK=$SLURM_NODEID MASTER_ADDR=node001 \
        scripts/launch_multinode.sh configs/3b_64b/bf16.yaml
A run resumes from its newest checkpoint when started again (checkpoint.load=auto).
USAGE
}

set -euo pipefail
if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    usage
    [[ $# -ge 1 ]] && exit 0 || exit 2
fi
CONFIG=$1
shift
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ ! -f "$CONFIG" ]]; then
    echo "error: config file not found: $CONFIG" >&2
    exit 2
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_PORT=${MASTER_PORT:-29500}
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
    GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]] || GPUS_PER_NODE=8
fi
for v in NNODES NODE_RANK MASTER_PORT GPUS_PER_NODE; do
    if ! [[ "${!v}" =~ ^[0-9]+$ ]]; then
        echo "error: $v must be a non-negative integer, got '${!v}'" >&2
        exit 2
    fi
done
if (( NNODES < 1 || GPUS_PER_NODE < 1 )); then
    echo "error: NNODES and GPUS_PER_NODE must be at least 1" >&2
    exit 2
fi
if (( NODE_RANK >= NNODES )); then
    echo "error: NODE_RANK ($NODE_RANK) must be below NNODES ($NNODES)" >&2
    exit 2
fi
if (( NNODES > 1 )) && [[ -z "${MASTER_ADDR:-}" ]]; then
    echo "error: MASTER_ADDR (node 0's address) is required when NNODES > 1" >&2
    exit 2
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi

CMD=("$PYTHON" -m torch.distributed.run
     --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE"
     --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
     "$REPO/pretrain_gpt.py" --config "$CONFIG" "$@")
echo "[launch] node $NODE_RANK/$NNODES, $GPUS_PER_NODE GPUs per node, world size $((NNODES * GPUS_PER_NODE))" >&2
if [[ "${DRY_RUN:-0}" == "1" ]]; then
    printf '%q ' "${CMD[@]}"
    echo
    exit 0
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
exec "${CMD[@]}"
