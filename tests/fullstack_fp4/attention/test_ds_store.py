"""dS stored once (``triton_ds_store.py``): the dkdv kernel writes each dS tile quantized along
keys, ``_dq_ds_kernel`` decodes it instead of recomputing S, P, dP, dS.

Both kernels compute the same S/dP products in FP32 and quantize the same tiles the same way,
but not with the same tile shapes: under the interpreter np.matmul's summation order depends on
them and on the CPU's BLAS kernel (bit for bit on an Intel CPU, 6e-6 apart on an AMD EPYC:
``ORDER_TOL``, kernel_inputs.py); on a GPU the two kernels' MMAs may accumulate in another
order (``GRAD_TOL``, as test_kernels.py). dK, dV are untouched by the store: equal everywhere.
The scratch is pre-filled with garbage so a slot the dkdv kernel failed to write would show.
"""

import pytest
import torch

from fullstack_fp4.attention import reference
from fullstack_fp4.attention.paths import resolve_paths
from fullstack_fp4.attention.prologue import make_views
from tests.fullstack_fp4.attention.kernel_inputs import DEV, GRAD_TOL, ORDER_TOL
from tests.fullstack_fp4.attention.kernel_inputs import inputs as _inputs
from tests.fullstack_fp4.attention.kernel_inputs import rel as _rel


def _garbage_scratch(monkeypatch):
    from fullstack_fp4.attention import triton_bwd, triton_ds_store
    calls = []

    def scratch(*a, **kw):
        codes, scales, dec, *rest = triton_ds_store.ds_scratch(*a, **kw)
        codes.fill_(0x77)                       # code 7 = 6.0 in both nibbles
        scales.fill_(0x7E)                      # E4M3 448
        dec.fill_(float("nan"))
        calls.append(codes.numel())
        return (codes, scales, dec, *rest)
    monkeypatch.setattr(triton_bwd, "ds_scratch", scratch)
    return calls


def _fwd(b, h, hk, s, d, causal, seed=4):
    from fullstack_fp4.attention.triton_fwd import attention_forward
    q, k, v, do = _inputs(b, h, hk, s, d, seed=seed)
    views = make_views(q, k, qk_fp4=True, ds_fp4=True, smooth=True, backend="triton")
    o, lse = attention_forward(views, v, causal=causal, scale=d ** -0.5)
    return q, k, v, do, views, o, lse


# (b, h, hk, s, d, causal, stochastic, FP4_QATTN_BWD or None = the D's default config)
CASES = [(1, 2, 1, 64, 64, True, False, None),              # one tile
         (1, 4, 2, 150, 64, True, False, "4,2,4,2,2,2"),    # GQA, ragged, 128-row programs
         (1, 4, 2, 150, 64, False, True, "4,2,4,2,2,1"),    # non-causal, stochastic, rn 2 / rm 1
         (1, 4, 2, 150, 64, True, True, "4,2,4,2,1,2"),     # causal stochastic, rn 1 / rm 2
         (1, 2, 1, 100, 128, False, False, None),           # D 128 (its default 128-row tiles)
         (1, 4, 1, 130, 128, True, True, None)]             # D 128, GQA 4, causal, stochastic


@pytest.mark.parametrize("b,h,hk,s,d,causal,stoch,cfg", CASES)
def test_stored_ds_matches_recompute(monkeypatch, b, h, hk, s, d, causal, stoch, cfg):
    from fullstack_fp4.attention.triton_bwd import attention_backward
    if cfg is not None:
        monkeypatch.setenv("FP4_QATTN_BWD", cfg)
    calls = _garbage_scratch(monkeypatch)
    _, _, v, do, views, o, lse = _fwd(b, h, hk, s, d, causal)
    kw = dict(causal=causal, scale=d ** -0.5, ds_stochastic=stoch, seed=9)
    want = attention_backward(do, o, lse, v, views, ds_store=False, **kw)
    assert not calls
    got = attention_backward(do, o, lse, v, views, ds_store=True, **kw)
    assert len(calls) == 1
    for name, a, w in zip("QKV", got, want):
        if name != "Q":
            assert torch.equal(a, w), name
        else:
            tol = ORDER_TOL if DEV.type == "cpu" else GRAD_TOL
            assert _rel(a, w) < tol, (name, _rel(a, w))


