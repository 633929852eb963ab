#!/usr/bin/env bash
# Device calls of session 20 (one nvidia-h200; carry .whl, made by
# `bash ../shared/tools/device-wheels.sh megatron-core==0.16.1 torchao==0.18.0 pytest-xdist execnet`).
# Pass FULLSTACK_COMMIT=<rev> on the command line.
#   bash scripts/gpu/session20.sh pow2   # Q-AdamW without divisions in a row's encode
#       (power-of-two chunk scales, reciprocal table; PERF.md "v9"): the kernel, optimizer,
#       streams and multi-tensor tests on the GPU (kernel == reference bit for bit), then the
#       bench: QAdamW IEEE and approximate division at 1/2/3 streams, the flat bound, torch
#       fused AdamW and torchao beside them
#   bash scripts/gpu/session20.sh tests  # the same tests alone, with room for the cold compiles
#       of the two-body kernel (run82's four failures were 60-s pytest time-outs while Triton
#       compiled), and test_model_param_write's GPU cases
#   bash scripts/gpu/session20.sh loss   # (carry data/quickstart too) Q-AdamW's loss gap to
#       AdamW with the new chunk scales: the ablation's bf16 and q_adamw arms at seeds 1234,
#       4321 and 99, six arms at once on the GPU (BENCHMARKS.md §I.1's setup)
#   bash scripts/gpu/session20.sh final  # the kernel as landed (chunk scales decode-first,
#       reciprocal table, unbounded full-program body): the GPU tests with room for cold
#       compiles, then the bench as in pow2
set -u
source scripts/gpu/setup_env.sh
export OMP_NUM_THREADS=1
# Q-AdamW's test files with GPU cases (run in the pow2 mode: the first four and the last)
Q_TESTS="tests/fullstack_fp4/optim/test_q_adamw_streams.py tests/fullstack_fp4/optim/test_q_adamw_multi.py
  tests/fullstack_fp4/optim/test_q_adamw_kernel.py tests/fullstack_fp4/optim/test_q_adamw_optimizer.py
  tests/fullstack_fp4/optim/test_q_adamw_codecs.py
  tests/fullstack_fp4/integration/test_model_param_write.py::test_destinations_are_the_memory_megatron_copies_to"
case "${1:-pow2}" in
  pow2)
    TAILN=12 gpu_pytest pytest_pow2 240 -q -n 4 --dist loadfile \
      tests/fullstack_fp4/optim/test_q_adamw_kernel.py \
      tests/fullstack_fp4/optim/test_q_adamw_optimizer.py \
      tests/fullstack_fp4/optim/test_q_adamw_streams.py \
      tests/fullstack_fp4/optim/test_q_adamw_multi.py \
      "tests/fullstack_fp4/integration/test_model_param_write.py::test_destinations_are_the_memory_megatron_copies_to"
    # after the tests, not beside them (run79 timed while a pytest ran on the same GPU)
    TAILN=45 run q_adamw_pow2 480 python3 scripts/bench_q_adamw.py --cpp 1 --steps 10 \
      --fast-div-rows --flat-row --streams-rows
    ;;
  final)
    PER_TEST=190 TAILN=8 gpu_pytest pytest_final 330 -q -n 6 --dist loadfile $Q_TESTS
    TAILN=20 run q_adamw_final 250 python3 scripts/bench_q_adamw.py --cpp 1 --steps 10 \
      --fast-div-rows --flat-row --streams-rows
    ;;
  tests)
    PER_TEST=360 TAILN=14 gpu_pytest pytest_tests 560 -q -n 6 --dist loadfile $Q_TESTS
    ;;
  loss)
    start_ablations bf16,q_adamw abl_qadamw "$OUT" 1234 4321 99
    wait
    for d in /tmp/abl_qadamw_*; do b=$(basename "$d")
      cp "$d/ablation.md" "$OUT/$b.md" 2>/dev/null; cp "$d/ablation.json" "$OUT/$b.json" 2>/dev/null
      for a in "$d"/*/; do [ -f "$a/metrics.jsonl" ] && mkdir -p "$OUT/$b/$(basename "$a")" \
        && cp "$a/metrics.jsonl" "$OUT/$b/$(basename "$a")/"; done
      echo "== $d"; grep '^| ' "$d/ablation.md" | grep -v '^| ---'; done
    ;;
esac
