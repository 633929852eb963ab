"""Adapters that plug the fullstack_fp4 recipes into megatron-core (layer-spec modules, optimizer
wrappers, the FP4 state a checkpoint resumed at another TP size converts)."""
