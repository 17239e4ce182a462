"""``qnorm verify`` columns for the GPU schedule (:mod:`compilers.tvm.gpu`): opencl and cuda.

* ``opencl`` — the op's GPU-scheduled kernel as TVM OpenCL C, run on PoCL
  through pyopencl (:mod:`compilers.tvm.opencl`): blocks, barriers and
  cross-thread reductions executed for real, on this machine's CPU.
* ``cuda`` — the same schedule as TVM CUDA source, compiled by nvcc to PTX and
  a cubin for every architecture of ``qnorm/data/targets/cuda.toml``
  (:mod:`compilers.tvm.cuda`).  With a CUDA GPU present (``nvidia-smi`` lists
  one) every batch runs on it through compilers/tvm/harness/gpu_harness.cu, a plain CUDA
  runtime program (TVM has no CUDA runtime here).  Without one the cell is
  ``compiled``: built, not run, never a pass.

Both refuse, as a SKIP naming the intermediate, a config their target's
declared widths cannot compute exactly.  Importing this module registers the
columns without importing tvm.
"""

from __future__ import annotations

import importlib
from typing import Any

from compilers.toolchains import (
    gpu_compute_capability,
    nvcc_unavailable,
    opencl_unavailable,
)
from qnorm.extras import missing
from qnorm.ops.base import IntOp
from qnorm.verify.registry import (
    Backend,
    NotRun,
    Runner,
    Unsupported,
    column_target,
    refuse_beyond_limits,
    register,
)


def _module(name: str) -> Any:
    return importlib.import_module(f"compilers.tvm.{name}")


def _kernel_or_skip(build: Any, op: IntOp) -> Any:
    try:
        return build(op)
    except NotImplementedError as err:
        raise Unsupported(str(err) or f"no kernel for {type(op).__name__}") from None


# --------------------------------------------------------------------------- opencl


def _opencl_unavailable() -> str | None:
    return missing("tvm") or missing("pyopencl") or opencl_unavailable(column_target("opencl"))


def _opencl_prepare(op: IntOp) -> Runner:
    opencl = _module("opencl")
    refuse_beyond_limits(op, column_target("opencl"))
    compiled = _kernel_or_skip(opencl.opencl_kernel, op)
    return Runner(compiled, f"TVM opencl kernel (GPU schedule) on PoCL: {opencl.device_name()}")


# --------------------------------------------------------------------------- cuda

NO_GPU = "no CUDA GPU on this machine"


def _cuda_unavailable() -> str | None:
    return missing("tvm") or nvcc_unavailable()


def _cuda_not_run() -> str | None:
    return NO_GPU if gpu_compute_capability() is None else None


def _cuda_prepare(op: IntOp) -> Runner:
    cuda = _module("cuda")
    target = column_target("cuda")
    refuse_beyond_limits(op, target)
    compiled = _kernel_or_skip(cuda.cuda_kernel, op)
    built = f"nvcc {'/'.join(cuda.archs(target))} PTX+cubin"
    arch = gpu_compute_capability()
    if arch is None:
        raise NotRun(f"{built}; not run: {NO_GPU}")
    runner = cuda.gpu_runner(compiled)
    return Runner(
        runner, f"TVM cuda kernel (GPU schedule), {built}, run on {arch} via compilers/tvm/harness/gpu_harness.cu"
    )


register(
    Backend(
        "opencl",
        "TVM opencl kernels (GPU schedule), run on PoCL",
        _opencl_prepare,
        _opencl_unavailable,
    )
)
register(
    Backend(
        "cuda",
        "TVM cuda kernels (GPU schedule): nvcc PTX+cubin; run where a CUDA GPU is present",
        _cuda_prepare,
        _cuda_unavailable,
        not_run=_cuda_not_run,
    )
)
