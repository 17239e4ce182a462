"""A whole model's static plan lowered for a GPU-like device (OpenCL, CUDA).

:func:`lower_device_plan` plans a :func:`compilers.tvm.graph.to_relax` module (made
with the qnorm kernels' GPU schedule) for a fixed chunk of samples
(:func:`compilers.tvm.static_plan.plan_static`: a straight line of kernels on
static buffers), gives every legalized op TVM's default GPU schedule (``dlight``:
reductions, then one thread per output element; the qnorm kernels keep their
own), lowers each function as :func:`compilers.tvm.gpu.lower` does (launch
geometry read off the lowered IR) and lists every launch of the model in order,
with its global and local size and its arguments: buffers of the plan, and the
values of the symbolic dimensions a shape-generic kernel takes.  Each function's
kernels are renamed after it, so all sources go into one program.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import tvm
import tvm_ffi
from tvm import tirx

from compilers.tvm.gpu import DeviceModule, lower
from compilers.tvm.static_plan import StaticPlan, Step, plan_static

PREFIX = "qnorm_model_"


@dataclass(frozen=True)
class DevicePlan:
    """The plan, each function's device source (kernels renamed) and every launch in order."""

    plan: StaticPlan
    chunk: int
    sources: tuple[str, ...]
    launches: tuple[dict[str, Any], ...]

    def to_json(self) -> dict[str, Any]:
        """``plan.json``: the chunk, the input and output buffers, every buffer, every launch."""
        plan = self.plan
        return {
            "chunk": self.chunk,
            "input": plan.input,
            "output": plan.output,
            "buffers": [{"shape": list(b.shape), "dtype": b.dtype,
                         "constant_offset": b.offset if b.constant else None} for b in plan.buffers],
            "launches": list(self.launches),
        }  # fmt: skip


def lower_device_plan(mod: tvm.IRModule, target: tvm.target.Target, chunk: int) -> DevicePlan:
    """``mod`` planned for ``chunk`` samples and lowered for the device ``target``."""
    plan = plan_static(mod, PREFIX, chunk)
    sources, lowered = [], {}
    for gv, func in plan.kernels.functions.items():
        name = gv.name_hint
        main = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        if not _has_thread_bindings(main):
            main = _default_gpu_schedule(main, target)
        # CSE would hoist index arithmetic into scalar kernel arguments computed on a host
        with tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}):
            device = lower(main, target, allow_float=True)
        source = device.source
        for kernel in device.kernels:
            source = re.sub(rf"\b{re.escape(kernel.name)}\b", f"{name}_{kernel.name}", source)
        sources.append(source)
        lowered[name] = (device, [p.name for p in main["main"].params])
    launches = tuple(launch for step in plan.steps for launch in _launches(plan, step, *lowered[step.function]))
    return DevicePlan(plan, chunk, tuple(sources), launches)


def _launches(plan: StaticPlan, step: Step, device: DeviceModule, params: list[str]) -> list[dict[str, Any]]:
    """The launches of one call: its kernels on that call's buffers."""
    index = dict(zip(params, step.buffers, strict=True))
    shapes = {p: plan.buffers[i].shape for p, i in index.items()}
    found = []
    for kernel, launch in zip(device.kernels, device.launches(shapes), strict=True):
        # a scalar argument is a symbolic dimension of the kernel, its value fixed by the call's shapes
        args = [{"buffer": index[a]} if p.is_buffer else {"scalar": int(a), "dtype": p.dtype}
                for p, a in zip(kernel.params, launch.args, strict=True)]  # fmt: skip
        found.append({"kernel": f"{step.function}_{kernel.name}", "args": args, "local": list(launch.block),
                      "global": [g * b for g, b in zip(launch.grid, launch.block, strict=True)]})  # fmt: skip
    return found


def _has_thread_bindings(mod: tvm.IRModule) -> bool:
    """Whether ``mod`` is already laid out on GPU threads (the qnorm kernels' GPU schedule)."""
    found: list[Any] = []

    def visit(node: Any) -> None:
        if isinstance(node, tirx.For) and node.kind == tirx.ForKind.THREAD_BINDING:
            found.append(node)

    tvm_ffi.structural_walk(mod, visit, order="pre")
    return bool(found)


def _default_gpu_schedule(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    from tvm.s_tir import dlight

    rules = (dlight.gpu.Reduction(), dlight.gpu.GeneralReduction(), dlight.gpu.Fallback())
    with target:
        return dlight.ApplyDefaultSchedule(*rules)(mod)
