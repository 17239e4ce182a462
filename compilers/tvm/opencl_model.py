"""A whole model for an OpenCL device: one OpenCL C program and a fixed launch plan.

:func:`build_opencl` lowers the Relax module :func:`compilers.tvm.graph.to_relax`
makes with the GPU schedule of the qnorm kernels for the ``opencl`` target, for a
fixed chunk of :data:`CHUNK` samples (:func:`compilers.tvm.device_plan.lower_device_plan`),
and writes

* ``model.cl``: every kernel's OpenCL C, each renamed after its function;
* ``plan.json``: the buffers (shape, dtype, constant or not) and every launch in
  order (kernel, global and local size, its arguments: buffers, and the values of
  the symbolic dimensions a shape-generic kernel takes);
* ``constants.bin``: the constant buffers' bytes.

:class:`OpenCLModel` runs that on the first device of the target's platform
(PoCL here) through pyopencl, :data:`CHUNK` samples per pass (the last padded);
the host side needs neither TVM nor a compiler.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
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
from compilers.tvm.device_plan import lower_device_plan
from qnorm.targets import Target

ARTIFACT = "opencl"
SOURCE = "model.cl"
PLAN = "plan.json"
CONSTANTS = "constants.bin"
FILES = (SOURCE, PLAN, CONSTANTS)
CHUNK = 64  # samples per pass: the plan's fixed batch
_KEY_FORMAT = 1  # bump when the files or their layout change
_GENERATORS = ("opencl_model.py", "device_plan.py", "static_plan.py", "gpu.py")


def artifact_key(relax_key: str) -> str:
    """The cache key of an OpenCL build: the Relax module's key (module with the GPU
    kernels, constants, target, TVM) plus the code that writes the files."""
    here = Path(__file__).resolve().parent
    recipe = {"format": _KEY_FORMAT, "relax": relax_key, "chunk": CHUNK,
              "generators": {name: sha256_file(here / name) for name in _GENERATORS}}  # fmt: skip
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def build_opencl(mod: tvm.IRModule, target: Target, directory: Path) -> None:
    """Write ``model.cl``, ``plan.json`` and ``constants.bin`` for ``mod`` into ``directory``."""
    lowered = lower_device_plan(mod, tvm_target(target), CHUNK)
    (directory / SOURCE).write_text("\n".join(lowered.sources))
    (directory / CONSTANTS).write_bytes(lowered.plan.constants)
    (directory / PLAN).write_text(json.dumps(lowered.to_json(), indent=1) + "\n")


# --------------------------------------------------------------------------- run


@dataclass
class OpenCLModel(BuiltModel):
    """A built OpenCL model (the fields: :class:`~.artifacts.BuiltModel`)."""

    def unavailable(self) -> str | None:
        from compilers.tvm.opencl import unavailable

        return unavailable()

    def run_ints(self, k: np.ndarray) -> np.ndarray:
        """The output integers (int32, (batch, ...)) for input integers ``k`` (batch, ...)."""
        import pyopencl as cl

        from compilers.tvm.opencl import built_program, pocl_context

        reason = self.unavailable()
        if reason is not None:
            raise RuntimeError(f"cannot run an OpenCL model here: {reason}")
        k = check_input_integers(self.metadata, k)
        plan = json.loads((self.directory / PLAN).read_text())
        constants = (self.directory / CONSTANTS).read_bytes()
        ctx = pocl_context()
        program = built_program((self.directory / SOURCE).read_text())
        buffers = [_device_buffer(cl, ctx.context, b, constants) for b in plan["buffers"]]
        kernels = {name: cl.Kernel(program, name) for name in {launch["kernel"] for launch in plan["launches"]}}
        x_spec, y_spec = plan["buffers"][plan["input"]], plan["buffers"][plan["output"]]
        chunk, scale = plan["chunk"], np.float32(self.metadata["input"]["format"]["scale"])
        inv = np.float32(2.0 ** -self.metadata["output"]["format"]["grid_exp"])
        outputs = []
        for start in range(0, len(k), chunk):
            part = k[start:start + chunk]
            x = np.zeros(x_spec["shape"], np.float32)
            x[: len(part)] = part.astype(np.float32) * scale  # exact: a power-of-two scale
            cl.enqueue_copy(ctx.queue, buffers[plan["input"]], x)
            for launch in plan["launches"]:
                kernel = kernels[launch["kernel"]]
                for i, arg in enumerate(launch["args"]):
                    kernel.set_arg(i, buffers[arg["buffer"]] if "buffer" in arg else np.dtype(arg["dtype"]).type(arg["scalar"]))
                cl.enqueue_nd_range_kernel(ctx.queue, kernel, tuple(launch["global"]), tuple(launch["local"]))
            y = np.empty(y_spec["shape"], np.float32)
            cl.enqueue_copy(ctx.queue, y, buffers[plan["output"]])
            ctx.queue.finish()
            outputs.append(y[: len(part)] * inv)
        values = np.concatenate(outputs)
        bound = self.metadata["output"]["format"]["max_abs_int"]
        if not np.array_equal(values, np.rint(values)) or np.abs(values).max(initial=0) > bound:
            raise RuntimeError("the OpenCL model's output is off its proven grid: not the model that was proven")
        return values.astype(np.int32)

    def save(self, directory: str | Path, source: dict[str, Any] | None = None) -> Path:
        """Copy the model's files into ``directory`` (created) and write ``model.json``;
        ``source`` describes where the model came from."""
        return save_files(self.directory, FILES, self.digests, self.metadata, directory, source)


def _device_buffer(cl: Any, context: Any, spec: Mapping[str, Any], constants: bytes) -> Any:
    nbytes = int(np.prod(spec["shape"], dtype=np.int64)) * np.dtype(spec["dtype"]).itemsize
    flags = cl.mem_flags
    if spec["constant_offset"] is None:
        return cl.Buffer(context, flags.READ_WRITE, size=max(nbytes, 4))
    start = spec["constant_offset"]
    data = np.frombuffer(constants[start:start + nbytes], dtype=np.uint8).copy()
    return cl.Buffer(context, flags.READ_ONLY | flags.COPY_HOST_PTR, hostbuf=data)
