"""Shared by the Q-Attn kernel test modules: the device, the GPU/CPU gradient tolerances, the
relative error, and the seeded inputs (test_kernels.py's docstring says why the tolerances)."""

import torch

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GRAD_TOL = 2e-2 if DEV.type == "cuda" else 1e-3
# Two kernel configurations with other tile shapes, under the interpreter: tl.dot is np.matmul,
# whose summation order depends on the matrix shape and on the BLAS kernel the CPU selects
# (OpenBLAS picks one per CPU model: on an Intel CPU the 64- and 128-row tiles gave equal
# gradients, on an AMD EPYC dV 1 ulp apart in 12% of entries, and dQ 6e-6 apart after a few
# of dS's 4-bit roundings flipped). A wrong tile scale moves them by ~1e-1.
ORDER_TOL = 2e-4


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def inputs(b, h, hk, s, d, seed=0):
    """q, k, v, dO in BF16 on ``DEV``, built on CPU from one seed: per-channel Q scales, K
    channel offsets (what K-smoothing removes), outlier tokens."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g) * torch.exp(0.5 * torch.randn(1, 1, 1, d, generator=g))
    k = torch.randn(b, hk, s, d, generator=g) + torch.randn(1, hk, 1, d, generator=g)
    q[:, :, 3] *= 10.0                              # outlier tokens
    k[:, :, 5] *= 10.0
    v = torch.randn(b, hk, s, d, generator=g)
    do = torch.randn(b, h, s, d, generator=g)
    return [x.to(device=DEV, dtype=torch.bfloat16) for x in (q, k, v, do)]
