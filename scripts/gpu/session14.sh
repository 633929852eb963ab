#!/usr/bin/env bash
# Device calls of session 14 (one nvidia-h200; carry .whl, made by
# `bash ../shared/tools/device-wheels.sh megatron-core==0.16.1 torchao==0.18.0`: torchao is the
# peer of the quantize and Q-AdamW benches). Each mode is one call.
#   bash scripts/gpu/session14.sh sweep   # the GPU tests whose oracles run60 found drawing SR
#       uniforms through a Triton dump on CPU tensors (now the PyTorch stream), then the launch
#       configurations of the linear's operand kernels (scripts/gpu/sweep_two_ways.py)
#   bash scripts/gpu/session14.sh final   # Q-AdamW's bench (torchao's AdamW4bit/8bit beside it:
#       carry the torchao wheel in .whl); dY's rounding form against its register cap
#       (sweep_two_ways.py --dy), then the linear bench + profile with the fastest form
#   bash scripts/gpu/session14.sh tests   # not yet run: the fused-linear and two-way GPU tests in
#       full (cold Triton compiles: ~400 s), then the linear bench after L.1/L.4 and the quantize
#       bench with torchao's NVFP4Tensor.to_nvfp4 beside it, as far as the time goes
set -u
source scripts/gpu/setup_env.sh
export OMP_NUM_THREADS=1
case "${1:-sweep}" in
  sweep)
    TAILN=12 run pytest_gpu 200 python3 -m pytest -q -p no:cacheprovider --tb=short \
      tests/fullstack_fp4/linear/test_nvfp4_linear_fused.py \
      tests/fullstack_fp4/nvfp4/test_quantize_two_ways.py tests/fullstack_fp4/nvfp4/test_sr_stream.py
    TAILN=4 run pytest_gpu_philox 60 python3 -m pytest -q -p no:cacheprovider --tb=short \
      tests/fullstack_fp4/nvfp4/test_triton_quantize.py -k philox
    TAILN=60 run sweep_two_ways 300 python3 scripts/gpu/sweep_two_ways.py --jobs 12
    ;;
  final)
    OUT="$OUT" TAILN=14 run q_adamw 200 python3 scripts/bench_q_adamw.py --cpp 1 --steps 10
    OUT="$OUT" TAILN=10 run dy_forms 80 python3 scripts/gpu/sweep_two_ways.py --dy --jobs 3
    mkdir -p "$OUT/linear"
    OUT="$OUT/linear" TAILN=8 run linear 220 python3 scripts/gpu/run_with_dy_choice.py \
      "$OUT/dy_choice.json" scripts/bench_nvfp4_linear.py
    TAILN=34 run profile_linear 90 python3 scripts/gpu/run_with_dy_choice.py \
      "$OUT/dy_choice.json" scripts/gpu/profile_linear_device.py
    ;;
  tests)
    TAILN=12 run pytest_gpu 360 python3 -m pytest -q -p no:cacheprovider --tb=short \
      tests/fullstack_fp4/linear/test_nvfp4_linear_fused.py \
      tests/fullstack_fp4/nvfp4/test_quantize_two_ways.py tests/fullstack_fp4/nvfp4/test_sr_stream.py
    mkdir -p "$OUT/linear"
    OUT="$OUT/linear" TAILN=8 run linear 170 python3 scripts/bench_nvfp4_linear.py
    OUT="$OUT" TAILN=24 run quantize 60 python3 scripts/bench_nvfp4_quantize.py
    ;;
  final2)   # final's budget after the machine was taken back mid-call: no linear bench
    OUT="$OUT" TAILN=14 run q_adamw 150 python3 scripts/bench_q_adamw.py --cpp 1 --steps 10
    OUT="$OUT" TAILN=10 run dy_forms 70 python3 scripts/gpu/sweep_two_ways.py --dy --jobs 3
    TAILN=34 run profile_linear 190 python3 scripts/gpu/run_with_dy_choice.py \
      "$OUT/dy_choice.json" scripts/gpu/profile_linear_device.py
    ;;
esac
