#!/usr/bin/env bash
# A run interrupted by SIGTERM (what a cluster scheduler sends) saves a checkpoint and exits 0;
# running the same command again resumes from it, exactly where it stopped.
set -euo pipefail
PY=.venv/bin/python
RUN=runs/resume_demo
rm -rf "$RUN"
ARGS=(--config configs/quickstart.yaml train.iters=400 train.log_interval=5
      checkpoint.save_dir=$RUN/checkpoints logging.dir=$RUN)
$PY pretrain_gpt.py "${ARGS[@]}" &
PID=$!
sleep 60                      # let it train a while
kill -TERM $PID               # the scheduler's pre-emption signal
wait $PID && echo "exited 0 after saving"
cat $RUN/checkpoints/latest; echo
$PY pretrain_gpt.py "${ARGS[@]}"   # checkpoint.load=auto (the default): the newest complete checkpoint
