"""On-disk build caches that never serve a wrong answer.

Every cache of qnorm's compilers (TVM kernel libraries, whole-model libraries,
cross-compiled executables, HLS C-simulation binaries, nvcc outputs) keeps each
entry as a directory ``<cache>/<kind>/<key>/`` holding the entry's files and
``entry.json``, which records every file's size and SHA-256.

* **Written atomically.**  :func:`publish` lets the builder write into a private
  temporary directory next to the entry, records the digests last, and renames
  the whole directory into place: a reader sees no entry or a complete one.  A
  build that fails publishes nothing; one that is killed leaves at most a
  ``.tmp-`` directory, which no reader looks at.
* **Verified on every hit.**  :func:`lookup` hashes every file of the entry again
  and compares it with ``entry.json``.  An entry that does not match (a flipped
  bit, a truncated or missing file, a missing or garbled ``entry.json``) is
  removed with a warning naming the file and the problem, and the caller builds
  it again.  Hashing costs 2–3 ms per MB (a demo model: 1–2 ms per hit).

A hit is checked once, when it is looked up; callers use the files right away.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CACHE_ENV = "QNORM_CACHE"
MANIFEST = "entry.json"
FORMAT = "qnorm.cache-entry"
VERSION = 1
_PUBLISH_ATTEMPTS = 3  # a rename can lose to a concurrent writer whose entry then fails its check

log = logging.getLogger(__name__)


class CacheError(RuntimeError):
    """A cache entry could not be written."""


@dataclass(frozen=True)
class Entry:
    """A verified cache entry: its directory and the SHA-256 of each of its files."""

    path: Path
    digests: Mapping[str, str]  # file name -> sha256, as checked (a hit) or just written
    hit: bool

    def __truediv__(self, name: str) -> Path:
        return self.path / name


def cache_root() -> Path:
    """``$QNORM_CACHE`` (default ``~/.cache/qnorm``), read at each call."""
    # Absolute: builders run compilers in other working directories.
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "qnorm").absolute()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cached(entry: Path, write: Callable[[Path], None]) -> Entry:
    """The verified entry at ``entry``, built by ``write`` (see :func:`publish`) when
    it is missing or does not match its digests."""
    found = lookup(entry)
    return found if found is not None else publish(entry, write)


def lookup(entry: Path) -> Entry | None:
    """The entry at ``entry`` if every file matches ``entry.json``; None when there is
    none, or when it did not match (it is then removed, with a warning)."""
    if not entry.exists():
        return None
    digests, problem = _check(entry)
    if problem is None:
        return Entry(entry, digests, hit=True)
    log.warning("cache entry %s: %s; removing it, it will be built again", entry, problem)
    remove(entry)
    return None


def publish(entry: Path, write: Callable[[Path], None]) -> Entry:
    """Build an entry: ``write(directory)`` puts its files into an empty private
    directory, their digests are recorded, and the directory is renamed to ``entry``.

    If a concurrent build published ``entry`` first, that entry (verified) is kept
    and this one discarded.  If ``write`` raises, nothing is published.
    """
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".tmp-{entry.name}-"))
    try:
        write(tmp)
        digests = _write_manifest(tmp, entry)
        for _ in range(_PUBLISH_ATTEMPTS):
            try:
                os.rename(tmp, entry)
                return Entry(entry, digests, hit=False)
            except OSError:
                if not entry.exists():
                    raise
            found = lookup(entry)  # someone else's, or a damaged one (then removed: try again)
            if found is not None:
                return found
        raise CacheError(f"cache entry {entry}: could not be published ({_PUBLISH_ATTEMPTS} attempts)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove(entry: Path) -> None:
    """Remove an entry: renamed away first, so no reader sees it half deleted."""
    if not entry.exists():
        return
    trash = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".trash-{entry.name}-"))
    try:
        os.rename(entry, trash / "entry")
    except FileNotFoundError:
        pass  # already removed (by a concurrent reader)
    finally:
        shutil.rmtree(trash, ignore_errors=True)


def _write_manifest(directory: Path, entry: Path) -> dict[str, str]:
    """Record the size and digest of every file the build wrote into ``directory``."""
    files = sorted(p for p in directory.iterdir() if p.name != MANIFEST)
    if not files or not all(p.is_file() for p in files):
        raise CacheError(
            f"cache entry {entry}: a build must write one or more plain files, it wrote {[p.name for p in files]}"
        )
    digests = {p.name: sha256_file(p) for p in files}
    record = {
        "format": FORMAT,
        "version": VERSION,
        "files": {p.name: {"bytes": p.stat().st_size, "sha256": digests[p.name]} for p in files},
    }
    (directory / MANIFEST).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return digests


def _check(entry: Path) -> tuple[dict[str, str], str | None]:
    """The entry's digests, and what is wrong with it (None when nothing is)."""
    files, problem = _read_manifest(entry)
    if problem is not None:
        return {}, problem
    digests: dict[str, str] = {}
    for name, want in files.items():
        path = entry / name
        if not path.is_file():
            return {}, f"{name} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return {}, f"{name} has {size} bytes, {MANIFEST} records {want['bytes']}"
        digests[name] = sha256_file(path)
        if digests[name] != want["sha256"]:
            return {}, f"{name} has sha256 {digests[name]}, {MANIFEST} records {want['sha256']}"
    return digests, None


def _read_manifest(entry: Path) -> tuple[dict[str, Any], str | None]:
    path = entry / MANIFEST
    if not path.is_file():
        return {}, f"{MANIFEST} is missing"
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return {}, f"{MANIFEST} is not readable JSON ({err})"
    files = record.get("files") if isinstance(record, dict) else None
    if (
        not isinstance(record, dict)
        or record.get("format") != FORMAT
        or record.get("version") != VERSION
        or not isinstance(files, dict)
        or not files
        or not all(_valid_file_record(name, want) for name, want in files.items())
    ):
        return {}, f"{MANIFEST} is not a {FORMAT} version {VERSION} record"
    return files, None


def _valid_file_record(name: str, want: Any) -> bool:
    return (
        Path(name).name == name
        and name not in ("", ".", "..", MANIFEST)
        and isinstance(want, dict)
        and isinstance(want.get("bytes"), int)
        and isinstance(want.get("sha256"), str)
    )
