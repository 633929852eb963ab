#!/usr/bin/env bash
# Session 6, device call 1 (one H200): kernel exactness, an Nsight Compute profile of the 1x16
# nearest quantize in its three kernel forms, the quantize sweep (flat kernels included), and
# the Q-Attn tile sweep. Logs under $OUT.
#   bash scripts/gpu/session6_kernels.sh
set -u
source scripts/gpu/setup_env.sh
step() { echo "===== $1 ($(date +%T))"; shift; "$@" 2>&1 | grep -v -i "warn" | tee "$OUT/$LOGNAME.txt" | tail -${TAILN:-60}; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
LOGNAME=check TAILN=15 step check timeout 120 python3 scripts/gpu/check_kernels_exact.py
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
if [ -n "$NCU" ]; then
  LOGNAME=ncu TAILN=400 step ncu timeout 150 "$NCU" --clock-control none --kernel-name regex:'quantize|amax' \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis python3 scripts/bench_nvfp4_quantize.py --once
fi
LOGNAME=quantize TAILN=120 step quantize timeout 200 python3 scripts/bench_nvfp4_quantize.py --sweep --no-peers
LOGNAME=q_attn TAILN=80 step q_attn timeout 200 python3 scripts/bench_q_attn.py --sweep
ls -la "$OUT"
