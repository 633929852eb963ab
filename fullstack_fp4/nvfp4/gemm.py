"""``nvfp4_matmul``: the ONE backend function for NVFP4 GEMMs, ``a @ b.T``.

Both operands are quantized along the shared reduction dimension K (``a``: ``[..., M, K]``
flattened to ``[M, K]``; ``b``: ``[N, K]``), exactly as the tensor cores consume them.

Emulated path (every GPU, and the CPU):

1. Decode ``e2m1(code) · fp32(block_scale)`` and store it in BF16. This is **exact**:
   an E2M1 magnitude is ``m · 2^e`` with a 2-bit significand m ∈ {0, 1, 2, 3} (0.5 = 1·2⁻¹,
   1.5 = 3·2⁻¹, 3 = 3·2⁰, 6 = 3·2¹), an E4M3 scale is ``n · 2^g`` with a 4-bit significand
   n ≤ 15 (subnormals: n ≤ 7, g = -9), so the product's significand ``m · n ≤ 45 < 2⁶`` needs
   at most 6 bits, below BF16's 8 (7 stored + the implicit bit); its magnitude lies in
   ``[0.5 · 2⁻⁹, 6 · 448] = [2⁻¹⁰, 2688]``, far inside BF16's normal range ``[2⁻¹²⁶, 2¹²⁸)``.
   So the BF16 operand equals the mathematical product and the only rounding of the whole
   GEMM is in the accumulation.
2. Multiply with FP32 accumulation: on CUDA ``torch.mm(..., out_dtype=torch.float32)`` (BF16
   tensor cores, FP32 accumulate and FP32 output); on CPU the BF16 operands are upcast to FP32
   (exact) and multiplied in FP32.
3. Multiply the product of the two FP32 tensor scales onto the FP32 result, then cast to
   ``out_dtype``: ``out = acc · (ts_a · ts_b)`` (``ts_a · ts_b`` first, one FP32 rounding,
   as torchao's ``scale_result``), matching the hardware, which applies the global scale as an
   epilogue ``alpha``.

The result equals the exact NVFP4 product up to FP32 accumulation order and the final cast.

On CUDA, by default (backend ``"cublaslt"``), steps 2 and 3 are one cuBLASLt call
(``kernels.cublaslt.scaled_mm_cublaslt``): ``alpha`` is read by device pointer and the output
written in BF16 / FP32 or added into a buffer, with no FP32 accumulator in memory; its outputs
equal the two-pass path's bit for bit where the sums are exact (checked on the H200 by
``benchmarks/bench_nvfp4_gemm.py``). The backend ``"cublas"`` (:func:`set_gemm_backend`, for
the benchmark's comparison; taken anyway for FP16 outputs, odd strides, or where cuBLASLt
cannot be loaded) runs the two steps: ``torch.mm`` with FP32 output, then step 3 as one
Triton pass (``kernels.gemm_epilogue.scale_cast_triton``: reads the
FP32 accumulator once, writes ``out_dtype``; bit-identical to ``(acc * alpha).to(out_dtype)``,
which is two passes and an FP32 temporary). :func:`decoded_matmul` runs steps 2-3 on operands
decoded elsewhere (the NVFP4 linear's fused quantize→decode kernels).

Accumulating epilogue (``accumulate_into=dst`` of :func:`decoded_matmul` / :func:`nvfp4_matmul`,
or :func:`scale_accumulate` on an accumulator): instead of casting, step 3 adds the scaled
accumulator into an existing FP32 or BF16 tensor, ``dst ← dst + acc · alpha``, rounded once to
``dst``'s dtype (``(dst.float() + acc * alpha).to(dst.dtype)``; on CUDA one Triton pass,
``kernels.gemm_epilogue.scale_accumulate_triton``, bit-identical). It is the NVFP4 linear's
gradient-accumulation fusion: the wgrad goes straight into the optimizer's gradient buffer,
without a BF16 dW and without the separate ``main_grad.add_(dW)`` pass. With the cuBLASLt
backend the GEMM adds it itself (``beta = 1``); cuBLAS may round ``acc · alpha + dst`` once
where the two-pass path rounds ``acc · alpha`` first, so the two differ by at most one FP32 ulp
of the product plus one ulp of the sum (tested on the GPU) — the size of the accumulation-order
freedom every GEMM has. Because the two backends are not bit-identical in every case, the
backend is no environment variable: training always runs ``"cublaslt"`` (with the fallbacks
above), and only :func:`set_gemm_backend` switches it.

A native Blackwell path (sm_100 / sm_120: ``torch._scaled_mm`` with ``float4_e2m1fn_x2``
operands and swizzled E4M3 block scales) would slot in here, behind :func:`nvfp4_matmul` and
:func:`decoded_matmul`, once it can be tested on Blackwell against the emulated path; its FP32
accumulation order differs, so it would be a validated config key, not a switch.
"""

