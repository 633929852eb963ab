"""Q-AdamW: AdamW with NVFP4 moment states (README.md in this folder)."""

from .codecs import (MomentState, decode_exp_avg, decode_exp_avg_sq, encode_exp_avg,
                     encode_exp_avg_sq, state_bytes_per_param)
from .optimizer import QAdamW, optimizer_state_bytes, q_adamw_step_reference

__all__ = ["QAdamW", "MomentState", "encode_exp_avg", "decode_exp_avg", "encode_exp_avg_sq",
           "decode_exp_avg_sq", "state_bytes_per_param", "optimizer_state_bytes",
           "q_adamw_step_reference"]
