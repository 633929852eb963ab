#!/usr/bin/env bash
# Device calls of session 18 (one nvidia-h200; carry .whl, made by
# `bash ../shared/tools/device-wheels.sh megatron-core==0.16.1 torchao==0.18.0 pytest-xdist execnet`).
# Each mode is one call; pass FULLSTACK_COMMIT=<rev> on the command line.
#   bash scripts/gpu/session18.sh flat   # Q-AdamW: what the ~51 launches cost beyond their work
#       (PERF.md "v6": the kernel over all params as one flat tensor in one launch, IEEE and
#       approximate division, beside the per-parameter rows, torch fused AdamW and torchao)
set -u
source scripts/gpu/setup_env.sh
export OMP_NUM_THREADS=1
case "${1:-flat}" in
  flat)
    TAILN=40 run q_adamw_flat 540 python3 scripts/bench_q_adamw.py --cpp 1 --steps 10 \
      --fast-div-rows --flat-row
    ;;
esac
