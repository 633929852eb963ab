"""The cuBLASLt path of the emulated NVFP4 GEMM (``fullstack_fp4/nvfp4/kernels/cublaslt.py``).

CPU: :func:`plan` — the mapping of a row-major ``D = A @ B`` with arbitrary unit-strided operand
layouts onto one column-major cuBLAS call — against an oracle that does what cuBLAS does with
those numbers: read each operand's *memory* column-major with the plan's rows, columns and
leading dimension, apply the transpose flag, multiply, and write ``D``'s memory column-major.
If the plan were wrong (a swapped flag, a wrong ld) the oracle would read other elements and
the product would differ from ``a @ b``.

CPU: the ``ctypes`` glue against a recording stand-in for libcublasLt (the argument order of
``cublasLtMatmul`` as cublasLt.h declares it, ``beta`` 0 or 1, a workspace per stream, the state
a CUDA graph capture needs made eagerly first (on any stream), the call's shape prepared once, a failing status
as a clear error).

GPU (skipped without CUDA): the call itself against the two-pass path (``torch.mm`` FP32 out +
the epilogue) on operands whose sums are exact in FP32, bit for bit, for every output mode.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch

from fullstack_fp4.nvfp4 import gemm
from fullstack_fp4.nvfp4.kernels import cublaslt


def _memory_view(t: torch.Tensor, rows: int, cols: int, ld: int) -> torch.Tensor:
    """``t``'s memory read as a column-major ``rows × cols`` matrix with leading dimension ld."""
    return t.as_strided((rows, cols), (1, ld))


def _cublas_oracle(p: cublaslt.Plan, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor) -> None:
    """What cuBLAS computes for plan ``p``: ``Dc = op(Ac) op(Bc)``, Ac = b's memory, Bc = a's."""
    ac = _memory_view(b, p.rows_a, p.cols_a, p.ld_a)
    bc = _memory_view(a, p.rows_b, p.cols_b, p.ld_b)
    ac = ac.t() if p.trans_a == 1 else ac
    bc = bc.t() if p.trans_b == 1 else bc
    assert ac.shape == (p.m, p.k) and bc.shape == (p.k, p.n)
    d.as_strided((p.m, p.n), (1, p.ld_d)).copy_(ac @ bc)


