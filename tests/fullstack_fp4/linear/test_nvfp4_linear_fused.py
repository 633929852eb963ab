"""The NVFP4 linear's GPU path (fused operands) gives the reference composition's y, dX, dW bit for bit.

Oracle: each operand quantized by ``quantize_reference`` (RHT operands: ``hadamard16`` of the
zero-padded transpose), stochastic rounding fed the uniforms of the PyTorch stream
``sr_stream.sr_uniforms`` for the seeds the path must draw (``torch.randint(0, 2**31 - 1, (1,), generator=g)``, dY's first, then
RHT(dYᵀ)'s: what ``quantize_triton`` draws on the composed path), multiplied by
``nvfp4_matmul`` / ``nvfp4_matmul_nt`` with the same operand layouts, on the device the path
runs on. On CPU that GEMM is an FP32 ``torch.mm`` of the same values in the same layouts; on a
GPU it is the same cuBLAS call the path makes (a CPU GEMM's summation order is not a GPU's, so
the oracle's GEMMs run where the path's do), so equality is exact either way — except that the
cuBLASLt backend may round ``alpha·acc + buf`` once when it adds the wgrad into a buffer, which
that test allows on the GPU (one FP32 ulp of the product plus one of the sum).

The GPU path is selected for CUDA tensors only; on CPU (``TRITON_INTERPRET=1``) the tests call
it directly, and once through the autograd function with the dispatch forced.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn.functional as F

from fullstack_fp4.linear import BufferAccumulator
from fullstack_fp4.nvfp4 import DEFAULT_SIGNS, NVFP4Tensor, hadamard16, quantize_reference
from fullstack_fp4.nvfp4.gemm import gemm_backend, nvfp4_matmul, nvfp4_matmul_nt
from fullstack_fp4.nvfp4.sr_stream import sr_uniforms

# the package re-exports the function ``nvfp4_linear``, which shadows the submodule's name
lin = importlib.import_module("fullstack_fp4.linear.nvfp4_linear")
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
pytestmark = pytest.mark.skipif(not (_INTERPRET or torch.cuda.is_available()),
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if (torch.cuda.is_available() and not _INTERPRET) else "cpu"


def _data(t, fin, fout, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, fin, generator=g) * torch.logspace(-1, 1, fin)).bfloat16()
    w = (torch.randn(fout, fin, generator=g) / fin ** 0.5).bfloat16()
    dy = torch.randn(t, fout, generator=g).bfloat16()
    return x, w, dy


def _rht_t(m):
    return hadamard16(F.pad(m.float(), (0, 0, 0, (-m.shape[0]) % 16)).t(), DEFAULT_SIGNS)


def _seeds(gen_seed, n):
    g = torch.Generator().manual_seed(gen_seed)
    return [int(torch.randint(0, 2**31 - 1, (1,), generator=g).item()) for _ in range(n)]


def _oracle(x, w, dy, seeds, scale=None, dw_dtype=None):
    """y, dX, dW and the saved codes by the reference composition (``scale``: the factor an
    amax_reduce applies to every amax; ``dw_dtype``: dW's dtype, default W's)."""
    def q(m, **kw):
        if scale is not None:
            kw["global_amax"] = scale * m.float().abs().amax()
        return quantize_reference(m, **kw)

    qx, qw = q(x), q(w, tile=(16, 16))
    xt, dyt = _rht_t(x), _rht_t(dy)
    qxt = q(xt)
    qdy = q(dy, rounding="stochastic", rand=sr_uniforms(dy.shape, seeds[0]))
    qdyt = q(dyt, rounding="stochastic", rand=sr_uniforms(dyt.shape, seeds[1]))
    y = nvfp4_matmul(_on_dev(qx), _on_dev(qw), out_dtype=x.dtype)
    dx = nvfp4_matmul_nt(_on_dev(qdy), _on_dev(qw), out_dtype=x.dtype)
    dw = nvfp4_matmul(_on_dev(qdyt), _on_dev(qxt), out_dtype=dw_dtype or w.dtype)
    return y.cpu(), dx.cpu(), dw.cpu(), qw, qxt


def _on_dev(q: NVFP4Tensor) -> NVFP4Tensor:
    """The reference's codes on the device the path runs on (its GEMM, see module docstring)."""
    return NVFP4Tensor(q.data.to(DEV), q.block_scale.to(DEV), q.tensor_scale.to(DEV), q.shape,
                       q.dtype, q.tile)


