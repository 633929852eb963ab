"""Errors caused by what the user gave us (config, data, checkpoint).

The entry point prints their message as one `error:` line and exits with code 2; anything
else is a bug and keeps its traceback. `UserError` and `ConfigError` are the recipe
packages' own (fullstack_fp4/errors.py), so a recipe raises them without importing the
training layer.
"""
from fullstack_fp4.errors import ConfigError, UserError

__all__ = ["UserError", "ConfigError", "CheckpointError", "DataError"]


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be loaded."""


class DataError(UserError, ValueError):
    """Data or tokenizer files that cannot be used."""
