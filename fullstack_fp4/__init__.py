"""Full-Stack FP4: NVFP4 recipes (numerics, linear, optimizers, attention) usable without megatron."""
