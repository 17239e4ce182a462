"""Whole-model compilation: a trained qnorm model -> torch.export -> Relax -> one library.

:func:`compile_model` freezes the model (:func:`qnorm.deploy.freeze`), exports it
with a dynamic batch dimension, proves the exported float graph exact on
power-of-two grids (:func:`qnorm.deploy.prove_exact`: refused otherwise), imports
it with ``from_exported_program`` and compiles it with ``tvm.compile``.  Each
``qnorm::int_op`` node becomes, via ``custom_convert_map``:

    move the channel axis last -> quantize (TE: QFormat.quantize's own float64 steps,
    half up, saturate) -> call_tir of the op's kernel (``kernel_for(op)``, its
    per-channel constants as Relax constants) -> dequantize (TE: int * 2^k) -> move back

Ops whose kernels have the same text (those differing only in their per-channel
constants, e.g. a transformer's LayerNorms) are scheduled once and share one kernel
function, so LLVM compiles it once.  Every other node is TVM's own conversion.  ``aten.round`` is legalized to
``nearbyint`` (ties to even, like ``torch.round``; the tie tests pin that down).

**Cache.**  Libraries live in ``$QNORM_CACHE/tvm/models/<key>/model.so``, keyed by
the SHA-256 of the Relax module's text with its constants, the target and the TVM
version.  Computing that key needs the export (seconds), so a second, *model*
key indexes it (``models/index-<key>/index.json``) for models that
:func:`qnorm.deploy.model_spec` describes (the digits models of
:mod:`qnorm.train.models` register their describer there):
the SHA-256 of the spec, every module's class, ``extra_repr`` and qnorm
metadata (the golden ops' integer constants), every state tensor, the input
signature, the target, the torch / Brevitas / TVM versions and the source text
of ``qnorm`` and ``compilers`` (any code change misses).  Models with a module
class from elsewhere get no model key (their code is not hashed).  A recompile
of the same model reads one JSON file and loads the library: milliseconds.
Both are :mod:`compilers.cache` entries: every hit is checked against the SHA-256
recorded when it was written, and one that does not match is built again.

**Reproducible.**  The same module compiles to the same bytes: the Relax pipeline
is :func:`compilers.tvm.reproducible.relax_pipeline`, which fixes the one order
TVM leaves to chance.

:meth:`CompiledModel.save` writes ``model.so`` + ``model.json`` (input and output
formats, target, datapath, versions, the library's SHA-256, the source checkpoint, as
:func:`qnorm.train.compiled.compile_checkpoint` records it);
:func:`load_compiled` refuses a directory whose library does not match.

**Boards.**  A cross target (aarch64, riscv64), or x86_64 with ``c_api_requested``,
gets the C API of :mod:`compilers.tvm.c_api` instead of a VM library: the same Relax
module as a static library, header and runner that need no TVM runtime
(``model.json``'s ``artifact`` is ``"c-api"``; its ``files`` record each file's SHA-256).
``opencl`` gets an OpenCL program and launch plan (:mod:`compilers.tvm.opencl_model`),
``cuda`` CUDA source, PTX and cubins and the same plan (:mod:`compilers.tvm.cuda_model`),
both from the module built with the qnorm kernels' GPU schedule.  These artifacts take
and give integers (:mod:`compilers.tvm.artifacts`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import tvm
import tvm_ffi
from torch import nn
from tvm import relax, te, tirx
from tvm.relax.frontend.torch import from_exported_program

from compilers import cache
from compilers.cache import sha256_file
from compilers.tvm import acceptance, c_api, cuda_model, opencl_model, x86_rowsums
from compilers.tvm.build import build_recipe, cache_dir, tvm_target
from compilers.tvm.gpu import GPU
from compilers.tvm.kernels import Kernel, kernel_for
from compilers.tvm.reproducible import relax_pipeline
from compilers.tvm.schedules import CPU, Schedule
from qnorm.deploy import (
    ExactnessReport,
    export,
    freeze,
    input_format,
    input_quantizer,
    model_spec,
    prove_exact,
)
from qnorm.deploy.freeze import int_op_info
from qnorm.errors import DeployError, UsageError
from qnorm.fixedpoint import DEFAULT_ROUND, Round
from qnorm.nn.metadata import collect_module_metadata
from qnorm.qformat import QFormat
from qnorm.targets import C_API_TARGETS, Target, load_target, not_compiled_for, target_name

FORMAT = "qnorm.compiled"
VERSION = 1
LIBRARY = "model.so"
METADATA = "model.json"
INDEX = "index.json"  # a model key's cache entry: the library key and the metadata
_KEY_FORMAT = 2  # bump when a key recipe or the cache layout changes
HOST_TARGETS = ("x86_64",)  # where a Relax VM library (model.so) runs: this machine
OPENCL_TARGETS = ("opencl",)  # an OpenCL program and launch plan (compilers.tvm.opencl_model)
CUDA_TARGETS = ("cuda",)  # CUDA source, PTX and cubins and a launch plan (compilers.tvm.cuda_model)
VM_ARTIFACT = "relax-vm"
IntegerModel = c_api.CApiModel | opencl_model.OpenCLModel | cuda_model.CudaModel  # integers in and out
_X86_LEVELS = ("x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4")  # each runs the ones before it
_SOURCE_PACKAGES = ("qnorm", "compilers")
# Module classes whose code a model key covers: qnorm's by source_digest, the rest by version.
_HASHED_CODE = ("qnorm.", "compilers.", "torch.", "brevitas.")


def compile_target(target: str | Target) -> Target:
    """The qnorm target (a name, ``x86`` meaning ``x86_64``, or a loaded Target), if
    ``compile`` supports it yet."""
    if isinstance(target, str):
        target = load_target(target_name(target))  # unknown: its error lists the known targets
    if target.name not in HOST_TARGETS + C_API_TARGETS + OPENCL_TARGETS + CUDA_TARGETS:
        raise not_compiled_for(target.name)
    return target


def artifact_kind(target: Target, c_api_requested: bool) -> str:
    """What compile builds for ``target``: a Relax VM library for this machine, the C API
    (always for a cross target: a board has no TVM runtime), an OpenCL program or CUDA binaries."""
    if target.name in OPENCL_TARGETS and not c_api_requested:
        return opencl_model.ARTIFACT
    if target.name in CUDA_TARGETS and not c_api_requested:
        return cuda_model.ARTIFACT
    if target.name in HOST_TARGETS and not c_api_requested:
        return VM_ARTIFACT
    if target.name not in C_API_TARGETS:
        raise UsageError(f"the C API builds for {', '.join(C_API_TARGETS)}, not {target.name}")
    return c_api.ARTIFACT


# --------------------------------------------------------------------------- export -> Relax


def to_relax(program: torch.export.ExportedProgram, schedule: Schedule = CPU) -> tvm.IRModule:
    """The decomposed ``program`` as a Relax module; qnorm ops call their kernels,
    laid out by ``schedule`` (the CPU's, or the GPU's for a device target)."""
    # one kernel function per kernel text, shared by every op that has it (see _kernel_var)
    convert = functools.partial(_convert_int_op, schedule=schedule, kernels={})
    return from_exported_program(
        program,
        custom_convert_map={"int_op.default": convert},
        run_ep_decomposition=False,  # qnorm.deploy.export decomposed it (the proof saw that graph)
        unwrap_unit_return_tuple=True,
    )


def kernel_symbol(op_name: str) -> str:
    """The symbol of the kernel a qnorm op named ``op_name`` (its module path) compiles to;
    its quantizer and dequantizer are this symbol with ``_quantize`` / ``_dequantize``.
    Ops with the same kernel text call the kernel of the first of them (in graph order).
    Profiles of a compiled model map the steps they time back to ops by it."""
    return "qnorm_" + "".join(c if c.isalnum() else "_" for c in op_name)


def _convert_int_op(
    node: torch.fx.Node, importer: Any, schedule: Schedule, kernels: dict[str, relax.GlobalVar]
) -> relax.Expr:
    info = int_op_info(node.args[1])
    bb = importer.block_builder
    name = kernel_symbol(info.name)
    x = importer.env[node.args[0]]
    ndim = len(x.ty.shape)
    channel = info.channel_dim % ndim
    order = [d for d in range(ndim) if d != channel] + [channel]
    moved = x if order == list(range(ndim)) else bb.emit(relax.op.permute_dims(x, order))
    # an elementwise op (an activation) takes rows of any length: the tensor's last axis
    kernel = kernel_for(info.op, schedule, row=int(moved.ty.shape[-1]))
    q = bb.emit_te(_quantizer(info.op.in_fmt, kernel.in_dtype), moved, primfunc_name_hint=f"{name}_quantize")
    lead = 1 if kernel.time_major else 0
    row = math.prod(kernel.row_shape)
    shape = list(moved.ty.shape)
    if [int(d) for d in shape[ndim - len(kernel.row_shape):]] != list(kernel.row_shape):
        raise ValueError(f"{info.name}: input rows {shape} do not end in the kernel's row shape {kernel.row_shape}")
    already_rows = ndim == lead + 2 and len(kernel.row_shape) == 1  # (T?, rows, C): the kernel's layout
    flat = q if already_rows else bb.emit(relax.op.reshape(q, [*shape[:lead], -1, row]))
    gv = _kernel_var(bb, kernel, name, kernels)
    consts = [relax.const(c) for c in kernel.consts]
    out = bb.emit(relax.call_tir(gv, [flat, *consts], out_ty=relax.TensorType(flat.ty.shape, kernel.out_dtype)))
    y = out if already_rows else bb.emit(relax.op.reshape(out, shape))
    y = bb.emit_te(_dequantizer(info.op.out_fmt), y, primfunc_name_hint=f"{name}_dequantize")
    inverse = [order.index(d) for d in range(ndim)]
    return y if order == list(range(ndim)) else bb.emit(relax.op.permute_dims(y, inverse))


def _kernel_var(
    bb: relax.BlockBuilder, kernel: Kernel, name: str, kernels: dict[str, relax.GlobalVar]
) -> relax.GlobalVar:
    """The module's function for ``kernel``: added as ``name``, or the one already added for
    a kernel of the same text (ops differing only in their per-channel constants, which are
    arguments).  Each function is compiled by LLVM on its own, so sharing one is what saves
    the compile time; the text key makes the shared function exactly the one each op
    would have had, less its name."""
    text = kernel.mod.script()
    if text not in kernels:
        func = _kernel_func(kernel.mod).with_attr("global_symbol", name)
        kernels[text] = bb.add_func(func, name)
    return kernels[text]


def _kernel_func(mod: tvm.IRModule | tirx.PrimFunc) -> tirx.PrimFunc:
    func = mod["main"] if isinstance(mod, tvm.IRModule) else mod
    # Opaque: Relax's operator fusion must leave the hand-scheduled kernel as it is.
    return func.with_attr("op_pattern", 8)


def _quantizer(fmt: QFormat, dtype: str) -> Callable[[te.Tensor], te.Tensor]:
    """TE of :meth:`QFormat.quantize` (default rounding): the same float64 steps.

    ``t = x / scale`` in float64 (exact: the scale is a power of two and float32
    widens exactly), clipped to ``[lo - 1, hi + 1]``, rounded half up as
    ``floor(t) + (t - floor(t) >= 1/2)`` (``t - floor(t)`` is exact), saturated.
    Mirrors :func:`qnorm.fixedpoint.round_float`, which cannot run on TIR (it
    calls numpy's or torch's floor).
    """
    if DEFAULT_ROUND is not Round.HALF_UP:
        raise NotImplementedError(f"quantizer TE mirrors half-up rounding, the default is {DEFAULT_ROUND}")
    scale = tirx.const(fmt.scale, "float64")
    lo, hi = float(fmt.lo), float(fmt.hi)

    def element(v: Any) -> Any:
        t = v.astype("float64") / scale
        t = tirx.max(tirx.min(t, tirx.const(hi + 1, "float64")), tirx.const(lo - 1, "float64"))
        fl = tirx.floor(t)
        up = tirx.Select(t - fl >= tirx.const(0.5, "float64"), tirx.const(1.0, "float64"), tirx.const(0.0, "float64"))
        q = tirx.max(tirx.min(fl + up, tirx.const(hi, "float64")), tirx.const(lo, "float64"))
        return q.astype(dtype)

    return lambda x: te.compute(x.shape, lambda *i: element(x(*i)), name="quantize")


def _dequantizer(fmt: QFormat) -> Callable[[te.Tensor], te.Tensor]:
    """``ints.to(float32) * scale``, as the QAT layers compute their output."""
    scale = tirx.const(fmt.scale, "float32")
    return lambda y: te.compute(y.shape, lambda *i: y(*i).astype("float32") * scale, name="dequantize")


# --------------------------------------------------------------------------- compile + cache


@dataclass
class CompiledModel:
    """A compiled model: call it on float32 numpy input of the recorded shape."""

    library: Path
    metadata: dict[str, Any]
    cache_hit: bool = False  # nothing was compiled: found in the cache (or loaded from a directory)
    seconds: float = 0.0  # compile_model's wall time (freeze .. load), or load_compiled's
    library_sha256: str | None = None  # as checked when the library was found or built

    def __post_init__(self) -> None:
        self._vm = relax.VirtualMachine(tvm.runtime.load_module(str(self.library)), tvm.cpu())

    def unavailable(self) -> str | None:
        """None: the library was built for this host and is loaded."""
        return None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        spec = self.metadata["input"]
        want = spec["shape"]
        if x.dtype != np.float32 or x.ndim != len(want) or x.shape[0] < 1 or list(x.shape[1:]) != want[1:]:
            raise ValueError(f"compiled model takes float32 input of shape (batch, {', '.join(map(str, want[1:]))}), "
                             f"got {x.dtype} {x.shape}")
        if not np.isfinite(x).all():
            raise ValueError("input contains NaN or Inf: no fixed-point value (the QAT model refuses them too)")
        return self._vm["main"](tvm.runtime.tensor(np.ascontiguousarray(x))).numpy()

    def save(self, directory: str | Path, source: dict[str, Any] | None = None) -> Path:
        """Write ``model.so`` and ``model.json`` into ``directory`` (created); ``source``
        describes where the model came from (a checkpoint) and is recorded as given."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        library = directory / LIBRARY
        shutil.copyfile(self.library, library)
        record = {"file": LIBRARY, "bytes": library.stat().st_size, "sha256": sha256_file(library)}
        if self.library_sha256 is not None and record["sha256"] != self.library_sha256:
            library.unlink()
            raise ValueError(f"{self.library} changed since it was checked (sha256 {record['sha256']}, "
                             f"expected {self.library_sha256}): compile again")
        meta = {**self.metadata, "library": record}
        if source is not None:
            meta["source"] = source
        (directory / METADATA).write_text(json.dumps(meta, indent=2, allow_nan=False) + "\n")
        return directory


