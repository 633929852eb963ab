"""The emulated NVFP4 GEMM with its epilogue inside: ``out = ((a @ b) · (ts_a · ts_b)).to(dtype)``
or ``dst ← dst + (a @ b) · (ts_a · ts_b)``, one kernel, no FP32 accumulator in memory.

Why: the emulated GEMM (``gemm.py``) multiplies the decoded BF16 operands with ``torch.mm``
and FP32 output, then a Triton pass scales and casts (``triton_gemm_epilogue``). cuBLAS can
scale its output only by a *host* scalar, and the tensor scales live on the device (reading them
would sync the host once per GEMM). So every NVFP4 GEMM writes an FP32 ``[M, N]`` accumulator and
reads it back: 4 + 4 bytes per output element on top of the 2 the BF16 output needs. At the
issue's linear shapes (8192 tokens, 3072 → 8192) that is 0.54 GB of the forward+backward's
traffic, ~0.15 ms at the H200's copy bandwidth, against a BF16 forward+backward of 1.8 ms.
Here the accumulator stays in registers and the epilogue reads the two scales on the device.

Arithmetic (the same as ``triton_gemm_epilogue``, so the two paths differ only in the order
of the FP32 accumulation inside the GEMM, which no GEMM fixes):

* the products ``a·b`` of decoded NVFP4 operands are exact in BF16 and their sum is accumulated
  in FP32 by the tensor cores (``tl.dot``, BF16 inputs, FP32 accumulator) — cuBLAS does the
  same with another blocking of K;
* ``alpha = fp32(ts_a) · fp32(ts_b)``, ``v = acc · alpha`` (RNE, no FMA:
  ``enable_fp_fusion=False``);
* cast: BF16 by integer RNE on the FP32 bits (``_bf16_rne_bits``: the interpreter's cast
  truncates), FP16 by Triton's cast, FP32 as is;
* accumulate: ``s = fp32(dst) + v`` (a separate RNE add, not an FMA), stored rounded once to
  ``dst``'s dtype (FP32 or BF16).

So for operands whose exact product is representable in FP32 the output is bit-identical to
``gemm.decoded_matmul``'s (tested under ``TRITON_INTERPRET=1``), and in general both are the
exact NVFP4 product up to FP32 accumulation order and the one final rounding.

Operands: ``a [M, K]`` and ``b [K, N]`` BF16 with any strides whose inner one is 1 on either
axis (``b`` is often ``decoded.t()``); the kernel reads them through pointers with their
strides (Hopper: cp.async pipelining into ``wgmma``). ``M``, ``N`` and ``K`` need not divide the
tiles (masked loads and stores).

Tiles: :func:`pick_config` — 128×128×64 (4 warps, 4 stages) by default, 128×256×64 (8 warps,
3 stages) when both M and N are ≥ 4096, after the sweep in BENCHMARKS.md; grouped launch order
(``GROUP_M`` tiles of M share their B columns in L2).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .triton_gemm_epilogue import _bf16_rne_bits, _scale_operand
from .triton_launch import cdiv, launch

__all__ = ["GemmConfig", "pick_config", "scaled_mm_triton", "supported"]

# output modes: write a fresh tensor (FP32 / BF16 / FP16) or add into dst (FP32 / BF16)
_OUT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ACC = {torch.float32: 3, torch.bfloat16: 4}

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def pick_config(m: int, n: int, k: int) -> GemmConfig:
    """The tile for an ``[M, K] @ [K, N]`` GEMM (module docstring); tiny tiles under the
    interpreter, where a tile costs Python time, not registers."""
    if _INTERPRET:
        return GemmConfig(32, 32, 32, 2, 4, 1)
    if m >= 4096 and n >= 4096:
        return GemmConfig(128, 256, 64, 8, 8, 3)
    return GemmConfig(128, 128, 64, 8, 4, 4)


@triton.jit
def _scaled_mm_kernel(a_ptr, b_ptr, ts_a_ptr, ts_b_ptr, out_ptr, M, N, K,
                      s_am, s_ak, s_bk, s_bn, s_om, s_on,
                      MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, INTERP: tl.constexpr):
    # grouped order: GROUP_M consecutive programs walk down M under the same columns of b
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * s_am + rk[None, :] * s_ak
    b_ptrs = b_ptr + rk[:, None] * s_bk + rn[None, :].to(tl.int64) * s_bn
    m_ok = rm[:, None] < M
    n_ok = rn[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        a = tl.load(a_ptrs, mask=m_ok & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)
        if INTERP:
            # the interpreter's BF16 dot returns garbage (attention/triton_nvfp4.dot_bf16);
            # BF16 is exact in FP32 and an FP32 dot forms exact products too
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk

    alpha = tl.load(ts_a_ptr) * tl.load(ts_b_ptr)
    v = acc * alpha
    o_ptrs = out_ptr + rm[:, None].to(tl.int64) * s_om + rn[None, :].to(tl.int64) * s_on
    o_ok = m_ok & n_ok
    if MODE == 0:
        tl.store(o_ptrs, v, mask=o_ok)
    elif MODE == 1:
        tl.store(o_ptrs, _bf16_rne_bits(v), mask=o_ok)
    elif MODE == 2:
        tl.store(o_ptrs, v.to(tl.float16), mask=o_ok)
    elif MODE == 3:
        s = tl.load(o_ptrs, mask=o_ok, other=0.0) + v
        tl.store(o_ptrs, s, mask=o_ok)
    else:
        # BF16 dst widened exactly (its bits are the high half of the FP32 pattern)
        old = tl.load(o_ptrs, mask=o_ok, other=0).to(tl.int32) << 16
        s = old.to(tl.float32, bitcast=True) + v
        tl.store(o_ptrs, _bf16_rne_bits(s), mask=o_ok)


def _inner_unit(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 or t.stride(-2) == 1


def supported(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether :func:`scaled_mm_triton` takes these operands: 2-D BF16 on one CUDA device (or
    any device under the interpreter), each unit-strided along one axis."""
    return (a.dim() == 2 and b.dim() == 2 and a.dtype == torch.bfloat16
            and b.dtype == torch.bfloat16 and a.shape[1] == b.shape[0]
            and a.device == b.device and (a.is_cuda or _INTERPRET)
            and _inner_unit(a) and _inner_unit(b))


