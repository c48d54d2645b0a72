"""The errors a user can cause, one type per kind of input, at the bottom of the package.

Every mistake a user can make -- a config value, a data file, a checkpoint or model folder --
raises one of these with one sentence that names the field or file, what is wrong and what to
change. The ``meshlm`` command prints that sentence without a traceback (``meshlm/cli.py``).
They live here, imported by every layer and importing nothing, so that no layer has to import a
higher one just to raise its error.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and the fix."""


class DataError(ValueError):
    """Input text, a tokenizer's output or a token store on disk is wrong; the message names the file."""


class CheckpointError(RuntimeError):
    """A model directory or checkpoint is missing, corrupt or does not match; the message names the file."""


def check_choice(key: str, value, allowed) -> None:
    """Refuse a setting ``key`` whose ``value`` is not one of ``allowed``, listing them."""
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}.")


__all__ = ["CheckpointError", "ConfigError", "DataError", "check_choice"]
