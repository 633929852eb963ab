"""Triton kernels (interpreter on CPU) vs the PyTorch reference.

Tolerances, and why:
  * prologue views: bit-exact (same NVFP4 contract, FP32 order fixed).
  * forward O: relative Frobenius ≤ 1e-2, LSE ≤ 1e-4 absolute. The kernel rounds the
    *unnormalised* exp to BF16 before PV, the reference the normalised P: BF16 rounding flips
    in P (≤ 2⁻⁹ relative each) average out to ~5e-3 on O.
  * backward, given the same (O, LSE): dQ, dK ≤ 1e-3 (the recomputed S and dP differ only by
    FP32 accumulation order, so dS quantizes to the same codes except on rare exact ties);
    dV ≤ 1e-2 (same BF16-rounding-of-P effect as O). On a GPU dQ, dK ≤ 2e-2 (MMA accumulation
    order can flip a few dS codes; as ``benchmarks/bench_q_attn.py``).

Device: CUDA when present (real kernels), else CPU under ``TRITON_INTERPRET=1`` (conftest.py).
Every tensor is built on CPU (seeded) and moved to ``DEV``, so kernels never see a CPU pointer.
"""

import pytest
import torch

from fullstack_fp4.attention import reference
from fullstack_fp4.attention.paths import resolve_paths
from fullstack_fp4.attention.prologue import make_views
from tests.fullstack_fp4.attention.kernel_inputs import DEV, GRAD_TOL, ORDER_TOL
from tests.fullstack_fp4.attention.kernel_inputs import inputs as _inputs
from tests.fullstack_fp4.attention.kernel_inputs import rel as _rel


@pytest.mark.parametrize("smooth,tiling", [(False, ""), (True, ""), (True, "16,4"),
                                           (False, "32,8")])
def test_prologue_views_bit_exact(smooth, tiling, monkeypatch):
    """Triton prologue vs the reference quantizer: BF16 values of both views, the packed codes and
    E4M3 scale bytes, and the decode scale, all bit for bit (seq 40: partial 16-, 32- and
    64-row tiles; an outlier; with K-smoothing the kernel subtracts the mean itself), at the
    default tiling and at 16 and 32 rows per program (``knobs.QATTN_PROLOGUE``)."""
    from fullstack_fp4 import knobs
    from fullstack_fp4.attention.triton_prologue import quantize_views
    monkeypatch.setattr(knobs, "QATTN_PROLOGUE",
                        knobs.parse_ints("FP4_QATTN_PROLOGUE", tiling, 2))
    from fullstack_fp4.attention.quant import per_head_packed, per_head_view, smooth_k
    x = _inputs(1, 2, 1, 40, 64)[0]
    x[0, 1, 7, 9] = 300.0
    x[0, 0, 2, :16] = 0.0                          # an all-zero block (zero scale)
    src, mean = smooth_k(x) if smooth else (x, None)
    r = quantize_views(x, mean, hd_bf16=True, sq_bf16=True, pack_hd=True, pack_sq=True)
    rh, rdec = per_head_view(src, "head_dim")
    rs, _ = per_head_view(src, "seq")
    assert r["hd"].device.type == DEV.type
    assert torch.equal(r["hd"].float().cpu(), rh.cpu())
    assert torch.equal(r["sq"].float().cpu(), rs.cpu())
    assert torch.equal(r["dec"].cpu(), rdec.cpu())
    for name, along in (("hd_packed", "head_dim"), ("sq_packed", "seq")):
        ref, _ = per_head_packed(src, along)
        assert torch.equal(r[name].codes.cpu(), ref.codes.cpu()), name
        assert torch.equal(r[name].scales.cpu(), ref.scales.cpu()), name


CASES = [(1, 4, 2, 50, 64, True, None),           # GQA, causal, ragged seq
         (1, 2, 1, 64, 128, False, None),         # head_dim 128, non-causal
         (1, 2, 2, 70, 64, True, {"ds": "bf16"}), # ds path switched off in the kernel
         (1, 2, 1, 33, 64, True, {"qk": "bf16"})] # qk path switched off in the kernel


