"""Compile TIR for a qnorm target, through an on-disk content-hash cache.

The cache key is the SHA-256 of the module's TVMScript text (metadata included),
the resolved TVM target, the linker and its flags, and the TVM version: the same
kernel for the same target is compiled once per machine, and any change to the
kernel, the target or TVM misses.  Entries are ``export_library`` shared objects,
``$QNORM_CACHE/tvm/<key>/kernel.so`` (default ``~/.cache/qnorm/tvm``), written
and checked by :mod:`compilers.cache` (a library that no longer matches its
recorded SHA-256 is built again); checking and loading one takes about a
millisecond.

:func:`build` refuses kernels that use a non-integer dtype anywhere (qnorm kernels
are integer by contract); :func:`dtypes_used` is the walker behind that check.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tvm
import tvm_ffi
from tvm import tirx

from compilers import cache
from compilers.tvm import x86_rowsums
from qnorm.targets import Target

_KEY_FORMAT = 2  # bump when the key recipe or the entry layout changes
LIBRARY = "kernel.so"
_LINKABLE_KINDS = ("llvm", "c")


@dataclass(frozen=True)
class Built:
    """A loaded kernel library and how it was obtained."""

    module: tvm.runtime.Module
    path: Path
    key: str
    cache_hit: bool
    seconds: float  # compile + export + load on a miss, digest check + load on a hit

    def __getitem__(self, name: str) -> Any:
        return self.module[name]

    def __call__(self, *args: Any) -> None:
        self.module["main"](*args)


def cache_dir() -> Path:
    """Where compiled libraries live (``$QNORM_CACHE/tvm``, read at each call)."""
    return cache.cache_root() / "tvm"


def tvm_target(target: Target) -> tvm.target.Target:
    """The TVM target of a qnorm target (with its host target, for devices)."""
    host = target.tvm_host_spec()
    return tvm.target.Target(
        target.tvm_spec(), host=None if host is None else tvm.target.Target(host)
    )


def build_recipe(target: Target) -> dict[str, Any]:
    """What a compiled library depends on besides its module: TVM, the target, the linker."""
    return {
        "tvm": tvm.__version__,
        "target": target.tvm_spec(),
        "host": target.tvm_host_spec(),
        "cc": target.build.cc,
        "cflags": list(target.build.cflags),
    }


def cache_key(mod: tirx.PrimFunc | tvm.IRModule, target: Target) -> str:
    recipe = {
        "format": _KEY_FORMAT,
        **build_recipe(target),
        "module": _as_module(mod).script(show_meta=True),
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def build(mod: tirx.PrimFunc | tvm.IRModule, target: Target, *, allow_float: bool = False) -> Built:
    """Compile ``mod`` for ``target`` (or load it from the cache) and load it here.

    Only targets that run natively can be loaded into this process; the others
    get their own runners (qemu-user, PoCL, nvcc, C simulation).
    """
    if not target.runs_natively:
        raise ValueError(
            f"target {target.name!r} runs via {target.run.method}, not in this process"
        )
    if target.tvm["kind"] not in _LINKABLE_KINDS:
        raise ValueError(
            f"target {target.name!r} has TVM kind {target.tvm['kind']!r}; build() links llvm or c"
        )
    # target-specific instructions first: the cache key is of the text that is compiled
    mod = x86_rowsums.rewrite(_as_module(mod), target)
    if not allow_float:
        bad = non_integer_dtypes(mod)
        if bad:
            raise ValueError(
                f"kernel uses non-integer dtypes {sorted(bad)}; qnorm kernels are integer-only"
            )

    key = cache_key(mod, target)
    start = time.perf_counter()

    def export(directory: Path) -> None:
        executable = tvm.compile(mod, target=tvm_target(target))
        executable.export_library(str(directory / LIBRARY), cc=target.build.cc, options=list(target.build.cflags))

    entry = cache.cached(cache_dir() / key, export)
    module = tvm.runtime.load_module(str(entry / LIBRARY))
    return Built(module, entry / LIBRARY, key, entry.hit, time.perf_counter() - start)


# --------------------------------------------------------------------------- dtypes


def dtypes_used(mod: tirx.PrimFunc | tvm.IRModule) -> frozenset[str]:
    """Every dtype of every buffer, variable and expression in ``mod``.

    A pre-order structural walk that skips already-seen nodes, so shared
    subexpressions are visited once.
    """
    found: set[str] = set()
    seen: set[int] = set()

    def visit(node: Any) -> Any:
        if not isinstance(node, tvm_ffi.Object):
            return None
        key = node.__chandle__()
        if key in seen:
            return tvm_ffi.WalkResult.SKIP
        seen.add(key)
        _collect_type(node, found)
        _collect_type(getattr(node, "ty", None), found)
        return None

    tvm_ffi.structural_walk(mod, visit, order="pre")
    return frozenset(found)


def non_integer_dtypes(mod: tirx.PrimFunc | tvm.IRModule) -> frozenset[str]:
    """The dtypes in ``mod`` that are not integers, bool or pointers (floats of any
    width and format, including bfloat and the float8/float4 variants)."""
    return frozenset(
        d
        for d in dtypes_used(mod)
        if not d.startswith(("int", "uint")) and d not in ("bool", "handle", "void")
    )


def _collect_type(ty: Any, found: set[str]) -> None:
    if isinstance(ty, tvm.ir.PrimType):
        found.add(str(ty))
    elif isinstance(ty, tvm.ir.PointerType):
        _collect_type(ty.element_type, found)
    elif isinstance(ty, tirx.buffer.BufferType):
        found.add(str(ty.dtype))


def _as_module(mod: tirx.PrimFunc | tvm.IRModule) -> tvm.IRModule:
    return tvm.IRModule({"main": mod}) if isinstance(mod, tirx.PrimFunc) else mod
