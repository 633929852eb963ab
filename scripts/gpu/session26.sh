#!/usr/bin/env bash
# Device calls of session 26 (one nvidia-h200): the NVFP4 linear's amax pass and decode with
# fewer instructions (issue 3).
#   FULLSTACK_COMMIT=<rev> bash scripts/gpu/session26.sh amax        (carry .whl; run98 at 94900c9)
# 1. the GPU tests of the two-way kernels, the decode and the fused linear;
# 2. the amax pass in word layout at each (words, token blocks, warps) a program, bit for bit
#    against PyTorch, timed beside a copy (sweep_two_ways.py --amax);
# 3. the decode of saved codes (bench_decode.py --sweep: bit for bit, then its launch sweep);
# 4. the linear's device time per kernel (torch.profiler).
#   FULLSTACK_COMMIT=7f74c65 bash scripts/gpu/session26.sh ftab      (carry .whl; run99, run100 —
#   the factor table, F_TABLE_LOOKUP and sweep --ftab exist at 7f74c65..0a46db1 only: slower)
# 5. the GPU tests of 1. (more time: run98's stopped at its session timeout after 49 passed);
# 6. x's, W's and dY's calls with each block's factor from the program's table against the
#    division (sweep_two_ways.py --ftab), bit for bit, timed; 4. again.
#   FULLSTACK_COMMIT=0a46db1 bash scripts/gpu/session26.sh sweep_ftab  (carry .whl; run100)
# 6'. the sweep of 6. alone (run99's stopped on a bug of the script: call() lost its ways).
#   FULLSTACK_COMMIT=<rev> bash scripts/gpu/session26.sh linear      (carry .whl)
# 7. the linear's device time per kernel, its fwd+bwd against BF16 F.linear, eager and CUDA
#    graph (the bench checks against the reference first), and the GPU tests of the two-way
#    kernels and the decode.
# Packs its files into $OUT/<mode>.tgz.
set -u
source scripts/gpu/setup_env.sh
mkdir -p /tmp/pack

case "${1:-amax}" in
  amax)
    PER_TEST=150 TAILN=12 gpu_pytest two_ways_tests 170 -q -n 8 \
      tests/fullstack_fp4/nvfp4/test_quantize_two_ways.py tests/fullstack_fp4/nvfp4/test_fast_paths.py \
      tests/fullstack_fp4/linear/test_nvfp4_linear_fused.py
    TAILN=40 run sweep_amax 120 python3 scripts/gpu/sweep_two_ways.py --amax
    TAILN=20 run decode 80 python3 scripts/bench_decode.py --sweep
    TAILN=25 run profile_linear 120 python3 scripts/gpu/profile_linear_device.py
    cp "$OUT"/*.txt "$OUT"/*.json /tmp/pack/ 2>/dev/null
    ;;
  ftab)
    PER_TEST=200 TAILN=12 gpu_pytest two_ways_tests 300 -q -n 8 \
      tests/fullstack_fp4/nvfp4/test_quantize_two_ways.py tests/fullstack_fp4/nvfp4/test_fast_paths.py \
      tests/fullstack_fp4/linear/test_nvfp4_linear_fused.py
    TAILN=16 run sweep_ftab 150 python3 scripts/gpu/sweep_two_ways.py --ftab --jobs 6
    TAILN=25 run profile_linear 100 python3 scripts/gpu/profile_linear_device.py
    cp "$OUT"/*.txt "$OUT"/*.json /tmp/pack/ 2>/dev/null
    ;;
  sweep_ftab)
    TAILN=16 run sweep_ftab 200 python3 scripts/gpu/sweep_two_ways.py --ftab --jobs 6
    cp "$OUT"/*.txt /tmp/pack/ 2>/dev/null
    ;;
  linear)
    TAILN=25 run profile_linear 90 python3 scripts/gpu/profile_linear_device.py
    TAILN=12 run bench_linear 300 python3 scripts/bench_nvfp4_linear.py
    PER_TEST=120 TAILN=12 gpu_pytest two_ways_tests 170 -q -n 8 \
      tests/fullstack_fp4/nvfp4/test_quantize_two_ways.py tests/fullstack_fp4/nvfp4/test_fast_paths.py
    cp "$OUT"/*.txt "$OUT"/*.json /tmp/pack/ 2>/dev/null
    ;;
esac
tar -czf "$OUT/${1:-amax}.tgz" -C /tmp/pack .