def compile_model(
    model: nn.Module, example: torch.Tensor, target: str | Target = "x86_64", *, c_api_requested: bool = False
) -> CompiledModel | c_api.CApiModel:
    """Compile ``model`` for input like ``example`` (float32, dimension 0 the batch).

    For ``x86_64`` the result is a Relax VM library run in this process, or with
    ``c_api_requested`` the C API of :mod:`compilers.tvm.c_api`, which is what every
    cross target (aarch64, riscv64) gets.

    Raises :class:`qnorm.deploy.NotDeployableError` (a ValueError listing every
    problem) when the exported graph cannot be proven exact, and ValueError for a
    model that cannot be frozen or a target ``compile`` does not support.
    """
    start = time.perf_counter()
    target = compile_target(target)
    kind = artifact_kind(target, c_api_requested)
    index = _index_entry(model_key(model, example, target, kind))
    if index is not None and (found := cache.lookup(index)) is not None:
        entry = json.loads((found / INDEX).read_text())
        library = cache.lookup(_library_entry(entry["library_key"]))
        if library is not None:
            return _compiled(kind, library, entry["metadata"], target, start)
        cache.remove(index)  # its library is gone: index the one built below
    frozen = freeze(model)
    program = export(frozen, example)
    report = prove_exact(program)
    mod = to_relax(program, GPU if kind in (opencl_model.ARTIFACT, cuda_model.ARTIFACT) else CPU)
    # target-specific instructions before the key: the key is of the text that is compiled
    mod = x86_rowsums.rewrite(mod, target)
    key = relax_key(mod, target)
    metadata = _metadata(program, report, target, key)
    if kind == c_api.ARTIFACT:
        metadata, api = _integer_metadata(metadata, program, kind)
        key = c_api.artifact_key(key)
        version = f"qnorm {metadata['versions']['qnorm']}, TVM {tvm.__version__}, model {key[:16]}"
        metadata["cache_key"] = key
        library = cache.cached(_library_entry(key), lambda d: c_api.build_c_api(mod, target, api, version, d))
    elif kind == opencl_model.ARTIFACT:
        metadata, _ = _integer_metadata(metadata, program, kind)
        key = opencl_model.artifact_key(key)
        metadata["cache_key"] = key
        library = cache.cached(_library_entry(key), lambda d: opencl_model.build_opencl(mod, target, d))
    elif kind == cuda_model.ARTIFACT:
        metadata, _ = _integer_metadata(metadata, program, kind)
        key = cuda_model.artifact_key(key, target)
        metadata["cache_key"] = key
        library = cache.cached(_library_entry(key), lambda d: cuda_model.build_cuda(mod, target, d))
    else:
        library = cache.cached(_library_entry(key), lambda d: _build_library(mod, target, d / LIBRARY))
    compiled = _compiled(kind, library, metadata, target, start)
    try:
        metadata["acceptance"] = acceptance.accept(compiled, frozen, example)
    except acceptance.MiscompileError:
        cache.remove(_library_entry(key))
        raise
    if index is not None:
        text = json.dumps({"library_key": key, "metadata": metadata}, indent=1) + "\n"
        cache.cached(index, lambda directory: (directory / INDEX).write_text(text))
    compiled.seconds = time.perf_counter() - start
    return compiled