def _layout(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x``'s values in another memory layout: row-major, column-major (a ``.t()`` view) or
    row-major inside a wider buffer (a padded leading dimension)."""
    if kind == "row":
        return x.contiguous()
    if kind == "col":
        return x.t().contiguous().t()
    wide = torch.full((x.shape[0], x.shape[1] + 5), float("nan"), dtype=x.dtype)
    wide[:, : x.shape[1]] = x
    return wide[:, : x.shape[1]]


@pytest.mark.parametrize("a_kind", ["row", "col", "padded"])
@pytest.mark.parametrize("b_kind", ["row", "col", "padded"])
@pytest.mark.parametrize("d_kind", ["row", "padded"])
@pytest.mark.parametrize("mkn", [(7, 5, 3), (1, 4, 6), (6, 4, 1), (16, 32, 48)])
def test_plan_is_the_product_cublas_computes(a_kind, b_kind, d_kind, mkn):
    m, k, n = mkn
    g = torch.Generator().manual_seed(m * 100 + k * 10 + n)
    a = _layout(torch.randn(m, k, generator=g, dtype=torch.float64), a_kind)
    b = _layout(torch.randn(k, n, generator=g, dtype=torch.float64), b_kind)
    d = _layout(torch.zeros(m, n, dtype=torch.float64), d_kind)
    p = cublaslt.plan(a, b, d)
    assert p is not None and (p.m, p.n, p.k) == (n, m, k)
    _cublas_oracle(p, a, b, d)
    torch.testing.assert_close(d, a @ b, rtol=1e-12, atol=1e-12)


def test_plan_refuses_layouts_one_call_cannot_express():
    a = torch.randn(8, 6)
    b = torch.randn(6, 4)
    strided = torch.randn(16, 12)[::2, ::2]               # no unit stride on either axis
    assert cublaslt.plan(strided, b, torch.empty(8, 4)) is None
    assert cublaslt.plan(a, torch.randn(12, 8)[::2, ::2], torch.empty(8, 4)) is None
    assert cublaslt.plan(a, b, torch.empty(4, 8).t()) is None   # D column-major


def test_backend_switch_rejects_unknown_names():
    with pytest.raises(ValueError, match="cublaslt"):
        gemm.set_gemm_backend("cutlass")
    previous = gemm.set_gemm_backend("cublas")
    try:
        assert gemm.gemm_backend() == "cublas"
    finally:
        gemm.set_gemm_backend(previous)


_GPU = torch.cuda.is_available() and cublaslt.available()


@pytest.mark.skipif(not _GPU, reason="needs CUDA and libcublasLt")
@pytest.mark.parametrize("mode", ["bf16", "fp32", "+=fp32", "+=bf16"])
@pytest.mark.parametrize("b_kind", ["row", "col"])
def test_cublaslt_equals_two_pass_path_on_exact_operands(mode, b_kind):
    g = torch.Generator().manual_seed(3)

    def ints(*shape):   # products and sums exact in FP32: any accumulation order, same acc
        v = torch.randint(-6, 7, shape, generator=g).float()
        return (v * 2.0 ** torch.randint(-2, 2, shape, generator=g).float()).bfloat16()

    a = ints(200, 96).cuda()
    b = _layout(ints(96, 72), b_kind).cuda()
    ts_a, ts_b = torch.tensor(0.37, device="cuda"), torch.tensor([1.7e-3], device="cuda")
    prev = gemm.set_gemm_backend("cublas")
    try:
        if mode.startswith("+="):
            dt = torch.float32 if mode == "+=fp32" else torch.bfloat16
            start = (torch.randint(-64, 64, (200, 72), generator=g).float() * 0.25).to(dt).cuda()
            want, got = start.clone(), start.clone()
            gemm.decoded_matmul(a, b, ts_a, ts_b, accumulate_into=want)
            product = gemm.decoded_matmul(a, b, ts_a, ts_b, torch.float32)   # alpha·acc, rounded
            assert cublaslt.scaled_mm_cublaslt(a, b, ts_a, ts_b, accumulate_into=got) is None
        else:
            dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[mode]
            want = gemm.decoded_matmul(a, b, ts_a, ts_b, dt)
            got = cublaslt.scaled_mm_cublaslt(a, b, ts_a, ts_b, dt)
    finally:
        gemm.set_gemm_backend(prev)
    assert got.dtype == want.dtype
    with pytest.raises(ValueError, match="FP32 or BF16"):   # FP16 out: the two-pass path's job
        cublaslt.scaled_mm_cublaslt(a, b, ts_a, ts_b, torch.float16)
    if mode.startswith("+="):
        # cuBLAS may form alpha·acc + C with one rounding where the two-pass path rounds alpha·acc
        # first: the two differ by at most half an FP32 ulp of alpha·acc plus one ulp (of the
        # output dtype) of the sum — relative to the product, not to the sum, which can cancel
        eps = torch.finfo(dt).eps
        tol = torch.finfo(torch.float32).eps * product.abs() + eps * want.float().abs()
        assert bool(((got.float() - want.float()).abs() <= tol).all())
        assert not torch.equal(got, start)            # something was added
    else:
        assert torch.equal(got, want)


class _FakeLt:
    """A recording stand-in for libcublasLt: every function returns success (or ``fail``'s
    status), the heuristic returns one algorithm, and each matmul's pointers are kept."""

    def __init__(self, fail=None):
        self.fail, self.calls, self.matmuls, self.handles = fail or {}, [], [], 0

    def __getattr__(self, name):
        def fn(*args):
            self.calls.append(name)
            if name == "cublasLtCreate":
                self.handles += 1
                args[0]._obj.value = 1000 + self.handles
            elif name.endswith("Create"):
                args[0]._obj.value = 1
            elif name == "cublasLtMatmulAlgoGetHeuristic":
                args[-1]._obj.value = 1
            elif name == "cublasLtMatmul":   # cublasLt.h: 16 arguments, stream last
                assert len(args) == 16
                # alpha and beta are FP32 in (CPU) memory the call reads: read them as cuBLAS would
                self.matmuls.append(dict(alpha_value=ctypes.c_float.from_address(args[2].value).value,
                                         beta_value=ctypes.c_float.from_address(args[7].value).value,
                                         alpha=args[2].value, a=args[3].value, b=args[5].value,
                                         beta=args[7].value, c=args[8].value, d=args[10].value,
                                         workspace=args[13].value, stream=args[15].value))
            return self.fail.get(name, 0)
        return fn


@pytest.fixture
def fake_cuda(monkeypatch):
    """cublaslt's host glue on the CPU: the fake library, a settable current stream and capture
    flag, and fresh per-process state."""
    lib, env = _FakeLt(), dict(stream=0x5000, capturing=False, device_switches=0)
    monkeypatch.setattr(cublaslt, "_LIB", lib)
    monkeypatch.setattr(cublaslt, "_STATE", {})
    monkeypatch.setattr(cublaslt, "_CACHE", {})
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: env["stream"],
                        raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: env["capturing"])

    class _Switch:
        def __init__(self, dev):
            env["device_switches"] += 1

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "device", _Switch)
    return lib, env


