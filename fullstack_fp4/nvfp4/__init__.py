"""NVFP4 numerics: the format, its pure-PyTorch reference quantizer, RHT-16 and the GEMM.

See README.md in this folder and docs/nvfp4-format.md (the FP32 contract).
"""

from .e2m1 import (E2M1_MAX, E2M1_VALUES, e2m1_decode, e2m1_round_nearest,
                   e2m1_round_stochastic, pack_codes, unpack_codes)
from .hadamard import (DEFAULT_SIGNS, hadamard16, hadamard_matrix, hadamard_transform,
                       inverse_hadamard16)
from .quantize import quantize
from .reference import quantize_reference, tensor_scales
from .tensor import NVFP4Tensor, dequantize

__all__ = [
    "NVFP4Tensor", "quantize", "dequantize", "quantize_reference", "tensor_scales",
    "hadamard16", "inverse_hadamard16", "hadamard_transform", "hadamard_matrix", "DEFAULT_SIGNS",
    "E2M1_VALUES", "E2M1_MAX", "e2m1_round_nearest", "e2m1_round_stochastic", "e2m1_decode",
    "pack_codes", "unpack_codes",
]