def _compiled(
    kind: str, library: cache.Entry, metadata: dict[str, Any], target: Target, start: float
) -> CompiledModel | IntegerModel:
    seconds = time.perf_counter() - start
    if kind in _INTEGER_ARTIFACTS:
        return _INTEGER_ARTIFACTS[kind](library.path, metadata, target, library.hit, seconds, library.digests)
    return CompiledModel(library / LIBRARY, metadata, library.hit, seconds, library.digests[LIBRARY])


_INTEGER_ARTIFACTS = {c_api.ARTIFACT: c_api.CApiModel, opencl_model.ARTIFACT: opencl_model.OpenCLModel,
                      cuda_model.ARTIFACT: cuda_model.CudaModel}  # fmt: skip
# The files each needs (a CUDA build adds nvcc's, one pair per architecture).
_ARTIFACT_FILES = {c_api.ARTIFACT: c_api.FILES, opencl_model.ARTIFACT: opencl_model.FILES,
                   cuda_model.ARTIFACT: cuda_model.REQUIRED}  # fmt: skip
_ARTIFACT_TARGETS = {c_api.ARTIFACT: C_API_TARGETS, opencl_model.ARTIFACT: OPENCL_TARGETS,
                     cuda_model.ARTIFACT: CUDA_TARGETS}  # fmt: skip


