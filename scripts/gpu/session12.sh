#!/usr/bin/env bash
# Device calls of session 12 (one nvidia-h200; carry .whl). Each mode is one call.
#   bash scripts/gpu/session12.sh nsgraph   # Newton–Schulz as CUDA graphs (issue 6): every graphed
#       NS and optimizer step checked bit for bit against eager, then timed (bench_newton_schulz.py),
#       and 4 blocks of 3b with the orthogonal arms through the trainer (bench_blocks.py; the
#       trainer's default is optimizer.orthogonal.cuda_graph=true)
#   bash scripts/gpu/session12.sh lean2   # the lean two-term NS checked against the composed one bit
#       for bit and timed (NS shapes and optimizer steps), q_root through the trainer
#   bash scripts/gpu/session12.sh qadamw_regs   # Q-AdamW register caps below 128 (more warps per SM;
#       ncu: 16 warps/SM, issue slots 70% busy): each checked bit for bit, then timed
#   bash scripts/gpu/session12.sh seeds2   # issue 4: bf16 / nvfp4_linear / lora_svd at seeds 2024 and
#       99, both seeds side by side (6 arms on the GPU; carry data/quickstart too)
#   bash scripts/gpu/session12.sh next     # not yet run: what changed after run53 (the graphed NS
#       returns a copy; bench_blocks drops each arm's NS graphs), measured: NS steps, every
#       orthogonal arm's step and optimizer-phase memory alone
#   bash scripts/gpu/session12.sh ncu_qadamw   # Nsight Compute of the fused Q-AdamW kernel (issue 5):
#       where its warps stall (scripts/gpu/ncu_q_adamw.py)
set -u
source scripts/gpu/setup_env.sh
export OMP_NUM_THREADS=1
case "${1:-nsgraph}" in
  nsgraph)
    mkdir -p "$OUT/ns_steps" "$OUT/ns_shapes"
    OUT="$OUT/ns_steps" TAILN=16 run ns_steps 240 python3 scripts/bench_newton_schulz.py --parts steps --iters 12
    TAILN=12 run blocks_orth 200 python3 scripts/bench_blocks.py \
      --arms bf16,root,q_root,muon,q_muon --steps 6 --warmup 2 --out "$OUT/blocks"
    OUT="$OUT/ns_shapes" TAILN=24 run ns_shapes 150 python3 scripts/bench_newton_schulz.py --parts ns --iters 10
    ;;
  lean2)
    mkdir -p "$OUT/ns_shapes" "$OUT/ns_steps"
    OUT="$OUT/ns_shapes" TAILN=30 run ns_shapes 200 python3 scripts/bench_newton_schulz.py --parts ns --iters 10
    OUT="$OUT/ns_steps" TAILN=14 run ns_steps 200 python3 scripts/bench_newton_schulz.py --parts steps --iters 12
    TAILN=8 run blocks_orth 150 python3 scripts/bench_blocks.py \
      --arms bf16,root,q_root --steps 6 --warmup 2 --out "$OUT/blocks"
    ;;
  seeds2)
    ABL="python3 scripts/ablation.py --iters 300 --ppl-tokens 65536 --cloze-items 200"
    for sd in 2024 99; do
      timeout 350 $ABL --arms bf16,nvfp4_linear,lora_svd --jobs 3 --out "/tmp/abl$sd" \
        --time-budget 320 --set "train.seed=$sd" >"$OUT/ablation_seed$sd.txt" 2>&1 &
    done
    wait
    for sd in 2024 99; do tail -8 "$OUT/ablation_seed$sd.txt"
      cp "/tmp/abl$sd/ablation.md" "$OUT/ablation_seed$sd.md"; cp "/tmp/abl$sd/ablation.json" "$OUT/ablation_seed$sd.json"; done
    ;;
  next)
    mkdir -p "$OUT/ns_steps"
    OUT="$OUT/ns_steps" TAILN=14 run ns_steps 200 python3 scripts/bench_newton_schulz.py --parts steps --iters 12
    TAILN=10 run blocks_orth 300 python3 scripts/bench_blocks.py \
      --arms bf16,root,q_root,muon,q_muon,full_stack_root --steps 6 --warmup 2 --out "$OUT/blocks"
    ;;
  qadamw_regs)
    OUT="$OUT" TAILN=20 run qadamw_regs 540 python3 scripts/bench_q_adamw.py --sweep \
      --sweep-configs '1,128,1;1,96,1;1,80,1' --steps 10
    ;;
  ncu_qadamw)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    echo "ncu: ${NCU:-none}"
    TAILN=400 run ncu_qadamw 400 "$NCU" --clock-control none --kernel-name regex:q_adamw \
      --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section SchedulerStats --section WarpStateStats \
      --section InstructionStats --section SourceCounters --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis python3 scripts/gpu/ncu_q_adamw.py
    ;;
esac
