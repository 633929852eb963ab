"""Q-Attn: trainable mixed-precision attention (NVFP4 QKᵀ and dS GEMMs, BF16 elsewhere).

See README.md in this folder for the math, the design choices and the measured errors.
"""

from .function import q_attention
from .paths import DEFAULT_PATHS, PATH_NAMES

__all__ = ["q_attention", "DEFAULT_PATHS", "PATH_NAMES"]
