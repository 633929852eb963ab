#!/usr/bin/env bash
# Device calls of session 19 (one nvidia-h200; carry .whl, made by
# `bash ../shared/tools/device-wheels.sh megatron-core==0.16.1 torchao==0.18.0 pytest-xdist execnet`).
# Pass FULLSTACK_COMMIT=<rev> on the command line.
#   bash scripts/gpu/session19.sh streams   # Q-AdamW: per-parameter launches over CUDA streams
#       (QAdamW(launch_streams=2), the new default; PERF.md "v8"): its GPU tests (bit for bit
#       the one-stream step) with the kernel and optimizer tests beside them, then the bench with
#       QAdamW at 1, 2, 3 streams, IEEE and approximate division, the multi-tensor and flat
#       rows again (session 18's run79 measured them), torch fused AdamW and torchao
set -u
source scripts/gpu/setup_env.sh
export OMP_NUM_THREADS=1
case "${1:-streams}" in
  streams)
    TAILN=12 gpu_pytest pytest_streams 240 -q -n 4 --dist loadfile tests/fullstack_fp4/optim/test_q_adamw_streams.py \
      tests/fullstack_fp4/optim/test_q_adamw_optimizer.py \
      tests/fullstack_fp4/optim/test_q_adamw_kernel.py \
      "tests/fullstack_fp4/integration/test_model_param_write.py::test_destinations_are_the_memory_megatron_copies_to"
    # after the tests, not beside them: run79 timed while a pytest ran on the same GPU
    TAILN=45 run q_adamw_streams 540 python3 scripts/bench_q_adamw.py --cpp 1 --steps 10 \
      --fast-div-rows --flat-row --multi-rows --streams-rows
    ;;
esac