def _integer_metadata(
    metadata: dict[str, Any], program: torch.export.ExportedProgram, kind: str
) -> tuple[dict[str, Any], c_api.Interface]:
    """``metadata`` of an artifact with integer input (the first quantizer's range) and output."""
    quantizer = input_quantizer(program)
    api = c_api.interface(metadata, None if quantizer is None else quantizer[1:])
    metadata = {
        **metadata,
        "artifact": kind,
        "input": {**metadata["input"], "dtype": api.input_dtype, "range": list(api.input_range)},
        "output": {**metadata["output"], "dtype": "int32"},
    }
    return metadata, api


def load_compiled(
    directory: str | Path, target: str | None = None
) -> CompiledModel | IntegerModel:
    """Load a directory written by :meth:`CompiledModel.save` or :meth:`c_api.CApiModel.save`,
    refusing a corrupt or foreign one, and one not compiled for ``target`` when given."""
    start = time.perf_counter()
    directory = Path(directory)
    meta_path = directory / METADATA
    if not meta_path.is_file():
        raise ValueError(f"compiled model {directory}: missing {METADATA}")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"compiled model {directory}: {METADATA} is not valid JSON: {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"compiled model {directory}: {METADATA} is not a {FORMAT} version {VERSION} file")
    kind = meta.get("artifact", VM_ARTIFACT)
    for key in ("input", "output", "target", "versions", "files" if kind in _INTEGER_ARTIFACTS else "library"):
        if not isinstance(meta.get(key), dict):
            raise ValueError(f"compiled model {directory}: {METADATA} lacks a valid {key!r} entry")
    built_for = meta["target"].get("name")
    if target is not None and target_name(target) != built_for:
        raise ValueError(f"compiled model {directory} was compiled for {built_for}, not {target_name(target)}")
    if kind in _INTEGER_ARTIFACTS:
        return _load_integer_artifact(directory, meta, kind, start)
    if kind != VM_ARTIFACT:
        raise ValueError(f"compiled model {directory}: unknown artifact {kind!r} in {METADATA}")
    if built_for not in HOST_TARGETS:
        raise ValueError(f"compiled model {directory}: {METADATA} says its {LIBRARY} is for {built_for}; "
                         f"a {LIBRARY} runs on {', '.join(HOST_TARGETS)}")  # fmt: skip
    library = directory / LIBRARY
    if not library.is_file():
        raise ValueError(f"compiled model {directory}: missing {LIBRARY}")
    if sha256_file(library) != meta["library"].get("sha256"):
        raise ValueError(f"compiled model {directory}: {LIBRARY} is corrupt or not the one {METADATA} describes "
                         "(its sha256 differs)")
    built_tvm = meta["versions"].get("tvm")
    if built_tvm != tvm.__version__:
        raise ValueError(f"compiled model {directory} was built with TVM {built_tvm}; this is TVM {tvm.__version__}: "
                         "compile it again")
    _check_cpu(directory, meta["target"].get("tvm") or {})
    return CompiledModel(library, meta, True, time.perf_counter() - start, meta["library"]["sha256"])


