"""Linear layers whose GEMMs run in NVFP4 (see README.md in this folder)."""

from .nvfp4_linear import (BufferAccumulator, NVFP4LinearFunction, nvfp4_linear,
                           quantize_wgrad_operand)

__all__ = ["BufferAccumulator", "NVFP4LinearFunction", "nvfp4_linear", "quantize_wgrad_operand"]
