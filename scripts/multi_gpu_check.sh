#!/usr/bin/env bash
# Multi-GPU check on one 2- or 4-GPU machine, within a time budget; docs/multi-gpu.md explains it.
#   bash scripts/multi_gpu_check.sh               # 2 or 4 GPUs, budget MG_BUDGET=540 s
#   bash scripts/multi_gpu_check.sh --cpu-smoke   # same flow on CPU: gloo, tiny model, mock data, q_adamw/root arms
# MG_PARTS=refs runs only the 1-GPU references and repeats; MG_PARTS=1,4,5 (a comma list) runs the references and
# those parts only. MG_SKIP=name,name skips single runs (e.g. ones measured in an earlier call).
# MG_T_RUN: time limit of one multi-GPU training run (default 130 s; a cold Triton cache compiles the TP=2
# shapes first, which can take most of it). MG_EARLIER=summary.json of an earlier call (same commit):
# its runs (losses stored in it) join this call's summary, so references need not be rerun.
# Writes $OUT/multi_gpu_check.log, $OUT/summary.md, $OUT/summary.json (OUT defaults to runs/multi_gpu_check).
# Every run has a `timeout`; a failed run is recorded and the script goes on; runs that would not fit the
# remaining budget are recorded as skipped. With 4 GPUs independent runs go side by side (two pairs).
# Parts, in priority order (ARM1 = full_stack, ARM2 = full_stack_root; 50 steps, same global batch):
#  1. 1-GPU references and repeats (run-to-run noise); ARM1 at TP=2 (checkpoints at 25) and DP=2 (distributed optimizer, else plain DDP);
#  2. checkpoint TP=2 @25 -> resume at DP=2 and on 1 GPU: bf16 (DDP and dist-opt) and ARM1;
#  3. 4-block 3b benchmark: 1 GPU vs TP=2 (benchmarks/bench_blocks_tp.py), tokens/s per GPU;
#  4. ARM2 at TP=2 / DP=2 (DDP and the distributed optimizer);
#  5. PP=2 x DP=2 (4 GPUs, or 4 gloo processes in the smoke): ARM1, ARM2, bf16 with the dist-opt;
#  6. bf16 DP=2 with the distributed optimizer.
set -u
SMOKE=0
[ "${1:-}" = "--cpu-smoke" ] && SMOKE=1
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/runs/multi_gpu_check}
mkdir -p "$OUT"
W=${MG_WORK:-/tmp/multi_gpu_check.$$}
rm -rf "$W"; mkdir -p "$W"
LOG=$OUT/multi_gpu_check.log
MAN=$W/manifest.jsonl
: > "$LOG"; : > "$MAN"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore NCCL_NVLS_ENABLE=0 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
say() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$LOG"; }

if [ $SMOKE = 1 ]; then
  PY=${PY:-$REPO/.venv/bin/python}; [ -x "$PY" ] || PY=python3
  export PYTHONPATH=$REPO OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""
  BUDGET=${MG_BUDGET:-900}
  ITERS=4; HALF=2
  printf 'model:\n  preset: tiny\n' > "$W/tiny.yaml"
  CFG=$W/tiny.yaml
  COMMON=(model.preset=tiny model.seq_length=32 model.vocab_size=256 data.mock=true train.global_batch_size=4
          train.micro_batch_size=2 train.precision=fp32 optimizer.lr=3e-3 optimizer.min_lr=3e-4 optimizer.warmup_iters=1)
  ARM1=q_adamw; ARM2=root      # NVFP4 linears on CPU are slow: bf16-linear arms stand in for full_stack(_root)
  BENCH_SET=(--set model.preset=tiny model.num_layers=2 model.seq_length=32 model.vocab_size=256
             train.global_batch_size=4 train.micro_batch_size=2 train.precision=fp32)
  T_REF=200; T_RUN=200; T_RES=200; T_BENCH=200
else
  PY=python3
  # up to five processes share the host: torch's CPU work (--cpu-init draws, the LoRA-SVD factor SVDs,
  # Triton compiles) with every process on every core oversubscribes it
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}   # the project's requirements installed in python3
  BUDGET=${MG_BUDGET:-540}
  ITERS=${MG_ITERS:-50}; HALF=$((ITERS / 2))
  CFG=configs/ablation/base.yaml
  D=data/quickstart
  # base.yaml's model at seq 512, global batch 16 (8,192 tokens/step; base: 64), micro 8: 2 micro-batches on
  # 1 GPU and TP=2, 1 per rank at DP=2. warmup 10 of 50 steps so the loss moves.
  COMMON=(model.seq_length=512 train.global_batch_size=16 train.micro_batch_size=8 optimizer.warmup_iters=10
          "data.path=[$D/train_text_document]" "data.valid_path=[$D/valid_text_document]" 'data.split="100,0,0"'
          "data.tokenizer=$D/tokenizer.model")
  ARM1=full_stack; ARM2=full_stack_root
  BENCH_SET=()
  T_REF=${MG_T_REF:-170}; T_RUN=${MG_T_RUN:-130}; T_RES=100; T_BENCH=130