def _eq(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


def _eq_q(a, b):
    assert torch.equal(a.data.cpu(), b.data.cpu())
    assert torch.equal(a.block_scale.cpu().view(torch.uint8), b.block_scale.cpu().view(torch.uint8))
    assert int(a.tensor_scale.cpu().view(torch.int32)) == int(b.tensor_scale.cpu().view(torch.int32))


def test_fused_forward_backward_bit_identical_to_reference_composition():
    # T = 40: the wgrad token blocks are zero-padded to 48.
    x, w, dy = _data(40, 64, 48, 0)
    y, qw, qxt = lin._fused_forward(x.to(DEV), w.to(DEV), x.dtype, True, True, None)
    dx, dw = lin._fused_backward(dy.to(DEV), qw, qxt, x.dtype, w.dtype,
                                 torch.Generator().manual_seed(11), None)
    ry, rdx, rdw, rqw, rqxt = _oracle(x, w, dy, _seeds(11, 2))
    _eq_q(qw, rqw)
    _eq_q(qxt, rqxt)
    _eq(y, ry)
    _eq(dx, rdx)
    _eq(dw, rdw)


def test_fused_path_only_what_is_needed_and_amax_reduce_order():
    x, w, dy = _data(32, 64, 32, 1)
    seen = []

    def reduce(a):
        seen.append(int(a.float().view(torch.int32)))
        return a * 2

    def bits(v):
        return int(v.float().abs().amax().view(torch.int32))

    y, qw, qxt = lin._fused_forward(x.to(DEV), w.to(DEV), x.dtype, True, True, reduce)
    dx, dw = lin._fused_backward(dy.to(DEV), qw, qxt, x.dtype, w.dtype,
                                 torch.Generator().manual_seed(3), reduce)
    # x, W, RHT(xᵀ) in the forward; dY, RHT(dYᵀ) in the backward: the composed path's order
    assert seen == [bits(x), bits(w), bits(_rht_t(x)), bits(dy), bits(_rht_t(dy))]
    ry, rdx, rdw, _, _ = _oracle(x, w, dy, _seeds(3, 2), scale=2.0)
    _eq(y, ry)
    _eq(dx, rdx)
    _eq(dw, rdw)
    # no weight gradient wanted: RHT(xᵀ) is not quantized, dY draws only its own seed
    y2, qw2, qxt2 = lin._fused_forward(x.to(DEV), w.to(DEV), x.dtype, True, False, None)
    assert qxt2 is None and qw2 is not None
    dx2, dw2 = lin._fused_backward(dy.to(DEV), qw2, None, x.dtype, w.dtype,
                                   torch.Generator().manual_seed(3), None)
    assert dw2 is None
    _eq(dx2, _oracle(x, w, dy, _seeds(3, 2))[1])


def test_autograd_function_on_the_fused_path(monkeypatch):
    """The Function's wiring (saved codes, megatron [s, b, h] shapes, bias) with the GPU path."""
    monkeypatch.setattr(lin, "_use_fused", lambda t: True)
    x, w, dy = _data(48, 64, 32, 2)
    b = torch.randn(32, generator=torch.Generator().manual_seed(5)).bfloat16()
    xx = x.reshape(6, 8, 64).to(DEV).requires_grad_()
    ww, bb = w.to(DEV).requires_grad_(), b.to(DEV).requires_grad_()
    out = lin.nvfp4_linear(xx, ww, bb, generator=torch.Generator().manual_seed(8))
    out.backward(dy.reshape(6, 8, 32).to(DEV))
    ry, rdx, rdw, _, _ = _oracle(x, w, dy, _seeds(8, 2))
    _eq(out.detach().reshape(48, 32), ry + b)
    _eq(xx.grad.reshape(48, 64), rdx)
    _eq(ww.grad, rdw)
    assert torch.equal(bb.grad.cpu(), dy.float().sum(0).bfloat16())


# ~30 s a case under the interpreter: make test-all
@pytest.mark.long
@pytest.mark.parametrize("buf_dtype", [torch.float32, torch.bfloat16])
def test_fused_backward_accumulates_the_wgrad_into_a_buffer(buf_dtype, monkeypatch):
    """``wgrad_into``: the buffer ends as ``(buf + dW_fp32)`` rounded once to its dtype, dW_fp32
    the reference composition's wgrad in FP32 (acc·alpha); dX and the draws unchanged. Also
    through the autograd Function with an accumulator."""
    x, w, dy = _data(40, 64, 48, 4)
    _, rdx, rdw32, _, _ = _oracle(x, w, dy, _seeds(13, 2), dw_dtype=torch.float32)
    b0 = torch.randn(48, 64, generator=torch.Generator().manual_seed(2)).to(buf_dtype)
    want = (b0.float() + rdw32).to(buf_dtype)

    def same_sum(got):
        if DEV == "cpu" or gemm_backend() != "cublaslt":
            return torch.equal(got.cpu(), want)
        tol = torch.finfo(torch.float32).eps * rdw32.abs() + torch.finfo(buf_dtype).eps * want.float().abs()
        return bool(((got.cpu().float() - want.float()).abs() <= tol).all())

    _, qw, qxt = lin._fused_forward(x.to(DEV), w.to(DEV), x.dtype, True, True, None)
    buf = b0.clone().to(DEV)      # .to(cpu) would alias b0
    dx, dw = lin._fused_backward(dy.to(DEV), qw, qxt, x.dtype, w.dtype,
                                 torch.Generator().manual_seed(13), None, wgrad_into=buf)
    assert dw is None
    _eq(dx, rdx)
    assert same_sum(buf)

    monkeypatch.setattr(lin, "_use_fused", lambda t: True)
    sink = BufferAccumulator(b0.clone().to(DEV))
    xx, ww = x.to(DEV).requires_grad_(), w.to(DEV).requires_grad_()
    lin.nvfp4_linear(xx, ww, generator=torch.Generator().manual_seed(13),
                     wgrad_accumulator=sink).backward(dy.to(DEV))
    assert ww.grad is None and same_sum(sink.buf)
    _eq(xx.grad, rdx)


@pytest.mark.parametrize("where", ["x", "dy"])
def test_fused_path_nan_propagates_without_raising(where, monkeypatch):
    x, w, dy = _data(32, 64, 32, 4)
    if where == "x":
        x[5, 7] = float("nan")
    else:
        dy[5, 7] = float("nan")
    step = (lin._fused_forward if where == "x" else lin._fused_backward)
    monkeypatch.setattr(lin, "_check_finite", lambda t: True)    # the raising form
    with pytest.raises(ValueError, match="NaN or Inf"):
        if where == "x":
            step(x.to(DEV), w.to(DEV), x.dtype, True, True, None)
        else:
            q = lin._fused_forward(x.to(DEV), w.to(DEV), x.dtype, True, True, None)
            step(dy.to(DEV), q[1], q[2], x.dtype, w.dtype, None, None)
    monkeypatch.setattr(lin, "_check_finite", lambda t: False)   # the default: no sync, no raise
    y, qw, qxt = lin._fused_forward(x.to(DEV), w.to(DEV), x.dtype, True, True, None)
    dx, dw = lin._fused_backward(dy.to(DEV), qw, qxt, x.dtype, w.dtype, None, None)
    if where == "x":
        assert torch.isnan(y.float()).all() and torch.isnan(dw.float()).all()
        assert not torch.isnan(dx.float()).any()
    else:
        assert not torch.isnan(y.float()).any()
        assert torch.isnan(dx.float()).all() and torch.isnan(dw.float()).all()


def test_wgrad_operand_public_function_on_the_fused_path(monkeypatch):
    monkeypatch.setattr(lin, "_use_fused", lambda t: True)
    x, _, dy = _data(40, 64, 48, 6)
    _eq_q(lin.quantize_wgrad_operand(x.to(DEV), rounding="nearest"), quantize_reference(_rht_t(x)))
    q = lin.quantize_wgrad_operand(dy.to(DEV), rounding="stochastic",
                                   generator=torch.Generator().manual_seed(9))
    dyt = _rht_t(dy)
    _eq_q(q, quantize_reference(dyt, rounding="stochastic",
                                rand=sr_uniforms(dyt.shape, _seeds(9, 1)[0])))
    assert q.shape == (48, 48) and q.dtype == torch.bfloat16


@pytest.mark.skipif(_INTERPRET or not torch.cuda.is_available(), reason="a CUDA graph: GPU only")
def test_cuda_graph_capture_takes_the_one_call_gemms(monkeypatch):
    """fwd+bwd captured by ``torch.cuda.graph`` (on its own capture stream, which no eager call
    used) runs its three GEMMs as single cuBLASLt calls, not the two-pass path (FP32 output +
    an epilogue pass each), and the replay gives the eager forward's bits. Before 2026-12-04
    every capture fell back to the two-pass path (cublaslt.ready asked for a workspace made
    eagerly on the capture stream)."""
    from fullstack_fp4.nvfp4 import gemm
    if gemm.gemm_backend() != "cublaslt":
        pytest.skip("the cuBLASLt GEMM backend is not the one in use")
    two_pass = []
    real = gemm._epilogue
    monkeypatch.setattr(gemm, "_epilogue", lambda *a, **k: two_pass.append(1) or real(*a, **k))
    x, w, dy = (t.to(DEV) for t in _data(64, 128, 96, 11))
    x.requires_grad_()
    w.requires_grad_()

    def run():
        x.grad = w.grad = None
        y = lin.nvfp4_linear(x, w)
        y.backward(dy)
        return y
    y_eager = run().detach().clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = run()
    g.replay()
    torch.cuda.synchronize()
    assert not two_pass
    assert torch.equal(y.view(torch.int16), y_eager.view(torch.int16))
    assert x.grad is not None and w.grad is not None and torch.isfinite(w.grad.float()).all()


# ---------------------------------------------------------------- every access inside its tensors
# The medium model's linears (configs/ablation/medium.yaml: 16,384 tokens a micro-batch; QKV
# 768→1280, FC1 768→4096, FC2 2048→768) and a token count of partial tiles; on the CPU one small
# layer through the interpreter (~20 s a case: make test-all)
_ACCUMULATION_SHAPES = ([(16384, 768, 1280), (16384, 768, 4096), (16384, 2048, 768), (1040, 768, 768)]
                        if DEV == "cuda" else [pytest.param(40, 64, 48, marks=pytest.mark.long)])


@pytest.mark.parametrize("t, fin, fout", _ACCUMULATION_SHAPES)
@pytest.mark.parametrize("offset", [64, 1])
def test_wgrad_accumulation_stays_inside_its_view(t, fin, fout, offset, monkeypatch):
    """Two micro-batches each adding dW into a view of a zeroed FP32 buffer, as megatron's
    main_grad is a view of its grad buffer: at element offset 64, and at 1 (an output only 4-byte
    aligned, which the cuBLASLt call must be planned for). The buffer outside the view stays
    zero, and the view holds the sum of the two FP32 dWs that ``nvfp4_linear_backward`` returns
    for the same draws (to GEMM summation order on the GPU: the calls may take different
    algorithms). Under ``PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck``
    every access of the layer's kernels is checked too (docs/reproduction.md, "Memory and
    faults")."""
    monkeypatch.setattr(lin, "_use_fused", lambda t: True)     # the GPU path, also on the CPU
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(fout, fin, generator=g) / fin ** 0.5).bfloat16().to(DEV)
    buf = torch.zeros(fout * fin + 2 * offset, device=DEV)
    view = buf[offset:offset + fout * fin].view(fout, fin)
    want = torch.zeros(fout, fin, dtype=torch.float64, device=DEV)
    for mb in range(2):
        x = torch.randn(t, fin, generator=g).bfloat16().to(DEV)
        dy = torch.randn(t, fout, generator=g).bfloat16().to(DEV)
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = lin.nvfp4_linear(xx, ww, generator=torch.Generator().manual_seed(mb),
                             wgrad_accumulator=BufferAccumulator(view))
        y.backward(dy)
        assert ww.grad is None and torch.isfinite(xx.grad.float()).all()
        # dX is asked for too, so the draws are the autograd backward's (dY's seed, then RHT(dYᵀ)'s)
        _, qw, qxt = lin.nvfp4_linear_forward(x, w, True, True)
        _, dw = lin.nvfp4_linear_backward(dy, qw, qxt, x.dtype, torch.float32,
                                          generator=torch.Generator().manual_seed(mb))
        want += dw.double()
    assert not buf[:offset].any() and not buf[offset + fout * fin:].any()
    err = (view.double() - want).norm() / want.norm()
    assert err < 1e-5, err


