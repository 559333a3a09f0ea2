"""Errors in what a user gave qtk, apart from bugs.

A QtkError says what was wrong with the input (a path, a flag, a recipe, a checkpoint, a request)
and how to fix it: the CLI prints its message on one line and exits 2. Anything else that escapes
(a torch error, an out-of-memory, a bug of ours) keeps its traceback.

Each class also derives from the builtin a caller would catch (ValueError, FileNotFoundError, ...).
"""
from __future__ import annotations


class QtkError(Exception):
    """Base class of every error caused by the user's input."""


class InputError(QtkError, ValueError):
    """A bad value: a flag, a recipe key, a scheme, a dataset that is too short."""


class NotFoundError(QtkError, FileNotFoundError):
    """A model, dataset or recipe path that does not exist or is not what it should be."""


class OutputError(QtkError, OSError):
    """An output path that cannot be written."""


class OutputExistsError(OutputError, FileExistsError):
    """An output path that exists (and no --force)."""


class CheckpointError(QtkError, ValueError):
    """A checkpoint that cannot be read as written; the message names the file or tensor."""


class DataSourceError(QtkError, RuntimeError):
    """A dataset that could not be fetched or read (e.g. a hub dataset while offline)."""
