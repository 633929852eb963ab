#!/usr/bin/env bash
# One call on a 2-GPU machine (nvidia-h200-x2): GPU 0 runs the 4-block efficiency table for
# every arm, then the kernel benchmarks; GPU 1 runs the convergence ablation, time-boxed.
#   bash scripts/gpu/two_gpus.sh [ABLATION_ITERS] [ABLATION_BUDGET_S]
# Carry .whl and data/quickstart. Results: $OUT/g0 (blocks + kernels), $OUT/g1 (ablation).
set -u
ITERS=${1:-300}
BUDGET=${2:-480}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
mkdir -p "$OUT/g0" "$OUT/g1"
ARMS=bf16,nvfp4_linear,lora_svd,q_adamw,muon,q_muon,root,q_root,q_attn,full_stack,full_stack_root
ABL_ARMS=${ABL_ARMS:-$ARMS}                  # ablation arms (GPU 1), in order of priority
BENCHES=${BENCHES:-bench_nvfp4_linear bench_q_attn bench_newton_schulz bench_nvfp4_quantize}
BLOCKS_TIMEOUT=${BLOCKS_TIMEOUT:-330}
g0() {
  export CUDA_VISIBLE_DEVICES=0
  timeout "$BLOCKS_TIMEOUT" python3 scripts/bench_blocks.py --arms "$ARMS" --steps 6 --warmup 2 --out "$OUT/g0"
  for s in $BENCHES; do
    echo "===== $s"; OUT= timeout 60 python3 scripts/$s.py
  done
}
g1() {
  export CUDA_VISIBLE_DEVICES=1
  timeout $((BUDGET + 60)) python3 scripts/ablation.py --arms "$ABL_ARMS" --iters "$ITERS" --time-budget "$BUDGET" \
    --out /tmp/ablation --ppl-tokens 65536 --cloze-items 200
  cp /tmp/ablation/ablation.json /tmp/ablation/ablation.md /tmp/ablation/ablation.png "$OUT/g1"/ 2>/dev/null
}
g0 > "$OUT/g0/log.txt" 2>&1 &
g1 > "$OUT/g1/log.txt" 2>&1 &
wait
rm -f "$OUT"/g0/*.json.tmp
grep -v -i warn "$OUT/g0/log.txt" | grep -E "^\||=====|error|Error" | head -120
echo "-------- ablation"
tail -30 "$OUT/g1/log.txt"
ls -la "$OUT"/g0 "$OUT"/g1
