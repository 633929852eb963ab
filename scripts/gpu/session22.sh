#!/usr/bin/env bash
# Device call of session 22 (one nvidia-h200; carry .whl and data/quickstart):
#   FULLSTACK_COMMIT=<rev> bash scripts/gpu/session22.sh wshare
# 1. scripts/gpu/check_partial_nvfp4.py: the diagnostic linear with nothing kept against the
#    NVFP4 linear on the GPU, and its cost;
# 2. how much of NVFP4's loss gap is W's (issue 4): at seeds 1234, 4321 and 99 the ablation's
#    bf16, nvfp4_linear and lora_svd arms (BENCHMARKS.md §I.1's setup), and beside them the
#    nvfp4_linear arm with W unquantized (`fp4.unquantized_operands=[w]`): twelve arms at once.
#   FULLSTACK_COMMIT=<rev> bash scripts/gpu/session22.sh wshare2
#    the same at seeds 2024, 777 and 5, the check beside them (its 32,768-token case did not
#    finish within its 120 s in the first call).
# Both pack their results into one archive, $OUT/wshare.tgz: run89 (wshare) still copied 23
# files into $OUT one by one, more than a call brings back (8 came back).
#   FULLSTACK_COMMIT=<rev> bash scripts/gpu/session22.sh qadamw     (carry .whl)
#    Q-AdamW's step a third time (as run84 and run86, BENCHMARKS.md §R.2), with Q-AdamW unchanged
set -u
source scripts/gpu/setup_env.sh
export OMP_NUM_THREADS=1

# ablate_wshare SEED...: per seed the bf16, nvfp4_linear and lora_svd arms, and beside them
# nvfp4_linear with W unquantized, all at once; then every table printed and packed.
ablate_wshare() {
  ABL="python3 scripts/ablation.py --iters 300 --ppl-tokens 65536 --cloze-items 200 --time-budget 420"
  for sd in "$@"; do
    timeout 470 $ABL --arms bf16,nvfp4_linear,lora_svd --jobs 3 --out "/tmp/abl_$sd" \
      --set "train.seed=$sd" >"$OUT/abl_seed$sd.txt" 2>&1 &
    timeout 470 $ABL --arms nvfp4_linear --jobs 1 --out "/tmp/abl_keepw_$sd" \
      --set "train.seed=$sd" "fp4.unquantized_operands=[w]" >"$OUT/abl_keepw_seed$sd.txt" 2>&1 &
  done
  wait
  mkdir -p /tmp/pack
  for d in /tmp/abl_*; do b=$(basename "$d"); mkdir -p "/tmp/pack/$b"
    cp "$d/ablation.md" "$d/ablation.json" "/tmp/pack/$b/" 2>/dev/null
    for a in "$d"/*/; do [ -f "$a/metrics.jsonl" ] && mkdir -p "/tmp/pack/$b/$(basename "$a")" \
      && cp "$a/metrics.jsonl" "/tmp/pack/$b/$(basename "$a")/"; done
    echo "== $d"; grep '^| ' "$d/ablation.md" | grep -v '^| ---'; done
  mv "$OUT"/*.txt /tmp/pack/ && tar -czf "$OUT/wshare.tgz" -C /tmp/pack .
}

case "${1:-wshare}" in
  wshare)
    TAILN=12 run check_partial 120 python3 scripts/gpu/check_partial_nvfp4.py
    ablate_wshare 1234 4321 99
    ;;
  wshare2)
    run check_partial 400 python3 scripts/gpu/check_partial_nvfp4.py > /dev/null &
    ablate_wshare 2024 777 5     # waits for the check too
    tar -xzOf "$OUT/wshare.tgz" ./check_partial.txt
    ;;
  qadamw)
    TAILN=30 run q_adamw_third 330 python3 scripts/bench_q_adamw.py --cpp 1 --steps 10 \
      --fast-div-rows --flat-row --streams-rows
    ;;
esac
