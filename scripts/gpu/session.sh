#!/usr/bin/env bash
# One device-tool call, logs and JSON under $OUT (the device tool brings $OUT back).
#   bash scripts/gpu/session.sh kernels            # GPU kernel tests + kernel benchmarks
#   bash scripts/gpu/session.sh blocks ARMS        # 4-block 3b efficiency table for the arms
#   bash scripts/gpu/session.sh ablation ARMS ITERS  # small-model convergence ablation
# The GPU machine has no network: megatron-core comes as a cp312 wheel in .whl/
# (../shared/tools/device-wheels.sh megatron-core==0.16.1); carry .whl (and data/quickstart
# for the ablation).
set -u
MODE=${1:-kernels}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
LOG=$OUT/all.log
step() { echo "===== $1 ($(date +%T))" | tee -a "$LOG"; shift; "$@" 2>&1 | grep -v -i "warn" | tee -a "$LOG" | tail -40; }
step env bash -c 'nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"'
case "$MODE" in
  kernels)
    step gpu-tests timeout 200 python3 -m pytest -q -p no:cacheprovider tests/fullstack_fp4 -k "triton or kernel" --maxfail=5
    step nvfp4-quantize timeout 90 python3 scripts/bench_nvfp4_quantize.py
    step q-attn timeout 80 python3 scripts/bench_q_attn.py
    step newton-schulz timeout 100 python3 scripts/bench_newton_schulz.py
    step q-adamw timeout 150 python3 scripts/bench_q_adamw.py --cpp 1
    ;;
  blocks)
    step blocks timeout 560 python3 scripts/bench_blocks.py --arms "${2:-bf16}" --steps 8 --out /tmp/blocks
    cp /tmp/blocks/bench_blocks.json /tmp/blocks/bench_blocks.png /tmp/blocks/bench_blocks.md "$OUT"/ 2>/dev/null
    ;;
  ablation)
    step ablation timeout 560 python3 scripts/ablation.py --arms "${2:-bf16,nvfp4_linear}" --iters "${3:-300}" --out /tmp/ablation
    cp /tmp/ablation/ablation.json /tmp/ablation/ablation.md /tmp/ablation/*.png "$OUT"/ 2>/dev/null
    ;;
esac
ls -la "$OUT"
