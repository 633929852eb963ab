#!/usr/bin/env bash
# Device calls of session 13 (one nvidia-h200; carry .whl). Each mode is one call.
#   bash scripts/gpu/session13.sh gemm   # issue 3: the emulated NVFP4 GEMM as one cuBLASLt call
#       (tensor scales by device pointer) against torch.mm FP32-out + the epilogue pass, per GEMM of
#       the linear (checked first), its GPU tests, then the NVFP4 linear fwd+bwd with each backend
#   bash scripts/gpu/session13.sh linear   # its GPU tests, the linear with cuBLASLt (a cold Triton
#       cache needs > 200 s before the first line), 4 blocks of 3b: bf16 and nvfp4_linear with
#       cuBLASLt, nvfp4_linear with the two-pass GEMM
#   bash scripts/gpu/session13.sh check   # the GPU tests after the accumulate tolerance fix, the GEMM
#       bench again, and the linear's device time per kernel (profile_linear_device.py)
#   bash scripts/gpu/session13.sh next   # not yet run: what changed after run59 on the GPU — the
#       fused-linear tests with their GEMMs on the device, the cuBLASLt glue (workspace per stream,
#       capture rule, one-multiply alpha, raw stream), the linear's eager host time with it
#   bash scripts/gpu/session13.sh blocks   # 4 blocks of 3b, the NVFP4-linear arms with each GEMM
#       backend (bench_blocks.py)
# (run56, commit 2c689f1, ran the first `gemm` mode: a Triton GEMM with the epilogue inside, since
# removed — BENCHMARKS.md §K.1.)
set -u
source scripts/gpu/setup_env.sh
export OMP_NUM_THREADS=1
case "${1:-gemm}" in
  gemm)
    OUT="$OUT" TAILN=14 run gemm 120 python3 scripts/bench_nvfp4_gemm.py
    TAILN=6 run pytest_gpu 150 python3 -m pytest -q -x tests/fullstack_fp4/nvfp4/test_cublaslt.py \
      tests/fullstack_fp4/nvfp4/test_gemm.py tests/fullstack_fp4/nvfp4/test_gemm_epilogue.py \
      tests/fullstack_fp4/linear -p no:cacheprovider
    mkdir -p "$OUT/cublas" "$OUT/cublaslt"
    OUT="$OUT/cublaslt" TAILN=42 run linear_cublaslt 200 python3 scripts/bench_nvfp4_linear.py
    OUT="$OUT/cublas" FULLSTACK_FP4_GEMM=cublas TAILN=6 run linear_cublas 120 python3 scripts/bench_nvfp4_linear.py
    ;;
  linear)
    TAILN=4 run pytest_gpu 90 python3 -m pytest -q -x tests/fullstack_fp4/nvfp4/test_cublaslt.py \
      tests/fullstack_fp4/nvfp4/test_gemm.py tests/fullstack_fp4/nvfp4/test_gemm_epilogue.py \
      tests/fullstack_fp4/linear -p no:cacheprovider
    mkdir -p "$OUT/cublaslt"
    OUT="$OUT/cublaslt" TAILN=42 run linear_cublaslt 300 python3 scripts/bench_nvfp4_linear.py
    TAILN=8 run blocks_cublaslt 110 python3 scripts/bench_blocks.py \
      --arms bf16,nvfp4_linear --steps 6 --warmup 2 --out "$OUT/blocks_cublaslt"
    FULLSTACK_FP4_GEMM=cublas TAILN=8 run blocks_cublas 80 python3 scripts/bench_blocks.py \
      --arms nvfp4_linear --steps 6 --warmup 2 --out "$OUT/blocks_cublas"
    ;;
  check)
    TAILN=4 run pytest_gpu 120 python3 -m pytest -q tests/fullstack_fp4/nvfp4/test_cublaslt.py \
      tests/fullstack_fp4/nvfp4/test_gemm.py tests/fullstack_fp4/nvfp4/test_gemm_epilogue.py \
      tests/fullstack_fp4/linear -p no:cacheprovider
    OUT="$OUT" TAILN=10 run gemm 100 python3 scripts/bench_nvfp4_gemm.py
    TAILN=80 run profile_linear 300 python3 scripts/gpu/profile_linear_device.py
    ;;
  next)
    TAILN=6 run pytest_gpu 200 python3 -m pytest -q tests/fullstack_fp4/nvfp4/test_cublaslt.py \
      tests/fullstack_fp4/nvfp4/test_gemm.py tests/fullstack_fp4/linear -p no:cacheprovider
    mkdir -p "$OUT/linear"
    OUT="$OUT/linear" TAILN=6 run linear 250 python3 scripts/bench_nvfp4_linear.py
    TAILN=40 run profile_linear 100 python3 scripts/gpu/profile_linear_device.py
    ;;
  blocks)
    for be in cublas cublaslt; do
      FULLSTACK_FP4_GEMM=$be TAILN=8 run "blocks_$be" 250 python3 scripts/bench_blocks.py \
        --arms bf16,nvfp4_linear,lora_svd,full_stack --steps 6 --warmup 2 --out "$OUT/blocks_$be"
    done
    ;;
esac