def test_glue_workspace_per_stream_beta_and_state_made_once(fake_cuda):
    lib, env = fake_cuda
    a, b = torch.zeros(32, 48, dtype=torch.bfloat16), torch.zeros(48, 16, dtype=torch.bfloat16)
    one = torch.ones(())
    ts_a, ts_b = torch.tensor(0.37), torch.tensor([1.7e-3])
    out = cublaslt.scaled_mm_cublaslt(a, b, ts_a, ts_b)
    assert out.shape == (32, 16) and out.dtype == torch.bfloat16
    dst = torch.zeros(32, 16)
    assert cublaslt.scaled_mm_cublaslt(a, b, one, one, accumulate_into=dst) is None
    env["stream"] = 0x6000
    cublaslt.scaled_mm_cublaslt(a, b, one, one)
    m0, m1, m2 = lib.matmuls
    st = cublaslt._STATE[0]
    assert lib.handles == 1                                    # one handle for the device
    assert m0["beta"] == st["zero"].data_ptr() and m1["beta"] == st["one"].data_ptr()
    assert (m0["beta_value"], m1["beta_value"]) == (0.0, 1.0)
    assert m0["alpha_value"] == (ts_a * ts_b).item()            # one FP32 product, on the device
    assert m1["alpha_value"] == 1.0
    assert m0["a"] == b.data_ptr() and m0["b"] == a.data_ptr()  # cuBLAS's A is b (Dᵀ = bᵀ aᵀ)
    assert m1["c"] == m1["d"] == dst.data_ptr()                # added into dst in place
    assert m0["workspace"] == m1["workspace"] != m2["workspace"]   # one per stream
    assert (m0["stream"], m2["stream"]) == (0x5000, 0x6000)
    assert env["device_switches"] == 3                         # a's device differs from current
    # the descriptor, layouts and algorithm of a call shape are made once
    queries = lib.calls.count("cublasLtMatmulAlgoGetHeuristic")
    cublaslt.scaled_mm_cublaslt(a, b, one, one, accumulate_into=dst)
    assert lib.calls.count("cublasLtMatmulAlgoGetHeuristic") == queries
    assert lib.calls.count("cublasLtMatmul") == 4


def test_glue_capture_needs_state_made_eagerly(fake_cuda):
    lib, env = fake_cuda
    a = torch.zeros(16, 16, dtype=torch.bfloat16)
    env["capturing"] = True
    assert not cublaslt.ready(a)                               # nothing made yet: two-pass path
    env["capturing"] = False
    assert cublaslt.ready(a)
    cublaslt.scaled_mm_cublaslt(a, a, torch.ones(()), torch.ones(()))
    env["capturing"] = True
    assert cublaslt.ready(a)                                   # this stream has its workspace
    # a capture on a stream no eager call used (torch.cuda.graph's own): still one call, with
    # a workspace of that stream's own, made in the capture and kept for later captures
    env["stream"] = 0x7000
    assert cublaslt.ready(a)
    cublaslt.scaled_mm_cublaslt(a, a, torch.ones(()), torch.ones(()))
    cublaslt.scaled_mm_cublaslt(a, a, torch.ones(()), torch.ones(()))
    m0, m1, m2 = lib.matmuls
    assert m1["stream"] == m2["stream"] == 0x7000 and m0["stream"] == 0x5000
    assert m1["workspace"] == m2["workspace"] != m0["workspace"]
    assert lib.handles == 1


def test_glue_failure_status_is_a_clear_error(fake_cuda, monkeypatch):
    monkeypatch.setattr(cublaslt, "_LIB", _FakeLt(fail={"cublasLtMatmulAlgoGetHeuristic": 15}))
    a = torch.zeros(16, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="heuristic failed with status 15"):
        cublaslt.scaled_mm_cublaslt(a, a, torch.ones(()), torch.ones(()))


def test_backend_is_not_read_from_the_environment():
    """The two backends can differ by an ulp (accumulating epilogue), so no environment variable
    selects one: a run always starts on cuBLASLt; only ``set_gemm_backend`` switches."""
    code = "from fullstack_fp4.nvfp4 import gemm; print(gemm.gemm_backend())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "FULLSTACK_FP4_GEMM": "cublas"})
    assert r.returncode == 0 and r.stdout.strip() == "cublaslt", r.stderr
    with pytest.raises(ValueError, match="GEMM backend"):
        gemm.set_gemm_backend("cutlas")
    previous = gemm.set_gemm_backend("cublas")
    try:
        assert gemm.gemm_backend() == "cublas"
    finally:
        gemm.set_gemm_backend(previous)


def test_glue_try_declines_what_one_call_cannot_take_and_runs_nothing(fake_cuda):
    lib, _ = fake_cuda
    a, b = torch.zeros(32, 48, dtype=torch.bfloat16), torch.zeros(48, 16, dtype=torch.bfloat16)
    one = torch.ones(())
    strided = torch.zeros(96, 32, dtype=torch.bfloat16)[::2, ::2]          # no unit stride
    for args, kw in (((a, b, one, one, torch.float16), {}),                  # FP16 out
                     ((strided, b, one, one), {}),
                     ((a.float(), b, one, one), {}),                         # FP32 operand
                     ((a, b, one, one), dict(accumulate_into=torch.zeros(16, 32))),
                     ((a, b, one, one), dict(accumulate_into=torch.zeros(32, 16).half()))):
        assert cublaslt.try_scaled_mm(*args, **kw) == (False, None)
        with pytest.raises(ValueError, match="FP32 or BF16 output"):
            cublaslt.scaled_mm_cublaslt(*args, **kw)
    assert lib.matmuls == [] and "cublasLtCreate" not in lib.calls
    done, out = cublaslt.try_scaled_mm(a, b, one, one)
    assert done and out.shape == (32, 16) and len(lib.matmuls) == 1
