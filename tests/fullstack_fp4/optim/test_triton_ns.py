"""The fused quantize→decode kernel of the NS against the nvfp4 reference (TRITON_INTERPRET=1)."""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from fullstack_fp4.nvfp4 import quantize  # noqa: E402
from fullstack_fp4.nvfp4.gemm import decode_to_bf16, nvfp4_matmul  # noqa: E402
from fullstack_fp4.optim.newton_schulz import newton_schulz  # noqa: E402
from fullstack_fp4.optim.triton_ns import decoded_matmul, quantize_decode  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_decoded_operand_is_bit_exact_with_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=g) * torch.exp(3 * torch.randn(40, 1, generator=g))
    x[3] = 0                                     # an all-zero row: zero block scales
    x[5, :16] = 1e-30                            # E4M3-subnormal / underflowing block scales
    x = x.to(DEV)
    dec, ts = quantize_decode(x)
    q = quantize(x, backend="reference")
    assert torch.equal(dec, decode_to_bf16(q).reshape(dec.shape))
    assert torch.equal(ts.reshape(()), q.tensor_scale.reshape(()).to(torch.float32))


def test_strided_view_is_read_in_place_and_keeps_layout():
    X = torch.randn(48, 32, generator=torch.Generator().manual_seed(1)).to(DEV)
    dec, ts = quantize_decode(X.t())             # X quantized along dim 0
    assert dec.shape == (32, 48) and dec.stride() == (1, 32)
    q = quantize(X.t().contiguous(), backend="reference")
    assert torch.equal(dec, decode_to_bf16(q))
    prod = decoded_matmul(quantize_decode(X), quantize_decode(X))
    ref = nvfp4_matmul(quantize(X, backend="reference"), quantize(X, backend="reference"),
                       out_dtype=torch.float32)
    assert torch.allclose(prod, ref, rtol=1e-6, atol=1e-6)


def test_triton_ns_matches_reference_ns():
    G = torch.randn(48, 96, generator=torch.Generator().manual_seed(2)).to(DEV)
    a = newton_schulz(G, steps=2, precision="nvfp4", backend="triton")
    b = newton_schulz(G, steps=2, precision="nvfp4", backend="reference")
    assert ((a - b).norm() / b.norm()).item() < 1e-5


def test_fused_scale_and_shared_amax_are_bit_exact():
    """quantize_decode(x, scale=s, amax=abs_max(x)·s) == quantize_decode(x·s), views too."""
    from fullstack_fp4.optim.triton_ns import abs_max
    X = torch.randn(32, 48, generator=torch.Generator().manual_seed(3)).to(DEV)
    s = torch.tensor([0.8123], device=DEV)
    for v in (X, X.t()):
        a, ta = quantize_decode(v, scale=s, amax=abs_max(v) * s)
        b, tb = quantize_decode(v * s)
        assert torch.equal(a, b) and torch.equal(ta, tb)
