"""Our training layer on top of megatron-core (config, model, loop, checkpoints, data)."""
