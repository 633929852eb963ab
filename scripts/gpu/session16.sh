#!/usr/bin/env bash
# Device calls of session 16 (one nvidia-h200; carry .whl, made by
# `bash ../shared/tools/device-wheels.sh megatron-core==0.16.1 torchao==0.18.0 pytest-xdist execnet`).
# Each mode is one call; pass FULLSTACK_COMMIT=<rev> on the command line.
#   bash scripts/gpu/session16.sh tests   # the GPU tests session 15 could not run after its
#       signed-zero fix (9f32fa1): Q-Attn's kernel tests, the rest of the two-way and NS tests,
#       and Q-AdamW's kernel tests with the Philox-path check (kernel_uniforms); then the
#       Q-AdamW bench: its correctness block (now also the Philox path) and the step beside
#       torch fused AdamW and torchao, with a kernel row on the old 16-bit uniforms
#   bash scripts/gpu/session16.sh all     # test_core_attention.py's Triton cases, which run70 ran
#       on CPU tensors (fixed: CUDA when there is a GPU), then every test under tests/fullstack_fp4
#       on the GPU (12 processes; -v so a time-out still leaves each finished test's verdict)
#   bash scripts/gpu/session16.sh failing # the 25 tests that failed or errored in `all` (run71,
#       listed in scripts/gpu/session16_failing.txt), with their tracebacks
set -u
source scripts/gpu/setup_env.sh
export OMP_NUM_THREADS=1
case "${1:-tests}" in
  tests)
    TAILN=12 run pytest_gpu 330 python3 -m pytest -q -p no:cacheprovider --tb=short -n 8 \
      tests/fullstack_fp4/attention tests/fullstack_fp4/optim/test_q_adamw_kernel.py \
      tests/fullstack_fp4/nvfp4/test_quantize_two_ways.py tests/fullstack_fp4/optim/test_triton_ns.py
    TAILN=30 run q_adamw 240 python3 scripts/bench_q_adamw.py --cpp 1 --steps 10 --u16-row
    ;;
  all)
    TAILN=4 run pytest_core_attention 150 python3 -m pytest -q -p no:cacheprovider --tb=short -n 3 \
      tests/fullstack_fp4/attention/test_core_attention.py
    TAILN=25 run pytest_fullstack_fp4 400 python3 -m pytest -v -p no:cacheprovider --tb=line -n 12 \
      -rfE tests/fullstack_fp4
    grep -c " PASSED " "$OUT/pytest_fullstack_fp4.txt"; grep -E " (FAILED|ERROR) " "$OUT/pytest_fullstack_fp4.txt" | head -40
    ;;
  failing)
    TAILN=40 run pytest_failing 330 python3 -m pytest -q -p no:cacheprovider --tb=short -n 8 -rfE \
      $(cat scripts/gpu/session16_failing.txt)
    ;;
esac
