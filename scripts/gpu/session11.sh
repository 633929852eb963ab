#!/usr/bin/env bash
# Session 11's device calls on one H200 (each fits the 600 s limit). Carry .whl (+ data/quickstart
# for the ablation modes). OMP_NUM_THREADS=1: up to nine training processes share 16 cores.
#   bash scripts/gpu/session11.sh ablation   # every arm of issue 8's ablation at once
#       (--jobs 9: the 27.8M-parameter model is host-bound, so the arms share the GPU), then
#       the table; the arms' folders without checkpoints come back as abl_arms.tgz, so arms a
#       later call trains can be tabulated with them (ablation.py --report-only)
#   bash scripts/gpu/session11.sh abl2       # the arm the first call did not finish
#       (full_stack_root), trained from scratch next to the first call's results (carry
#       runs/abl_kept: abl_arms.tgz unpacked), the whole table again; side by side, bf16,
#       nvfp4_linear and lora_svd at a second seed (4321)
#   bash scripts/gpu/session11.sh blocks     # the efficiency table, every arm in ONE process
#       (4 blocks of the 3b preset, seq 4096)
#   bash scripts/gpu/session11.sh extra      # issue 3's linear bench (warm cache from "blocks"),
#       the BF16-grad-buffer arms of the 4-block table, the lean-launch check + host table
#   bash scripts/gpu/session11.sh seed 777   # bf16, nvfp4_linear, lora_svd at one more seed
#       (issue 4: LoRA-SVD's gap against NVFP4's)
#   bash scripts/gpu/session11.sh smoke3b    # every configs/3b_64b arm from its own YAML, 4 blocks,
#       3 steps on random tokens (scripts/smoke_3b_64b.sh); run in session 12 (BENCHMARKS §J.1)
set -u
source scripts/gpu/setup_env.sh
export OMP_NUM_THREADS=1
ALL_ARMS=bf16,nvfp4_linear,lora_svd,q_adamw,root,q_root,q_attn,full_stack,full_stack_root
ABL="python3 scripts/ablation.py --iters 300 --ppl-tokens 65536 --cloze-items 200"
keep_arms() {   # DIR: table, JSON, plot, and one archive of the arms' folders without checkpoints
  cp "$1"/ablation.md "$1"/ablation.json "$1"/ablation.png "$OUT"/ 2>/dev/null
  tar czf "$OUT/abl_arms.tgz" --exclude=checkpoints -C "$(dirname "$1")" "$(basename "$1")"; }
case "${1:-ablation}" in
  ablation)
    TAILN=40 run ablation 520 $ABL --arms $ALL_ARMS --jobs 9 --out /tmp/abl --time-budget 420
    keep_arms /tmp/abl
    ;;
  abl2)
    mkdir -p /tmp/abl && cp -r runs/abl_kept/abl/. /tmp/abl/ && rm -rf /tmp/abl/full_stack_root
    echo "===== abl2 ($(date +%T))"
    timeout 500 $ABL --arms $ALL_ARMS --jobs 9 --out /tmp/abl --time-budget 400 >"$OUT/ablation.txt" 2>&1 &
    timeout 500 $ABL --arms bf16,nvfp4_linear,lora_svd --jobs 3 --out /tmp/abl4321 --time-budget 400 \
      --set train.seed=4321 >"$OUT/ablation_seed4321.txt" 2>&1 &
    wait
    tail -25 "$OUT/ablation.txt"; tail -12 "$OUT/ablation_seed4321.txt"
    keep_arms /tmp/abl
    cp /tmp/abl4321/ablation.md "$OUT/ablation_seed4321.md"; cp /tmp/abl4321/ablation.json "$OUT/ablation_seed4321.json"
    ;;
  blocks)
    TAILN=60 run blocks 330 python3 scripts/bench_blocks.py \
      --arms bf16,nvfp4_linear,lora_svd,q_adamw,muon,q_muon,root,q_root,q_attn,full_stack,full_stack_root \
      --steps 6 --warmup 2 --out "$OUT"
    ;;
  seed)
    TAILN=12 run "ablation_seed$2" 260 $ABL --arms bf16,nvfp4_linear,lora_svd --jobs 3 \
      --out "/tmp/abl$2" --time-budget 220 --set "train.seed=$2"
    cp "/tmp/abl$2/ablation.md" "$OUT/ablation_seed$2.md"; cp "/tmp/abl$2/ablation.json" "$OUT/ablation_seed$2.json"
    ;;
  smoke3b)
    LOGDIR=/tmp/smoke TAILN=12 run smoke3b 560 bash scripts/smoke_3b_64b.sh
    ;;
  extra)
    OUT="$OUT" TAILN=40 run linear 280 python3 scripts/bench_nvfp4_linear.py
    TAILN=8 run blocks_bf16_grads 120 python3 scripts/bench_blocks.py \
      --arms bf16,q_adamw_bf16_grads,full_stack_bf16_grads --steps 6 --warmup 2 --out "$OUT/bf16_grads"
    TAILN=16 run lean 110 python3 scripts/gpu/check_lean_launch.py
    ;;
esac
