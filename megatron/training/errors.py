"""Errors caused by what the user gave us (config, data, checkpoint).

The entry point prints their message as one `error:` line and exits with code 2; anything
else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input; the message says what is wrong and how to fix it."""


class ConfigError(UserError, ValueError):
    """A config the run cannot start from."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be loaded."""


class DataError(UserError, ValueError):
    """Data or tokenizer files that cannot be used."""
