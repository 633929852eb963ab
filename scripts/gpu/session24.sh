#!/usr/bin/env bash
# Device calls of session 24 (one nvidia-h200): the NVFP4 linear's operand kernels with whole
# 32-byte sectors a request (issue 3).
#   FULLSTACK_COMMIT=176f77b bash scripts/gpu/session24.sh rows      (carry .whl; run94 — the
#   `--coalesced` sweep and the COALESCED_ROWS switch it measured exist at 176f77b only)
# 1. the two-way kernels (amax and quantize, every call of the linear) with token rows read and
#    the row way written as whole blocks against the half-block accesses before, bit for bit
#    and timed (CUDA graphs);
# 2. the decode of saved codes, a lane a half-block against a lane a block, bit for bit against
#    the PyTorch decode and timed;
# 3. the linear's device time per kernel (torch.profiler) and its fwd+bwd against BF16 F.linear
#    (eager and CUDA graph; the bench checks against the reference first);
# 4. Nsight Compute on the 8 operand launches of one fwd+bwd at 8192 × 3072 → 3072, the new
#    forms and the old, with L2 request and DRAM byte counts.
#   FULLSTACK_COMMIT=<rev> bash scripts/gpu/session24.sh tbs         (carry .whl; run95)
# 5. x's call with 1, 2 or 4 token blocks a program (a channel's column codes and scales stored
#    as one run), uncapped and capped at 128 registers, bit for bit against 1;
# 6. 3. and 4. (the new forms only) again at the chosen default, and the GPU tests of the
#    two-way kernels, the decode and the fused linear.
#   FULLSTACK_COMMIT=<rev> bash scripts/gpu/session24.sh linear      (carry .whl; run96)
# 7. the linear's fwd+bwd against BF16 F.linear, eager and CUDA graph (run95's bench ran past
#    its limit in cold compiles), and its device time per kernel.
#   FULLSTACK_COMMIT=<rev> bash scripts/gpu/session24.sh dy          (carry .whl; run97)
# 8. dY's call with its stochastic rounding as ceil(v - u) (_dec_sr_bits): the --dy sweep
#    checks it bit for bit against the nibble form at 8192 x 3072 / 8192 and times it; then
#    the linear's device time per kernel.
# Packs its files into $OUT/<mode>.tgz.
set -u
source scripts/gpu/setup_env.sh
mkdir -p /tmp/pack
NCU_METRICS=lts__t_requests_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_write.sum,\
lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum,\
dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum,\
sm__inst_executed.sum,lts__t_sectors.avg.pct_of_peak_sustained_elapsed

case "${1:-rows}" in
  rows)
    TAILN=30 run sweep_coalesced 240 python3 scripts/gpu/sweep_two_ways.py --coalesced --jobs 12
    TAILN=15 run decode 90 python3 scripts/bench_decode.py
    TAILN=25 run profile_linear 150 python3 scripts/gpu/profile_linear_device.py
    TAILN=30 run bench_linear 200 python3 scripts/bench_nvfp4_linear.py
    for form in new before; do
      flag=""; [ "$form" = before ] && flag="--before"
      TAILN=5 run "ncu_$form" 110 ncu --clock-control none --launch-skip 8 --launch-count 8 \
        -k regex:'_amax_two_ways|_quantize_two_ways|_dequantize_flat' \
        --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis \
        --section SchedulerStats --metrics "$NCU_METRICS" \
        python3 scripts/gpu/diag_two_ways.py --ncu-linear $flag
    done
    cp "$OUT"/*.txt "$OUT"/*.json /tmp/pack/ 2>/dev/null
    ;;
  tbs)
    TAILN=14 run sweep_tbs 200 python3 scripts/gpu/sweep_two_ways.py --tbs --jobs 10
    TAILN=25 run profile_linear 120 python3 scripts/gpu/profile_linear_device.py
    TAILN=8 run bench_linear 150 python3 scripts/bench_nvfp4_linear.py
    TAILN=5 run ncu_new 90 ncu --clock-control none --launch-skip 8 --launch-count 8 \
      -k regex:'_amax_two_ways|_quantize_two_ways|_dequantize_flat' \
      --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis \
      --section SchedulerStats --metrics "$NCU_METRICS" \
      python3 scripts/gpu/diag_two_ways.py --ncu-linear
    PER_TEST=150 TAILN=12 gpu_pytest two_ways_tests 150 -q -n 6 \
      tests/fullstack_fp4/nvfp4/test_quantize_two_ways.py tests/fullstack_fp4/nvfp4/test_fast_paths.py \
      tests/fullstack_fp4/linear/test_nvfp4_linear_fused.py
    cp "$OUT"/*.txt "$OUT"/*.json /tmp/pack/ 2>/dev/null
    ;;
  dy)
    TAILN=12 run sweep_dy 150 python3 scripts/gpu/sweep_two_ways.py --dy --jobs 3
    TAILN=25 run profile_linear 120 python3 scripts/gpu/profile_linear_device.py
    cp "$OUT"/*.txt "$OUT"/*.json /tmp/pack/ 2>/dev/null
    ;;
  linear)
    TAILN=12 run bench_linear 330 python3 scripts/bench_nvfp4_linear.py
    TAILN=25 run profile_linear 100 python3 scripts/gpu/profile_linear_device.py
    cp "$OUT"/*.txt "$OUT"/*.json /tmp/pack/ 2>/dev/null
    ;;
esac
tar -czf "$OUT/${1:-rows}.tgz" -C /tmp/pack .
