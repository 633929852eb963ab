#!/usr/bin/env bash
# Session 10's device calls on one H200 (each fits the 600 s limit). Carry .whl.
#   bash scripts/gpu/session10.sh lean    # the lean Triton launcher: quantize kernels exact,
#       lean launches exact and verified against JITFunction.run's pick, host time per call
#       (lean off / on), then the 4-block table of bf16 / nvfp4_linear / full stack (lean on)
#       and the full stack again with the lean launcher off (same machine, A/B)
set -u
source scripts/gpu/setup_env.sh
case "${1:-lean}" in
  lean)
    TAILN=20 run check 150 python3 scripts/gpu/check_kernels_exact.py
    TAILN=60 run lean 240 python3 scripts/gpu/check_lean_launch.py
    TAILN=30 run blocks 200 python3 scripts/bench_blocks.py --arms bf16,nvfp4_linear,full_stack_bf16_grads \
      --steps 6 --warmup 2 --profile --out "$OUT"
    FULLSTACK_FP4_LEAN_LAUNCH=0 TAILN=14 run blocks_lean_off 120 python3 scripts/bench_blocks.py \
      --arms full_stack_bf16_grads --steps 6 --warmup 2 --profile --out "$OUT/lean_off"
    ;;
esac
