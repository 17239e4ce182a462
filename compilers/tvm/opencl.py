"""The GPU-scheduled kernels as OpenCL C, executed on PoCL (CPU OpenCL) through pyopencl.

This is the one place the GPU schedule (:mod:`compilers.tvm.gpu`) is *run* on a
machine without a GPU: the same module that becomes CUDA source becomes OpenCL
C here, with the same blocks, barriers and cross-thread reductions, and PoCL
executes every work-group with real barrier semantics.  TVM has no OpenCL
runtime here, so this module is the host side: it builds the program with
pyopencl, passes the buffers in the order of each ``__kernel`` signature and
launches every kernel TVM split out of ``main``, in order, with the launch
geometry read off the lowered module (``global = grid * block``,
``local = block``).

``opencl_kernel(op)`` returns a :class:`~compilers.tvm.kernels.CompiledKernel`,
so inputs are validated and laid out exactly as for the CPU kernels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from compilers.toolchains import opencl_device, opencl_unavailable
from compilers.tvm.build import tvm_target
from compilers.tvm.gpu import GPU, DeviceModule, Launch, Param, lower
from compilers.tvm.kernels import CompiledKernel, Kernel, kernel_for
from qnorm.extras import missing
from qnorm.targets import Target, load_target

TARGET = "opencl"


@functools.cache
def opencl_target() -> Target:
    return load_target(TARGET)


def unavailable() -> str | None:
    """None if PoCL can run kernels here, else what is missing."""
    return missing("pyopencl") or opencl_unavailable(opencl_target())


def device_name() -> str:
    """The OpenCL device the kernels run on (PoCL names the host CPU)."""
    return str(opencl_device(opencl_target()).name)


@dataclass(frozen=True, eq=False)
class PoclContext:
    """The PoCL context and command queue every OpenCL run of this process shares."""

    context: Any
    queue: Any


@functools.cache
def pocl_context() -> PoclContext:
    """The shared context on the PoCL device (created once per process)."""
    import pyopencl as cl

    ctx = cl.Context([opencl_device(opencl_target())])
    return PoclContext(ctx, cl.CommandQueue(ctx))


@functools.cache
def built_program(source: str) -> Any:
    """The built program of ``source``, once per process (PoCL also caches binaries on disk)."""
    import pyopencl as cl

    try:
        return cl.Program(pocl_context().context, source).build()
    except cl.RuntimeError as err:
        raise RuntimeError(f"PoCL could not build the TVM OpenCL source: {err}") from None


def device_module(kernel: Kernel) -> DeviceModule:
    """OpenCL C and launches of a GPU-scheduled kernel, checked against the work-group limit."""
    target = opencl_target()
    dev = lower(kernel.mod, tvm_target(target))
    limit = target.hardware.max_threads
    if limit is not None and dev.max_threads() > limit:
        raise ValueError(f"a work-group of {dev.max_threads()} exceeds {target.name}'s {limit}")
    return dev


@dataclass(frozen=True, eq=False)
class PoclFunction:
    """``main(x, *consts, out)`` on PoCL, called like a TVM library function.

    Takes and fills ``tvm.runtime.Tensor`` arguments so that
    :class:`~compilers.tvm.kernels.CompiledKernel` drives it like a CPU build.
    """

    device: DeviceModule
    names: tuple[str, ...]  # main's parameters, in order

    def __call__(self, *tensors: Any) -> None:
        arrays = {n: t.numpy() for n, t in zip(self.names, tensors, strict=True)}
        out = self.names[-1]
        arrays[out] = run(self.device, arrays, out)
        tensors[-1].copyfrom(arrays[out])


def run(device: DeviceModule, arrays: dict[str, np.ndarray], out: str) -> np.ndarray:
    """Launch every kernel of ``device`` on PoCL; returns the ``out`` buffer's contents."""
    import pyopencl as cl

    ctx = pocl_context()
    launches = device.launches({n: a.shape for n, a in arrays.items()})
    if any(0 in lc.grid for lc in launches):  # no rows: nothing to launch
        return arrays[out]
    program = built_program(device.source)
    flags = cl.mem_flags
    bufs = {
        n: cl.Buffer(
            ctx.context, flags.READ_WRITE | flags.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a)
        )
        for n, a in arrays.items()
    }
    for kernel, launch in zip(device.kernels, launches, strict=True):
        _enqueue(ctx.queue, program, kernel.params, launch, bufs)
    result = np.empty_like(arrays[out])
    cl.enqueue_copy(ctx.queue, result, bufs[out])
    ctx.queue.finish()
    return result


def _enqueue(
    queue: Any, program: Any, params: tuple[Param, ...], launch: Launch, bufs: dict[str, Any]
) -> None:
    import pyopencl as cl

    kernel = cl.Kernel(program, launch.kernel)
    for i, (param, arg) in enumerate(zip(params, launch.args, strict=True)):
        kernel.set_arg(i, bufs[arg] if param.is_buffer else np.dtype(param.dtype).type(arg))
    size = tuple(g * b for g, b in zip(launch.grid, launch.block, strict=True))
    cl.enqueue_nd_range_kernel(queue, kernel, size, launch.block)


def opencl_kernel(op: Any) -> CompiledKernel:
    """``op``'s GPU-scheduled kernel, runnable on numpy arrays through PoCL."""
    kernel = kernel_for(op, GPU)
    device = device_module(kernel)
    return CompiledKernel(kernel, PoclFunction(device, tuple(device.buffers)))  # type: ignore[arg-type]
