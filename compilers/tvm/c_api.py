"""A whole model as a C library for a board: no Python, no TVM runtime, no heap.

:func:`build_c_api` turns a :func:`compilers.tvm.graph.to_relax` module into

* ``libqnorm_model.a``: the model's TVM kernels (TVM's LLVM back end, compiled for
  the target's triple and CPU, as :mod:`compilers.tvm.cross` compiles op kernels),
  the batch-1 plan that calls them (:func:`compilers.tvm.static_plan.plan_static`:
  static arena, constants embedded) and ``harness/model_runtime.c``, the C API;
* ``qnorm_model.h``: that API (``qnorm_model_run`` on the integers of the model's
  input grid, giving the integers of its proven output grid; shapes, scales,
  target and version);
* ``qnorm_run``: ``harness/qnorm_run.c`` linked statically with the library (a
  .npy or raw file of input integers in, output integers out, classes printed),

all built by the target's gcc (the Debian cross toolchains for aarch64 and
riscv64; ``-static``, so qemu-user needs nothing from the target's sysroot).
A C file that includes the header for another architecture fails to compile
with a message naming the target.

:class:`CApiModel` runs the runner (natively, or under the target's qemu-user)
on numpy arrays; :func:`compilers.tvm.graph.compile_model` builds and caches it
and :func:`compilers.tvm.graph.load_compiled` loads a saved one.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tvm
import tvm.libinfo
import tvm_ffi.libinfo

from compilers.cache import sha256_file
from compilers.toolchains import emulator_unavailable
from compilers.tvm.artifacts import (
    BuiltModel,
    check_input_integers,
    save_files,
)
from compilers.tvm.build import tvm_target
from compilers.tvm.static_plan import ALIGN, StaticPlan, plan_static
from qnorm.errors import DeployError
from qnorm.targets import Target

ARTIFACT = "c-api"
LIBRARY = "libqnorm_model.a"
HEADER = "qnorm_model.h"
RUNNER = "qnorm_run"
FILES = (LIBRARY, HEADER, RUNNER)
HARNESS = Path(__file__).resolve().parent / "harness"
_SOURCES = (HARNESS / "model_runtime.c", HARNESS / "qnorm_run.c")
_CFLAGS = ("-O2", "-std=c11")
_KEY_FORMAT = 1  # bump when the generated files or the build change
SYMBOL_PREFIX = "qnorm_model_k_"  # the kernels' C symbols: no clash with a program's own
RUN_TIMEOUT_S = 600
# The C test a header makes of the compiler's architecture, per target (qnorm.targets.C_API_TARGETS).
ARCH_MACROS = {
    "x86_64": "defined(__x86_64__)",
    "aarch64": "defined(__aarch64__)",
    "riscv64": "defined(__riscv) && __riscv_xlen == 64",
}
# ELF e_machine of each target's executables (the runner names its architecture).
ELF_MACHINES = {62: "x86_64", 183: "aarch64", 243: "riscv64"}
# The runtime entry points model_runtime.c installs (TVM's context pointers).
_PROVIDED = frozenset(
    {"__TVMBackendAllocWorkspace", "__TVMBackendFreeWorkspace", "__TVMBackendParallelLaunch",
     "__TVMBackendParallelBarrier"}
)  # fmt: skip
_CONTEXT_GLOBAL = re.compile(r"^@(__TVM\w+) = ", re.MULTILINE)
_DL_CODES = {"int": "kDLInt", "uint": "kDLUInt", "float": "kDLFloat", "bool": "kDLBool"}
# The C integer types an input grid can take, narrowest first.
_INPUT_TYPES = (("int8", -(2**7), 2**7 - 1), ("uint8", 0, 2**8 - 1), ("int16", -(2**15), 2**15 - 1),
                ("uint16", 0, 2**16 - 1), ("int32", -(2**31), 2**31 - 1))  # fmt: skip


class CApiError(RuntimeError):
    """Building or running a C-API model failed (the message names the target and the command)."""


@dataclass(frozen=True)
class Interface:
    """What the C API exchanges: the input integers and the output grid."""

    input_shape: tuple[int, ...]  # one sample's
    input_scale: float  # x = k * input_scale (a power of two)
    input_range: tuple[int, int]  # the first quantizer's clamp: the integers the model computes on
    output_shape: tuple[int, ...]  # one sample's
    output_exp: int  # y = k * 2^output_exp
    output_max_abs: int  # |k| <= this (the exactness proof's bound)

    @property
    def input_dtype(self) -> str:
        lo, hi = self.input_range
        return next(name for name, a, b in _INPUT_TYPES if a <= lo and hi <= b)


def interface(metadata: Mapping[str, Any], input_range: tuple[int, int] | None) -> Interface:
    """The C API of a model whose compile metadata is ``metadata`` (see
    :func:`compilers.tvm.graph.compile_model`); refused when its input or output has
    no integer grid."""
    fmt, grid = metadata["input"]["format"], metadata["output"]["format"]
    if fmt is None or input_range is None:
        raise DeployError("the model's input meets no quantizer first: the C API takes the integers of the "
                          "model's input grid, and this model has none")  # fmt: skip
    if grid is None:
        raise DeployError("the model's output has no proven integer grid: the C API returns its integers")
    if grid["max_abs_int"] >= 2**31 or not -126 <= grid["grid_exp"] <= 126 or input_range[0] < -(2**31) \
            or input_range[1] >= 2**31:  # fmt: skip
        raise DeployError(f"the model's input range {input_range} or output grid {grid} does not fit int32 "
                          "and float32 scales")  # fmt: skip
    return Interface(
        tuple(metadata["input"]["shape"][1:]), fmt["scale"], input_range, tuple(metadata["output"]["shape"][1:]),
        grid["grid_exp"], grid["max_abs_int"],
    )  # fmt: skip


def artifact_key(relax_key: str) -> str:
    """The cache key of a C-API build: the Relax module's key (module, constants,
    target, TVM) plus the C sources and flags this module adds."""
    recipe = {"format": _KEY_FORMAT, "relax": relax_key, "flags": list(_CFLAGS),
              "sources": {p.name: sha256_file(p) for p in _SOURCES}, "generator": sha256_file(Path(__file__)),
              "plan": sha256_file(Path(__file__).with_name("static_plan.py"))}  # fmt: skip
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------- build


def build_c_api(mod: tvm.IRModule, target: Target, api: Interface, version: str, directory: Path) -> None:
    """Write ``libqnorm_model.a``, ``qnorm_model.h`` and ``qnorm_run`` for ``target``
    into ``directory`` (a cache entry being written: those files only)."""
    if target.name not in ARCH_MACROS or target.tvm["kind"] != "llvm":
        raise DeployError(f"target {target.name!r} has no C API build (those are {', '.join(ARCH_MACROS)})")
    plan = plan_static(mod, SYMBOL_PREFIX)
    with tempfile.TemporaryDirectory(prefix="qnorm-c-api-") as tmp:
        work = Path(tmp)
        kernels = work / "kernels.o"
        _compile_kernels(plan, target, kernels)
        (work / "constants.bin").write_bytes(plan.constants)
        (directory / HEADER).write_text(_public_header(api, target, version))
        (work / "model_plan.h").write_text(_plan_header(plan, api))
        (work / "model_plan.c").write_text(_plan_source(plan))
        cc = target.build.cc
        includes = [f"-I{work}", f"-I{directory}", *(f"-I{d}" for d in _include_dirs())]
        objects = [kernels]
        for source in (work / "model_plan.c", HARNESS / "model_runtime.c"):
            obj = work / (source.stem + ".o")
            _run_tool(target, [cc, *_CFLAGS, *includes, "-c", str(source), "-o", str(obj)], cwd=work)
            objects.append(obj)
        _run_tool(target, [_archiver(cc), "rcs", str(directory / LIBRARY), *map(str, objects)], cwd=work)
        _run_tool(target, [cc, *_CFLAGS, "-static", *includes, str(HARNESS / "qnorm_run.c"), str(directory / LIBRARY),
                           "-lm", "-o", str(directory / RUNNER)], cwd=work)  # fmt: skip


def _include_dirs() -> list[str]:
    """TVM-FFI's C ABI (TVMFFIAny, DLTensor) and TVM's backend API, from the installed packages."""
    return [*tvm_ffi.libinfo.include_paths(), tvm.libinfo.find_include_path()]


def _archiver(cc: str) -> str:
    """The ``ar`` of ``cc``'s toolchain (``aarch64-linux-gnu-gcc`` -> ``aarch64-linux-gnu-ar``)."""
    return cc[: -len("gcc")] + "ar" if cc.endswith("gcc") else "ar"


