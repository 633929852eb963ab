#!/usr/bin/env bash
# One device-tool call: GPU kernel tests + every benchmark, logs and JSON under $OUT.
#   usage (device tool, carry .whl):  bash scripts/gpu/session.sh [blocks-arms]
# The GPU machine has no network: megatron-core comes as a cp312 wheel in .whl/
# (../shared/tools/device-wheels.sh megatron-core==0.16.1).
set -u
ARMS=${1:-bf16,nvfp4_linear,q_attn}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
LOG=$OUT/all.log
step() { echo "===== $1 ($(date +%T))" | tee -a "$LOG"; shift; "$@" 2>&1 | grep -v -i "warn" | tee -a "$LOG" | tail -40; }
step env bash -c 'nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; git rev-parse HEAD 2>/dev/null; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"'
step gpu-tests timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/fullstack_fp4 -k "triton or kernel" --maxfail=3
step nvfp4-quantize timeout 120 python3 scripts/bench_nvfp4_quantize.py
step q-attn timeout 90 python3 scripts/bench_q_attn.py
step newton-schulz timeout 90 python3 scripts/bench_newton_schulz.py
step q-adamw timeout 90 python3 scripts/bench_q_adamw.py
step blocks timeout 200 python3 scripts/bench_blocks.py --arms "$ARMS" --steps 8 --out /tmp/blocks
cp /tmp/blocks/bench_blocks.json /tmp/blocks/bench_blocks.png "$OUT"/ 2>/dev/null
ls -la "$OUT"
