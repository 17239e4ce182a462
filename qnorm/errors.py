"""The errors qnorm raises for problems the user can fix, in one hierarchy.

A :class:`QnormError` means "what was asked for, or what was given, cannot be
used": an unknown name, a bad option value, a corrupt file, a model that cannot
be compiled exactly.  The ``qnorm`` command prints its message on one line,
without a traceback, and exits with its ``exit_code``; any other exception is a
bug and keeps its traceback.

This module sits at the bottom of the layer stack: it imports nothing from
qnorm and nothing heavy, so every module (and the command line's argument
checks, which must answer before torch or tvm load) can raise these.

Most classes also derive from ``ValueError``: they replace ValueErrors that
callers and tests already catch.
"""

from __future__ import annotations

from typing import ClassVar


class QnormError(Exception):
    """A problem with the user's request or inputs (not a bug in qnorm)."""

    exit_code: ClassVar[int] = 1


class UsageError(QnormError, ValueError):
    """The command line asks for something that does not exist or cannot be done as
    written: an unknown name, an option value out of range, an output path that is a file."""

    exit_code = 2


class TargetError(QnormError, ValueError):
    """A target description (``targets/*.toml``) is missing a field, has a wrong type or
    value, or describes a machine this one cannot stand in for."""


class UnknownTargetError(TargetError, UsageError):
    """A target name no description has, or one the command does not support."""


class CheckpointError(QnormError, ValueError):
    """A checkpoint directory is corrupt or does not match the model it describes."""


class CheckpointNotFoundError(CheckpointError, UsageError):
    """No checkpoint directory where the caller said one is."""


class DeployError(QnormError, ValueError):
    """A model cannot be frozen, exported or compiled bit-exactly as asked."""
