"""The emulated NVFP4 GEMM through cuBLASLt with the tensor scales read on the device.

Why: ``torch.mm`` can scale its output only by a *host* number, and the NVFP4 tensor scales
live on the GPU (reading them syncs the host once per GEMM). So the two-pass path writes an FP32
accumulator and scales it in a second pass (``gemm_epilogue.py``): 4 + 4 more bytes per
output element (``docs/perf/nvfp4.md``). cuBLASLt itself takes ``alpha`` and ``beta`` by *device* pointer
(``CUBLASLT_POINTER_MODE_DEVICE``): the GEMM then writes ``alpha · (a @ b)`` in the output dtype
directly, or adds it into an FP32 / BF16 buffer (``beta = 1``, the wgrad into ``main_grad``).
PyTorch does not expose that mode, so this module calls ``libcublasLt`` (the one PyTorch
loaded) through ``ctypes``. (A Triton GEMM with the epilogue inside was slower than the
two-pass path on four of the six linear GEMM shapes even at its best tiles: docs/perf/nvfp4.md.)

Arithmetic: BF16 operands (decoded NVFP4, exact), FP32 accumulation in cuBLAS's own order (the
same kernels ``torch.mm`` picks), ``alpha = fp32(ts_a) · fp32(ts_b)`` formed on the device by
one FP32 product (as every other path), then cuBLAS's epilogue ``D = alpha · acc (+ beta · C)``
in FP32 and one rounding to D's dtype. Against ``gemm.decoded_matmul``'s cuBLAS path
(``(acc · alpha).to(dtype)``): the same bits when nothing is added (checked on the GPU by
``benchmarks/bench_nvfp4_gemm.py`` with operands whose sums are exact); when adding into a buffer,
cuBLAS may fuse ``alpha · acc + C`` into one rounding where the two-pass path rounds twice — at
most one FP32 ulp of the product plus one ulp of the sum apart, the size of the
accumulation-order freedom every GEMM has.

Layout: a row-major ``D [M, N] = A [M, K] @ B [K, N]`` is, in cuBLAS's column-major terms,
``Dᵀ = Bᵀ Aᵀ``; :func:`plan` maps each operand's strides (unit stride on either axis) to a
transpose flag and a leading dimension, without copies. Tested on the CPU against a
column-major GEMM written out in torch (``tests/fullstack_fp4/nvfp4/test_cublaslt.py``).

Per process and device: one handle and the device constants 0 and 1 (``beta``); per stream a
32 MiB workspace; per (shapes, layouts, dtypes, alignments): one operation descriptor, four
layouts and the heuristic's first algorithm — each made on first use and kept. Inside a CUDA
graph capture a call runs only once its device and stream have them (:func:`ready`; a captured
fill of the constants would not run until the graph replays): ``gemm.py`` takes the two-pass
path otherwise, which captures as it is. Calls are captured like any cuBLAS call.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Dict, NamedTuple, Optional, Tuple

import torch

__all__ = ["Plan", "plan", "available", "ready", "try_scaled_mm", "scaled_mm_cublaslt"]

# cublasLt.h / cublas_api.h / library_types.h (CUDA 12)
_COMPUTE_32F = 68
_R_32F, _R_16BF = 0, 14
_DESC_POINTER_MODE, _DESC_TRANSA, _DESC_TRANSB = 2, 3, 4
_POINTER_MODE_DEVICE = 1
_OP_N, _OP_T = 0, 1
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT = {"a": 5, "b": 6, "c": 7, "d": 8}
_WORKSPACE_BYTES = 32 << 20
# D types with BF16 operands: FP16 has no kernel (cublasLtMatmulAlgoGetHeuristic answers
# NOT_SUPPORTED on the H200), so an FP16 output takes the two-pass path
_DTYPES = {torch.float32: _R_32F, torch.bfloat16: _R_16BF}


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class Plan(NamedTuple):
    """cuBLAS's view of ``D [M, N] = A [M, K] @ B [K, N]`` (row-major logic): ``Dc = op(Ac) ·
    op(Bc)`` with ``Ac`` the memory of B, ``Bc`` the memory of A, ``Dc = Dᵀ`` column-major."""
    m: int            # = N
    n: int            # = M
    k: int
    trans_a: int      # op on B's memory
    rows_a: int
    cols_a: int
    ld_a: int
    trans_b: int      # op on A's memory
    rows_b: int
    cols_b: int
    ld_b: int
    ld_d: int


def _operand(t: torch.Tensor, rows_if_n: int,
             cols_if_n: int) -> Optional[Tuple[int, int, int, int]]:
    """(op, rows, cols, ld) of a 2-D tensor read column-major so that op(view) is ``tᵀ``:
    unit stride along dim 1 → the view is ``tᵀ`` itself (op N); along dim 0 → the view is
    ``t`` (op T). None if neither stride is 1 or the leading dimension is too small."""
    r, c = t.shape
    if t.stride(1) == 1 and t.stride(0) >= max(1, c):
        return _OP_N, rows_if_n, cols_if_n, t.stride(0)
    if t.stride(0) == 1 and t.stride(1) >= max(1, r):
        return _OP_T, r, c, t.stride(1)
    if r == 1 and t.stride(1) == 1:          # one row: any row stride will do
        return _OP_N, rows_if_n, cols_if_n, max(1, c)
    if c == 1 and t.stride(0) == 1:          # one column
        return _OP_T, r, c, max(1, r)
    return None


def plan(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor) -> Optional[Plan]:
    """The cuBLAS call for ``d = a @ b`` (shapes ``[M, K]``, ``[K, N]``, ``[M, N]``), or None if
    a stride pattern does not map (``d`` needs unit stride along dim 1)."""
    m_, k = a.shape
    n_ = b.shape[1]
    pa = _operand(b, n_, k)     # want op = bᵀ [N, K]
    pb = _operand(a, k, m_)     # want op = aᵀ [K, M]
    if pa is None or pb is None:
        return None
    if d.stride(1) != 1 and n_ > 1:
        return None
    ld_d = d.stride(0) if m_ > 1 else max(1, n_)
    if ld_d < max(1, n_):
        return None
    return Plan(n_, m_, k, *pa, *pb, ld_d)


_LIB = None
_STATE: Dict[int, dict] = {}          # device index -> handle, constants, workspace per stream
_CACHE: Dict[tuple, tuple] = {}       # key -> (desc, layouts, algo)


def _lib():
    """libcublasLt as PyTorch loaded it (the soname first, then the nvidia wheel's folder)."""
    global _LIB
    if _LIB is None:
        names = ["libcublasLt.so.12", "libcublasLt.so.13", "libcublasLt.so"]
        site = os.path.dirname(os.path.dirname(torch.__file__))
        for spec in ("nvidia/cublas/lib/libcublasLt.so*", "nvidia/cu13/lib/libcublasLt.so*"):
            names += sorted(glob.glob(os.path.join(site, spec)))
        for name in names:
            try:
                _LIB = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if _LIB is None:
            raise RuntimeError("libcublasLt not found (looked for "
                               + ", ".join(names[:3]) + " …)")
    return _LIB


def available() -> bool:
    """Whether the cuBLASLt path can run here (CUDA present and the library loads)."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    try:
        _lib()
    except RuntimeError:
        return False
    return True


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


def _index(dev: torch.device) -> int:
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _device_state(dev: torch.device) -> dict:
    """The handle and the constants 0 and 1 of ``dev``, made on first use (which must not be
    inside a graph capture: a captured fill would not run until the graph replays)."""
    idx = _index(dev)
    st = _STATE.get(idx)
    if st is None:
        handle = ctypes.c_void_p()
        _check(_lib().cublasLtCreate(ctypes.byref(handle)), "create")
        st = dict(handle=handle, workspaces={},
                  zero=torch.zeros(1, dtype=torch.float32, device=dev),
                  one=torch.ones(1, dtype=torch.float32, device=dev))
        _STATE[idx] = st
    return st


def _workspace(st: dict, dev: torch.device, stream: int) -> torch.Tensor:
    """One workspace per stream: two streams running GEMMs at once must not share one (as
    PyTorch keeps one cuBLAS workspace per handle and stream)."""
    ws = st["workspaces"].get(stream)
    if ws is None:
        ws = st["workspaces"][stream] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    return ws


def ready(a: torch.Tensor) -> bool:
    """Whether a call on ``a``'s device and current stream can run now: always outside a CUDA
    graph capture; inside one once the device's handle and constants exist (made by an eager
    call on any stream: the caller takes the two-pass path otherwise). A stream without a
    workspace yet gets one in the capture, from the graph's memory pool (``torch.empty`` is
    capture-safe), as PyTorch makes its own cuBLAS workspace for a capture stream.
    (``torch.cuda.graph`` captures on a stream of its own, which no eager call has used: asking
    for the capture stream's workspace here would send every capture down the two-pass path.)"""
    if not torch.cuda.is_current_stream_capturing():
        return True
    return _STATE.get(_index(a.device)) is not None


def _raw_stream(dev: torch.device) -> int:
    """The current stream of ``dev`` as the ``cudaStream_t`` value (no Stream object: host time
    per GEMM matters where the linear waits on the host)."""
    return torch._C._cuda_getCurrentRawStream(_index(dev))


def _alpha(ts_a: torch.Tensor, ts_b: torch.Tensor) -> torch.Tensor:
    """``fp32(ts_a) · fp32(ts_b)`` on the device: one multiply for the FP32 tensor scales the
    quantizers make (each further view or cast is another dispatch on the host's critical path)."""
    if ts_a.dtype != torch.float32 or ts_b.dtype != torch.float32:
        ts_a, ts_b = ts_a.to(torch.float32), ts_b.to(torch.float32)
    return torch.mul(ts_a.detach(), ts_b.detach())


def _alignment(t: torch.Tensor) -> int:
    p = t.data_ptr()
    return 256 if p % 256 == 0 else (p & -p)


def _layout(dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
    lay = ctypes.c_void_p()
    _check(_lib().cublasLtMatrixLayoutCreate(ctypes.byref(lay), ctypes.c_int(dtype),
                                             ctypes.c_uint64(rows), ctypes.c_uint64(cols),
                                             ctypes.c_int64(ld)), "layout")
    return lay


def _set(fn, obj, attr: int, value, ctype) -> None:
    v = ctype(value)
    _check(fn(obj, ctypes.c_int(attr), ctypes.byref(v), ctypes.c_size_t(ctypes.sizeof(v))),
           f"set attribute {attr}")


def _prepared(p: Plan, d_type: int, aligns: tuple, handle) -> tuple:
    """The descriptor, layouts and algorithm of one call shape under ``handle`` (a device's: the
    heuristic's pick depends on the GPU), made once."""
    key = (handle.value, p, d_type, aligns)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    lib = _lib()
    desc = ctypes.c_void_p()
    _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), ctypes.c_int(_COMPUTE_32F),
                                        ctypes.c_int(_R_32F)), "descriptor")
    _set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_POINTER_MODE, _POINTER_MODE_DEVICE,
         ctypes.c_int32)
    _set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_TRANSA, p.trans_a, ctypes.c_int32)
    _set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_TRANSB, p.trans_b, ctypes.c_int32)
    lay_a = _layout(_R_16BF, p.rows_a, p.cols_a, p.ld_a)
    lay_b = _layout(_R_16BF, p.rows_b, p.cols_b, p.ld_b)
    lay_d = _layout(d_type, p.m, p.n, p.ld_d)
    pref = ctypes.c_void_p()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
    _set(lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_MAX_WORKSPACE_BYTES,
         _WORKSPACE_BYTES, ctypes.c_uint64)
    for name, al in zip("abcd", aligns):
        _set(lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_MIN_ALIGNMENT[name], al,
             ctypes.c_uint32)
    result, count = _Heuristic(), ctypes.c_int(0)
    _check(lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, lay_a, lay_b, lay_d, lay_d, pref, 1,
                                              ctypes.byref(result), ctypes.byref(count)),
           "heuristic")
    lib.cublasLtMatmulPreferenceDestroy(pref)
    if count.value < 1:
        raise RuntimeError(f"cuBLASLt has no algorithm for {p}")
    hit = (desc, lay_a, lay_b, lay_d, result.algo)
    _CACHE[key] = hit
    return hit