def _load_integer_artifact(
    directory: Path, meta: dict[str, Any], kind: str, start: float
) -> IntegerModel:
    """A saved C-API, OpenCL or CUDA model, its files checked against ``model.json``; a
    C API's library must name the target ``model.json`` names."""
    name = meta["target"].get("name")
    if name not in _ARTIFACT_TARGETS[kind]:
        raise ValueError(f"compiled model {directory}: {METADATA} names target {name!r}, which has no {kind} build")
    digests = {}
    for file in sorted(set(_ARTIFACT_FILES[kind]) | set(meta["files"])):
        path, record = directory / file, meta["files"].get(file)
        if not path.is_file() or not isinstance(record, dict):
            raise ValueError(f"compiled model {directory}: missing {file}")
        digests[file] = sha256_file(path)
        if digests[file] != record.get("sha256"):
            raise ValueError(f"compiled model {directory}: {file} is corrupt or not the one {METADATA} describes "
                             "(its sha256 differs)")  # fmt: skip
    if kind != c_api.ARTIFACT:
        return _INTEGER_ARTIFACTS[kind](directory, meta, load_target(name), True, time.perf_counter() - start, digests)
    model = c_api.CApiModel(directory, meta, load_target(name), True, 0.0, digests)
    machine = model.runner_machine()
    built = model.built_for() if machine == name else machine
    if built != name:
        raise ValueError(f"compiled model {directory}: {METADATA} says {name}, but its library was compiled for "
                         f"{built}")  # fmt: skip
    model.seconds = time.perf_counter() - start
    return model


