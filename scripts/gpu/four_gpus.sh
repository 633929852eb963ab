#!/usr/bin/env bash
# One call on a 4-GPU machine (nvidia-h200-x4), four jobs side by side, one GPU each (on a 2-GPU
# machine: GPU 0 as below, GPU 1 trains all ablation arms, $ABL3 then $ABL1):
#   GPU 0: the 4-block 3b efficiency table for every arm (with the telemetry overhead), then the
#          kernel benchmarks ($BENCHES: each a "script args..." entry, '|'-separated);
#   GPU 1-2 (and 3 if $ABL2 is set and MG_SNAP is not): the convergence ablation, arms split over
#          the GPUs (GPU 1 $ABL1, GPU 2 $ABL3, GPU 3 $ABL2), all
#          with telemetry on (logging.quant_stats_interval=$QSI), so every arm also gives its
#          per-layer quantization heat map; at the end one table over all arms (--report-only).
#   bash scripts/gpu/four_gpus.sh
#   GPU 3 with MG_SNAP=DIR: the 1-GPU references and repeats of scripts/multi_gpu_check.sh
#          (MG_PARTS=refs) run from DIR, a copy of an older commit (that of an earlier multi-GPU run)
#          whose layouts they complete; then $G3_BENCHES on GPU 3.
# BENCHES_FIRST=1: GPU 0 runs $BENCHES before the efficiency table. ABL0 (optional): arms GPU 0 trains after its benchmarks, in the time left.
# Carry .whl and data/quickstart. Everything comes back as $OUT/results.tgz + $OUT/log.txt (the
# device tool returns at most 8 files). FULLSTACK_COMMIT names the commit (no .git there).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
R=/tmp/results; mkdir -p $R/g0 $R/g3 $R/abl $R/abl_g0 $R/abl_g1 $R/abl_g2 $R/abl_g3
BUDGET=${BUDGET:-500}                 # seconds of training per ablation GPU
ITERS=${ITERS:-300}
QSI=${QSI:-25}
ARMS=${ARMS:-bf16,nvfp4_linear,lora_svd,q_adamw,muon,q_muon,root,q_root,q_attn,full_stack,full_stack_root}
ABL1=${ABL1:-q_root,full_stack_root}
ABL2=${ABL2:-}
ABL3=${ABL3:-bf16,nvfp4_linear,lora_svd,q_adamw,q_attn,full_stack}
BENCHES=${BENCHES:-"bench_nvfp4_quantize.py|bench_newton_schulz.py|bench_q_adamw.py --cpp 1"}
BLOCKS_TIMEOUT=${BLOCKS_TIMEOUT:-330}
BENCH_QSI=${BENCH_QSI:-100}           # telemetry interval of the overhead measurement (target: <= 2% at 100)
t0=$SECONDS
g0() {
  export CUDA_VISIBLE_DEVICES=0
  # BENCHES_FIRST=1: the kernel benchmarks (each checks its kernels against the reference first)
  # before the efficiency table, e.g. when the kernels changed since the last GPU run
  [ "${BENCHES_FIRST:-0}" = 1 ] && benches $R/g0 "$BENCHES"
  local bt=$BLOCKS_TIMEOUT left=$((BUDGET + 60 - (SECONDS - t0)))
  [ $left -lt $bt ] && bt=$left
  [ $bt -lt 30 ] && bt=1   # no time left: the table is skipped (timeout 1)
  timeout "$bt" python3 scripts/bench_blocks.py --arms "$ARMS" --steps 6 --warmup 2 \
    --quant-stats-interval "$BENCH_QSI" --out $R/g0
  [ "${BENCHES_FIRST:-0}" = 1 ] || benches $R/g0 "$BENCHES"
  # $ABL0: ablation arms GPU 0 trains after its benchmarks, in the time left of BUDGET + 60
  if [ -n "${ABL0:-}" ]; then
    local left=$((BUDGET + 60 - (SECONDS - t0) - 40))
    [ $left -ge 60 ] && abl 0 "$ABL0" $left || echo "===== ablation $ABL0 on GPU 0: skipped (time)"
  fi
}
benches() {  # benches OUTDIR LIST: each '|'-separated "script args..." entry, while time is left
  local out=$1 b left
  IFS='|' read -ra B <<< "$2"
  for b in "${B[@]}"; do
    left=$((BUDGET + 60 - (SECONDS - t0)))
    [ $left -lt 20 ] && { echo "===== $b: skipped (time)"; continue; }
    echo "===== $b ($(date +%T), ${left}s left)"; OUT=$out eval "timeout $left python3 scripts/$b"
  done
}
abl() {  # abl GPU ARMS [BUDGET]
  export CUDA_VISIBLE_DEVICES=$1
  local budget=${3:-$BUDGET}
  timeout $((budget + 90)) python3 scripts/ablation.py --arms "$2" --iters "$ITERS" --time-budget "$budget" \
    --out $R/abl_g$1 --ppl-tokens 65536 --cloze-items 200 \
    --set logging.quant_stats_interval=$QSI data.cache_dir=/tmp/cache_g$1
}
mg_refs() {
  (cd "$MG_SNAP" && ln -sfn "$OLDPWD/.whl" .whl && mkdir -p data && ln -sfn "$OLDPWD/data/quickstart" data/quickstart \
    && CUDA_VISIBLE_DEVICES=3 MG_NO_INSTALL=1 MG_PARTS=refs MG_T_REF=$((BUDGET + 30)) MG_BUDGET=$((BUDGET + 60)) \
       MG_WORK=/tmp/mg_refs OUT=$R/mg_refs bash scripts/multi_gpu_check.sh)
  mkdir -p $R/mg_refs/runs
  for d in /tmp/mg_refs/*/log; do n=$(basename "$(dirname "$d")"); cp "$d/metrics.jsonl" "$R/mg_refs/runs/$n.jsonl"; done
  g3_after
}
g3_after() {  # $G3_BENCHES ('|'-separated "script args...") on GPU 3 after the references, time permitting
  export CUDA_VISIBLE_DEVICES=3
  benches $R/g3 "${G3_BENCHES:-}"
}
NGPU=$(nvidia-smi -L | grep -c GPU)
g0 > $R/g0/log.txt 2>&1 &
if [ "$NGPU" -lt 4 ]; then   # 2 GPUs: GPU 1 trains every ablation arm in order (time-boxed); no GPU 2-3 jobs
  abl 1 "$ABL3,$ABL1" > $R/abl_g1/log.txt 2>&1 &
  MG_SNAP=""; ABL2=""
else
  abl 1 "$ABL1" > $R/abl_g1/log.txt 2>&1 &
  abl 2 "$ABL3" > $R/abl_g2/log.txt 2>&1 &
fi
if [ "$NGPU" -lt 4 ]; then :
elif [ -n "${MG_SNAP:-}" ]; then
  mg_refs > $R/mg_refs.log 2>&1 &
elif [ -n "$ABL2" ]; then
  abl 3 "$ABL2" > $R/abl_g3/log.txt 2>&1 &
fi
wait
for d in $R/abl_g*/*/; do mv "$d" $R/abl/; done   # one --out per GPU while training (no shared temp files)
ALL=$(echo "$ABL3,$ABL1,${ABL2:-},${ABL0:-}" | tr ',' '\n' | awk 'NF && !s[$0]++' | paste -sd,)
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 scripts/ablation.py --arms "$ALL" --iters "$ITERS" --report-only \
  --out $R/abl --ppl-tokens 65536 --cloze-items 200 > $R/abl/log_report.txt 2>&1
for a in ${ALL//,/ }; do   # one heat map per arm that logged statistics
  [ -f $R/abl/$a/metrics.jsonl ] && timeout 60 python3 scripts/quant_heatmap.py $R/abl/$a/metrics.jsonl \
    --out $R/abl/heatmap_$a.png >> $R/abl/log_heatmaps.txt 2>&1
done
{
  grep -v -i warn $R/g0/log.txt | grep -E "^\||=====|error|Error|Telemetry" | head -150
  echo "-------- ablation"; cat $R/abl/ablation.md 2>/dev/null; tail -4 $R/abl_g*/log.txt
  echo "-------- multi-GPU references"; sed -n '/## Runs/,/## 4-block/p' $R/mg_refs/summary.md 2>/dev/null
  echo "-------- GPU 3 benches"; grep -v -i warn $R/mg_refs.log 2>/dev/null | grep -E "^\||=====|error|Error" | head -60
} > "$OUT/log.txt"
rm -rf $R/abl/*/checkpoints $R/g0/*.tmp; find $R -name "*.pt" -size +5M -delete   # big dumps stay there
tar czf "$OUT/results.tgz" -C /tmp results
cat "$OUT/log.txt"
