#!/usr/bin/env bash
# Device calls of session 23 (one nvidia-h200): Q-AdamW's codec version 2 (v: the "4" rule,
# 64-entry tile means; codecs.py) on the GPU (issue 5).
#   FULLSTACK_COMMIT=<rev> bash scripts/gpu/session23.sh qadamw        (carry .whl)
# 1. Q-AdamW's five test files and the model-param-write GPU test (kernel against the reference
#    bit for bit on the GPU, multi-tensor and stream launches, resume);
# 2. the step against torch fused AdamW and torchao, same run (as runs 84/86/91, BENCHMARKS.md
#    §R.2 and §S.2), the kernel checked against the reference first.
#   FULLSTACK_COMMIT=<rev> bash scripts/gpu/session23.sh loss          (carry .whl, data/quickstart)
# 3. loss against AdamW on the real corpus: the ablation's bf16 (AdamW) and q_adamw arms at
#    seeds 1234, 4321, 99 (as run87, §R.3), six runs at once;
# 4. beside them, the optimizer-phase peak memory of 4 blocks of the 3b preset (§I.2's arms),
#    and the tests of 1. again on the warm machine (run92's four failures were cold-compile
#    timeouts).
# Each packs its files into one archive, $OUT/<mode>.tgz (a call brings back only a few files).
set -u
source scripts/gpu/setup_env.sh
export OMP_NUM_THREADS=1
mkdir -p /tmp/pack
QTESTS="tests/fullstack_fp4/optim/test_q_adamw_kernel.py tests/fullstack_fp4/optim/test_q_adamw_multi.py
  tests/fullstack_fp4/optim/test_q_adamw_optimizer.py tests/fullstack_fp4/optim/test_q_adamw_streams.py
  tests/fullstack_fp4/optim/test_q_adamw_codecs.py tests/fullstack_fp4/integration/test_model_param_write.py"

case "${1:-qadamw}" in
  qadamw)
    TAILN=15 gpu_pytest q_adamw_tests 240 -q -n 8 --dist loadfile $QTESTS
    TAILN=30 run q_adamw_v2 320 python3 scripts/bench_q_adamw.py --cpp 1 --steps 10 --fast-div-rows
    cp "$OUT"/*.txt "$OUT"/*.json /tmp/pack/ 2>/dev/null
    ;;
  loss)
    start_ablations bf16,q_adamw abl_qadamw /tmp/pack 1234 4321 99
    # run92's four test timeouts were cold compiles (60 s a test): the same tests again on the
    # warm machine (Triton's cache of the first call), beside the runs, 240 s a test
    PER_TEST=240 TAILN=15 gpu_pytest q_adamw_tests_warm 420 -q -n 6 --dist loadfile $QTESTS \
      >/dev/null &
    timeout 400 python3 scripts/bench_blocks.py --arms bf16,q_adamw,q_adamw_bf16_grads --steps 6 \
      --out /tmp/pack/bench_blocks \
      --warmup 2 >/tmp/pack/bench_blocks.txt 2>&1 &
    wait
    for d in /tmp/abl_qadamw_*; do b=$(basename "$d"); mkdir -p "/tmp/pack/$b"
      cp "$d/ablation.md" "$d/ablation.json" "/tmp/pack/$b/" 2>/dev/null
      for a in "$d"/*/; do [ -f "$a/metrics.jsonl" ] && mkdir -p "/tmp/pack/$b/$(basename "$a")" \
        && cp "$a/metrics.jsonl" "/tmp/pack/$b/$(basename "$a")/"; done
      echo "== $d"; grep '^| ' "$d/ablation.md" | grep -v '^| ---'; done
    echo "== bench_blocks"; tail -25 /tmp/pack/bench_blocks.txt
    echo "== tests"; tail -8 "$OUT/q_adamw_tests_warm.txt"; cp "$OUT"/*.txt /tmp/pack/
    ;;
esac
tar -czf "$OUT/${1:-qadamw}.tgz" -C /tmp/pack .
