"""4-bit storage of Q-Attn's NVFP4 views: what the forward saves for the backward.

A quantized view holds the values ``e2m1(code) · fp32(e4m3 block scale)`` (``quant.py``), which
are exact in BF16. Saving those values costs 2 bytes/element; saving the codes and block scales
costs ``1/2 + 1/16 = 0.5625`` bytes/element, and decoding them gives the BF16 values back *bit
for bit* (the BF16 value is that product). The per-(b, head) FP32 decode scale is saved beside
(``prologue.SavedViews``).

Layout of a view of a ``[B, H, S, D]`` tensor (codes two per byte, the even element in the low
nibble, scales as E4M3 bit patterns in uint8 — ``fullstack_fp4.nvfp4``'s conventions):

* ``along="head_dim"`` (1×16 blocks along D): ``codes [B, H, S, D/2]``, ``scales [B, H, S, D/16]``
  — ``nvfp4``'s layout of the tensor itself.
* ``along="seq"`` (16×1 blocks along S): ``codes [B, H, Sp/2, D]`` (byte ``(i, d)`` holds seq
  positions ``2i`` (low) and ``2i + 1`` (high) of column d), ``scales [B, H, Sp/16, D]``, with
  ``Sp`` = S rounded up to 16 (padding positions hold code 0, as the reference zero-pads). This
  is ``nvfp4``'s layout of the transposed view ``[B, H, D, Sp]`` stored transposed, so a
  ``[64, D]`` tile of the view is 32 contiguous rows of code bytes and 4 rows of scales (how the
  prologue kernel writes it and the unpack kernel reads it).

The torch decode here (:meth:`PackedView.values`) is the CPU path and the tests' oracle; the GPU
decodes with ``triton_unpack.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fullstack_fp4.nvfp4.e2m1 import e2m1_decode, unpack_codes

ALONG = ("head_dim", "seq")


def padded_seq(s: int) -> int:
    """Sequence length rounded up to a whole number of 16-blocks (the seq view's storage)."""
    return -(-s // 16) * 16


@dataclass
class PackedView:
    codes: torch.Tensor    # uint8, layout in the module docstring
    scales: torch.Tensor   # uint8 E4M3 bit patterns
    along: str             # "head_dim" | "seq"
    seq: int               # S (the seq view stores Sp >= S rows)

    @property
    def head_dim(self) -> int:
        return self.codes.shape[3] * (2 if self.along == "head_dim" else 1)

    @property
    def shape(self) -> tuple:
        return (self.codes.shape[0], self.codes.shape[1], self.seq, self.head_dim)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel()

    def values(self) -> torch.Tensor:
        """FP32 ``e2m1(code) · fp32(scale)`` ``[B, H, S, D]`` (exact; the quantized view)."""
        scale = self.scales.view(torch.float8_e4m3fn).to(torch.float32)
        if self.along == "head_dim":
            vals = e2m1_decode(unpack_codes(self.codes))                       # [B, H, S, D]
            b, h, s, d = vals.shape
            return (vals.reshape(b, h, s, d // 16, 16) * scale.unsqueeze(-1)).reshape(b, h, s, d)
        vals = e2m1_decode(unpack_codes(self.codes.transpose(2, 3)))          # [B, H, D, Sp]
        b, h, d, sp = vals.shape
        vals = vals.reshape(b, h, d, sp // 16, 16) * scale.transpose(2, 3).unsqueeze(-1)
        return vals.reshape(b, h, d, sp).transpose(2, 3)[:, :, :self.seq].contiguous()


def empty_packed(b: int, h: int, s: int, d: int, along: str, device) -> PackedView:
    """Uninitialised storage for one view (filled by the prologue kernel)."""
    if along == "head_dim":
        codes = torch.empty(b, h, s, d // 2, dtype=torch.uint8, device=device)
        scales = torch.empty(b, h, s, d // 16, dtype=torch.uint8, device=device)
    elif along == "seq":
        sp = padded_seq(s)
        codes = torch.empty(b, h, sp // 2, d, dtype=torch.uint8, device=device)
        scales = torch.empty(b, h, sp // 16, d, dtype=torch.uint8, device=device)
    else:
        raise ValueError(f"along must be one of {ALONG}, got {along!r}")
    return PackedView(codes, scales, along, s)