def _compile_kernels(plan: StaticPlan, target: Target, obj: Path) -> None:
    module = tvm.compile(plan.kernels, target=tvm_target(target)).mod
    if module.imports:
        raise CApiError(f"{target.name}: the compiled kernels import {len(module.imports)} other modules; "
                        "the C API links a single LLVM object")  # fmt: skip
    source = module.inspect_source("ll")
    needed = set(_CONTEXT_GLOBAL.findall(source)) - _PROVIDED
    if needed:
        raise CApiError(f"{target.name}: the kernels need runtime entry points the C API does not provide: "
                        f"{', '.join(sorted(needed))}")  # fmt: skip
    missing = [s.function for s in plan.steps if f"@__tvm_ffi_{s.function}(" not in source]
    if missing:
        raise CApiError(f"{target.name}: the compiled kernels lack the entry points {missing}")
    module.write_to_file(str(obj))


def _run_tool(target: Target, cmd: list[str], cwd: Path) -> None:
    done = subprocess.run(cmd, cwd=cwd, check=False, capture_output=True, text=True, errors="replace")
    if done.returncode != 0:
        raise CApiError(f"{target.name}: `{shlex.join(cmd)}` failed (exit {done.returncode}):\n{done.stderr.strip()}")


def _c_float(value: float) -> str:
    return float(value).hex() + "f"


