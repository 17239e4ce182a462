"""C simulation of an HLS project: gcc builds testbench + top + kernel, then it runs.

Binaries are cached by content hash in ``$QNORM_CACHE/hls/<key>/`` (default
``~/.cache/qnorm/hls``): the key is the SHA-256 of every C source and header of
the project, the compiler and its flags, so the same project is compiled once
per machine and any change to a source misses.  The vectors file is read at run
time and is not part of the key.  The binary and the compiler's messages are one
:mod:`compilers.cache` entry: written whole (concurrent builds never run a
half-written binary) and checked against their SHA-256 on every hit (a damaged
binary is compiled again, never run).
"""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from compilers import cache
from compilers.fpga import csource
from compilers.fpga.vectors import read_outputs, write_vectors
from compilers.toolchains import compiler_unavailable
from compilers.tvm.build import cache_dir as tvm_cache_dir
from qnorm.targets import Target

_KEY_FORMAT = 2  # bump when the key recipe or the entry layout changes
BINARY, LOG = "qnorm_tb", "compiler.log"
_HEADERS = (csource.TOP_H, csource.ABI_H)


class CsimError(RuntimeError):
    """The C simulation could not be built or did not run cleanly."""


@dataclass(frozen=True)
class Csim:
    """A built C simulation binary and how it was obtained."""

    binary: Path
    compiler_output: str  # gcc's warnings (empty when clean)
    cache_hit: bool
    seconds: float  # compile on a miss, digest check on a hit


def cache_dir() -> Path:
    """``$QNORM_CACHE/hls``: next to the TVM build cache, read at each call."""
    return tvm_cache_dir().parent / "hls"


def cache_key(project: Path, target: Target) -> str:
    h = hashlib.sha256()
    h.update(repr((_KEY_FORMAT, target.build.cc, target.build.cflags)).encode())
    for name in sorted((*csource.CSIM_SOURCES, *_HEADERS)):
        h.update(name.encode() + b"\0" + (project / name).read_bytes() + b"\0")
    return h.hexdigest()


def build_csim(project: Path, target: Target) -> Csim:
    """Compile the project's testbench, top, kernel and ABI shim (or find them cached)."""
    reason = compiler_unavailable(target)
    if reason is not None:
        raise CsimError(reason)
    project = Path(project)
    start = time.perf_counter()
    entry = cache.cached(cache_dir() / cache_key(project, target), lambda d: _compile(project, target, d))
    return Csim(entry / BINARY, (entry / LOG).read_text(), entry.hit, time.perf_counter() - start)


def _compile(project: Path, target: Target, directory: Path) -> None:
    """The testbench binary and the compiler's messages, into ``directory``."""
    command = [target.build.cc, *target.build.cflags, "-o", str(directory / BINARY), *csource.CSIM_SOURCES]
    done = subprocess.run(command, check=False, cwd=project, capture_output=True, text=True)
    if done.returncode != 0:
        raise CsimError(f"C simulation build failed ({' '.join(command)} in {project}):\n{done.stderr}")
    (directory / LOG).write_text(done.stderr)


def run_testbench(binary: Path, vectors: Path, outputs: Path | None = None) -> subprocess.CompletedProcess:
    """Run the testbench on a vectors file (no check of its exit status)."""
    command = [str(binary), str(vectors), *([] if outputs is None else [str(outputs)])]
    return subprocess.run(command, check=False, capture_output=True, text=True)


def simulate(binary: Path, units: np.ndarray, in_bytes: int, out_bytes: int) -> np.ndarray:
    """The top's outputs for ``units`` (vectors, elements per vector), via the testbench."""
    with tempfile.TemporaryDirectory(prefix="qnorm-csim-") as tmp:
        vectors = write_vectors(Path(tmp) / csource.VECTORS, units, in_bytes, out_bytes)
        outputs = Path(tmp) / "outputs.bin"
        done = run_testbench(binary, vectors, outputs)
        if done.returncode != 0:
            raise CsimError(f"C simulation {binary} exited {done.returncode}: {done.stderr.strip()}")
        return read_outputs(outputs, *units.shape)


def acceptance(project: Path, target: Target) -> str:
    """Build a written project's C simulation and run it on its own ``vectors.bin`` (the
    golden op's outputs inside): the testbench's PASS line, or ``not run: <why>`` where
    this machine has no C compiler.  :class:`CsimError` with the testbench's message (the
    first mismatch) when the project's outputs differ or it does not run cleanly."""
    reason = compiler_unavailable(target)
    if reason is not None:
        return f"not run: {reason}"
    project = Path(project)
    done = run_testbench(build_csim(project, target).binary, project / csource.VECTORS)
    if done.returncode != 0:
        raise CsimError(f"{project}: the C simulation of the written project failed (exit {done.returncode}): "
                        f"{done.stderr.strip() or '(no message)'}; do not synthesize it")
    return done.stdout.strip()