fi
CPU_INIT=${MG_CPU_INIT:-1}   # 1: every run draws its initial weights on CPU (same weights at TP=1 and TP=2)
RESERVE=25                   # seconds kept for the summary
# a port per run name: runs started side by side (in subshells) never share one
port_of() { echo $((20000 + $(printf '%s' "$1" | cksum | cut -d' ' -f1) % 20000)); }
arm_set() { "$PY" -c "import sys; sys.path.insert(0,'benchmarks'); from bench_blocks import ARMS; print(' '.join(ARMS['$1']))"; }
A1=$(arm_set $ARM1); A2=$(arm_set $ARM2)
say "mode smoke=$SMOKE budget=${BUDGET}s iters=$ITERS arms=$ARM1($A1),$ARM2($A2) cpu_init=$CPU_INIT work=$W"
if [ $SMOKE = 0 ]; then
  timeout 30 nvidia-smi --query-gpu=index,name,memory.total --format=csv 2>&1 | tee -a "$LOG"
fi
timeout 60 "$PY" -c "import torch, megatron.core; print('torch', torch.__version__, 'mcore', megatron.core.__version__, 'gpus', torch.cuda.device_count())" 2>&1 | tail -1 | tee -a "$LOG"

# ---------------------------------------------------------------------------- one run
# record NAME FIELDS...: one manifest line (JSON built by python, no quoting trouble)
record() { "$PY" -c 'import json,sys; d=dict(a.split("=",1) for a in sys.argv[2:]);
d={k:(int(v) if k in ("rc","wall_s") and v.lstrip("-").isdigit() else (None if v=="" else v)) for k,v in d.items()}
open(sys.argv[1],"a").write(json.dumps(d)+"\n")' "$MAN" "$@"; }

# train NAME NPROC GPUS LIMIT PART ARM LAYOUT KIND REF REF2 -- overrides...   (run in the foreground)
train() {
  local name=$1 nproc=$2 gpus=$3 limit=$4 part=$5 arm=$6 layout=$7 kind=$8 ref=$9 ref2=${10}; shift 11
  local left=$((BUDGET - SECONDS - RESERVE))
  local rd=$W/$name
  if [[ ",${MG_SKIP:-}," == *",$name,"* ]]; then
    say "SKIP $name (MG_SKIP)"
    record name=$name part=$part arm=$arm layout="$layout" kind=$kind ref=$ref ref2=$ref2 note="skipped: MG_SKIP"
    return 0
  fi
  if [ $left -lt 20 ]; then
    say "SKIP $name (budget: ${left}s left)"
    record name=$name part=$part arm=$arm layout="$layout" kind=$kind ref=$ref ref2=$ref2 note="skipped: time budget"
    return 0
  fi
  [ $limit -gt $left ] && limit=$left
  mkdir -p "$rd"
  local init=(); [ "$CPU_INIT" = 1 ] && init=(--cpu-init)
  local launcher=("$PY")
  if [ $nproc -gt 1 ]; then
    launcher=("$PY" -m torch.distributed.run --nproc-per-node $nproc --master-addr 127.0.0.1 --master-port $(port_of $name))
  fi
  # one process: SIGABRT at the limit, so that faulthandler prints where it was (a run that made no step)
  local sig=TERM; [ $nproc = 1 ] && sig=ABRT
  local cmd=(timeout -s $sig -k 10 $limit env CUDA_VISIBLE_DEVICES=$gpus "${launcher[@]}" scripts/multi_gpu_compare.py pretrain
             "${init[@]}" -- --config "$CFG" "${COMMON[@]}" train.iters=$ITERS train.log_interval=1
             train.eval_interval=$HALF train.eval_iters=2 logging.tensorboard=false logging.dir=$rd/log
             "$@")
  [ $SMOKE = 0 ] && cmd+=(data.cache_dir=${CACHE:-$rd/cache})
  say "RUN $name [$layout, limit ${limit}s]: ${cmd[*]:5}"
  local t0=$SECONDS
  PYTHONFAULTHANDLER=1 "${cmd[@]}" > "$rd/out.txt" 2>&1
  local rc=$? wall=$((SECONDS - t0))
  grep -v -i "warn" "$rd/out.txt" | grep -E "error|Error|iteration +($HALF|$ITERS)/|checkpoint|stopping|Traceback" \
    | tail -6 | sed "s/^/    $name| /" | tee -a "$LOG"
  say "DONE $name rc=$rc wall=${wall}s"
  record name=$name part=$part arm=$arm layout="$layout" kind=$kind ref=$ref ref2=$ref2 rc=$rc wall_s=$wall \
    logdir=$rd/log log=$rd/out.txt
  # keep the run's full output in the one log file only when it failed (tail)
  [ $rc = 0 ] || { echo "    --- tail of $name/out.txt" >> "$LOG"; grep -v -i warn "$rd/out.txt" | tail -25 >> "$LOG"; }
  return 0
}
# bg: run `train` in the background (1-GPU runs side by side on different GPUs)
bg() { train "$@" & }

NGPU=0
[ $SMOKE = 0 ] && NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
# GPU slots. With 4 GPUs, independent runs go side by side: 1-GPU runs on G0..G3, 2-GPU runs on the
# pairs PA and PB, PP=2 x DP=2 on all four. With 2 GPUs everything on PB runs after PA (same GPUs).
G0=0; G1=1; G2=0; G3=1; PA=0,1; PB=0,1; QUAD=""
if [ "$NGPU" -ge 4 ]; then G2=2; G3=3; PB=2,3; QUAD=0,1,2,3; fi
if [ "$NGPU" = 1 ]; then G1=0; G3=0; fi   # MG_PARTS=refs on one GPU: the 1-GPU runs share it
[ $SMOKE = 1 ] && { G0=""; G1=""; G2=""; G3=""; PA=""; PB=""; QUAD=""; }
# par: side by side when the slots differ (4 GPUs); one after another otherwise
par() { if [ "$NGPU" -ge 4 ]; then train "$@" & else train "$@"; fi; }
# part N: is it selected? (MG_PARTS unset or "all": every part; "refs": none; else a comma list)
part() { case "${MG_PARTS:-all}" in all) return 0;; refs) return 1;; *) [[ ",$MG_PARTS," == *",$1,"* ]];; esac; }
say "GPUs: $NGPU (pairs $PA | $PB${QUAD:+, quad $QUAD})"
CK_ARM1=$W/${ARM1}_tp2/ckpt; CK_BF=$W/bf16_tp2/ckpt
SAVE="checkpoint.save_interval=$HALF checkpoint.keep_last=2"
NOSAVE="checkpoint.save_dir=null checkpoint.save_interval=null checkpoint.save_on_exit=false checkpoint.load=none"
RESUME="checkpoint.save_dir=null checkpoint.save_interval=null checkpoint.save_on_exit=false"
DISTOPT=parallel.use_distributed_optimizer=true

