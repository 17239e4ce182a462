"""JSON values as named fields: per-field checksums and field-by-field differences.

A checkpoint's meta.json is checked field by field, so that a refusal can say *which*
field differs (``config.norm``, ``golden.constants.gain[3]``), not only that
something does.  Fields are the leaves of the JSON value: ``a.b`` for object keys,
``a[3]`` for list items; an empty object or list is a leaf itself.  Leaves compare
by their canonical JSON text, so ``1``, ``1.0`` and ``true`` differ, as they do in
the file.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# How many differences a message lists before summarizing.
SHOWN = 8


def leaves(value: Any, path: str = "") -> dict[str, Any]:
    """``{field path: leaf value}`` of a parsed JSON value."""
    if isinstance(value, dict) and value:
        found: dict[str, Any] = {}
        for key, item in value.items():
            found.update(leaves(item, f"{path}.{key}" if path else str(key)))
        return found
    if isinstance(value, list) and value:
        found = {}
        for i, item in enumerate(value):
            found.update(leaves(item, f"{path}[{i}]"))
        return found
    return {path: value}


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, allow_nan=False)


def field_checksums(value: Any) -> dict[str, str]:
    """``{field path: sha256 of its canonical JSON}``: what meta.json records for a value."""
    return {path: hashlib.sha256(canonical(leaf).encode()).hexdigest() for path, leaf in leaves(value).items()}


def checksum_differences(value: Any, recorded: dict[str, str]) -> list[str]:
    """The fields of ``value`` whose checksum differs from ``recorded``, or that one of them lacks."""
    now, fields = field_checksums(value), leaves(value)
    found = [f"{p} = {canonical(fields[p])} (changed)" for p in now if p in recorded and now[p] != recorded[p]]
    found += [f"{p} = {canonical(fields[p])} (added)" for p in now if p not in recorded]
    found += [f"{p} (removed)" for p in recorded if p not in now]
    return found


def differences(recorded: Any, derived: Any) -> list[str]:
    """Field by field, where ``derived`` differs from ``recorded``."""
    old, new = leaves(recorded), leaves(derived)
    found = []
    for path in {**old, **new}:
        before = canonical(old[path]) if path in old else "nothing"
        after = canonical(new[path]) if path in new else "nothing"
        if before != after:
            found.append(f"{path or '(the whole value)'}: recorded {before}, re-derived {after}")
    return found


def listing(items: list[str], sep: str = "; ") -> str:
    """The first :data:`SHOWN` items, joined by ``sep``, with a count of the rest."""
    shown = sep.join(items[:SHOWN])
    return shown + (f" (+{len(items) - SHOWN} more)" if len(items) > SHOWN else "")
