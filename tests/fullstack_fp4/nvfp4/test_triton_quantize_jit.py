"""The block-scale helpers of ``nvfp4/kernels/fp4_math.py`` against PyTorch FP32 arithmetic.

``candidate_nb`` (the element factor ``1/(s·dec)`` without ``div_rn``'s branch) must give
what the reference computes: ``s = e4m3_rne(min(amax · (enc · fl(1/6)), 448))`` and
``f = min(1/fl(s·dec), FP32_MAX)``, each one IEEE FP32 operation (PyTorch on the CPU is the
oracle; its FP32 → E4M3 cast rounds to nearest even). The decode scales cover the whole range
a tensor can have (down to FP32 subnormals, where ``s·dec`` is subnormal or 0, up to the
largest, ``1/fl(2688/FP32_MAX)``), every finite E4M3 scale and a zero block. On the GPU the
reciprocal starts from the hardware's approximation; under ``TRITON_INTERPRET=1`` from NumPy's
exact quotient (the scaling, the zero block and the clamp are what the CPU run checks).
"""

from __future__ import annotations

import os

import pytest
import torch

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
pytestmark = pytest.mark.skipif(not (_INTERPRET or torch.cuda.is_available()),
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if (torch.cuda.is_available() and not _INTERPRET) else "cpu"
FP32_MAX = torch.finfo(torch.float32).max


triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from fullstack_fp4.nvfp4.kernels.fp4_math import INV6, candidate_nb, rcp_kd  # noqa: E402


@triton.jit
def _candidate_nb_kernel(a_ptr, e_ptr, d_ptr, s_ptr, b_ptr, f_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    dec = tl.load(d_ptr + i, mask=m, other=1.0)
    s_val, s_bits, f = candidate_nb(tl.load(a_ptr + i, mask=m, other=0.0),
                                     tl.load(e_ptr + i, mask=m, other=1.0), dec, rcp_kd(dec),
                                     INV6)
    tl.store(s_ptr + i, s_val, mask=m)
    tl.store(b_ptr + i, s_bits, mask=m)
    tl.store(f_ptr + i, f, mask=m)


def _run(bamax, enc, dec):
    n = bamax.numel()
    outs = [torch.empty(n, dtype=dt, device=DEV) for dt in (torch.float32, torch.int32,
                                                            torch.float32)]
    _candidate_nb_kernel[(triton.cdiv(n, 256),)](bamax.to(DEV), enc.to(DEV), dec.to(DEV), *outs,
                                                 n, BLOCK=256, enable_fp_fusion=False)
    return [o.cpu() for o in outs]


def _oracle(bamax, enc, dec):
    inv6 = torch.tensor(1.0, dtype=torch.float32) / 6.0
    s = torch.clamp(bamax * (enc * inv6), max=448.0)
    s8 = s.to(torch.float8_e4m3fn)
    s_val = s8.to(torch.float32)
    f = torch.clamp(torch.tensor(1.0) / (s_val * dec), max=FP32_MAX)
    return s_val, s8.view(torch.uint8).to(torch.int32), f


def test_candidate_nb_every_scale_and_the_whole_decode_range():
    e4m3 = torch.arange(127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    g = torch.Generator().manual_seed(0)
    decs = torch.cat([
        torch.tensor([2.0 ** -149, 2.0 ** -140, 2.0 ** -130, 2.0 ** -128, 1e-38, 2.0 ** -126,
                      3e-30, 2.0 ** -41, 2.0 ** -40, 2.0 ** -40 * 1.5, 1e-12, 1e-6, 0.37, 1.0,
                      1e3, 1e30, 1.0 / (2688.0 / FP32_MAX)]),
        torch.exp2(torch.rand(40, generator=g) * 266 - 149)])       # log-uniform 2^-149..2^117
    decs = decs.to(torch.float32)
    # enc = 6: enc · fl(1/6) rounds to 1, so the scale is the given amax: every E4M3 value
    bamax = e4m3.repeat(decs.numel())
    dec = decs.repeat_interleave(e4m3.numel())
    enc = torch.full_like(bamax, 6.0)
    # and amaxes that round (ties, the 448 clamp) under the decode's own encode scale
    ra = torch.rand(4000, generator=g) * 600
    rd = decs[torch.randint(decs.numel(), (4000,), generator=g)]
    bamax, enc, dec = torch.cat([bamax, ra]), torch.cat([enc, 2688.0 / (rd * 2688.0)]), \
        torch.cat([dec, rd])
    enc = enc.to(torch.float32)
    got = _run(bamax, enc, dec)
    want = _oracle(bamax, enc, dec)
    for g_, w_, name in zip(got, want, ("s_val", "s_bits", "f")):
        gb = g_.view(torch.int32) if g_.dtype == torch.float32 else g_
        wb = w_.view(torch.int32) if w_.dtype == torch.float32 else w_
        bad = (gb != wb).nonzero().flatten()
        assert bad.numel() == 0, (name, bamax[bad[:3]], dec[bad[:3]], g_[bad[:3]], w_[bad[:3]])
    # the cases the scaling exists for were in the set: zero blocks, s·dec tiny and subnormal
    prod = want[0] * dec
    assert (want[0] == 0).any() and ((prod > 0) & (prod < 2.0 ** -126)).any()
    assert ((prod >= 2.0 ** -128) & (prod < 2.0 ** -126) & (want[2] < FP32_MAX)).any()