from __future__ import annotations

from typing import Optional

import torch

from .e2m1 import e2m1_decode
from .tensor import NVFP4Tensor

__all__ = ["nvfp4_matmul", "nvfp4_matmul_nt", "decode_to_bf16", "decoded_matmul",
           "scale_accumulate", "set_gemm_backend", "gemm_backend"]

_BACKENDS = ("cublaslt", "cublas")
_BACKEND = "cublaslt"


def set_gemm_backend(name: str) -> str:
    """The CUDA GEMM of the emulated path: ``"cublaslt"`` (one cuBLASLt call with the tensor
    scales read on the device, the default) or ``"cublas"`` (``torch.mm`` with FP32 output, then
    the Triton epilogue pass). Both give the exact NVFP4 product up to FP32 accumulation order
    (module docstring). Returns the previous one."""
    global _BACKEND
    if name not in _BACKENDS:
        raise ValueError(f"GEMM backend must be one of {_BACKENDS}, got {name!r}")
    previous, _BACKEND = _BACKEND, name
    return previous


def gemm_backend() -> str:
    """The CUDA GEMM backend in use (:func:`set_gemm_backend`)."""
    return _BACKEND


def _triton(name: str):
    """A function of this package's Triton modules, or None without Triton; looked up once (the
    GEMM path runs it several times a linear, on the host's critical path)."""
    if name not in _TRITON_FNS:
        try:
            from .kernels import decode, gemm_epilogue  # noqa: PLC0415
            _TRITON_FNS.update(decode_bf16_triton=decode.decode_bf16_triton,
                               scale_cast_triton=gemm_epilogue.scale_cast_triton,
                               scale_accumulate_triton=gemm_epilogue.scale_accumulate_triton)
        except ImportError:
            _TRITON_FNS.update(decode_bf16_triton=None, scale_cast_triton=None,
                               scale_accumulate_triton=None)
    return _TRITON_FNS[name]


_TRITON_FNS: dict = {}


