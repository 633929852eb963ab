"""GPU check for `parallel.grad_reduce_in_fp32=false`: QAdamW's kernel stepping from a BF16
gradient (``decoupled_grad``, as fullstack_fp4/integration/bf16_grads.py hands it over) must give
the same bits as stepping from the same values held in FP32 (a BF16 value is exact in FP32):
params and the 4-bit states after three steps (the kernel against the reference is
scripts/bench_q_adamw.py's check). Prints `ok` lines; exits non-zero on a mismatch.

    python scripts/gpu/check_q_adamw_bf16_grads.py
"""
from __future__ import annotations

import sys

import torch

from fullstack_fp4.optim.q_adamw import QAdamW
from fullstack_fp4.optim.q_adamw.optimizer import GRAD_ATTR


def run(shape, steps=3, via_bf16=True, device="cuda", use_kernel=None):
    g = torch.Generator().manual_seed(7)
    p = torch.nn.Parameter(torch.randn(shape, generator=g).to(device))
    opt = QAdamW([p], lr=1e-3, weight_decay=0.1, seed=3, use_kernel=use_kernel)
    for _ in range(steps):
        grad = (torch.randn(shape, generator=g) * torch.rand(shape, generator=g).pow(4) * 3)
        grad = grad.to(torch.bfloat16).to(device)     # the BF16 buffer's values
        if via_bf16:
            p.grad = None
            setattr(p, GRAD_ATTR, grad)
        else:
            p.grad = grad.float()
        opt.step()
    return p.detach().cpu(), {k: v.cpu() for k, v in opt.state[p].items() if torch.is_tensor(v)}


def main() -> int:
    bad = 0
    for shape in ((3072, 3072), (1000, 4096), (8192 + 16, 1024)):
        pb, sb = run(shape)
        pf, sf = run(shape, via_bf16=False)
        same = torch.equal(pb, pf) and all(torch.equal(sb[k], sf[k]) for k in sb)
        print(("ok      " if same else "MISMATCH") + f" kernel, BF16 grad == FP32 grad {shape}")
        bad += not same
    print("q_adamw bf16 grads exact" if not bad else f"{bad} mismatch(es)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