def _check_cpu(directory: Path, built: dict[str, Any]) -> None:
    """Refuse a library built for a newer x86-64 level than this CPU has (it would crash)."""
    host = load_target("x86_64").tvm_spec().get("mcpu")
    level = built.get("mcpu")
    if level in _X86_LEVELS and host in _X86_LEVELS and _X86_LEVELS.index(level) > _X86_LEVELS.index(host):
        raise ValueError(f"compiled model {directory} was built for {level}; this CPU is {host}")


def _build_library(mod: tvm.IRModule, target: Target, library: Path) -> None:
    executable = tvm.compile(mod, target=tvm_target(target), relax_pipeline=relax_pipeline())
    executable.export_library(str(library), cc=target.build.cc, options=list(target.build.cflags))


def _metadata(
    program: torch.export.ExportedProgram, report: ExactnessReport, target: Target, key: str
) -> dict[str, Any]:
    user = [n for n in program.graph.nodes if n.op == "placeholder" and n.name in program.graph_signature.user_inputs]
    out_node = next(n for n in program.graph.nodes if n.op == "output")
    outputs = [a for a in out_node.args[0]]
    if len(user) != 1 or len(outputs) != 1:
        raise DeployError(f"compile takes models with one input and one output, got {len(user)} and {len(outputs)}")
    fmt = input_format(program)
    grid = report.outputs[0]
    return {
        "format": FORMAT,
        "version": VERSION,
        "input": {
            "name": user[0].name,
            "shape": _shape(user[0]),
            "dtype": "float32",
            "format": None if fmt is None else {"bits": fmt.bits, "scale": fmt.scale, "signed": fmt.signed},
        },
        "output": {
            "shape": _shape(outputs[0]),
            "dtype": "float32",
            # every output is k * 2^grid_exp with an integer |k| <= max_abs_int
            "format": None if grid is None else {
                "grid_exp": grid.exp, "scale": math.ldexp(1.0, grid.exp), "max_abs_int": grid.bound,
            },  # fmt: skip
        },
        "target": {"name": target.name, "tvm": target.tvm_spec(), "host": target.tvm_host_spec()},
        "datapath": _datapath(program),
        "versions": _versions(),
        "cache_key": key,
        "exactness": {"summary": report.summary(), **report.to_json()},
    }


