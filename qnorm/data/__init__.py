"""Data files shipped inside the qnorm package, found through :mod:`importlib.resources`.

* ``targets/*.toml`` — one description per target (:mod:`qnorm.targets`).
* ``golden/`` — the stored inputs and outputs of every verify case, npz files and a
  sha256 manifest (:mod:`qnorm.verify.golden_store`).

They live in the package, not beside it in the repository, so that an installed
qnorm (a wheel) reads the same files as a checkout does.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def data_dir(name: str) -> Path:
    """The directory ``name`` of qnorm's package data, as a filesystem path.

    Callers glob, read and (``qnorm golden --regenerate``) write these directories,
    so they must be real directories: a qnorm imported from a zip archive is refused.
    """
    resource = files(__name__).joinpath(name)
    if not isinstance(resource, Path):
        raise RuntimeError(
            f"qnorm's package data {name!r} is not on the filesystem ({resource!r}); "
            "install qnorm as a directory (pip install), not as a zip archive"
        )
    return resource
