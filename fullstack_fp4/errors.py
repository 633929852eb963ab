"""Errors a recipe raises for input it cannot use (as opposed to a bug, which keeps its
traceback).

`megatron.training.errors` re-exports both: the entry point prints the message of a
`UserError` as one `error:` line and exits with code 2, whichever layer raised it.
"""


class UserError(Exception):
    """Bad input; the message says what is wrong and how to fix it."""


class ConfigError(UserError, ValueError):
    """A config the run cannot start from."""
