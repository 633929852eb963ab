#!/usr/bin/env bash
# Smoke test of configs/3b_64b/ on one GPU: every arm builds its model from its own YAML and
# runs a few steps on random tokens: each arm must at least build the model and run a few steps
# on one H200, at 4 blocks if memory demands.
usage() {
    cat <<'USAGE'
usage: benchmarks/smoke_3b_64b.sh [ARM ...] [-- section.key=value ...]

ARM: a file name in configs/3b_64b/ without .yaml (default: every arm, base.yaml excluded).
Each arm runs, one after another:
    pretrain_gpt.py --config configs/3b_64b/ARM.yaml data.mock=true model.num_layers=$LAYERS
        train.iters=$STEPS train.global_batch_size=2 train.micro_batch_size=1 train.eval_iters=0
        train.log_interval=1
        checkpoint.load=none checkpoint.save_dir=null checkpoint.save_interval=null
        logging.dir=null [overrides after --]
i.e. the arm's own file with only the run length, the batch, the data (random tokens, no files)
and, by default, the depth changed: 4 of the 28 blocks, as the paper's efficiency setting.

environment
  LAYERS   decoder blocks (default 4; 28 is the full 3B model)
  STEPS    training steps per arm (default 3)
  LOGDIR   one log per arm, ARM.log (default runs/smoke_3b_64b)
  PYTHON   interpreter (default: .venv/bin/python if present, else python3)

Prints one line per arm (ok / FAILED, seconds, and the last step's time, loss and peak memory as
the training log gives them) and exits 1 if any arm failed, 2 on bad usage.
USAGE
}

set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR="$REPO/configs/3b_64b"
ARMS=()
EXTRA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) ARMS+=("$1"); shift ;;
    esac
done
if [[ ${#ARMS[@]} -eq 0 ]]; then
    for f in "$DIR"/*.yaml; do
        a=$(basename "$f" .yaml)
        [[ "$a" == base ]] || ARMS+=("$a")
    done
fi
for a in "${ARMS[@]}"; do
    if [[ ! -f "$DIR/$a.yaml" || "$a" == base ]]; then
        echo "error: no arm '$a' in configs/3b_64b/ (choose from: $(cd "$DIR" && ls *.yaml | sed 's/\.yaml$//' | grep -vx base | tr '\n' ' '))" >&2
        exit 2
    fi
done
LAYERS=${LAYERS:-4}
STEPS=${STEPS:-3}
LOGDIR=${LOGDIR:-runs/smoke_3b_64b}
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
mkdir -p "$LOGDIR"
failed=0
for a in "${ARMS[@]}"; do
    log="$LOGDIR/$a.log"
    t0=$(date +%s)
    (cd "$REPO" && "$PYTHON" pretrain_gpt.py --config "configs/3b_64b/$a.yaml" data.mock=true \
        "model.num_layers=$LAYERS" "train.iters=$STEPS" train.global_batch_size=2 \
        train.micro_batch_size=1 train.eval_iters=0 train.log_interval=1 checkpoint.load=none checkpoint.save_dir=null \
        checkpoint.save_interval=null logging.dir=null "${EXTRA[@]}") >"$log" 2>&1
    rc=$?
    last=$(grep -E "^ *iteration +$STEPS/" "$log" | tail -1)
    if [[ $rc -eq 0 && -n "$last" ]]; then
        status=ok
    else
        status="FAILED (exit $rc, see $log)"
        failed=1
    fi
    # The fields a reader compares across arms; the whole line is in the log.
    fields=$(echo "$last" | grep -oE "(elapsed time per iteration \(ms\)|lm loss|peak mem \(GiB\)): [^|]*" \
        | sed -e 's/elapsed time per iteration (ms)/step ms/' -e 's/ *$//' | paste -sd'|' | sed 's/|/ | /g')
    printf '%-16s %-8s %4ss  %s\n' "$a" "$status" "$(( $(date +%s) - t0 ))" "$fields"
done
exit $failed
