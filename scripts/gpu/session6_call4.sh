#!/usr/bin/env bash
# Session 6, device call 4 (one H200): the LoRA-SVD diagnostic at the GPU ablation scale (issue 4):
# the recipe with W_res unquantized beside BF16 and the quantized recipe, 300 steps each.
#   FULLSTACK_COMMIT=<sha> bash scripts/gpu/session6_call4.sh   (carry .whl and data/quickstart)
set -u
source scripts/gpu/setup_env.sh
timeout 520 python3 scripts/ablation.py --arms bf16,lora_svd_unquantized,lora_svd --iters 300 \
  --out /tmp/abl --time-budget 430 --ppl-tokens 65536 --cloze-items 200 2>&1 | grep -v -i "warn" \
  | tee "$OUT/ablation.log" | tail -25
cp /tmp/abl/ablation.md /tmp/abl/ablation.json /tmp/abl/*.png "$OUT"/ 2>/dev/null
for a in bf16 lora_svd_unquantized lora_svd; do
  [ -f /tmp/abl/$a/metrics.jsonl ] && mkdir -p "$OUT/$a" && cp /tmp/abl/$a/metrics.jsonl "$OUT/$a/"
done
ls -la "$OUT"
