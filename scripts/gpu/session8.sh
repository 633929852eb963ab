#!/usr/bin/env bash
# Session 8's device calls on one H200 (each fits the 600 s limit). Carry .whl.
#   bash scripts/gpu/session8.sh attn     # Q-Attn beside every SDPA backend (eager),
#       prologue/forward/backward tiling sweeps; per-kernel profile; the 4-block 3b
#       step profiled (GPU busy vs idle, kernel time by family) for bf16, q_attn, full stack
#   bash scripts/gpu/session8.sh adamw    # kernels check; FAST_IEEE exactness check; Q-AdamW sweep
#   bash scripts/gpu/session8.sh blocks   # 4-block 3b table + profile (bf16, nvfp4_linear, q_attn,
#       q_adamw_bf16_grads, full_stack_bf16_grads); Q-Attn per-kernel and host profile
#   FULLSTACK_COMMIT=<sha> bash scripts/gpu/session8.sh ablation   # bf16, q_attn, full stack losses
#   bash scripts/gpu/session8.sh decode   # flat NVFP4 decode sweep, then the 4-block table with it
set -u
source scripts/gpu/setup_env.sh
case "${1:-attn}" in
  attn)
    TAILN=60 run q_attn 300 python3 scripts/bench_q_attn.py --sweep
    TAILN=20 run profile_q_attn 90 python3 scripts/gpu/profile_q_attn.py
    TAILN=12 run blocks 240 python3 scripts/bench_blocks.py --arms bf16,q_attn,full_stack_bf16_grads \
      --steps 4 --warmup 2 --profile --out "$OUT"
    ;;
  adamw)   # Q-AdamW v3 (default) beside the FAST_IEEE and Philox (u8, 7 rounds) options
    TAILN=3 run check 60 python3 scripts/gpu/check_kernels_exact.py
    TAILN=12 run check_fast_ieee 200 python3 scripts/gpu/check_fast_ieee.py
    TAILN=30 run q_adamw 330 python3 scripts/bench_q_adamw.py --sweep \
      --sweep-configs '1,128,1;1,128,1,0,10,1;1,128,1,1,7;1,128,1,1,7,1'
    ;;
  blocks)  # the 4-block 3b table with the kernel-family profile; Q-Attn's host side
    TAILN=40 run blocks 420 python3 scripts/bench_blocks.py \
      --arms bf16,nvfp4_linear,q_attn,q_adamw_bf16_grads,full_stack_bf16_grads --steps 6 --warmup 2 \
      --profile --out "$OUT"
    TAILN=40 run profile_q_attn 120 python3 scripts/gpu/profile_q_attn.py
    ;;
  ablation)  # bf16, q_attn, full stack at the current kernels (seed 1234, as run26); carry data/quickstart
    run ablation 420 python3 scripts/ablation.py --arms bf16,q_attn,full_stack_bf16_grads --iters 300 \
      --out /tmp/abl --time-budget 360 --ppl-tokens 65536 --cloze-items 200
    keep_ablation /tmp/abl
    ;;
  decode)  # the flat decode kernel: exactness + GB/s sweep; then the 4-block table with the
           # fastest (blocks/program, warps) exported, so the step figure uses it
    TAILN=40 run decode 150 python3 scripts/bench_decode.py --sweep
    best=$(python3 -c "import json; c=json.load(open('$OUT/bench_decode.json'))['configs']
t={k: sum(r['ms'] for r in v) for k, v in c.items()}; b=min(t, key=t.get); print('' if b == 'default' else b)")
    if [ -n "$best" ]; then export FP4_DEQUANT_NBP=${best%,*} FP4_DEQUANT_WARPS=${best#*,}; fi
    echo "decode config for the blocks run: ${best:-default}"
    TAILN=14 run blocks 330 python3 scripts/bench_blocks.py --arms bf16,nvfp4_linear,full_stack_bf16_grads \
      --steps 6 --warmup 2 --profile --out "$OUT"
    ;;
esac
