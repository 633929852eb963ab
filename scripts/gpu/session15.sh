#!/usr/bin/env bash
# Device calls of session 15 (one nvidia-h200; carry .whl, made by
# `bash ../shared/tools/device-wheels.sh megatron-core==0.16.1 torchao==0.18.0 pytest-xdist execnet`:
# torchao is the peer of the quantize and Q-AdamW benches, pytest-xdist compiles the tests' Triton
# kernels on 8 processes at once). Each mode is one call.
#   bash scripts/gpu/session15.sh tests   # the fused-linear and two-way GPU tests in full (cold
#       Triton compiles took ~400 s on one process), then the linear bench after §L.1/L.4 and the
#       quantize bench with torchao's NVFP4Tensor.to_nvfp4 beside it
#   bash scripts/gpu/session15.sh lora    # issue 4 (carry data/quickstart too): does the split pay
#       when the BF16 branch follows W (realignment every 50 steps), and how much of NVFP4's gap
#       can the split remove at all (rank 256 of 512)? Three seeds x {bf16, nvfp4_linear,
#       lora_svd realigned every 50, lora_svd rank 256}, 12 runs on the GPU at once; beside them
#       the GPU tests that session 15 fixed (signed zeros of the decoded operands)
#   bash scripts/gpu/session15.sh rank    # issue 4, after `lora`: the rank's dose-response at the
#       default interval: three seeds x {bf16, nvfp4_linear, lora_svd rank 128, lora_svd rank 64},
#       12 runs at once; beside them the same GPU tests, their summary line kept
set -u
source scripts/gpu/setup_env.sh
export OMP_NUM_THREADS=1
case "${1:-tests}" in
  tests)
    TAILN=14 run pytest_gpu 240 python3 -m pytest -q -p no:cacheprovider --tb=short -n 8 \
      tests/fullstack_fp4/linear/test_nvfp4_linear_fused.py \
      tests/fullstack_fp4/nvfp4/test_quantize_two_ways.py tests/fullstack_fp4/nvfp4/test_sr_stream.py
    mkdir -p "$OUT/linear"
    OUT="$OUT/linear" TAILN=10 run linear 220 python3 scripts/bench_nvfp4_linear.py
    OUT="$OUT" TAILN=24 run quantize 70 python3 scripts/bench_nvfp4_quantize.py
    ;;
  lora)
    ABL="python3 scripts/ablation.py --iters 300 --ppl-tokens 65536 --cloze-items 200 --time-budget 440"
    for sd in 1234 4321 99; do
      timeout 470 $ABL --arms bf16,nvfp4_linear,lora_svd --jobs 3 --out "/tmp/abl_r50_$sd" \
        --set "train.seed=$sd" fp4.lora_svd.realign_interval=50 >"$OUT/r50_seed$sd.txt" 2>&1 &
      timeout 470 $ABL --arms lora_svd --jobs 1 --out "/tmp/abl_rank256_$sd" \
        --set "train.seed=$sd" fp4.lora_svd.rank=256 >"$OUT/rank256_seed$sd.txt" 2>&1 &
    done
    TAILN=8 run pytest_gpu 300 python3 -m pytest -q -p no:cacheprovider --tb=line -n 4 \
      tests/fullstack_fp4/nvfp4/test_quantize_two_ways.py tests/fullstack_fp4/optim/test_triton_ns.py
    wait
    for d in /tmp/abl_r50_* /tmp/abl_rank256_*; do b=$(basename "$d")
      cp "$d/ablation.md" "$OUT/$b.md" 2>/dev/null; cp "$d/ablation.json" "$OUT/$b.json" 2>/dev/null
      for a in "$d"/*/; do [ -f "$a/metrics.jsonl" ] && mkdir -p "$OUT/$b/$(basename "$a")" \
        && cp "$a/metrics.jsonl" "$OUT/$b/$(basename "$a")/"; done; done
    for f in "$OUT"/abl_*.md; do echo "== $f"; grep -i 'val\|arm\|gap' "$f" | head -8; done
    ;;
  rank)   # few files come back from a call: keep one table per run and the test log
    ABL="python3 scripts/ablation.py --iters 300 --ppl-tokens 65536 --cloze-items 200 --time-budget 440"
    for sd in 1234 4321 99; do
      timeout 470 $ABL --arms bf16,nvfp4_linear,lora_svd --jobs 3 --out "/tmp/abl_rank128_$sd" \
        --set "train.seed=$sd" fp4.lora_svd.rank=128 >/dev/null 2>&1 &
      timeout 470 $ABL --arms lora_svd --jobs 1 --out "/tmp/abl_rank64_$sd" \
        --set "train.seed=$sd" >/dev/null 2>&1 &
    done
    timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=line -n 4 \
      tests/fullstack_fp4/nvfp4/test_quantize_two_ways.py tests/fullstack_fp4/optim/test_triton_ns.py \
      >"$OUT/pytest_gpu.txt" 2>&1; tail -3 "$OUT/pytest_gpu.txt"
    wait
    for d in /tmp/abl_rank128_* /tmp/abl_rank64_*; do cp "$d/ablation.md" "$OUT/$(basename "$d").md"
      echo "== $d"; grep '^| ' "$d/ablation.md" | grep -v '^| arm\|^| ---'; done
    ;;
esac
