"""Errors caused by what the user gave us (config, data, checkpoint).

The entry point prints their message as one `error:` line and exits with code 2; anything
else is a bug and keeps its traceback. `UserError` and `ConfigError` are the recipe
packages' own (fullstack_fp4/errors.py), so a recipe raises them without importing the
training layer.
"""
import argparse

from fullstack_fp4.errors import ConfigError, UserError

__all__ = ["UserError", "ConfigError", "CheckpointError", "DataError", "ArgumentParser"]


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be loaded."""


class DataError(UserError, ValueError):
    """Data or tokenizer files that cannot be used."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose command-line errors keep the same contract: one `error:`
    line on stderr, exit code 2 (argparse's own prints its usage block first, then
    `prog: error: ...`). `--help` still prints the usage."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")
