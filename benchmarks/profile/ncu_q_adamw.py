"""ncu target: the fused Q-AdamW kernel on one 3072×8192 FP32 parameter (25.2M entries), FP32
grad, the default launch; 4 steps (ncu profiles the last with --launch-skip 3 --launch-count 1).
Prints the kernel's own CUDA-event time per step first (no profiler), for scale.

    ncu --clock-control none --kernel-name regex:q_adamw --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section SchedulerStats \
        --section WarpStateStats --section InstructionStats --section SourceCounters \
        python3 benchmarks/profile/ncu_q_adamw.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from fullstack_fp4.optim.q_adamw.codecs import padded_numel  # noqa: E402
from fullstack_fp4.optim.q_adamw.optimizer import kernel_hyper, kernel_views  # noqa: E402
from fullstack_fp4.optim.q_adamw.state import init_state  # noqa: E402
from fullstack_fp4.optim.q_adamw.triton_step import launch  # noqa: E402


def main():
    torch.manual_seed(0)
    p = torch.randn(3072 * 8192, device="cuda") * 0.02
    g = torch.randn_like(p) * 1e-3
    n = p.numel()
    st = kernel_views(init_state(n, "cuda"))
    for t in range(1, 5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        launch(p, g, st, n, padded_numel(n), seed=t, **kernel_hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, t, "cuda"))
        b.record()
        torch.cuda.synchronize()
        print(f"step {t}: {a.elapsed_time(b) * 1e3:.1f} us for {n} entries "
              f"({a.elapsed_time(b) * 1e6 / n:.3f} ns/entry)", flush=True)


if __name__ == "__main__":
    main()
