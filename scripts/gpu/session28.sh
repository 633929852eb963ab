#!/usr/bin/env bash
# Device calls of session 28 (one nvidia-h200): fewer launches in the NVFP4 linear, the block
# scales' element factor without div_rn's branch, the graph capture's GEMM path (issue 3;
# BENCHMARKS.md §W). Modes in the order they ran: rcp (run103), linear (run104), bench (run105),
# graph (run106), sustained (run107); each one's steps are below and at its case.
#   bash scripts/gpu/session28.sh rcp      (carry .whl)
# 1. every FP32 d of the reciprocal's range against div_rn (scripts/gpu/rcp_exhaustive.py);
# 2. the three quantize calls with div_rn or branch-free, bit for bit, timed
#    (scripts/gpu/rcp_variants.py);
# 3. the linear's fwd+bwd as a CUDA graph against BF16: the tree before this session (d0d10de,
#    checked out beside) and this one with the branch-free form on none, W+dY, all calls.
#   bash scripts/gpu/session28.sh linear   (carry .whl)
# 4. where the linear's CUDA-graph time goes beyond its kernels (scripts/gpu/graph_kernel_trace.py:
#    per kernel of a replay, its time and the idle gap before it), the linear's device time per
#    kernel, the bench (reference checks first), the GPU tests of the two-way kernels, the decode,
#    the jit helpers and the fused linear.
# Packs its files into $OUT/<mode>.tgz.
set -u
source scripts/gpu/setup_env.sh
mkdir -p /tmp/pack

ab() {  # ab LABEL RCP: linear_graph_ab.py on this tree with FP4_TWO_WAYS_RCP=RCP
  FP4_TWO_WAYS_RCP=$2 TAILN=8 run "graph_ab_$1" 120 python3 scripts/gpu/linear_graph_ab.py --label "$1"
}
case "${1:-rcp}" in
  rcp)
    run rcp_exhaustive 90 python3 scripts/gpu/rcp_exhaustive.py
    TAILN=20 run rcp_variants 200 python3 scripts/gpu/rcp_variants.py
    rm -rf /tmp/old && mkdir -p /tmp/old && git archive d0d10de | tar -x -C /tmp/old \
      && cp scripts/gpu/linear_graph_ab.py /tmp/old/scripts/gpu/ \
      && (cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old TAILN=8 run graph_ab_before 150 \
            python3 scripts/gpu/linear_graph_ab.py --label before-d0d10de)
    ab none ""
    ab w_dy "W,dY"
    ab all "x,W,dY"
    ;;
  linear)
    TAILN=60 run graph_trace 120 python3 scripts/gpu/graph_kernel_trace.py
    TAILN=25 run profile_linear 90 python3 scripts/gpu/profile_linear_device.py
    TAILN=12 run bench_linear 200 python3 scripts/bench_nvfp4_linear.py
    PER_TEST=120 TAILN=12 gpu_pytest gpu_tests 200 -q -n 8 \
      tests/fullstack_fp4/nvfp4/test_quantize_two_ways.py tests/fullstack_fp4/nvfp4/test_fast_paths.py \
      tests/fullstack_fp4/nvfp4/test_triton_quantize_jit.py \
      tests/fullstack_fp4/linear/test_nvfp4_linear_fused.py
    ;;
  bench)   # run105: 4. again without the profile (run104's bench was cut at 200 s, its graph
           # trace failed), the bench given 330 s, and this session's new GPU tests by name
    TAILN=90 run graph_trace 120 python3 scripts/gpu/graph_kernel_trace.py
    TAILN=12 run bench_linear 330 python3 scripts/bench_nvfp4_linear.py
    PER_TEST=100 TAILN=12 gpu_pytest gpu_tests_new 150 -q -n 8 -rA \
      -k "pair or alpha or candidate_nb or every_code" \
      tests/fullstack_fp4/nvfp4/test_quantize_two_ways.py tests/fullstack_fp4/nvfp4/test_fast_paths.py \
      tests/fullstack_fp4/nvfp4/test_triton_quantize_jit.py
    ;;
  sustained)   # run107: the graphs under sustained load (do_bench's pattern) at both shapes
    TAILN=70 run sustained_3072 150 python3 scripts/gpu/graph_kernel_trace.py --sustained
    TAILN=70 run sustained_8192 150 python3 scripts/gpu/graph_kernel_trace.py --sustained --fout 8192
    ;;
  graph)   # run106: cublaslt.ready no longer asks the capture stream for an eagerly made
           # workspace (every torch.cuda.graph capture took the two-pass GEMM path before)
    PER_TEST=100 TAILN=12 gpu_pytest gpu_tests_graph 120 -q -rA -k "cuda_graph or (test_cublaslt and not glue)" \
      tests/fullstack_fp4/linear/test_nvfp4_linear_fused.py tests/fullstack_fp4/nvfp4/test_cublaslt.py
    TAILN=90 run graph_trace 150 python3 scripts/gpu/graph_kernel_trace.py
    ab fixed "W"
    TAILN=12 run bench_linear 330 python3 scripts/bench_nvfp4_linear.py
    ;;
esac
cp "$OUT"/*.txt "$OUT"/*.json /tmp/pack/ 2>/dev/null
tar -czf "$OUT/${1:-rcp}.tgz" -C /tmp/pack .
