"""compilers.cache: entries are published whole with their digests and checked on every hit;
a damaged entry is removed (with a warning naming it) and built again, never served."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
from cache_damage import DAMAGES

from compilers import cache

PAYLOAD = b"\x7fELF pretend library " + bytes(range(256)) * 8


class Writer:
    """Writes ``PAYLOAD`` (and a second file) into an entry; counts its calls."""

    def __init__(self, payload: bytes = PAYLOAD) -> None:
        self.payload = payload
        self.calls = 0

    def __call__(self, directory: Path) -> None:
        self.calls += 1
        (directory / "lib.so").write_bytes(self.payload)
        (directory / "log.txt").write_text("no warnings\n")


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_cache_root_is_the_environment_variable_made_absolute(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    assert cache.cache_root() == tmp_path
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(cache.CACHE_ENV, "relative")
    assert cache.cache_root() == tmp_path / "relative"
    monkeypatch.delenv(cache.CACHE_ENV)
    assert cache.cache_root() == Path.home() / ".cache" / "qnorm"


def test_an_entry_is_built_once_then_served_with_its_digests(tmp_path) -> None:
    write = Writer()
    first = cache.cached(tmp_path / "key", write)
    again = cache.cached(tmp_path / "key", write)
    assert write.calls == 1 and not first.hit and again.hit
    assert (again / "lib.so").read_bytes() == PAYLOAD
    want = hashlib.sha256(PAYLOAD).hexdigest()
    assert first.digests["lib.so"] == again.digests["lib.so"] == want
    record = json.loads((tmp_path / "key" / cache.MANIFEST).read_text())
    assert record["format"] == cache.FORMAT and sorted(record["files"]) == ["lib.so", "log.txt"]
    assert record["files"]["lib.so"] == {"bytes": len(PAYLOAD), "sha256": want}
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_entry_is_removed_with_a_warning_and_built_again(tmp_path, caplog, damage) -> None:
    spoil, words = DAMAGES[damage]
    write = Writer()
    cache.cached(tmp_path / "key", write)
    spoil(tmp_path / "key", "lib.so")
    with caplog.at_level(logging.WARNING, logger="compilers.cache"):
        again = cache.cached(tmp_path / "key", write)
    assert write.calls == 2 and not again.hit
    assert (again / "lib.so").read_bytes() == PAYLOAD
    assert again.digests["lib.so"] == hashlib.sha256(PAYLOAD).hexdigest()
    [record] = caplog.records
    assert str(tmp_path / "key") in record.getMessage() and words in record.getMessage()
    assert leftovers(tmp_path) == []


def test_lookup_never_returns_a_damaged_entry(tmp_path) -> None:
    cache.cached(tmp_path / "key", Writer())
    DAMAGES["flipped-byte"][0](tmp_path / "key", "lib.so")
    assert cache.lookup(tmp_path / "key") is None
    assert not (tmp_path / "key").exists()
    assert cache.lookup(tmp_path / "key") is None  # and a missing entry is simply a miss


@pytest.mark.parametrize(
    "files",
    [
        {"../lib.so": {"bytes": 1, "sha256": "0" * 64}},  # a name outside the entry
        {"lib.so": {"bytes": "1", "sha256": "0" * 64}},
        {},
    ],
)
def test_a_manifest_of_the_wrong_shape_is_garbled(tmp_path, caplog, files) -> None:
    cache.cached(tmp_path / "key", Writer())
    manifest = tmp_path / "key" / cache.MANIFEST
    manifest.write_text(json.dumps({"format": cache.FORMAT, "version": cache.VERSION, "files": files}))
    assert cache.lookup(tmp_path / "key") is None
    assert f"{cache.MANIFEST} is not a {cache.FORMAT} version {cache.VERSION} record" in caplog.text


def test_a_missing_file_the_manifest_records_is_damage(tmp_path, caplog) -> None:
    cache.cached(tmp_path / "key", Writer())
    (tmp_path / "key" / "log.txt").unlink()
    assert cache.lookup(tmp_path / "key") is None
    assert "log.txt is missing" in caplog.text


def test_a_failed_build_publishes_nothing(tmp_path) -> None:
    def fail(directory: Path) -> None:
        (directory / "lib.so").write_bytes(PAYLOAD[:10])  # half written, then the compiler fails
        raise RuntimeError("compiler failed")

    with pytest.raises(RuntimeError, match="compiler failed"):
        cache.cached(tmp_path / "key", fail)
    assert not (tmp_path / "key").exists() and leftovers(tmp_path) == []


def test_a_killed_build_is_never_mistaken_for_an_entry(tmp_path) -> None:
    """A process killed mid-build leaves its private directory (no manifest, half a file)."""
    stale = tmp_path / ".tmp-key-abcd"
    stale.mkdir()
    (stale / "lib.so").write_bytes(PAYLOAD[:10])
    assert cache.lookup(tmp_path / "key") is None
    assert (cache.cached(tmp_path / "key", Writer()) / "lib.so").read_bytes() == PAYLOAD


def test_a_concurrent_build_that_published_first_is_kept(tmp_path) -> None:
    def racing(directory: Path) -> None:
        cache.publish(tmp_path / "key", Writer())  # another process finishes first
        Writer(b"same program, other bytes")(directory)

    entry = cache.publish(tmp_path / "key", racing)
    assert (entry / "lib.so").read_bytes() == PAYLOAD
    assert entry.digests["lib.so"] == hashlib.sha256(PAYLOAD).hexdigest()
    assert leftovers(tmp_path) == []


def test_an_entry_holds_plain_files_only(tmp_path) -> None:
    with pytest.raises(cache.CacheError, match="plain files"):
        cache.cached(tmp_path / "key", lambda d: (d / "sub").mkdir())
    with pytest.raises(cache.CacheError, match="plain files"):
        cache.cached(tmp_path / "key", lambda d: None)
    assert not (tmp_path / "key").exists()
