"""The GPU-scheduled kernels as CUDA: TVM's CUDA source, nvcc's PTX and cubins, a plain runner.

* :func:`cuda_kernel` lowers ``kernel_for(op, GPU)`` for ``qnorm/data/targets/cuda.toml``
  (TVM's own build steps, see :func:`compilers.tvm.gpu.lower`) and compiles the
  source with nvcc to PTX and to a cubin for every architecture the target
  lists (``run.compile_args``: ``-arch=sm_80``, ``-arch=sm_90``).  Results are
  cached by content hash under ``$QNORM_CACHE/cuda`` as :mod:`compilers.cache`
  entries (checked against their SHA-256 on every hit, rebuilt when damaged);
  a failing nvcc raises :class:`NvccError` with the command line and nvcc's
  message.
* The launch geometry (grid and block of every kernel function, in launch
  order, as expressions of ``rows``/``steps``) comes with the source, so
  something other than TVM can launch it: ``compilers/tvm/harness/gpu_harness.cu``, a small
  CUDA runtime program that reads a *plan* (module, buffers as binary files,
  launches, expected outputs) and needs no TVM.  :class:`PlanWriter` writes
  plans; :func:`gpu_runner` runs a kernel through the harness on this
  machine's GPU.

The TVM build qnorm uses has no CUDA runtime, so the kernels run only through
the harness, where a GPU is present; without one they are compiled, never run
(the same schedule runs on PoCL, :mod:`.opencl`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
import tempfile
import time
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from compilers import cache
from compilers.toolchains import NVCC
from compilers.tvm.build import cache_dir as tvm_cache_dir
from compilers.tvm.build import tvm_target
from compilers.tvm.gpu import GPU, DeviceKernel, DeviceModule, Launch, lower
from compilers.tvm.kernels import CompiledKernel, Kernel, kernel_for
from qnorm.targets import Target, load_target

TARGET = "cuda"
OUTPUTS = ("ptx", "cubin")  # what nvcc makes of the source, for every architecture
HARNESS_FLAGS = ("-O2", "-std=c++17")
HARNESS_SOURCE = Path(__file__).resolve().parent / "harness" / "gpu_harness.cu"  # package data
_KEY_FORMAT = 2  # bump when the key recipe or the entry layout changes
HARNESS = "gpu_harness"
_ARCH = re.compile(r"^-arch=(sm_\d+a?)$")


class NvccError(RuntimeError):
    """nvcc failed; the message holds the command line and nvcc's output."""


@functools.cache
def cuda_target() -> Target:
    return load_target(TARGET)


def archs(target: Target) -> tuple[str, ...]:
    """The architectures to build for: every ``-arch=sm_XX`` of ``run.compile_args``."""
    found = tuple(m.group(1) for a in target.run.compile_args if (m := _ARCH.match(a)))
    if not found:
        raise ValueError(f"{target.path}: run.compile_args names no -arch=sm_XX")
    return found


def nvcc_flags(target: Target) -> tuple[str, ...]:
    """``run.compile_args`` other than the architectures: passed to every nvcc call."""
    return tuple(a for a in target.run.compile_args if not _ARCH.match(a))


