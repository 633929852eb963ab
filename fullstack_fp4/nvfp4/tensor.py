"""``NVFP4Tensor``: the storage container (a plain dataclass, not a tensor subclass).

Layout (quantized along the last dimension K, which is a multiple of 16):

* ``data``         uint8 ``[..., K // 2]``: two E2M1 codes per byte, element ``2i`` in the low
  nibble, ``2i + 1`` in the high nibble.
* ``block_scale``  float8_e4m3fn ``[..., K // 16]``: one scale per 16 consecutive elements of a
  row. For 2D (16×16) tiles the tile's scale is stored on each of its 16 rows, so every
  consumer reads 1×16 and 16×16 tensors the same way.
* ``tensor_scale`` FP32 0-dim tensor: the *decode* scale (``global_amax / (6 · 448)`` for the
  6-rule, up to FP32 rounding of ``1 / enc``).

Decoding is ``x̂ = e2m1(code) · fp32(block_scale) · tensor_scale`` in FP32, left to right.

Why a dataclass and not a ``torch.Tensor`` subclass (torchao's choice): our consumers are a
handful of explicit call sites (the GEMM, the linear's autograd function, optimizer states),
which call ``nvfp4_matmul`` / ``dequantize`` directly; a subclass would add ``__torch_dispatch__``
machinery whose only effect here would be to make an accidental fallback to a dense op silent.

Why 2D tiles can be transposed for free: a 16×16 tile has one scale, its amax is symmetric in
the two axes and the global amax is that of the whole tensor, so quantizing ``Wᵀ`` with 16×16
tiles gives exactly the transposed codes and the same tile scales. :meth:`NVFP4Tensor.t` builds
that view by repacking codes, bit for bit what ``quantize(W.T, tile=(16, 16))`` would return.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .e2m1 import e2m1_decode, pack_codes, unpack_codes

__all__ = ["NVFP4Tensor", "dequantize"]


@dataclass
class NVFP4Tensor:
    data: torch.Tensor
    block_scale: torch.Tensor
    tensor_scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    tile: tuple = (1, 16)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes held: codes + block scales + the 4-byte tensor scale (≈ 4.5 bits/element)."""
        return (self.data.numel() * self.data.element_size()
                + self.block_scale.numel() * self.block_scale.element_size()
                + self.tensor_scale.numel() * self.tensor_scale.element_size())

    def codes(self) -> torch.Tensor:
        """Unpacked uint8 codes, shape ``self.shape``."""
        return unpack_codes(self.data)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``e2m1(code) · fp32(block_scale) · tensor_scale`` in FP32, then cast to ``dtype``."""
        vals = e2m1_decode(self.codes())
        k = vals.shape[-1]
        vals = vals.reshape(*vals.shape[:-1], k // 16, 16)
        scale = self.block_scale.to(torch.float32).unsqueeze(-1)
        out = (vals * scale) * self.tensor_scale.to(torch.float32)
        return out.reshape(self.shape).to(dtype)

    def t(self) -> "NVFP4Tensor":
        """Transpose of a 2D tensor quantized with 16×16 tiles (exact, see module docstring).

        1×16 tensors cannot be transposed this way (their scales run along one axis only).
        """
        if tuple(self.tile) != (16, 16) or len(self.shape) != 2:
            raise ValueError("only a 2D tensor quantized with 16x16 tiles has a free transpose")
        rows, cols = self.shape
        codes_t = self.codes().t().contiguous()
        # One scale per tile: take row 0 of each tile, transpose the tile grid, repeat.
        tiles = self.block_scale[::16]                      # [rows/16, cols/16]
        scale_t = tiles.t().contiguous().repeat_interleave(16, dim=0)   # [cols, rows/16]
        return NVFP4Tensor(pack_codes(codes_t), scale_t, self.tensor_scale,
                           torch.Size((cols, rows)), self.dtype, (16, 16))


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Functional form of :meth:`NVFP4Tensor.dequantize`."""
    return t.dequantize(dtype)
