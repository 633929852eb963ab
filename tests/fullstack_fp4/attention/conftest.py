"""Run the Triton kernels under the interpreter on machines without CUDA.

Must be set before any ``triton.jit`` function is created (the kernel modules are imported
lazily by fullstack_fp4.attention, i.e. after this runs)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