def _datapath(program: torch.export.ExportedProgram) -> dict[str, Any]:
    """What the compiled model computes in: float32 on the proven power-of-two grids,
    and each qnorm integer op in its lanes (None: compares only, no per-element products)."""
    ops = [int_op_info(n.args[1]) for n in program.graph.nodes if str(n.target) == "qnorm.int_op.default"]
    return {
        "float": "float32, every value on a power-of-two grid below 2^24 units (exactness proof)",
        "int_ops": {info.name: {"op": type(info.op).__name__, "lanes": getattr(getattr(info.op, "config", None),
                                                                                  "lanes", None)}
                    for info in ops},
    }  # fmt: skip


def _shape(node: torch.fx.Node) -> list[int | None]:
    return [int(d) if isinstance(d, int) else None for d in node.meta["val"].shape]


def _versions() -> dict[str, str]:
    import brevitas

    return {"qnorm": importlib.metadata.version("qnorm"), "tvm": tvm.__version__, "torch": torch.__version__,
            "brevitas": brevitas.__version__}


# --------------------------------------------------------------------------- keys


def relax_key(mod: tvm.IRModule, target: Target) -> str:
    """SHA-256 of the Relax module (text and constants), the target and the TVM version.

    The text is printed without metadata (``show_meta=True`` crashes TVM 0.27 on
    Relax constants); the constants, in the order a structural walk meets them,
    are hashed from their bytes instead.
    """
    recipe = {"format": _KEY_FORMAT, **build_recipe(target), "module": mod.script()}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode())
    for value in _tensor_constants(mod):
        digest.update(f"{value.dtype}:{value.shape}:".encode() + np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()


def _tensor_constants(mod: tvm.IRModule) -> list[np.ndarray]:
    found: list[np.ndarray] = []
    seen: set[int] = set()

    def visit(node: Any) -> Any:
        if isinstance(node, tvm.ir.GenericConst) and node.__chandle__() not in seen:
            seen.add(node.__chandle__())
            found.append(node.value.numpy())
        return None

    tvm_ffi.structural_walk(mod, visit, order="pre")
    return found


def model_key(model: nn.Module, example: torch.Tensor, target: Target, kind: str = VM_ARTIFACT) -> str | None:
    """The model-level cache key (see the module docstring), or None for a model whose
    code is not all in qnorm, torch and Brevitas (or that no registered describer of
    :func:`qnorm.deploy.model_spec` knows)."""
    spec = model_spec(model)
    if spec is None:
        return None
    modules = [
        (name, f"{type(m).__module__}.{type(m).__qualname__}", m.extra_repr()) for name, m in model.named_modules()
    ]
    if not all(cls.startswith(_HASHED_CODE) for _, cls, _ in modules):
        return None
    digest = hashlib.sha256()
    recipe = {
        "format": _KEY_FORMAT, "spec": spec, "modules": modules, "qnorm": collect_module_metadata(model),
        "versions": _versions(), "source": source_digest(), "target": target.tvm_spec(),
        "host": target.tvm_host_spec(), "cc": target.build.cc, "cflags": list(target.build.cflags),
        "input": [list(example.shape[1:]), str(example.dtype)], "artifact": kind,
    }  # fmt: skip
    digest.update(json.dumps(recipe, sort_keys=True).encode())
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}:".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def source_digest() -> str:
    """SHA-256 over the Python source of the qnorm and compilers packages.

    Each package's directory comes from the imported package itself, so an installed
    qnorm hashes its installed files (the same digest as the checkout they came from).
    """
    digest = hashlib.sha256()
    for package in _SOURCE_PACKAGES:
        root = Path(importlib.import_module(package).__file__).resolve().parent
        for path in sorted(root.rglob("*.py")):
            name = f"{package}/{path.relative_to(root)}"
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _models_dir() -> Path:
    return cache_dir() / "models"


def _library_entry(key: str) -> Path:
    return _models_dir() / key


def _index_entry(key: str | None) -> Path | None:
    return None if key is None else _models_dir() / f"index-{key}"