def _public_header(api: Interface, target: Target, version: str) -> str:
    dtype = api.input_dtype
    dims = " x ".join(map(str, api.input_shape))
    out_dims = " x ".join(map(str, api.output_shape))
    return f"""/* qnorm_model.h: the C API of a model compiled by `qnorm compile --target {target.name}`.
 *
 * Input: per sample {dims} integers k of the model's input grid, x = k * {api.input_scale!r}
 * (the model's first quantizer computes on {api.input_range[0]} .. {api.input_range[1]}; values outside saturate).
 * Output: per sample {out_dims} int32 k, y = k * 2^{api.output_exp} (|k| <= {api.output_max_abs}): bit for bit
 * the integers of the trained (QAT) model.
 * Not reentrant: one qnorm_model_run at a time (its buffers are static).
 */
#ifndef QNORM_MODEL_H
#define QNORM_MODEL_H

#include <stddef.h>
#include <stdint.h>

#if !({ARCH_MACROS[target.name]})
#error "qnorm_model.h: this model was compiled for {target.name}; the compiler targets another architecture"
#endif

#ifdef __cplusplus
extern "C" {{
#endif

typedef {dtype}_t qnorm_model_input_t;
#define QNORM_MODEL_INPUT_DTYPE "{dtype}"
#define QNORM_MODEL_INPUT_KIND '{dtype[0]}'
#define QNORM_MODEL_INPUT_RANK {len(api.input_shape)}
#define QNORM_MODEL_INPUT_SIZE {int(np.prod(api.input_shape))}
#define QNORM_MODEL_INPUT_MIN {api.input_range[0]}
#define QNORM_MODEL_INPUT_MAX {api.input_range[1]}
#define QNORM_MODEL_OUTPUT_RANK {len(api.output_shape)}
#define QNORM_MODEL_OUTPUT_SIZE {int(np.prod(api.output_shape))}
#define QNORM_MODEL_TARGET "{target.name}"
#define QNORM_MODEL_VERSION "{version}"

/* Runs batch samples: in holds batch * QNORM_MODEL_INPUT_SIZE integers, out receives
 * batch * QNORM_MODEL_OUTPUT_SIZE.  0 on success, -1 with qnorm_model_error() set. */
int qnorm_model_run(const qnorm_model_input_t* in, size_t batch, int32_t* out);
const char* qnorm_model_error(void);

/* One sample's dimensions (*dims points into the library); returns the rank. */
size_t qnorm_model_input_shape(const int64_t** dims);
size_t qnorm_model_output_shape(const int64_t** dims);
double qnorm_model_input_scale(void);  /* x = k * scale */
double qnorm_model_output_scale(void); /* y = k * scale */
const char* qnorm_model_target(void);  /* "{target.name}" */
const char* qnorm_model_version(void);

#ifdef __cplusplus
}}
#endif
#endif
"""


