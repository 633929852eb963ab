#!/usr/bin/env bash
# Session 9's device calls on one H200 (each fits the 600 s limit). Carry .whl.
#   bash scripts/gpu/session9.sh diag    # quantize two-ways kernel table (events) + ncu of the
#       two-ways / amax kernels and Q-Attn's backward kernels (speed of light, occupancy, stalls)
#   bash scripts/gpu/session9.sh sr      # 8-bit SR stream + wgrad fusion: exactness (in-kernel
#       Philox vs the PyTorch stream), the two-ways table again, the NVFP4 linear bench, and the
#       4-block table for bf16 / nvfp4_linear / full stack with the kernel-family profile
#   bash scripts/gpu/session9.sh final   # Q-AdamW with the fused BF16 model-param write (GPU
#       bit-exactness of the hardware cast first), then the 4-block table + profile of the session's
#       code (8-bit SR, wgrad fusion, model-param write, Q-Attn without layout copies)
#   bash scripts/gpu/session9.sh ablation [--set train.seed=4321]  # bf16 vs full stack losses
#       at the session's numerics (8-bit SR, wgrad fused before the BF16 rounding); carry
#       data/quickstart; extra arguments go to scripts/ablation.py
set -u
source scripts/gpu/setup_env.sh
case "${1:-diag}" in
  diag)
    TAILN=16 run two_ways 180 python3 scripts/gpu/diag_two_ways.py
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    echo "ncu: ${NCU:-none}"
    if [ -n "$NCU" ]; then
      TAILN=5 run ncu 300 "$NCU" --clock-control none --launch-count 14 \
        -k regex:'_quantize_two_ways|_amax_two_ways|_dkdv_kernel|_dq_kernel' \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section SchedulerStats \
        python3 scripts/gpu/diag_two_ways.py --ncu-target
      grep -E "^  _|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit Registers|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|L1/TEX Hit|Mem Busy|Max Bandwidth" \
        "$OUT/ncu.txt" | head -220
    fi
    ;;
  final)
    TAILN=16 run q_adamw 200 python3 scripts/bench_q_adamw.py --cpp 1 --steps 5
    TAILN=40 run blocks 330 python3 scripts/bench_blocks.py \
      --arms bf16,nvfp4_linear,q_adamw_bf16_grads,full_stack_bf16_grads --steps 6 --warmup 2 \
      --profile --out "$OUT"
    ;;
  ablation)
    run ablation 330 python3 scripts/ablation.py --arms bf16,full_stack_bf16_grads --iters 300 \
      --out /tmp/abl --time-budget 300 --ppl-tokens 65536 --cloze-items 200 "${@:2}"
    keep_ablation /tmp/abl
    ;;
  sr)
    TAILN=30 run check 120 python3 scripts/gpu/check_kernels_exact.py
    TAILN=14 run two_ways 150 python3 scripts/gpu/diag_two_ways.py
    TAILN=8 run linear 150 python3 scripts/bench_nvfp4_linear.py
    TAILN=30 run blocks 300 python3 scripts/bench_blocks.py --arms bf16,nvfp4_linear,full_stack_bf16_grads \
      --steps 6 --warmup 2 --profile --out "$OUT"
    ;;
esac