# ---------------------------------------------------------------------------- part 1 (+ the 1-GPU references)
say "== part 1: 1-GPU references ($ARM1, $ARM2, bf16 side by side), then $ARM1 TP=2 / DP=2"
bg ${ARM1}_1gpu 1 "$G0" $T_REF 1 $ARM1 "1 GPU" train "" "" -- $A1 $NOSAVE
bg ${ARM2}_1gpu 1 "$G1" $T_REF 1 $ARM2 "1 GPU" train "" "" -- $A2 $NOSAVE
bg bf16_1gpu 1 "$G2" $T_REF 1 bf16 "1 GPU" train "" "" -- $NOSAVE
# controls: the same 1-GPU runs again. GPU kernels (atomics in the embedding backward, split-K
# GEMMs) are not bitwise deterministic, so this pair shows the run-to-run noise the other layouts
# are judged against.
bg bf16_1gpu_repeat 1 "$G3" $T_REF 0 bf16 "1 GPU (repeat)" train bf16_1gpu "" -- $NOSAVE
bg ${ARM1}_1gpu_repeat 1 "$G3" $T_REF 0 $ARM1 "1 GPU (repeat)" train ${ARM1}_1gpu "" -- $A1 $NOSAVE
wait
if [ $SMOKE = 0 ] && [ -d "$W/bf16_1gpu/cache" ]; then CACHE=$W/cache; cp -r "$W/bf16_1gpu/cache" "$CACHE"; fi
# (bf16_1gpu skipped with MG_SKIP, e.g. measured by an earlier call: nothing to judge by here)
if [ "$CPU_INIT" = 1 ] && [[ ",${MG_SKIP:-}," != *",bf16_1gpu,"* ]] && ! grep -q '"name": "bf16_1gpu".*"rc": 0' "$MAN"; then
  say "bf16_1gpu failed with --cpu-init: the rest runs with the trainer's own initialisation (MG_CPU_INIT=0)"
  CPU_INIT=0