@functools.cache
def nvcc_version() -> str:
    done = subprocess.run([NVCC, "--version"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NvccError(f"`{NVCC} --version` failed: {done.stderr.strip()}")
    return done.stdout.strip().splitlines()[-1]


# --------------------------------------------------------------------------- source


def device_module(kernel: Kernel, target: Target | None = None) -> DeviceModule:
    """CUDA source and launches of a GPU-scheduled kernel, checked against the block limit."""
    target = target or cuda_target()
    dev = lower(kernel.mod, tvm_target(target))
    limit = target.hardware.max_threads
    if limit is not None and dev.max_threads() > limit:
        raise ValueError(f"a block of {dev.max_threads()} threads exceeds {target.name}'s {limit}")
    return dev


# --------------------------------------------------------------------------- nvcc


@dataclass(frozen=True)
class CudaBinaries:
    """nvcc's outputs for one source, named ``{stem}.{arch}.ptx`` and ``{stem}.{arch}.cubin``."""

    stem: Path  # the cache entry's ``kernel``; ``kernel.cu`` is the source
    archs: tuple[str, ...]
    cache_hit: bool
    seconds: float  # nvcc wall time on a miss, the digest check on a hit

    @property
    def files(self) -> list[Path]:
        return [_output(self.stem, a, kind) for a in self.archs for kind in OUTPUTS]


def _output(stem: Path, arch: str, kind: str) -> Path:
    return stem.with_name(f"{stem.name}.{arch}.{kind}")


def cuda_cache_dir() -> Path:
    """``$QNORM_CACHE/cuda`` (next to the TVM build cache)."""
    return tvm_cache_dir().parent / "cuda"


def compile_source(source: str, target: Target | None = None) -> CudaBinaries:
    """PTX and cubin of ``source`` for every architecture of ``target``, via the cache."""
    target = target or cuda_target()
    arch_list, flags = archs(target), nvcc_flags(target)
    recipe = {
        "format": _KEY_FORMAT,
        "nvcc": nvcc_version(),
        "archs": arch_list,
        "flags": flags,
        "source": source,
    }
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()
    start = time.perf_counter()

    def compile_all(directory: Path) -> None:
        src = directory / "kernel.cu"
        src.write_text(source)
        with ThreadPoolExecutor(max_workers=len(arch_list)) as pool:
            list(pool.map(lambda arch: _nvcc(src, arch, flags), arch_list))

    entry = cache.cached(cuda_cache_dir() / key, compile_all)
    return CudaBinaries(entry / "kernel", arch_list, entry.hit, time.perf_counter() - start)


def _nvcc(src: Path, arch: str, flags: Sequence[str]) -> None:
    """PTX and cubin for ``arch`` from one nvcc call, next to ``src``.

    ``-cubin --keep`` leaves the PTX it assembled the cubin from in the keep
    directory: byte for byte what ``-ptx`` writes, at half the nvcc runs.
    """
    stem = src.with_suffix("")
    with tempfile.TemporaryDirectory(dir=src.parent, prefix=f"{arch}.") as tmp:
        cubin = Path(tmp) / f"{arch}.cubin"
        cmd = [
            NVCC,
            "-cubin",
            f"-arch={arch}",
            *flags,
            "--keep",
            "--keep-dir",
            tmp,
            str(src),
            "-o",
            str(cubin),
        ]
        run_nvcc(cmd)
        os.replace(Path(tmp) / f"{src.stem}.ptx", _output(stem, arch, "ptx"))
        os.replace(cubin, _output(stem, arch, "cubin"))


def run_nvcc(cmd: Sequence[str]) -> None:
    """Run an nvcc command; a failure raises :class:`NvccError` with the command and nvcc's output."""
    done = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NvccError(
            f"nvcc failed (exit {done.returncode}): {' '.join(cmd)}\n{done.stderr.strip()}"
        )


@dataclass(frozen=True, eq=False)
class CudaKernel:
    """A kernel compiled for CUDA: its source and launches, and nvcc's binaries."""

    kernel: Kernel
    device: DeviceModule
    binaries: CudaBinaries


def cuda_kernel(op: Any, target: Target | None = None) -> CudaKernel:
    """``op``'s GPU-scheduled kernel as CUDA source, compiled by nvcc for every architecture."""
    kernel = kernel_for(op, GPU)
    device = device_module(kernel, target)
    return CudaKernel(kernel, device, compile_source(device.source, target))


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class PlanRun:
    """One run of a plan: ``main``'s buffers, what to check, how often to time the launches.

    ``arrays`` holds every buffer of ``main`` in kernel layout (see
    :func:`kernel_arrays`); the output starts zeroed whatever it holds.
    ``expected`` is compared element by element; ``crc32`` (zlib's CRC-32 of the
    output bytes) stands in for it where the output is too big to ship;
    ``save`` writes the output back.
    """

    label: str
    arrays: dict[str, np.ndarray]
    out: str
    expected: np.ndarray | None = None
    crc32: int | None = None
    save: bool = False
    time_iters: int = 0


def kernel_arrays(kernel: Kernel, device: DeviceModule, x: np.ndarray) -> dict[str, np.ndarray]:
    """``main``'s buffers (named as in ``device``) for op-layout input ``x``: exactly what
    a CPU build of the kernel is called with (same checks, same layout: it is called that way)."""
    captured: list[np.ndarray] = []

    def capture(*tensors: Any) -> None:
        captured.extend(t.numpy() for t in tensors)

    CompiledKernel(kernel, capture)(x)  # type: ignore[arg-type]
    return dict(zip(device.buffers, captured, strict=True))


class PlanWriter:
    """Writes plans for compilers/tvm/harness/gpu_harness.cu into one directory, each data file once.

    A plan's ``module`` line names a stem and the architectures built for it;
    the harness loads ``{stem}.sm_XY.cubin`` for its GPU, or the newest older
    architecture's PTX (JIT-compiled by the driver).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._written: dict[bytes, str] = {}

    def data_file(self, a: np.ndarray, stem: str) -> str:
        raw = np.ascontiguousarray(a).tobytes()
        digest = hashlib.sha256(raw).digest()
        if digest not in self._written:
            self._written[digest] = f"{stem}.bin"
            (self.directory / self._written[digest]).write_bytes(raw)
        return self._written[digest]

    def write(
        self,
        name: str,
        module: str,
        module_archs: Sequence[str],
        device: DeviceModule,
        runs: Sequence[PlanRun],
    ) -> Path:
        lines = ["qnorm-gpu-plan 1", f"module {module} {' '.join(module_archs)}"]
        for i, run in enumerate(runs):
            lines += self._run_lines(f"{name}.r{i}", device, run)
        plan = self.directory / f"{name}.plan"
        plan.write_text("\n".join(lines) + "\n")
        return plan

    def _run_lines(self, prefix: str, device: DeviceModule, run: PlanRun) -> list[str]:
        lines = [f"run {run.label}"]
        for name, (dtype, _) in device.buffers.items():
            a = run.arrays[name]
            if str(a.dtype) != dtype:
                raise ValueError(f"buffer {name!r} is {dtype}, got {a.dtype}")
            src = "-" if name == run.out else self.data_file(a, f"{prefix}.{name}")
            lines.append(f"buffer {name} {dtype} {a.size} {src}")
        shapes = {n: a.shape for n, a in run.arrays.items()}
        lines += [
            _launch_line(k, launch) for k, launch in zip(device.kernels, device.launches(shapes), strict=True)
        ]
        out_dtype = device.buffers[run.out][0]
        if run.expected is not None:
            expected = self.data_file(
                np.asarray(run.expected).astype(out_dtype), f"{prefix}.expected"
            )
            lines.append(f"expect {run.out} {expected}")
        if run.crc32 is not None:
            lines.append(f"crc32 {run.out} {run.crc32}")
        if run.save:
            lines.append(f"save {run.out} {prefix}.result.bin")
        if run.time_iters:
            lines.append(f"time {run.time_iters}")
        return [*lines, "end"]


def _launch_line(kernel: DeviceKernel, launch: Launch) -> str:
    args = [
        f"buf:{a}" if p.is_buffer else f"{_scalar_tag(p.dtype)}:{a}"
        for p, a in zip(kernel.params, launch.args, strict=True)
    ]
    dims = " ".join(str(d) for d in (*launch.grid, *launch.block))
    return f"launch {launch.kernel} {dims} {len(args)} {' '.join(args)}"


def _scalar_tag(dtype: str) -> str:
    if dtype not in ("int32", "int64"):
        raise ValueError(f"the harness passes int32/int64 scalars, not {dtype}")
    return "i32" if dtype == "int32" else "i64"


def crc32(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).tobytes())


# --------------------------------------------------------------------------- running on a GPU


def build_harness(directory: Path | None = None) -> Path:
    """compilers/tvm/harness/gpu_harness.cu built by nvcc: a :mod:`compilers.cache` entry in
    ``directory`` (default the cache), keyed by the source and nvcc's version."""
    source = HARNESS_SOURCE.read_bytes()
    key = hashlib.sha256(source + nvcc_version().encode()).hexdigest()[:16]
    entry = cache.cached(
        (directory or cuda_cache_dir()) / f"{HARNESS}-{key}",
        lambda d: run_nvcc([NVCC, *HARNESS_FLAGS, str(HARNESS_SOURCE), "-o", str(d / HARNESS)]),
    )
    return entry / HARNESS


def run_harness(harness: Path, plans: Sequence[Path]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(harness), *map(str, plans)], capture_output=True, text=True, check=False
    )


@dataclass(frozen=True, eq=False)
class HarnessFunction:
    """``main(x, *consts, out)`` on this machine's GPU through the harness, called like a
    TVM library function (``tvm.runtime.Tensor`` arguments), for
    :class:`~compilers.tvm.kernels.CompiledKernel`."""

    device: DeviceModule
    binaries: CudaBinaries
    harness: Path

    def __call__(self, *tensors: Any) -> None:
        arrays = {n: t.numpy() for n, t in zip(self.device.buffers, tensors, strict=True)}
        out = list(self.device.buffers)[-1]
        with tempfile.TemporaryDirectory(prefix="qnorm-gpu-") as tmp:
            writer = PlanWriter(Path(tmp))
            plan = writer.write(
                "call",
                str(self.binaries.stem),
                self.binaries.archs,
                self.device,
                [PlanRun("call", arrays, out, save=True)],
            )
            done = run_harness(self.harness, [plan])
            if done.returncode != 0:
                raise RuntimeError(
                    f"gpu_harness failed: {done.stdout.strip()} {done.stderr.strip()}"
                )
            result = np.fromfile(
                Path(tmp) / "call.r0.result.bin", dtype=self.device.buffers[out][0]
            )
        tensors[-1].copyfrom(result.reshape(arrays[out].shape))


def gpu_runner(compiled: CudaKernel) -> CompiledKernel:
    """``compiled`` running on this machine's GPU through the harness."""
    function = HarnessFunction(compiled.device, compiled.binaries, build_harness())
    return CompiledKernel(compiled.kernel, function)  # type: ignore[arg-type]