def _gpu_tiles(monkeypatch):
    """The tile sizes a GPU launch takes (the interpreter's own are smaller, so masked lanes of
    the GPU's tiles would go unexercised): 32 / 64 channel blocks a program in the two-way
    quantizer, 256 blocks on 8 warps in the decode, the GPU's epilogue block."""
    from fullstack_fp4.nvfp4.kernels import decode, gemm_epilogue, quantize_two_ways

    monkeypatch.setattr(quantize_two_ways, "_interpreter", lambda: False)
    monkeypatch.setattr(decode, "_flat_config", lambda: (256, 8))
    monkeypatch.setattr(gemm_epilogue, "_INTERPRET", False)


@pytest.mark.skipif(not _INTERPRET, reason="the bounds check runs under TRITON_INTERPRET=1")
def test_bounds_check_catches_an_access_past_a_tensor():
    """The check itself: a kernel reading one element past its tensor's end (into memory the
    tensor's storage still owns, as a view of a larger buffer) is reported; the same kernel in
    bounds is not."""
    import triton
    import triton.language as tl

    from tests.fullstack_fp4.triton_bounds import bounds_checked

    @triton.jit
    def shifted_copy(x_ptr, y_ptr, n, shift, B: tl.constexpr):
        o = tl.arange(0, B)
        tl.store(y_ptr + o, tl.load(x_ptr + o + shift, mask=o < n, other=0.0), mask=o < n)

    x, y = torch.zeros(100)[:16], torch.zeros(16)
    with bounds_checked() as bad:
        shifted_copy[(1,)](x, y, 16, 0, B=32)
    assert bad == []
    with bounds_checked() as bad:
        shifted_copy[(1,)](x, y, 16, 1, B=32)
    assert bad == [("shifted_copy", "load", 1)]