fi
# MG_PARTS=refs: only the 1-GPU references and controls above (e.g. one GPU of a shared machine)
if part 1; then
par ${ARM1}_tp2 2 "$PA" $T_RUN 1 $ARM1 "TP=2" train ${ARM1}_1gpu "" -- $A1 parallel.tensor_model_parallel_size=2 \
  checkpoint.save_dir=$CK_ARM1 checkpoint.load=none $SAVE
# the issue asks for DP=2 with the distributed optimizer; a recipe that refuses it says so in one line,
# and the plain-DDP run beside it still compares the numbers
par ${ARM1}_dp2_distopt 2 "$PB" $T_RUN 1 $ARM1 "DP=2 (dist-opt)" train ${ARM1}_1gpu "" -- $A1 $DISTOPT $NOSAVE
wait
par ${ARM1}_dp2 2 "$PA" $T_RUN 1 $ARM1 "DP=2 (DDP)" train ${ARM1}_1gpu "" -- $A1 $NOSAVE
fi

# ---------------------------------------------------------------------------- part 2
if part 2; then
say "== part 2: save at TP=2 (iter $HALF), resume at DP=2 and on 1 GPU"
par bf16_tp2 2 "$PB" $T_RUN 2 bf16 "TP=2" train bf16_1gpu "" -- parallel.tensor_model_parallel_size=2 \
  checkpoint.save_dir=$CK_BF checkpoint.load=none $SAVE
wait
CKB=$CK_BF/$(printf 'iter_%07d' $HALF); CKA=$CK_ARM1/$(printf 'iter_%07d' $HALF)
par bf16_resume_dp2 2 "$PA" $T_RES 2 bf16 "TP=2 -> DP=2 (DDP)" resume bf16_tp2 bf16_1gpu -- checkpoint.load=$CKB $RESUME
par ${ARM1}_resume_dp2 2 "$PB" $T_RES 2 $ARM1 "TP=2 -> DP=2 (DDP)" resume ${ARM1}_tp2 ${ARM1}_1gpu -- $A1 \
  checkpoint.load=$CKA $RESUME
wait
bg bf16_resume_1gpu 1 "$G0" $T_RES 2 bf16 "TP=2 -> 1 GPU" resume bf16_tp2 bf16_1gpu -- checkpoint.load=$CKB $RESUME
bg ${ARM1}_resume_1gpu 1 "$G1" $T_RES 2 $ARM1 "TP=2 -> 1 GPU" resume ${ARM1}_tp2 ${ARM1}_1gpu -- $A1 \
  checkpoint.load=$CKA $RESUME
par bf16_resume_dp2_distopt 2 "$PB" $T_RES 2 bf16 "TP=2 -> DP=2 (dist-opt)" resume bf16_tp2 bf16_1gpu -- \
  $DISTOPT checkpoint.load=$CKB $RESUME
wait
par ${ARM1}_resume_dp2_distopt 2 "$PA" $T_RES 2 $ARM1 "TP=2 -> DP=2 (dist-opt)" resume ${ARM1}_tp2 ${ARM1}_1gpu -- \
  $A1 $DISTOPT checkpoint.load=$CKA $RESUME
wait

# ---------------------------------------------------------------------------- part 3
fi
say "== part 3: 4-block 3b benchmark, 1 GPU vs TP=2"
bench() {  # bench NAME NPROC GPUS LIMIT
  local name=$1 nproc=$2 gpus=$3 limit=$4 left=$((BUDGET - SECONDS - RESERVE))
  if [ $left -lt 30 ]; then say "SKIP $name (budget)"; record name=$name part=3 kind=bench note="skipped: time budget"; return 0; fi
  [ $limit -gt $left ] && limit=$left
  local launcher=("$PY")
  [ $nproc -gt 1 ] && launcher=("$PY" -m torch.distributed.run --nproc-per-node $nproc --master-addr 127.0.0.1 --master-port $(port_of $name))
  mkdir -p "$W/$name"
  say "RUN $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout -k 10 $limit env CUDA_VISIBLE_DEVICES=$gpus "${launcher[@]}" benchmarks/bench_blocks_tp.py --arms bf16,$ARM1 \
    --steps 5 --warmup 2 --out "$W/$name" "${BENCH_SET[@]}" > "$W/$name/out.txt" 2>&1
  local rc=$?
  grep '^{' "$W/$name/out.txt" | sed "s/^/    $name| /" | tee -a "$LOG"
  [ $rc = 0 ] || { grep -v -i warn "$W/$name/out.txt" | tail -15 >> "$LOG"; }
  say "DONE $name rc=$rc wall=$((SECONDS - t0))s"
  record name=$name part=3 arm=bf16,$ARM1 layout="TP=$nproc" kind=bench rc=$rc wall_s=$((SECONDS - t0)) \
    json=$W/$name/bench_tp$nproc.json log=$W/$name/out.txt
}
if ! part 3; then :
elif [ "$NGPU" -ge 4 ]; then
  bench bench_1gpu 1 "$G0" $T_BENCH & bench bench_tp2 2 "$PB" $T_BENCH & wait
