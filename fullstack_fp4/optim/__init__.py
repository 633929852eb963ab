"""Optimizers with low-precision states or NVFP4 arithmetic."""

from .q_adamw import (MomentState, QAdamW, decode_exp_avg, decode_exp_avg_sq, encode_exp_avg,
                      encode_exp_avg_sq, optimizer_state_bytes, q_adamw_step_reference,
                      state_bytes_per_param)
from .muon import Muon, split_params_for_orthogonal
from .newton_schulz import newton_schulz
from .ns_coefficients import resolve_schedule
from .root import Root
