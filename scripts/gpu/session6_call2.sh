#!/usr/bin/env bash
# Session 6, device call 2 (one H200): Q-Attn with the swept tile defaults (and the sweep around
# them), the NVFP4 linear benchmark with a host-time profile, the Q-AdamW kernel sweep.
#   bash scripts/gpu/session6_call2.sh
set -u
source scripts/gpu/setup_env.sh
step() { echo "===== $1 ($(date +%T))"; shift; "$@" 2>&1 | grep -v -i "warn" | tee "$OUT/$LOGNAME.txt" | tail -${TAILN:-60}; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
LOGNAME=check TAILN=3 step check timeout 120 python3 scripts/gpu/check_kernels_exact.py
LOGNAME=q_attn TAILN=45 step q_attn timeout 150 python3 scripts/bench_q_attn.py --sweep
LOGNAME=linear TAILN=45 step linear timeout 120 python3 scripts/bench_nvfp4_linear.py
LOGNAME=linear_host TAILN=70 step linear_host timeout 60 python3 scripts/gpu/profile_linear_host.py
LOGNAME=q_adamw TAILN=30 step q_adamw timeout 330 python3 scripts/bench_q_adamw.py --sweep
ls -la "$OUT"
