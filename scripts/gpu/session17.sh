#!/usr/bin/env bash
# Device calls of session 17 (one nvidia-h200; carry .whl, made by
# `bash ../shared/tools/device-wheels.sh megatron-core==0.16.1 torchao==0.18.0 pytest-xdist execnet`).
# Each mode is one call; pass FULLSTACK_COMMIT=<rev> on the command line.
#   bash scripts/gpu/session17.sh qadamw  # Q-AdamW's approximate update division (PERF.md "v6"):
#       its GPU test (states bit for bit, p' within the bound) beside the bench: correctness
#       block first (IEEE paths bit for bit; approx path within its bound), then kernel rows
#       and QAdamW rows with and without it beside torch fused AdamW and torchao
#   bash scripts/gpu/session17.sh tests   # every test under tests/fullstack_fp4 on the GPU
#       (gpu_pytest: ends with its summary and tracebacks before the call's limit; LIMIT=S and
#       PER_TEST=S on the command line set the call's and each test's limit; -v keeps every
#       finished test's verdict even if the call is cut)
#   bash scripts/gpu/session17.sh recheck # run75's three failures after their fixes (the
#       telemetry one alone: did it time out on 12 workers' compiles?), then a sweep of the
#       register cap / chunks per program with the approximate division
#   bash scripts/gpu/session17.sh telemetry # the telemetry test that timed out, alone
set -u
source scripts/gpu/setup_env.sh
export OMP_NUM_THREADS=1
case "${1:-qadamw}" in
  qadamw)
    # the test compiles its own variant (n = 2081) while the bench compiles its first ones
    TAILN=6 run pytest_fast_div 200 python3 -m pytest -q -p no:cacheprovider --tb=short \
      tests/fullstack_fp4/optim/test_q_adamw_kernel.py -k "approx_division or bit_for_bit" &
    TAILN=40 run q_adamw 480 python3 scripts/bench_q_adamw.py --cpp 1 --steps 10 --fast-div-rows
    wait
    ;;
  recheck)
    TAILN=12 gpu_pytest pytest_recheck 300 -v -n 3 \
      tests/fullstack_fp4/integration/test_optimizers_megatron.py::test_qkv_permutation_matches_megatron_attention \
      tests/fullstack_fp4/integration/test_orthogonal_tp.py::test_tensor_parallel_orthogonal_matches_one_process \
      tests/fullstack_fp4/telemetry/test_collector_fallback.py
    TAILN=16 run q_adamw_sweep 240 python3 scripts/bench_q_adamw.py --sweep --steps 10 \
      --sweep-configs '1,128,1,1,10,1;1,96,1,1,10,1;1,112,1,1,10,1;2,128,1,1,10,1;1,none,1,1,10,1'
    ;;
  telemetry)   # run75/run76's time-out alone, with the time a cold Triton cache needs
    TAILN=12 run pytest_telemetry 500 python3 -m pytest -v -p no:cacheprovider --tb=short \
      --timeout 450 --durations=5 tests/fullstack_fp4/telemetry/test_collector_fallback.py
    ;;
  tests)
    TAILN=30 PER_TEST=${PER_TEST:-} gpu_pytest pytest_fullstack_fp4 ${LIMIT:-540} -v -n 12 \
      tests/fullstack_fp4
    grep -c " PASSED " "$OUT/pytest_fullstack_fp4.txt"
    ;;
esac
