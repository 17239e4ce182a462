"""Argument types the ``qnorm`` subcommands share.

argparse calls them while parsing, so a bad value is a usage error (exit 2)
before any subcommand imports torch or tvm.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def output_dir(text: str) -> Path:
    """A directory to write into: it may exist (files in it are replaced) or not yet
    (it is created), but it must not be a file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    return path


def output_file(text: str) -> Path:
    """A file to write: it may exist (it is replaced) or not yet (its directory is
    created), but it must not be a directory."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file")
    return path
