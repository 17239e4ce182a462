"""qnorm/data/golden: stored inputs and outputs of every case, guarded by a sha256 manifest.

Layout: ``<dir>/<case>.npz`` holds ``x`` (op-layout inputs) and ``y`` (the golden
outputs when they were generated), both in the narrowest integer dtype; and
``<dir>/manifest.json`` records, per case, the file, its sha256, the case config
and the vector count, plus the qnorm version that wrote them.

The store is written only by :func:`regenerate` (``qnorm golden --regenerate``).
Everything else reads it through :func:`load`, which refuses — naming the file —
a missing manifest or file, a sha256 that differs, a config that no longer
matches the catalogue, and anything that is not a plain integer npz (loaded with
``allow_pickle=False``).  Whether the current golden model still reproduces
``y`` is the regression check the harness runs.

Files are written byte-for-byte deterministically (fixed zip timestamps), so
regenerating unchanged vectors leaves the files and the manifest unchanged.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from qnorm.data import data_dir
from qnorm.errors import QnormError
from qnorm.verify.cases import CASES, Case
from qnorm.verify.vectors import golden_inputs

FORMAT = 1
MANIFEST = "manifest.json"
DEFAULT_DIR = data_dir("golden")  # package data, so an installed qnorm verifies against it too
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest zip timestamp: no build time in the bytes
_KEYS = ("x", "y")


class GoldenStoreError(QnormError, ValueError):
    """The golden store is missing, modified, corrupt or out of step with the catalogue."""


@dataclass(frozen=True, eq=False)
class GoldenVectors:
    x: np.ndarray
    y: np.ndarray


def qnorm_version() -> str:
    return version("qnorm")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def config_json(case: Case) -> Any:
    """The case config as JSON reads it back (tuples become lists), for comparison."""
    return json.loads(json.dumps(case.config))


# --------------------------------------------------------------------------- writing


def narrow(a: np.ndarray) -> np.ndarray:
    """The smallest signed integer dtype holding ``a`` (int4/int8 data stores as int8)."""
    lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
    for dt in (np.int8, np.int16, np.int32):
        info = np.iinfo(dt)
        if info.min <= lo and hi <= info.max:
            return a.astype(dt)
    return a.astype(np.int64)


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An .npz that ``np.load`` reads, with fixed member timestamps (deterministic bytes)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, a in arrays.items():
            member = io.BytesIO()
            np.lib.format.write_array(member, np.ascontiguousarray(a), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, member.getvalue())
    return buf.getvalue()


def regenerate(directory: Path, cases: list[Case]) -> dict[str, Any]:
    """Rewrite the vectors of ``cases`` from the current golden model; returns the manifest.

    Entries of other cases still in the catalogue are kept as they are; entries
    (and files) of cases no longer in the catalogue are removed.
    """
    directory.mkdir(parents=True, exist_ok=True)
    known = {c.name for c in CASES}
    old = read_manifest(directory)["cases"] if (directory / MANIFEST).exists() else {}
    entries = {name: e for name, e in old.items() if name in known}
    for name, entry in old.items():
        if name not in known:
            (directory / entry["file"]).unlink(missing_ok=True)
    for case in cases:
        x = golden_inputs(case)
        y = case.build().forward(x)
        path = directory / f"{case.name}.npz"
        path.write_bytes(npz_bytes({"x": narrow(x), "y": narrow(np.asarray(y))}))
        entries[case.name] = {
            "file": path.name,
            "sha256": sha256(path),
            "op": case.op,
            "definition": case.definition,
            "config": config_json(case),
            "shape": list(x.shape),
        }
    manifest = {"format": FORMAT, "qnorm_version": qnorm_version(), "cases": dict(sorted(entries.items()))}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


# --------------------------------------------------------------------------- reading


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest, its structure validated (the files are checked by :func:`load`)."""
    path = directory / MANIFEST
    if not path.is_file():
        raise GoldenStoreError(f"golden manifest {path} not found; write it with `qnorm golden --regenerate`")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise GoldenStoreError(f"golden manifest {path} is not valid JSON: {err}") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("cases"), dict)
    ):
        raise GoldenStoreError(f"golden manifest {path} is not a format-{FORMAT} qnorm manifest")
    return manifest


def load(directory: Path, case: Case, manifest: dict[str, Any] | None = None) -> GoldenVectors:
    """The stored vectors of ``case``, after every integrity check (see the module docstring)."""
    manifest = manifest if manifest is not None else read_manifest(directory)
    entry = manifest["cases"].get(case.name)
    if entry is None:
        raise GoldenStoreError(
            f"no golden vectors for case {case.name!r} in {directory / MANIFEST}; "
            "add them with `qnorm golden --regenerate`"
        )
    if entry.get("definition", 1) != case.definition:
        raise GoldenStoreError(
            f"case {case.name!r}: its golden vectors in {directory / MANIFEST} were made by version "
            f"{entry.get('definition', 1)} of the {case.op} definition; this qnorm computes version "
            f"{case.definition}. The stored integers are not reinterpreted: regenerate them deliberately "
            "with `qnorm golden --regenerate`"
        )
    if entry.get("config") != config_json(case):
        raise GoldenStoreError(
            f"case {case.name!r}: its catalogue config differs from the one its golden vectors were "
            f"made for ({directory / MANIFEST}); regenerate them deliberately with `qnorm golden --regenerate`"
        )
    path = directory / str(entry.get("file"))
    if not path.is_file():
        raise GoldenStoreError(f"golden file {path} (case {case.name!r}) is missing")
    actual = sha256(path)
    if actual != entry.get("sha256"):
        raise GoldenStoreError(
            f"golden file {path} was modified: sha256 {actual}, manifest says {entry.get('sha256')}; "
            "restore it, or regenerate deliberately with `qnorm golden --regenerate`"
        )
    return _read_npz(path, tuple(entry.get("shape", ())))


def _read_npz(path: Path, shape: tuple[int, ...]) -> GoldenVectors:
    try:
        with np.load(path, allow_pickle=False) as npz:
            if sorted(npz.files) != sorted(_KEYS):
                raise GoldenStoreError(f"golden file {path} holds {sorted(npz.files)}, expected arrays {list(_KEYS)}")
            x, y = (npz[k] for k in _KEYS)
    except GoldenStoreError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as err:
        # ValueError covers object arrays, which allow_pickle=False refuses to load
        raise GoldenStoreError(f"golden file {path} is not a readable integer npz: {err}") from None
    for name, a in (("x", x), ("y", y)):
        if a.dtype.kind != "i":
            raise GoldenStoreError(f"golden file {path}: array {name!r} has dtype {a.dtype}, expected signed integers")
    if x.shape != shape or y.shape != x.shape:
        raise GoldenStoreError(
            f"golden file {path}: shapes x {x.shape}, y {y.shape} do not match the manifest's {shape}"
        )
    return GoldenVectors(x.astype(np.int64), y.astype(np.int64))


def check(directory: Path, cases: list[Case]) -> dict[str, str]:
    """Problems by case name: integrity errors, or stored outputs the golden model no
    longer reproduces (the count of differing elements).  Empty: all good."""
    problems: dict[str, str] = {}
    for case in cases:
        try:
            stored = load(directory, case)
        except GoldenStoreError as err:
            problems[case.name] = f"FAIL: {err}"
            continue
        got = case.build().forward(stored.x)
        if not np.array_equal(got, stored.y):
            diff = int(np.count_nonzero(got != stored.y))
            problems[case.name] = f"FAIL: the golden model no longer reproduces {diff} stored output(s)"
    return problems
