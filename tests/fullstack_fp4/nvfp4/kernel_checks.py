"""Shared by the quantize-kernel test modules: where the kernels can run, and the bit-for-bit
comparison of two NVFP4Tensors (codes, E4M3 block-scale bits, FP32 tensor-scale bits)."""
from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEV = "cuda" if (torch.cuda.is_available() and not INTERPRET) else "cpu"


def skip_module_without_kernels() -> None:
    """Skip the calling test module unless a GPU or the Triton interpreter can run kernels."""
    if not (INTERPRET or torch.cuda.is_available()):
        pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 (CPU interpreter)",
                    allow_module_level=True)


def assert_same_nvfp4(a, b, what: str = "") -> None:
    assert torch.equal(a.data.cpu(), b.data.cpu()), f"{what}: codes differ"
    assert torch.equal(a.block_scale.cpu().view(torch.uint8), b.block_scale.cpu().view(torch.uint8)), \
        f"{what}: block scales differ"
    assert int(a.tensor_scale.cpu().view(torch.int32)) == int(b.tensor_scale.cpu().view(torch.int32)), \
        f"{what}: tensor scale differs"
