"""Linear layers whose GEMMs run in NVFP4 (see README.md in this folder)."""

from .nvfp4_linear import NVFP4LinearFunction, nvfp4_linear, quantize_wgrad_operand

__all__ = ["NVFP4LinearFunction", "nvfp4_linear", "quantize_wgrad_operand"]
