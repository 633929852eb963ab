#!/usr/bin/env bash
# The measurements BENCHMARKS.md "Not measured yet" lists, as device calls on one H200 (each fits
# the 600 s limit). Logs and JSON under $OUT. Carry .whl (megatron-core wheel) and, for
# `ablation`, data/quickstart.
#   bash scripts/gpu/open_measurements.sh linear     # NVFP4 linear benchmark + host profile
#   bash scripts/gpu/open_measurements.sh blocks     # 4-block 3b table with LoRA-SVD's dense route
#   bash scripts/gpu/open_measurements.sh ablation   # dense route beside nvfp4_linear, full_stack
#     (four arms take more than one call; ARMS=bf16,nvfp4_linear,lora_svd then ARMS=bf16,full_stack
#     splits them: ablation.py stops at its time budget, and /tmp/abl does not outlive the machine)
set -u
source scripts/gpu/setup_env.sh
run check 120 python3 scripts/gpu/check_kernels_exact.py
case "${1:-linear}" in
  linear)   # the first run compiles the linear's kernels (minutes on a cold cache): give it room
    run linear 420 python3 scripts/bench_nvfp4_linear.py
    run linear_host 60 python3 scripts/gpu/profile_linear_host.py ;;
  blocks)
    run blocks 450 python3 scripts/bench_blocks.py --arms bf16,nvfp4_linear,lora_svd,lora_svd_projected,full_stack \
      --steps 6 --warmup 2 --out "$OUT" ;;
  ablation)
    run ablation 450 python3 scripts/ablation.py --arms "${ARMS:-bf16,nvfp4_linear,lora_svd,full_stack}" --iters 300 \
      --out /tmp/abl --time-budget 380 --ppl-tokens 65536 --cloze-items 200
    keep_ablation /tmp/abl ;;
esac