@pytest.mark.parametrize("causal", [True, False])
def test_stored_ds_matches_reference(causal):
    from fullstack_fp4.attention.triton_bwd import attention_backward
    q, k, v, do, views, o, lse = _fwd(1, 4, 2, 90, 64, causal, seed=1)
    vr = make_views(q, k, qk_fp4=True, ds_fp4=True, smooth=True, backend="reference")
    got = attention_backward(do, o, lse, v, views, causal=causal, scale=0.125, ds_store=True)
    want = reference.backward(do, o, v, vr, causal=causal, scale=0.125, paths=resolve_paths(None))
    for name, g, w, tol in zip("QKV", got, want, (GRAD_TOL, GRAD_TOL, 1e-2)):
        assert _rel(g, w) < tol, (name, _rel(g, w))


def test_stored_path_replaces_the_recompute_kernel(monkeypatch):
    """``FP4_QATTN_DS_STORE=1``: the stored path runs and the recompute dq kernel is not
    launched; the default (env unset, measured faster on the H200), ``FP4_QATTN_DS_STORE=0`` and
    a byte limit below the scratch run the recompute kernel and store nothing."""
    from fullstack_fp4.attention import triton_bwd

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("recompute _dq_kernel launched")
    _, _, v, do, views, o, lse = _fwd(1, 2, 1, 64, 64, True)
    monkeypatch.delenv("FP4_QATTN_DS_STORE_MAX_BYTES", raising=False)
    monkeypatch.setenv("FP4_QATTN_DS_STORE", "1")
    real = triton_bwd._dq_kernel
    monkeypatch.setattr(triton_bwd, "_dq_kernel", NoLaunch())
    got = triton_bwd.attention_backward(do, o, lse, v, views, causal=True, scale=0.125)
    monkeypatch.setattr(triton_bwd, "_dq_kernel", real)
    for env, val in (("FP4_QATTN_DS_STORE", None), ("FP4_QATTN_DS_STORE", "0"),
                     ("FP4_QATTN_DS_STORE_MAX_BYTES", "2307")):
        with monkeypatch.context() as m:
            if val is None:
                m.delenv(env, raising=False)
            else:
                m.setenv(env, val)
            calls = _garbage_scratch(m)
            want = triton_bwd.attention_backward(do, o, lse, v, views, causal=True, scale=0.125)
            assert not calls, env
        assert DEV.type != "cpu" or _rel(got[0], want[0]) < ORDER_TOL


def test_scratch_bytes_and_selection(monkeypatch):
    from fullstack_fp4.attention.triton_ds_store import ds_store_bytes, use_ds_store
    monkeypatch.delenv("FP4_QATTN_DS_STORE", raising=False)
    monkeypatch.delenv("FP4_QATTN_DS_STORE_MAX_BYTES", raising=False)
    # the bench shapes (PERF.md): 2080 / 528 tiles per head, 2308 B per tile
    assert ds_store_bytes(1, 24, 4096, 4096, True) == 24 * 2080 * 2308 == 115_215_360
    assert ds_store_bytes(4, 24, 2048, 2048, True) == 96 * 528 * 2308 == 116_987_904
    assert ds_store_bytes(1, 24, 4096, 4096, False) == 24 * 64 * 64 * 2308
    assert ds_store_bytes(1, 1, 100, 100, True) == 3 * 2308          # ragged: 2 tiles a side
    assert not use_ds_store(1, 24, 4096, 4096, 128, True, True)      # default: off
    monkeypatch.setenv("FP4_QATTN_DS_STORE", "1")
    assert use_ds_store(1, 24, 4096, 4096, 128, True, True)
    assert use_ds_store(4, 24, 2048, 2048, 128, True, True)
    assert not use_ds_store(1, 24, 4096, 4096, 128, True, False)     # BF16 dS path
    assert not use_ds_store(1, 2, 64, 64, 96, True, True)            # head_dim 96
    assert not use_ds_store(8, 32, 8192, 8192, 128, True, True)      # 4.9 GB: over the limit
    assert not use_ds_store(1, 24, 4096, 4096, 128, True, True, ds_store=False)
    monkeypatch.setenv("FP4_QATTN_DS_STORE", "0")
    assert not use_ds_store(1, 2, 64, 64, 64, True, True)
    assert use_ds_store(1, 2, 64, 64, 64, True, True, ds_store=True)
    monkeypatch.setenv("FP4_QATTN_DS_STORE_MAX_BYTES", str(8 << 30))
    assert use_ds_store(2, 24, 8192, 8192, 128, True, True, ds_store=True)       # 0.9 GB
    assert not use_ds_store(4, 32, 8192, 8192, 128, True, True, ds_store=True)   # int32 offsets
