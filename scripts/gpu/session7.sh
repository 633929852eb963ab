#!/usr/bin/env bash
# Session 7's device calls on one H200 (each fits the 600 s limit). Carry .whl and data/quickstart.
#   FULLSTACK_COMMIT=<sha> bash scripts/gpu/session7.sh memory     # kernels check; Q-AdamW steps
#       from a BF16 grad as from the same FP32 values; the 4-block 3b table with the BF16 grad
#       buffer (parallel.grad_reduce_in_fp32=false) and LoRA-SVD's direct NVFP4 calls
#   FULLSTACK_COMMIT=<sha> bash scripts/gpu/session7.sh ablation   # bf16, full_stack_bf16_grads,
#       nvfp4_linear, lora_svd (dense route): every gap against one BF16 baseline of the same call
set -u
source scripts/gpu/setup_env.sh
ablation() {  # ablation <arms> <time budget s>
  run ablation $(( $2 + 60 )) python3 scripts/ablation.py --arms "$1" --iters 300 --out /tmp/abl \
    --time-budget "$2" --ppl-tokens 65536 --cloze-items 200
  keep_ablation /tmp/abl
}
case "${1:-memory}" in
  memory)
    TAILN=3 run check 120 python3 scripts/gpu/check_kernels_exact.py
    TAILN=5 run check_bf16_grads 200 python3 scripts/gpu/check_q_adamw_bf16_grads.py
    TAILN=12 run blocks 300 python3 scripts/bench_blocks.py \
      --arms bf16,nvfp4_linear,lora_svd,q_adamw,q_adamw_bf16_grads,full_stack,full_stack_bf16_grads \
      --steps 6 --warmup 2 --out "$OUT"
    ;;
  ablation)
    ablation bf16,full_stack_bf16_grads,nvfp4_linear,lora_svd 440 ;;
esac
