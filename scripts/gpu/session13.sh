#!/usr/bin/env bash
# Device calls of session 13 (one nvidia-h200; carry .whl). Each mode is one call.
#   bash scripts/gpu/session13.sh gemm   # issue 3: the fused Triton GEMM (epilogue inside) against
#       cuBLAS FP32-out + the epilogue pass, per GEMM of the linear (checked first, tiles swept),
#       then the NVFP4 linear fwd+bwd with each GEMM backend (bench_nvfp4_linear.py)
#   bash scripts/gpu/session13.sh blocks   # 4 blocks of 3b, the NVFP4-linear arms with each GEMM
#       backend (bench_blocks.py), and the GPU tests of the GEMM
set -u
source scripts/gpu/setup_env.sh
export OMP_NUM_THREADS=1
case "${1:-gemm}" in
  gemm)
    OUT="$OUT" TAILN=30 run gemm 260 python3 scripts/bench_nvfp4_gemm.py --sweep
    mkdir -p "$OUT/cublas" "$OUT/triton"
    OUT="$OUT/cublas" FULLSTACK_FP4_GEMM=cublas TAILN=12 run linear_cublas 150 python3 scripts/bench_nvfp4_linear.py
    OUT="$OUT/triton" TAILN=40 run linear_triton 150 python3 scripts/bench_nvfp4_linear.py
    ;;
  blocks)
    for be in cublas triton; do
      FULLSTACK_FP4_GEMM=$be TAILN=8 run "blocks_$be" 200 python3 scripts/bench_blocks.py \
        --arms bf16,nvfp4_linear,lora_svd,full_stack --steps 6 --warmup 2 --out "$OUT/blocks_$be"
    done
    ;;
esac