def decode_to_bf16(t: NVFP4Tensor) -> torch.Tensor:
    """``e2m1(code) · fp32(block_scale)`` as BF16 (exact, see module docstring), ``[M, K]``.

    CUDA: one Triton pass (reads 0.5625 B/element, writes 2), bit-identical to the PyTorch
    decode below (which is ~6 elementwise passes with FP32 temporaries)."""
    k = t.shape[-1]
    if t.data.is_cuda and _triton("decode_bf16_triton") is not None:
        return _triton("decode_bf16_triton")(t)
    vals = e2m1_decode(t.codes()).reshape(-1, k // 16, 16)
    scale = t.block_scale.reshape(-1, k // 16, 1).to(torch.float32)
    return (vals * scale).reshape(-1, k).to(torch.bfloat16)


def _scale_cast(acc: torch.Tensor, ts_a: torch.Tensor, ts_b: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """``(acc · (ts_a · ts_b)).to(out_dtype)`` (step 3): one Triton pass on CUDA, else torch."""
    if (acc.is_cuda and out_dtype in (torch.float32, torch.bfloat16, torch.float16)
            and _triton("scale_cast_triton") is not None):
        return _triton("scale_cast_triton")(acc, ts_a, ts_b, out_dtype)
    alpha = ts_a.to(torch.float32) * ts_b.to(torch.float32)
    return (acc * alpha).to(out_dtype)


def scale_accumulate(acc: torch.Tensor, ts_a: torch.Tensor, ts_b: torch.Tensor,
                     dst: torch.Tensor) -> None:
    """``dst ← dst + acc · (ts_a · ts_b)`` in place (the accumulating step 3), rounded once to
    ``dst``'s dtype: ``(dst.float() + acc * alpha).to(dst.dtype)`` with ``alpha = fp32(ts_a) ·
    fp32(ts_b)`` and every product and sum one FP32 RNE operation. ``acc`` FP32 of ``dst``'s
    shape. One Triton pass on CUDA for an FP32 / BF16 ``dst`` (bit-identical), else torch."""
    if acc.shape != dst.shape:
        raise ValueError(f"accumulator {tuple(acc.shape)} and destination {tuple(dst.shape)} differ")
    if (acc.is_cuda and dst.dtype in (torch.float32, torch.bfloat16) and dst.is_contiguous()
            and _triton("scale_accumulate_triton") is not None):
        return _triton("scale_accumulate_triton")(acc.contiguous(), ts_a, ts_b, dst)
    alpha = ts_a.to(torch.float32) * ts_b.to(torch.float32)
    dst.copy_((dst.float() + acc * alpha).to(dst.dtype))
    return None


def _epilogue(acc: torch.Tensor, ts_a: torch.Tensor, ts_b: torch.Tensor, out_dtype: torch.dtype,
              accumulate_into: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Step 3 either way: the cast output, or None after adding into ``accumulate_into``."""
    if accumulate_into is None:
        return _scale_cast(acc, ts_a, ts_b, out_dtype)
    scale_accumulate(acc, ts_a, ts_b, accumulate_into)
    return None


def decoded_matmul(a2: torch.Tensor, b2: torch.Tensor, ts_a: torch.Tensor, ts_b: torch.Tensor,
                   out_dtype: torch.dtype = torch.bfloat16,
                   accumulate_into: Optional[torch.Tensor] = None,
                   alpha: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """``(a2 @ b2) · (ts_a · ts_b)`` cast to ``out_dtype``: steps 2-3 on already decoded BF16
    operands ``a2 [M, K]``, ``b2 [K, N]`` (any strides, e.g. ``decoded.t()``) and their FP32
    tensor scales. The same GEMM call and epilogue as :func:`nvfp4_matmul` for the same
    operand layouts, hence the same bits.

    ``accumulate_into`` (``[M, N]``, FP32 or BF16): add the product into it in place
    (:func:`scale_accumulate`, ``out_dtype`` unused) and return None.

    ``alpha``: ``fp32(ts_a) · fp32(ts_b)`` already on the device (1 element; e.g. written by
    the quantize kernel, ``TwoWays.row_alpha``), which the cuBLASLt call then reads instead of
    multiplying the two in a launch of its own; the other paths use ``ts_a``, ``ts_b``."""
    if a2.is_cuda:
        if _BACKEND == "cublaslt" and _cublaslt_ready(a2):
            done, out = _CUBLASLT[0].try_scaled_mm(a2, b2, ts_a, ts_b, out_dtype, accumulate_into,
                                                   alpha=alpha)
            if done:
                return out
        acc = torch.mm(a2, b2, out_dtype=torch.float32)
    else:
        acc = torch.mm(a2.to(torch.float32), b2.to(torch.float32))
    return _epilogue(acc, ts_a, ts_b, out_dtype, accumulate_into)


_CUBLASLT: list = []      # [module or None], loaded on the first CUDA GEMM


def _cublaslt_ready(a2: torch.Tensor) -> bool:
    """Whether the cuBLASLt call may run now: the library loads, and (in a graph capture) its
    state exists. Whether the operands fit one call is ``cublaslt.try_scaled_mm``'s answer
    (BF16 x BF16 -> FP16 and odd strides take the two-step path, same product)."""
    if not _CUBLASLT:
        from .kernels import cublaslt  # noqa: PLC0415
        _CUBLASLT.append(cublaslt if cublaslt.available() else None)
    return _CUBLASLT[0] is not None and _CUBLASLT[0].ready(a2)


def _check(a: NVFP4Tensor, b: NVFP4Tensor) -> None:
    if len(b.shape) != 2:
        raise ValueError(f"b must be 2D [N, K], got shape {tuple(b.shape)}")
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"reduction dims differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError("a and b are on different devices")


def nvfp4_matmul(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype = torch.bfloat16,
                 accumulate_into: Optional[torch.Tensor] = None):
    """``dequant(a) @ dequant(b).T`` computed as NVFP4 hardware would; shape ``[..., N]``.

    ``accumulate_into`` (2-D ``a`` only; ``[M, N]``, FP32 or BF16): add the product into it in
    place (:func:`scale_accumulate`) and return None."""
    _check(a, b)
    if accumulate_into is not None and len(a.shape) != 2:
        raise ValueError("accumulate_into needs a 2D a")
    out = decoded_matmul(decode_to_bf16(a), decode_to_bf16(b).t(), a.tensor_scale,
                         b.tensor_scale, out_dtype, accumulate_into)
    return None if out is None else out.reshape(*a.shape[:-1], b.shape[0])


def nvfp4_matmul_nt(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype = torch.bfloat16):
    """``dequant(a) @ dequant(b)`` for ``b`` ``[K, N]`` quantized with 16×16 tiles: the same
    product as ``nvfp4_matmul(a, b.t())`` (16×16 tiles transpose exactly, so ``decode(b.t()) ==
    decode(b).t()``) without repacking ``b``'s nibbles; the GEMM reads ``decode(b)`` as a
    transposed operand."""
    if tuple(b.tile) != (16, 16) or len(b.shape) != 2:
        raise ValueError("nvfp4_matmul_nt needs a 2D b quantized with 16x16 tiles")
    if a.shape[-1] != b.shape[0]:
        raise ValueError(f"reduction dims differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
    a2, b2 = decode_to_bf16(a), decode_to_bf16(b)      # b2: [K, N]
    out = decoded_matmul(a2, b2, a.tensor_scale, b.tensor_scale, out_dtype)
    return out.reshape(*a.shape[:-1], b.shape[1])