def _plan_header(plan: StaticPlan, api: Interface) -> str:
    return f"""/* model_plan.h: the static plan model_plan.c holds (generated; see compilers/tvm/static_plan.py). */
#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>
#include <tvm/ffi/c_api.h>
#include <tvm/runtime/c_backend_api.h>

#define QNORM_PLAN_ALIGN {ALIGN}
#define QNORM_PLAN_MAX_ARGS {max(len(s.buffers) for s in plan.steps)}
#define QNORM_PLAN_NUM_STEPS {len(plan.steps)}
#define QNORM_PLAN_INPUT {plan.input}
#define QNORM_PLAN_OUTPUT {plan.output}
#define QNORM_PLAN_INPUT_SCALE {_c_float(api.input_scale)}
#define QNORM_PLAN_OUTPUT_INV_SCALE {_c_float(2.0 ** -api.output_exp)}
#define QNORM_PLAN_OUTPUT_MAX_ABS {_c_float(api.output_max_abs)}

typedef int (*qnorm_plan_kernel)(void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result);
typedef struct {{
  qnorm_plan_kernel kernel;
  const char* name;
  uint32_t num_args;
  const uint32_t* args; /* indices into qnorm_plan_tensors, output last */
}} qnorm_plan_step;

extern DLTensor qnorm_plan_tensors[];
extern const qnorm_plan_step qnorm_plan_steps[];
extern const int64_t qnorm_plan_input_dims[];
extern const int64_t qnorm_plan_output_dims[];
"""


def _dl_dtype(dtype: str) -> str:
    kind = dtype.rstrip("0123456789")
    bits = 8 if dtype == "bool" else int(dtype[len(kind):])
    if kind not in _DL_CODES:
        raise DeployError(f"the C API passes tensors of int, uint, float and bool, not {dtype}")
    return f"{{{_DL_CODES[kind]}, {bits}, 1}}"


def _plan_source(plan: StaticPlan) -> str:
    lines = [
        "/* model_plan.c: one sample's kernel calls on a static arena (generated; see model_plan.h). */",
        '#include "model_plan.h"',
        "",
        "/* The constants, byte for byte as the compiler saw them (constants.bin, little endian). */",
        '__asm__(".section .rodata\\n.balign 64\\n.globl qnorm_plan_constants\\n.hidden qnorm_plan_constants\\n"',
        '        "qnorm_plan_constants:\\n.incbin \\"constants.bin\\"\\n.byte 0\\n.previous\\n");',
        "extern const unsigned char qnorm_plan_constants[];",
        f"static unsigned char arena[{max(plan.arena_bytes, ALIGN)}] __attribute__((aligned({ALIGN})));",
        "",
    ]
    for i, b in enumerate(plan.buffers):
        lines.append(f"static int64_t shape_{i}[] = {{{', '.join(map(str, b.shape)) or '0'}}};")
    lines.append("DLTensor qnorm_plan_tensors[] = {")
    for i, b in enumerate(plan.buffers):
        data = f"(void*)(qnorm_plan_constants + {b.offset})" if b.constant else f"arena + {b.offset}"
        lines.append(f"  {{{data}, {{kDLCPU, 0}}, {len(b.shape)}, {_dl_dtype(b.dtype)}, shape_{i}, NULL, 0}},")
    lines.append("};")
    for i, step in enumerate(plan.steps):
        lines.append(f"static const uint32_t args_{i}[] = {{{', '.join(map(str, step.buffers))}}};")
    for name in sorted({s.function for s in plan.steps}):
        lines.append(f"int __tvm_ffi_{name}(void*, const TVMFFIAny*, int32_t, TVMFFIAny*);")
    lines.append("const qnorm_plan_step qnorm_plan_steps[] = {")
    for i, step in enumerate(plan.steps):
        short = step.function[len(SYMBOL_PREFIX):]
        lines.append(f'  {{__tvm_ffi_{step.function}, "{short}", {len(step.buffers)}, args_{i}}},')
    lines.append("};")
    for which, index in (("input", plan.input), ("output", plan.output)):
        dims = plan.buffers[index].shape[1:]  # without the batch of 1
        lines.append(f"const int64_t qnorm_plan_{which}_dims[] = {{{', '.join(map(str, dims)) or '0'}}};")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- run