def try_scaled_mm(a: torch.Tensor, b: torch.Tensor, ts_a: torch.Tensor, ts_b: torch.Tensor,
                  out_dtype: torch.dtype = torch.bfloat16,
                  accumulate_into: Optional[torch.Tensor] = None,
                  alpha: Optional[torch.Tensor] = None
                  ) -> Tuple[bool, Optional[torch.Tensor]]:
    """:func:`scaled_mm_cublaslt` if one cuBLASLt call takes these operands: ``(True, output)``
    (the output None when added into ``accumulate_into``), else ``(False, None)`` with nothing
    run — the caller's other path then does the GEMM. The operands are checked and planned once
    (this is the emulated GEMM's hot path, where the linear waits on the host). ``alpha``: the
    product ``ts_a · ts_b`` already made on the device (FP32, 1 element), read in its place."""
    m, k = a.shape
    n = b.shape[1]
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        return False, None
    if accumulate_into is None:
        if out_dtype not in _DTYPES:
            return False, None
        d = torch.empty((m, n), dtype=out_dtype, device=a.device)
    else:
        d = accumulate_into
        if d.dtype not in _DTYPES or tuple(d.shape) != (m, n):
            return False, None
    p = plan(a, b, d)
    if p is None:
        return False, None
    out = None if accumulate_into is not None else d
    if m == 0 or n == 0:
        return True, out
    if k == 0:
        if accumulate_into is None:
            d.zero_()
        return True, out
    if a.device.index != torch.cuda.current_device():
        with torch.cuda.device(a.device):      # the launch goes to the current device's context
            _matmul(a, b, ts_a, ts_b, d, p, accumulate_into is not None, alpha)
    else:
        _matmul(a, b, ts_a, ts_b, d, p, accumulate_into is not None, alpha)
    return True, out


