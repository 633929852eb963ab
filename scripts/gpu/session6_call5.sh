#!/usr/bin/env bash
# Session 6, device call 5 (one H200): LoRA-SVD with the dense route (W_res takes the whole
# gradient) at the GPU ablation scale beside BF16, 300 steps each (issue 4).
#   FULLSTACK_COMMIT=<sha> bash scripts/gpu/session6_call5.sh   (carry .whl and data/quickstart)
set -u
source scripts/gpu/setup_env.sh
timeout 320 python3 scripts/ablation.py --arms bf16,lora_svd_dense --iters 300 \
  --out /tmp/abl --time-budget 260 --ppl-tokens 65536 --cloze-items 200 2>&1 | grep -v -i "warn" \
  | tee "$OUT/ablation.log" | tail -12
cp /tmp/abl/ablation.md /tmp/abl/ablation.json /tmp/abl/*.png "$OUT"/ 2>/dev/null
for a in bf16 lora_svd_dense; do
  [ -f /tmp/abl/$a/metrics.jsonl ] && mkdir -p "$OUT/$a" && cp /tmp/abl/$a/metrics.jsonl "$OUT/$a/"
done
