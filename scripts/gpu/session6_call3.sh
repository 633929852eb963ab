#!/usr/bin/env bash
# Session 6, device call 3 (one H200): the 4-block 3b efficiency table for the arms whose
# kernels changed this session (Q-Attn tile defaults, Q-AdamW register cap), beside BF16.
#   bash scripts/gpu/session6_call3.sh
set -u
source scripts/gpu/setup_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
timeout 520 python3 scripts/bench_blocks.py --arms bf16,q_attn,q_adamw,full_stack --steps 6 --warmup 2 \
  --out "$OUT" 2>&1 | grep -v -i "warn" | tee "$OUT/blocks.txt" | tail -30
ls -la "$OUT"
