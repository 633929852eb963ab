#!/usr/bin/env bash
# Device calls of session 27 (one nvidia-h200): the NVFP4 linear's operand launches in an order
# that lets the quantize kernels read from L2 (issue 3).
#   FULLSTACK_COMMIT=de43545 bash scripts/gpu/session27.sh order   (carry .whl; run102 — l2_order.py
#   and the AMAX_REVERSE switch it measured exist at de43545 only: no gain, not kept)
# 1. the GPU tests of the two-way kernels, the decode and the fused linear;
# 2. the forward's operand launches in five orders, the amax passes forward or reversed, the dY
#    launches, and the whole linear with each order, bit for bit first (scripts/gpu/l2_order.py);
# 3. the linear's device time per kernel (torch.profiler), its fwd+bwd against BF16 F.linear,
#    eager and CUDA graph (the bench checks against the reference first).
#   FULLSTACK_COMMIT=<rev> bash scripts/gpu/session27.sh linear      (carry .whl)
# 4. 3. alone, then the GPU tests of 1.
# Packs its files into $OUT/<mode>.tgz.
set -u
source scripts/gpu/setup_env.sh
mkdir -p /tmp/pack

tests() {
  PER_TEST=120 TAILN=12 gpu_pytest two_ways_tests "$1" -q -n 8 \
    tests/fullstack_fp4/nvfp4/test_quantize_two_ways.py tests/fullstack_fp4/nvfp4/test_fast_paths.py \
    tests/fullstack_fp4/linear/test_nvfp4_linear_fused.py
}
linear() {
  TAILN=25 run profile_linear 90 python3 scripts/gpu/profile_linear_device.py
  TAILN=12 run bench_linear 200 python3 scripts/bench_nvfp4_linear.py
}

case "${1:-order}" in
  order)
    TAILN=40 run l2_order 200 python3 scripts/gpu/l2_order.py
    linear
    tests 150
    ;;
  linear)
    linear
    tests 200
    ;;
esac
cp "$OUT"/*.txt "$OUT"/*.json /tmp/pack/ 2>/dev/null
tar -czf "$OUT/${1:-order}.tgz" -C /tmp/pack .