def scaled_mm_triton(a: torch.Tensor, b: torch.Tensor, ts_a: torch.Tensor, ts_b: torch.Tensor,
                     out_dtype: torch.dtype = torch.bfloat16,
                     accumulate_into: Optional[torch.Tensor] = None,
                     config: Optional[GemmConfig] = None) -> Optional[torch.Tensor]:
    """``((a @ b) · (ts_a · ts_b)).to(out_dtype)`` for BF16 ``a [M, K]``, ``b [K, N]`` and 1-element
    tensor scales; with ``accumulate_into`` (``[M, N]``, FP32 or BF16, any strides) the scaled
    product is added into it in place instead and None is returned (module docstring)."""
    if not supported(a, b):
        raise ValueError("scaled_mm_triton needs 2-D BF16 operands [M, K] @ [K, N] on one device, "
                         f"each unit-strided on one axis; got {tuple(a.shape)} {a.dtype} "
                         f"strides {a.stride()} and {tuple(b.shape)} {b.dtype} strides {b.stride()}")
    m, k = a.shape
    n = b.shape[1]
    if accumulate_into is None:
        if out_dtype not in _OUT:
            raise ValueError(f"out_dtype must be fp32, bf16 or fp16, got {out_dtype}")
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
        mode = _OUT[out_dtype]
    else:
        out = accumulate_into
        if out.dtype not in _ACC or tuple(out.shape) != (m, n) or out.device != a.device:
            raise ValueError(f"accumulate_into must be FP32 or BF16 of shape {(m, n)} on "
                             f"{a.device}; got {out.dtype} {tuple(out.shape)} on {out.device}")
        mode = _ACC[out.dtype]
    if m == 0 or n == 0:
        return None if accumulate_into is not None else out
    if k == 0:       # an empty sum: the product is zero (the kernel would not run its loop)
        a, b = a.new_zeros(m, 16), b.new_zeros(16, n)
        k = 16
    cfg = config or pick_config(m, n, k)
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
    o = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    launch(_scaled_mm_kernel, grid, a, b, _scale_operand(ts_a), _scale_operand(ts_b), o,
           m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), o.stride(0), o.stride(1),
           MODE=mode, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
           GROUP_M=cfg.group_m, INTERP=_INTERPRET, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
           enable_fp_fusion=False)
    return None if accumulate_into is not None else out