else
  bench bench_1gpu 1 "$G0" $T_BENCH
  bench bench_tp2 2 "$PA" $T_BENCH
fi

# ---------------------------------------------------------------------------- part 4
if part 4; then
say "== part 4: $ARM2 TP=2 / DP=2"
par ${ARM2}_tp2 2 "$PA" $T_RUN 4 $ARM2 "TP=2" train ${ARM2}_1gpu "" -- $A2 parallel.tensor_model_parallel_size=2 $NOSAVE
par ${ARM2}_dp2 2 "$PB" $T_RUN 4 $ARM2 "DP=2 (DDP)" train ${ARM2}_1gpu "" -- $A2 $NOSAVE
wait
par ${ARM2}_dp2_distopt 2 "$PA" $T_RUN 4 $ARM2 "DP=2 (dist-opt)" train ${ARM2}_1gpu "" -- $A2 $DISTOPT $NOSAVE
wait

fi
# ---------------------------------------------------------------------------- part 5 (4 GPUs; PP=2 alone on 2)
if ! part 5; then :
elif [ -n "$QUAD" ] || [ $SMOKE = 1 ]; then
  say "== part 5: PP=2 x DP=2 on 4 ranks ($ARM1, $ARM2, bf16 with the distributed optimizer)"
  train ${ARM1}_pp2dp2 4 "$QUAD" $T_RUN 5 $ARM1 "PP=2 x DP=2 (DDP)" train ${ARM1}_1gpu "" -- $A1 \
    parallel.pipeline_model_parallel_size=2 $NOSAVE
  train ${ARM2}_pp2dp2 4 "$QUAD" $T_RUN 5 $ARM2 "PP=2 x DP=2 (DDP)" train ${ARM2}_1gpu "" -- $A2 \
    parallel.pipeline_model_parallel_size=2 $NOSAVE
  train bf16_pp2dp2_distopt 4 "$QUAD" $T_RUN 5 bf16 "PP=2 x DP=2 (dist-opt)" train bf16_1gpu "" -- \
    parallel.pipeline_model_parallel_size=2 $DISTOPT $NOSAVE
elif [ "$NGPU" -ge 2 ]; then
  say "== part 5: PP=2 on 2 GPUs ($ARM2, $ARM1); PP=2 x DP=2 needs 4"
  train ${ARM2}_pp2 2 "$PA" $T_RUN 5 $ARM2 "PP=2" train ${ARM2}_1gpu "" -- $A2 \
    parallel.pipeline_model_parallel_size=2 $NOSAVE
  train ${ARM1}_pp2 2 "$PA" $T_RUN 5 $ARM1 "PP=2" train ${ARM1}_1gpu "" -- $A1 \
    parallel.pipeline_model_parallel_size=2 $NOSAVE
  record name=pp2dp2 part=5 kind=train note="PP=2 x DP=2 skipped: needs 4 GPUs"
fi

# ---------------------------------------------------------------------------- part 6 (extras)
if part 6; then
say "== part 6: bf16 DP=2 with the distributed optimizer"
par bf16_dp2_distopt 2 "$PA" $T_RUN 6 bf16 "DP=2 (dist-opt)" train bf16_1gpu "" -- $DISTOPT $NOSAVE
wait
fi

# ---------------------------------------------------------------------------- summary
say "== summary (manifest $MAN)"
EARLIER=(); [ -n "${MG_EARLIER:-}" ] && EARLIER=(--earlier "$MG_EARLIER")
timeout 60 "$PY" scripts/multi_gpu_compare.py summary --manifest "$MAN" --md "$OUT/summary.md" --json "$OUT/summary.json" \
  "${EARLIER[@]}" 2>&1 | tee -a "$LOG"
say "finished in ${SECONDS}s; files: $(ls "$OUT" | tr '\n' ' ')"
