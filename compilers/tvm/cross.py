"""Kernels for edge CPUs (aarch64, riscv64): TVM LLVM cross-compilation, run under qemu-user.

A kernel's CPU-scheduled module is compiled by TVM's LLVM back end for the
target's triple and CPU, and its object code is linked by the target's cross gcc
with ``harness/cross_main.c`` into one executable that needs no libtvm: the
harness reads the kernel's arguments from a file, calls TVM's packed entry
``__tvm_ffi_main`` through the TVM-FFI C ABI, provides the few runtime functions
the object calls (workspace allocation, a serial parallel-launch, error
reporting) and writes the output.  With ``-static`` in the target's
``build.cflags`` the executable carries its libc, so qemu-user needs nothing
from the target's sysroot.

Executables are cached like :mod:`compilers.tvm.build`'s libraries, as
``$QNORM_CACHE/tvm/cross/<target>-<key>/kernel``, keyed by that module's cache
key (kernel text, TVM target, cc, cflags, TVM version) plus the harness source
and the compile flags.  They are :mod:`compilers.cache` entries: an executable
whose bytes no longer match the SHA-256 recorded when it was linked is linked
again, never run.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import struct
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tvm
import tvm.libinfo
import tvm_ffi.libinfo

from compilers.toolchains import cross_tools_missing
from compilers import cache
from compilers.cache import sha256_file
from compilers.tvm.build import cache_dir, cache_key, non_integer_dtypes, tvm_target
from compilers.tvm.kernels import CompiledKernel, Kernel
from qnorm.targets import Target, load_target

HARNESS = Path(__file__).resolve().parent / "harness" / "cross_main.c"
_KEY_FORMAT = 2  # bump when the key recipe, the entry layout or the file protocol changes
EXECUTABLE = "kernel"
_CFLAGS = ("-O2", "-std=c11")
_MAGIC = b"QNXT"  # the arguments file of harness/cross_main.c
# The runtime entry points the harness installs (TVM's context pointers).
_PROVIDED = frozenset(
    {
        "__TVMBackendAllocWorkspace",
        "__TVMBackendFreeWorkspace",
        "__TVMBackendParallelLaunch",
        "__TVMBackendParallelBarrier",
    }
)
_CONTEXT_GLOBAL = re.compile(r"^@(__TVM\w+) = ", re.MULTILINE)
RUN_TIMEOUT_S = 600


class CrossError(RuntimeError):
    """Building or running a cross-compiled kernel failed (the message names target and command)."""


@dataclass(frozen=True)
class CrossBuilt:
    """A linked kernel executable and how it was obtained."""

    path: Path
    key: str
    cache_hit: bool
    seconds: float  # compile + link on a miss, digest check on a hit


# --------------------------------------------------------------------------- targets


def cross_target(target: Target | str) -> Target:
    """``target`` (or the target of that name), checked to be a qemu-user LLVM target."""
    if isinstance(target, str):
        target = load_target(target)
    if target.run.method != "qemu-user" or target.tvm["kind"] != "llvm":
        raise ValueError(
            f"target {target.name!r} is not a cross-compiled CPU target (its run method is "
            f"{target.run.method!r}, TVM kind {target.tvm['kind']!r}); cross builds need "
            "run.method = 'qemu-user' and tvm.kind = 'llvm'"
        )
    return target


def missing_tools(target: Target | str) -> str | None:
    """None when this machine can build and run ``target``'s kernels, else what is missing."""
    return cross_tools_missing(cross_target(target))


# --------------------------------------------------------------------------- build


def _include_dirs() -> list[str]:
    """TVM-FFI's C ABI (TVMFFIAny, DLTensor) and TVM's backend API, from the installed packages."""
    return [*tvm_ffi.libinfo.include_paths(), tvm.libinfo.find_include_path()]