@dataclass
class CApiModel(BuiltModel):
    """A built C-API model (the fields: :class:`~.artifacts.BuiltModel`)."""

    @property
    def runner(self) -> Path:
        return self.directory / RUNNER

    def command(self, *args: str) -> list[str]:
        """The runner with ``args`` on this machine (under qemu-user for a cross target)."""
        run = self.target.run
        prefix = [run.emulator, "-L", run.sysroot] if run.method == "qemu-user" else []
        return [*prefix, str(self.runner), *args]

    def unavailable(self) -> str | None:
        return emulator_unavailable(self.target)

    def run_ints(self, k: np.ndarray) -> np.ndarray:
        """The output integers (int32, (batch, ...)) for input integers ``k`` (batch, ...)."""
        k = check_input_integers(self.metadata, k)
        with tempfile.TemporaryDirectory(prefix="qnorm-run-") as tmp:
            inputs, outputs = Path(tmp) / "input.npy", Path(tmp) / "output.npy"
            np.save(inputs, np.ascontiguousarray(k.astype(k.dtype.newbyteorder("<"))))
            cmd = self.command("--target", self.target.name, str(inputs), str(outputs))
            self._execute(cmd)
            if not outputs.exists():
                raise CApiError(f"{self.target.name}: `{shlex.join(cmd)}` exited with status 0 but wrote no output")
            out = np.load(outputs, allow_pickle=False)
        if out.shape != (k.shape[0], *self.metadata["output"]["shape"][1:]) or out.dtype != np.int32:
            raise CApiError(f"{self.target.name}: the runner wrote {out.dtype} {out.shape}, not the model's output")
        return out

    def _execute(self, cmd: list[str]) -> None:
        try:
            done = subprocess.run(cmd, check=False, capture_output=True, text=True, errors="replace",
                                  timeout=RUN_TIMEOUT_S)  # fmt: skip
        except subprocess.TimeoutExpired:
            raise CApiError(f"{self.target.name}: `{shlex.join(cmd)}` ran longer than {RUN_TIMEOUT_S} s") from None
        if done.returncode != 0:
            raise CApiError(f"{self.target.name}: `{shlex.join(cmd)}` exited with status {done.returncode}: "
                            f"{done.stderr.strip() or '(no message)'}")  # fmt: skip

    def runner_machine(self) -> str:
        """The architecture the runner's ELF header names (without running it)."""
        with open(self.runner, "rb") as f:
            head = f.read(20)
        if len(head) < 20 or head[:4] != b"\x7fELF" or head[5] != 1:
            raise CApiError(f"{self.runner} is not a little-endian ELF executable")
        machine = int.from_bytes(head[18:20], "little")
        return ELF_MACHINES.get(machine, f"ELF machine {machine}")

    def built_for(self) -> str:
        """The target the library itself names (``qnorm_run --info``)."""
        cmd = self.command("--info")
        try:
            done = subprocess.run(cmd, check=False, capture_output=True, text=True, errors="replace",
                                  timeout=RUN_TIMEOUT_S)  # fmt: skip
        except OSError as err:
            raise CApiError(f"{self.target.name}: cannot run `{shlex.join(cmd)}`: {err}") from err
        first = done.stdout.splitlines()[0] if done.stdout else ""
        if done.returncode != 0 or not first.startswith("target "):
            raise CApiError(f"{self.target.name}: `{shlex.join(cmd)}` did not describe its model (exit "
                            f"{done.returncode}): {done.stderr.strip() or '(no message)'}")  # fmt: skip
        return first.split(" ", 1)[1]

    def save(self, directory: str | Path, source: dict[str, Any] | None = None) -> Path:
        """Copy the model's files into ``directory`` (created) and write ``model.json``;
        ``source`` describes where the model came from."""
        return save_files(self.directory, FILES, self.digests, self.metadata, directory, source)