def scaled_mm_cublaslt(a: torch.Tensor, b: torch.Tensor, ts_a: torch.Tensor, ts_b: torch.Tensor,
                       out_dtype: torch.dtype = torch.bfloat16,
                       accumulate_into: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """``((a @ b) · (ts_a · ts_b)).to(out_dtype)`` (FP32 or BF16) for CUDA BF16 ``a [M, K]``,
    ``b [K, N]`` (unit stride on either axis) and 1-element FP32 tensor scales, in one cuBLASLt
    call with no host sync; with ``accumulate_into`` (``[M, N]`` FP32 or BF16, unit stride along
    dim 1) the scaled product is added into it (``beta = 1``) and None is returned. Raises
    ``ValueError`` for operands it does not take (:func:`plan`)."""
    done, out = try_scaled_mm(a, b, ts_a, ts_b, out_dtype, accumulate_into)
    if not done:
        d = accumulate_into
        raise ValueError(
            "cuBLASLt path: BF16 operands [M, K] @ [K, N], each unit-strided on one axis, and an "
            f"FP32 or BF16 output with unit stride along dim 1; got {a.dtype} {tuple(a.shape)} "
            f"strides {a.stride()} @ {b.dtype} {tuple(b.shape)} strides {b.stride()} -> "
            + (f"{out_dtype}" if d is None else f"{d.dtype} {tuple(d.shape)} strides {d.stride()}"))
    return out


def _matmul(a, b, ts_a, ts_b, d, p: Plan, accumulate: bool, alpha=None) -> None:
    st = _device_state(a.device)
    stream = _raw_stream(a.device)
    workspace = _workspace(st, a.device, stream)
    if alpha is None:
        alpha = _alpha(ts_a, ts_b)
    elif alpha.dtype != torch.float32 or alpha.device != a.device:
        raise ValueError("alpha must be an FP32 tensor on the operands' device")
    if alpha.numel() != 1:
        raise ValueError(f"tensor scales must have one element each, got {tuple(ts_a.shape)} "
                         f"and {tuple(ts_b.shape)}")
    beta = st["one"] if accumulate else st["zero"]
    desc, lay_a, lay_b, lay_d, algo = _prepared(
        p, _DTYPES[d.dtype], (_alignment(b), _alignment(a), _alignment(d), _alignment(d)),
        st["handle"])
    _check(_lib().cublasLtMatmul(
        st["handle"], desc, ctypes.c_void_p(alpha.data_ptr()),
        ctypes.c_void_p(b.data_ptr()), lay_a, ctypes.c_void_p(a.data_ptr()), lay_b,
        ctypes.c_void_p(beta.data_ptr()), ctypes.c_void_p(d.data_ptr()), lay_d,
        ctypes.c_void_p(d.data_ptr()), lay_d, ctypes.byref(algo),
        ctypes.c_void_p(workspace.data_ptr()), ctypes.c_size_t(_WORKSPACE_BYTES),
        ctypes.c_void_p(stream)),
        "matmul")
