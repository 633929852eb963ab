#!/usr/bin/env bash
# Device calls of session 18 (one nvidia-h200; carry .whl, made by
# `bash ../shared/tools/device-wheels.sh megatron-core==0.16.1 torchao==0.18.0 pytest-xdist execnet`).
# Each mode is one call; pass FULLSTACK_COMMIT=<rev> on the command line.
#   bash scripts/gpu/session18.sh flat   # Q-AdamW: what the ~51 launches cost beyond their work
#       (PERF.md "v7": the kernel over all params as one flat tensor in one launch — the bound —
#       and the multi-tensor launch (triton_multi.py, sub 1 and 4), IEEE and approximate
#       division, beside the per-parameter rows, QAdamW(multi_tensor=True), torch fused AdamW
#       and torchao), with the multi-tensor tests on the GPU beside it (and run78's one unrun
#       test, test_model_param_write's destinations)
set -u
source scripts/gpu/setup_env.sh
export OMP_NUM_THREADS=1
case "${1:-flat}" in
  flat)
    TAILN=8 run pytest_multi 300 python3 -m pytest -q -p no:cacheprovider --tb=short \
      tests/fullstack_fp4/optim/test_q_adamw_multi.py \
      "tests/fullstack_fp4/integration/test_model_param_write.py::test_destinations_are_the_memory_megatron_copies_to" &
    TAILN=40 run q_adamw_flat 540 python3 scripts/bench_q_adamw.py --cpp 1 --steps 10 \
      --fast-div-rows --flat-row --multi-rows
    wait
    ;;
esac
