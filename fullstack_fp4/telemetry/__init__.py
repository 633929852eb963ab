"""Quantization telemetry (sampled error statistics, hooks) and the BF16 fallback policy.

No megatron imports: usable with any torch module. See docs/telemetry.md.
"""
from .collector import (TelemetryCollector, is_lora_svd_linear, is_nvfp4_linear, is_q_attn,
                        main_param_names, module_path, module_recipe)
from .fallback import FallbackPolicy, fallback_state, restore_fallback_state
from .stats import (nvfp4_qdq, rel_err, rel_err_from_sums, sampled_rel_err, sampled_sums, snr_db,
                    snr_db_from_rel_err)

__all__ = ["TelemetryCollector", "is_nvfp4_linear", "is_lora_svd_linear", "is_q_attn", "module_recipe",
           "main_param_names", "module_path", "FallbackPolicy",
           "fallback_state", "restore_fallback_state", "rel_err", "snr_db", "snr_db_from_rel_err",
           "sampled_rel_err", "sampled_sums", "rel_err_from_sums", "nvfp4_qdq"]
