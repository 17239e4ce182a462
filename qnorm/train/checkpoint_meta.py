"""A checkpoint's ``meta.json``: reading and validating it, without torch.

:mod:`qnorm.train.checkpoint` loads the weights (torch, safetensors); the
command line reads the sidecar first, so a missing or corrupt checkpoint is
reported in a blink instead of after seconds of imports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qnorm.errors import CheckpointError, CheckpointNotFoundError

WEIGHTS = "weights.safetensors"
META = "meta.json"
FORMAT = "qnorm.checkpoint"
# 2: the model spec is checksummed field by field; 3: input quantizers save the range their format
# is made from (format_max_abs); a version-2 checkpoint made it from running_max_abs, and loads so
VERSION = 3
READABLE = (2, 3)


def checkpoint_dir(directory: str | Path) -> Path:
    """``directory`` as a Path, or :class:`CheckpointNotFoundError` if it is not a directory."""
    directory = Path(directory)
    if not directory.exists():
        raise CheckpointNotFoundError(f"checkpoint directory {directory} does not exist")
    if not directory.is_dir():
        raise CheckpointNotFoundError(f"checkpoint {directory} is a file; a checkpoint is a directory")
    return directory


def read_metadata(directory: str | Path) -> dict[str, Any]:
    """Parse and validate `meta.json` of a checkpoint directory."""
    path = Path(directory) / META
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory}: missing metadata file {path}")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint {directory}: {path} is not valid JSON: {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {directory}: {path} is not a {FORMAT} file")
    if meta.get("version") not in READABLE:
        raise CheckpointError(f"checkpoint {directory}: unsupported version {meta.get('version')!r}, "
                              f"this code reads versions {', '.join(map(str, READABLE))}")
    for key, kind in (("model", dict), ("model_checksums", dict), ("metadata", dict), ("modules", dict),
                      ("weights", dict)):
        if not isinstance(meta.get(key), kind):
            raise CheckpointError(f"checkpoint {directory}: {path} lacks a valid {key!r} entry")
    return meta