@pytest.mark.skipif(not _INTERPRET, reason="the bounds check runs under TRITON_INTERPRET=1")
@pytest.mark.parametrize("t, fin, fout", [
    # a partial tile in every kernel; the wgrad's 40 tokens zero-padded to 48 (~20 s: make test-all)
    pytest.param(40, 80, 144, marks=pytest.mark.long),
    # 40 / 72 channel blocks: a second tile of 32 (x, W) / 64 (dY) blocks, partly masked (~45 s)
    pytest.param(16, 640, 1152, marks=[pytest.mark.slow, pytest.mark.long]),
    # every tile full (the unmasked EVEN path of each call: 32 channel blocks a program for x and
    # W, 64 for dY), and 4 token blocks, so RHT(xᵀ)'s codes are stored four blocks a word
    pytest.param(64, 512, 1024, marks=[pytest.mark.slow, pytest.mark.long]),
])
def test_fused_linear_touches_only_its_tensors_at_gpu_tiles(t, fin, fout, monkeypatch):
    """Forward and backward of the fused path at the GPU's tile sizes: no load, store or atomic
    outside the launch's tensors (an access past a tensor faults on a GPU only when it leaves
    mapped memory, so it shows as an intermittent launch failure there; tests/fullstack_fp4/
    triton_bounds.py), and y, dX, dW, the saved codes equal to the reference composition's."""
    from tests.fullstack_fp4.triton_bounds import bounds_checked

    _gpu_tiles(monkeypatch)
    x, w, dy = _data(t, fin, fout, 0)
    with bounds_checked() as bad:
        y, qw, qxt = lin._fused_forward(x, w, x.dtype, True, True, None)
        dx, dw = lin._fused_backward(dy, qw, qxt, x.dtype, w.dtype, torch.Generator().manual_seed(11), None)
    assert bad == []
    ry, rdx, rdw, rqw, rqxt = _oracle(x, w, dy, _seeds(11, 2))
    _eq(y, ry)
    _eq(dx, rdx)
    _eq(dw, rdw)
    _eq_q(qw, rqw)
    _eq_q(qxt, rqxt)
