"""A whole model for NVIDIA GPUs: one CUDA source, nvcc's PTX and cubins, a launch plan.

:func:`build_cuda` lowers the Relax module :func:`compilers.tvm.graph.to_relax` makes
with the GPU schedule of the qnorm kernels for the ``cuda`` target, for a fixed chunk
of :data:`CHUNK` samples (:func:`compilers.tvm.device_plan.lower_device_plan`), puts
every function's kernels into one translation unit and has nvcc build PTX and a cubin
for every architecture the target lists (:func:`compilers.tvm.cuda.compile_source`,
cached).  It writes ``model.cu``, ``model.<arch>.ptx`` / ``.cubin``, ``plan.json`` and
``constants.bin`` (the same plan format as :mod:`.opencl_model`).

Nothing here runs it: TVM here has no CUDA runtime and this machine no GPU.
:meth:`CudaModel.harness_plan` writes a plan for ``compilers/tvm/harness/gpu_harness.cu``
(every buffer, every launch, the expected output), which ``scripts/gpu_check.sh run``
executes where a GPU is.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tvm

from compilers.cache import sha256_file
from compilers.tvm.artifacts import (
    BuiltModel,
    check_input_integers,
    save_files,
)
from compilers.tvm.build import tvm_target
from compilers.tvm.cuda import OUTPUTS, archs, compile_source, nvcc_version
from compilers.tvm.device_plan import lower_device_plan
from qnorm.targets import Target

ARTIFACT = "cuda"
STEM = "model"
SOURCE = "model.cu"
PLAN = "plan.json"
CONSTANTS = "constants.bin"
REQUIRED = (SOURCE, PLAN, CONSTANTS)
CHUNK = 64  # samples per pass: the plan's fixed batch
_KEY_FORMAT = 1  # bump when the files or their layout change
_GENERATORS = ("cuda_model.py", "device_plan.py", "static_plan.py", "gpu.py")
_KERNEL_START = 'extern "C" __global__'


def files(target: Target) -> tuple[str, ...]:
    """Every file a build for ``target`` writes: source, plan, constants, nvcc's outputs."""
    return (*REQUIRED, *(f"{STEM}.{arch}.{kind}" for arch in archs(target) for kind in OUTPUTS))


def artifact_key(relax_key: str, target: Target) -> str:
    """The cache key of a CUDA build: the Relax module's key plus the code that writes
    the files, nvcc's version and the architectures."""
    here = Path(__file__).resolve().parent
    recipe = {"format": _KEY_FORMAT, "relax": relax_key, "chunk": CHUNK, "nvcc": nvcc_version(),
              "archs": archs(target), "generators": {name: sha256_file(here / name) for name in _GENERATORS}}  # fmt: skip
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def build_cuda(mod: tvm.IRModule, target: Target, directory: Path) -> None:
    """Write the source, nvcc's binaries, ``plan.json`` and ``constants.bin`` into ``directory``."""
    lowered = lower_device_plan(mod, tvm_target(target), CHUNK)
    source = one_translation_unit(lowered.sources)
    binaries = compile_source(source, target)
    (directory / SOURCE).write_text(source)
    for arch in binaries.archs:
        for kind in OUTPUTS:
            shutil.copyfile(binaries.stem.with_name(f"{binaries.stem.name}.{arch}.{kind}"),
                            directory / f"{STEM}.{arch}.{kind}")  # fmt: skip
    (directory / CONSTANTS).write_bytes(lowered.plan.constants)
    (directory / PLAN).write_text(json.dumps(lowered.to_json(), indent=1) + "\n")


def one_translation_unit(sources: tuple[str, ...]) -> str:
    """TVM's per-function CUDA sources as one: each distinct preamble (includes, helper
    macros) once, then every function's kernels."""
    preambles: list[str] = []
    kernels: list[str] = []
    for source in sources:
        at = source.find(_KERNEL_START)
        if at < 0:
            raise ValueError(f"a TVM CUDA source without {_KERNEL_START!r} kernels")
        if source[:at] not in preambles:
            preambles.append(source[:at])
        kernels.append(source[at:])
    return "".join(preambles) + "\n".join(kernels)


@dataclass
class CudaModel(BuiltModel):
    """A built CUDA model (the fields: :class:`~.artifacts.BuiltModel`)."""

    def unavailable(self) -> str:
        return "a CUDA model is built here, not run: scripts/gpu_check.sh runs it on a GPU " \
               "(CudaModel.harness_plan writes its plan)"  # fmt: skip

    def run_ints(self, k: np.ndarray) -> np.ndarray:
        raise RuntimeError(self.unavailable())

    def harness_plan(self, k: np.ndarray, expected: np.ndarray, directory: str | Path) -> Path:
        """A ``gpu_harness`` plan in ``directory`` (with the model's binaries) that runs the
        model on the first :data:`CHUNK` samples of input integers ``k`` (zero-padded) and
        checks the float32 output bit for bit against ``expected`` (the QAT model's)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        k = check_input_integers(self.metadata, k)[:CHUNK]
        plan = json.loads((self.directory / PLAN).read_text())
        constants = (self.directory / CONSTANTS).read_bytes()
        for name in files(self.target)[len(REQUIRED):]:
            shutil.copyfile(self.directory / name, directory / name)
        x = np.zeros(plan["buffers"][plan["input"]]["shape"], np.float32)
        x[: len(k)] = k.astype(np.float32) * np.float32(self.metadata["input"]["format"]["scale"])  # exact
        want = np.zeros(plan["buffers"][plan["output"]]["shape"], np.float32)
        want[: len(k)] = np.asarray(expected, np.float32)[: len(k)]
        lines = ["qnorm-gpu-plan 1", f"module {STEM} {' '.join(archs(self.target))}", f"run model.{len(k)}"]
        for i, spec in enumerate(plan["buffers"]):
            count = int(np.prod(spec["shape"], dtype=np.int64))
            data = "-"
            if i == plan["input"]:
                data = _data_file(directory, f"buffer{i}", x)
            elif spec["constant_offset"] is not None:
                nbytes = count * np.dtype(spec["dtype"]).itemsize
                start = spec["constant_offset"]
                data = _data_file(directory, f"buffer{i}", np.frombuffer(constants[start:start + nbytes], np.uint8))
            lines.append(f"buffer b{i} {spec['dtype']} {count} {data}")
        for launch in plan["launches"]:
            args = [f"buf:b{a['buffer']}" if "buffer" in a else f"{_SCALARS[a['dtype']]}:{a['scalar']}"
                    for a in launch["args"]]  # fmt: skip
            grid = [g // b for g, b in zip(launch["global"], launch["local"], strict=True)]
            lines.append(f"launch {launch['kernel']} {' '.join(map(str, [*grid, *launch['local']]))} "
                         f"{len(args)} {' '.join(args)}")  # fmt: skip
        lines += [f"expect b{plan['output']} {_data_file(directory, 'expected', want)}", "end"]
        path = directory / "model.plan"
        path.write_text("\n".join(lines) + "\n")
        return path

    def save(self, directory: str | Path, source: dict[str, Any] | None = None) -> Path:
        """Copy the model's files into ``directory`` (created) and write ``model.json``;
        ``source`` describes where the model came from."""
        return save_files(self.directory, files(self.target), self.digests, self.metadata, directory, source)


_SCALARS = {"int32": "i32", "int64": "i64"}


def _data_file(directory: Path, stem: str, a: np.ndarray) -> str:
    name = f"{stem}.bin"
    (directory / name).write_bytes(np.ascontiguousarray(a).tobytes())
    return name
