#!/usr/bin/env bash
# The same 60-step run three times: BF16, NVFP4 linears, NVFP4 linears + Q-Attn.
# On a CPU the NVFP4 arms run the pure-PyTorch reference quantizer (slow: minutes);
# on a GPU they use the Triton kernels (NVFP4 GEMMs emulated exactly on pre-Blackwell GPUs).
set -euo pipefail
PY=.venv/bin/python
COMMON=(--config configs/quickstart.yaml train.iters=60 train.eval_interval=60 checkpoint.load=none
        checkpoint.save_dir=null checkpoint.save_interval=null)
$PY pretrain_gpt.py "${COMMON[@]}" logging.dir=runs/recipes/bf16
$PY pretrain_gpt.py "${COMMON[@]}" logging.dir=runs/recipes/nvfp4 fp4.linear=nvfp4
$PY pretrain_gpt.py "${COMMON[@]}" logging.dir=runs/recipes/nvfp4_qattn fp4.linear=nvfp4 fp4.attention=q_attn
for arm in bf16 nvfp4 nvfp4_qattn; do
  echo "$arm: $(grep val_loss runs/recipes/$arm/metrics.jsonl | tail -1)"
done
