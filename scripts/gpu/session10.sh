#!/usr/bin/env bash
# Session 10's device calls on one H200 (each fits the 600 s limit). Carry .whl.
#   bash scripts/gpu/session10.sh lean    # the lean Triton launcher: quantize kernels exact,
#       lean launches exact and verified against JITFunction.run's pick, host time per call
#       (lean off / on), then the 4-block table of bf16 / nvfp4_linear / full stack (lean on)
#       and the full stack again with the lean launcher off (same machine, A/B)
#   bash scripts/gpu/session10.sh gc      # is the full stack's host idle Python's garbage
#       collector? The 4-block table (bf16, nvfp4_linear, full stack; one process, lean launcher
#       on) with automatic GC, then with --set train.manual_gc=true, then the full stack alone in
#       a fresh process; then the NVFP4 linear bench (issue 3's <= 1.3x)
#   bash scripts/gpu/session10.sh host    # where the host time of a step goes (bf16, full stack;
#       cProfile, syncs separated) and lean launcher off/on alternated in one process; then the
#       lean-launch check and host table again (seeds no longer specialised)
#   bash scripts/gpu/session10.sh final   # the same two, shorter, after the launcher's key was
#       made cheaper (binding plans per call shape, environment read once)
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
  gc)
    B="python3 scripts/bench_blocks.py --arms bf16,nvfp4_linear,full_stack_bf16_grads --steps 6 --warmup 2 --profile"
    TAILN=12 run blocks_auto_gc 240 $B --out "$OUT/auto_gc"
    TAILN=12 run blocks_manual_gc 120 $B --set train.manual_gc=true --out "$OUT/manual_gc"
    TAILN=6 run full_stack_alone 90 python3 scripts/bench_blocks.py --arms full_stack_bf16_grads \
      --steps 6 --warmup 2 --profile --out "$OUT/full_stack_alone"
    TAILN=12 run linear 200 python3 scripts/bench_nvfp4_linear.py
    ;;
  host)
    TAILN=200 run step_host 330 python3 scripts/gpu/profile_step_host.py --rounds 3
    TAILN=16 run lean 200 python3 scripts/gpu/check_lean_launch.py
    ;;
  final)
    TAILN=12 run lean 120 python3 scripts/gpu/check_lean_launch.py
    TAILN=80 run step_host 110 python3 scripts/gpu/profile_step_host.py \
      --arms full_stack_bf16_grads,bf16 --rounds 2
    ;;
esac
