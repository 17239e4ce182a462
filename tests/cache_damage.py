"""Ways a build-cache entry gets damaged, for the tests that show every cache builds a
damaged entry again instead of serving it.

Each damage takes the entry directory and the name of the payload file to damage.
Damaged files are written anew and renamed over the old ones: a library this test
process has already loaded stays mapped from the old file, exactly as it would if
another process had damaged the cache.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from compilers.cache import MANIFEST


def _rewrite(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".damaged")
    tmp.write_bytes(data)
    os.chmod(tmp, path.stat().st_mode)
    os.replace(tmp, path)


def flip_byte(entry: Path, name: str) -> None:
    data = bytearray((entry / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    _rewrite(entry / name, bytes(data))


def truncate(entry: Path, name: str) -> None:
    data = (entry / name).read_bytes()
    _rewrite(entry / name, data[: len(data) // 2])


def delete_manifest(entry: Path, name: str) -> None:
    (entry / MANIFEST).unlink()


def garble_manifest(entry: Path, name: str) -> None:
    data = (entry / MANIFEST).read_bytes()
    _rewrite(entry / MANIFEST, data[: len(data) // 2])


# name -> (damage, words the cache's warning uses for it)
DAMAGES: dict[str, tuple[Callable[[Path, str], None], str]] = {
    "flipped-byte": (flip_byte, "sha256"),
    "truncated": (truncate, "bytes"),
    "no-manifest": (delete_manifest, f"{MANIFEST} is missing"),
    "garbled-manifest": (garble_manifest, f"{MANIFEST} is not readable JSON"),
}