@pytest.mark.parametrize("b,h,hk,s,d,causal,paths", CASES)
def test_kernel_matches_reference(b, h, hk, s, d, causal, paths):
    from fullstack_fp4.attention.triton_bwd import attention_backward
    from fullstack_fp4.attention.triton_fwd import attention_forward
    q, k, v, do = _inputs(b, h, hk, s, d)
    pr = resolve_paths(paths)
    qk4, ds4 = pr["qk"] == "nvfp4", pr["ds"] == "nvfp4"
    scale = d ** -0.5
    vt = make_views(q, k, qk_fp4=qk4, ds_fp4=ds4, smooth=True, backend="triton")
    vr = make_views(q, k, qk_fp4=qk4, ds_fp4=ds4, smooth=True, backend="reference")
    o, lse = attention_forward(vt, v, causal=causal, scale=scale)
    o_ref, lse_ref = reference.forward(v, vr, causal=causal, scale=scale, paths=pr)
    assert _rel(o, o_ref) < 1e-2
    assert (lse - lse_ref).abs().max().item() < 1e-4
    grads = attention_backward(do, o, lse, v, vt, causal=causal, scale=scale, ds_fp4=ds4)
    grads_ref = reference.backward(do, o, v, vr, causal=causal, scale=scale, paths=pr)
    for name, g, gr, tol in zip("QKV", grads, grads_ref, (GRAD_TOL, GRAD_TOL, 1e-2)):
        assert _rel(g, gr) < tol, (name, _rel(g, gr))


def test_kernel_stochastic_ds_is_random_and_close():
    """SR dS: two seeds differ; each lies within 3× the nearest-rounding error of the BF16-dS
    gradient (SR's variance is bounded by the grid step, as nearest's error is)."""
    from fullstack_fp4.attention.triton_bwd import attention_backward
    from fullstack_fp4.attention.triton_fwd import attention_forward
    q, k, v, do = _inputs(1, 2, 1, 64, 64, seed=3)
    vt = make_views(q, k, qk_fp4=True, ds_fp4=True, smooth=True, backend="triton")
    o, lse = attention_forward(vt, v, causal=True, scale=0.125)
    exact_ds = attention_backward(do, o, lse, v, make_views(q, k, qk_fp4=True, ds_fp4=False,
                                  smooth=True, backend="triton"), causal=True, scale=0.125,
                                  ds_fp4=False)
    near = attention_backward(do, o, lse, v, vt, causal=True, scale=0.125)
    sr1 = attention_backward(do, o, lse, v, vt, causal=True, scale=0.125, ds_stochastic=True, seed=1)
    sr2 = attention_backward(do, o, lse, v, vt, causal=True, scale=0.125, ds_stochastic=True, seed=2)
    assert not torch.equal(sr1[0], sr2[0])
    for i in (0, 1):
        e_near = _rel(near[i], exact_ds[i])
        assert 0 < e_near
        assert _rel(sr1[i], exact_ds[i]) < 3 * e_near


@pytest.mark.parametrize("causal,stoch", [(True, False), (False, True)])
def test_wide_backward_tiles_match_64_row_tiles(monkeypatch, causal, stoch):
    """128-row programs (knobs.QATTN_BWD rn = rm = 2: two 64-row dS tiles per program, each with
    its own tensor scale) give the 64-row programs' gradients: the same FP32 operations per row,
    summed in an order that depends on the tile shape (under the interpreter np.matmul's, which
    also depends on the CPU: ``ORDER_TOL``; on a GPU the MMAs')."""
    from fullstack_fp4 import knobs
    from fullstack_fp4.attention.triton_bwd import attention_backward
    from fullstack_fp4.attention.triton_fwd import attention_forward
    q, k, v, do = _inputs(1, 4, 2, 150, 64, seed=4)          # GQA, ragged, 3 key blocks
    views = make_views(q, k, qk_fp4=True, ds_fp4=True, smooth=True, backend="triton")
    o, lse = attention_forward(views, v, causal=causal, scale=0.125)
    grads = {}
    for cfg in ("4,2,4,2,1,1", "4,2,4,2,2,1", "4,2,4,2,1,2"):
        monkeypatch.setattr(knobs, "QATTN_BWD", knobs.parse_ints("QATTN_BWD", cfg, 6))
        grads[cfg] = attention_backward(do, o, lse, v, views, causal=causal, scale=0.125,
                                        ds_stochastic=stoch, seed=9)
    base = grads.pop("4,2,4,2,1,1")
    for cfg, g in grads.items():
        for name, a, b in zip("QKV", g, base):
            if DEV.type == "cpu":
                assert _rel(a, b) < ORDER_TOL, (cfg, name, _rel(a, b))
            else:
                assert _rel(a, b) < GRAD_TOL, (cfg, name)