def executable_key(kernel: Kernel, target: Target) -> str:
    recipe = {
        "format": _KEY_FORMAT,
        "module": cache_key(kernel.mod, target),  # kernel text, TVM target, cc, cflags, TVM version
        "harness": sha256_file(HARNESS),
        "flags": list(_CFLAGS),
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def executable(kernel: Kernel, target: Target | str) -> CrossBuilt:
    """The kernel's executable for ``target``, from the cache or compiled and linked now."""
    target = cross_target(target)
    key = executable_key(kernel, target)
    start = time.perf_counter()
    entry = cache.cached(cache_dir() / "cross" / f"{target.name}-{key}", lambda d: _link(kernel, target, d))
    return CrossBuilt(entry / EXECUTABLE, key, entry.hit, time.perf_counter() - start)


def _link(kernel: Kernel, target: Target, directory: Path) -> None:
    """Compile the kernel to an object for ``target`` and link it with the harness into
    ``directory`` (the entry holds the executable only)."""
    bad = non_integer_dtypes(kernel.mod)
    if bad:
        raise ValueError(f"kernel uses non-integer dtypes {sorted(bad)}; qnorm kernels are integer-only")
    module = tvm.compile(kernel.mod, target=tvm_target(target)).mod
    if module.imports:
        raise CrossError(
            f"{target.name}: the compiled kernel imports {len(module.imports)} other modules; "
            "the standalone harness links a single LLVM object"
        )
    needed = set(_CONTEXT_GLOBAL.findall(module.inspect_source("ll"))) - _PROVIDED
    if needed:
        raise CrossError(
            f"{target.name}: the kernel object needs runtime entry points the harness does not "
            f"provide: {', '.join(sorted(needed))}"
        )
    obj, exe = directory / "kernel.o", directory / EXECUTABLE
    module.write_to_file(str(obj))
    includes = [f"-I{d}" for d in _include_dirs()]
    cmd = [target.build.cc, *_CFLAGS, *target.build.cflags, *includes, str(HARNESS), str(obj), "-o", str(exe)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, errors="replace")
    obj.unlink()
    if done.returncode != 0:
        raise CrossError(
            f"{target.name}: linking failed (exit {done.returncode}): {shlex.join(cmd)}\n{done.stderr.strip()}"
        )


# --------------------------------------------------------------------------- run


def _as_numpy(a: Any) -> np.ndarray:
    return a.numpy() if hasattr(a, "numpy") else np.asarray(a)


def _dtype_bits(dtype: str | np.dtype) -> int:
    d = np.dtype(str(dtype))
    if d.kind != "i":
        raise ValueError(f"the cross harness takes signed integer tensors, not {d}")
    return d.itemsize * 8


def write_args(path: Path, inputs: Sequence[np.ndarray], out_shape: tuple[int, ...], out_dtype: str) -> None:
    """The harness's arguments file: every header, then the inputs' data (see cross_main.c)."""
    shapes = [(a.shape, a.dtype) for a in inputs] + [(out_shape, out_dtype)]
    head = [_MAGIC, struct.pack("<I", len(shapes))]
    for shape, dtype in shapes:
        head.append(struct.pack(f"<II{len(shape)}q", _dtype_bits(dtype), len(shape), *shape))
    with open(path, "wb") as f:
        f.write(b"".join(head))
        f.writelines(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes() for a in inputs)


@dataclass(frozen=True, eq=False)
class CrossCompiledKernel(CompiledKernel):
    """A kernel executable run under qemu-user.

    ``__call__`` (the op's shape and input-format checks, the time-major layout,
    int4 values in int8 containers) is :class:`CompiledKernel`'s; only ``run``,
    which executes the kernel on kernel-layout arrays, differs.
    """

    built: CrossBuilt
    target: Target

    def command(self, args_file: Path, out_file: Path) -> list[str]:
        run = self.target.run
        return [run.emulator, "-L", run.sysroot, str(self.built.path), str(args_file), str(out_file)]

    def run(self, x: Any, consts: Sequence[Any] | None = None, out: Any = None) -> Any:
        """Run on one kernel-layout input (numpy or TVM tensor); returns ``out`` or a new TVM tensor."""
        k = self.kernel
        xs = _as_numpy(x)
        inputs = [xs, *(_as_numpy(c) for c in (k.consts if consts is None else consts))]
        with tempfile.TemporaryDirectory(prefix="qnorm-cross-") as tmp:
            args_file, out_file = Path(tmp) / "args", Path(tmp) / "out"
            write_args(args_file, inputs, xs.shape, k.out_dtype)
            cmd = self.command(args_file, out_file)
            y = self.execute(cmd, out_file, xs.shape)
        if out is None:
            return tvm.runtime.tensor(y)
        out.copyfrom(y)
        return out

    def execute(self, cmd: list[str], out_file: Path, shape: tuple[int, ...]) -> np.ndarray:
        """Run ``cmd`` (see :meth:`command`) and read the output it wrote to ``out_file``."""
        name = self.target.name
        try:
            done = subprocess.run(
                cmd, check=False, capture_output=True, text=True, errors="replace", timeout=RUN_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            raise CrossError(f"{name}: `{shlex.join(cmd)}` ran longer than {RUN_TIMEOUT_S} s") from None
        if done.returncode != 0 or done.stderr:
            raise CrossError(
                f"{name}: `{shlex.join(cmd)}` exited with status {done.returncode}: "
                f"{done.stderr.strip() or '(no message)'}"
            )
        dtype = np.dtype(self.kernel.out_dtype).newbyteorder("<")
        want = int(np.prod(shape)) * dtype.itemsize
        if not out_file.exists():
            raise CrossError(f"{name}: `{shlex.join(cmd)}` exited with status 0 but wrote no output")
        got = out_file.stat().st_size
        if got != want:
            raise CrossError(f"{name}: `{shlex.join(cmd)}` wrote {got} output bytes, expected {want}")
        return np.fromfile(out_file, dtype=dtype).reshape(shape)


def cross_build(kernel: Kernel, target: Target | str) -> CrossCompiledKernel:
    """``kernel`` built for a qemu-user target: a callable from op inputs to op outputs."""
    target = cross_target(target)
    return CrossCompiledKernel(kernel, executable(kernel, target), target)
