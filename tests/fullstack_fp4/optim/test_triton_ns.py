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


# ----------------------------------------------------------------------------- lean two-term
def _composed(P, x):
    """newton_schulz._split with two terms, written out: q(x), then q(x − dec·ts)."""
    q0 = P.op(x)
    return [q0, P.op(x - P.deq(q0))]


def _heavy(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(2 * torch.randn(shape[0], 1, generator=g))
    x[1] = 0                                     # an all-zero row: zero block scales
    return x.to(DEV)


def test_split2_is_the_composed_two_term_split():
    """split2 (residual amax and residual quantize fused, no FP32 temporaries) gives the same
    decoded operands and tensor scales, bit for bit, as quantize → dequantize → subtract →
    quantize in torch: row-major, a transposed view, and with a fused scale (the guard)."""
    from fullstack_fp4.optim.newton_schulz import NVFP4Products
    from fullstack_fp4.optim.triton_ns import abs_max, split2
    P = NVFP4Products("triton", None, "nearest", None, torch.device(DEV))
    X = _heavy((48, 64), 5)
    s = torch.tensor([0.7071], device=DEV)
    cases = [(split2(X), _composed(P, X)),
             (split2(X.t()), _composed(P, X.t())),
             (split2(X.t(), amax=abs_max(X) * s, scale=s), _composed(P, (X * s).t()))]
    for got, want in cases:
        for (dg, tg), (dw, tw) in zip(got, want):
            assert dg.stride() == dw.stride()
            assert torch.equal(dg, dw) and torch.equal(tg.reshape(()), tw.reshape(()))
    assert not torch.equal(cases[0][0][1][0], torch.zeros_like(X, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="densely"):
        split2(X[:, ::2])


def test_lean_two_term_step_is_the_composed_step_bit_for_bit():
    """The lean two-term step (fused splits, one-pass sums, guard scale fused) equals
    _step_nvfp4_split on the same Triton products, for a step where the basin guard acts
    (Muon's triple) and one where it has no repelling point; then whole NS runs, tall and
    wide, lean on and off."""
    import importlib
    ns = importlib.import_module("fullstack_fp4.optim.newton_schulz")   # the module, not the function
    P = ns.NVFP4Products("triton", None, "nearest", None, torch.device(DEV))
    from fullstack_fp4.optim.ns_coefficients import MUON
    X = _heavy((32, 80), 6)
    X = X / X.norm()
    Xc = X.t().contiguous().t()                  # column-major: a tall G's transposed view
    for x in (X, Xc):
        for abc in (MUON, (2.0, -1.5, 0.5)):
            want = ns._step_nvfp4_split(x.clone(), 32, abc, P, 2)
            got = ns._step_nvfp4_two_term_lean(x.clone(), 32, abc)
            assert torch.equal(got, want), abc
            assert got.stride() == want.stride()
    G = torch.randn(40, 72, generator=torch.Generator().manual_seed(7)).to(DEV)
    # wide; tall as a transposed view (X contiguous inside); tall and contiguous (X column-major)
    for g in (G, G.t(), G.t().contiguous()):
        lean = newton_schulz(g, steps=3, precision="nvfp4", backend="triton", coefficients="fp4")
        ns.LEAN_TWO_TERM = False
        try:
            comp = newton_schulz(g, steps=3, precision="nvfp4", backend="triton",
                                 coefficients="fp4")
        finally:
            ns.LEAN_TWO_TERM = True
        assert torch.equal(lean, comp)


def test_triton_two_term_still_refuses_stochastic_rounding():
    """The lean path rounds to nearest only, as the Triton backend does: a stochastic request must
    still reach the backend's error, not run silently with nearest rounding."""
    G = torch.randn(32, 48, generator=torch.Generator().manual_seed(8)).to(DEV)
    with pytest.raises(ValueError, match="nearest rounding only"):
        newton_schulz(G, steps=1, precision="nvfp4", backend="triton", rounding="stochastic",
                      nvfp4_terms=2)
