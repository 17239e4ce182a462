"""A whole-model Relax module as a fixed sequence of TIR calls over static buffers.

A board without Python has no TVM runtime to interpret Relax's virtual-machine
bytecode, so :func:`plan_static` removes everything that needs one:

* the batch dimension (the module's one symbolic shape variable) is bound to 1:
  the C API loops over samples, and every compiled model computes each sample
  on its own (the eval-mode graph has no op across the batch);
* ``LegalizeOps`` (the first pass of TVM's default Relax pipeline, the same one
  :func:`compilers.tvm.graph.compile_model` runs) turns every operator into a
  ``call_tir`` of a PrimFunc with static shapes;
* what is left must be a straight line of ``call_tir`` bindings whose arguments
  are earlier results, Relax constants or the input.  Anything else (a packed
  call, a tuple, a shape computation) is refused with the node named.

The buffers are then packed into one arena by their live ranges (first fit: a
buffer's bytes are reused once its last reader has run, never by an output of
that same reader), and the constants into one blob, each at a 64-byte boundary
(TVM's kernels assume that alignment).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, tirx

from qnorm.errors import DeployError

ALIGN = 64  # TVM's kernels assume 64-byte aligned buffers
BATCH = 1  # the batch a C plan computes: C loops over samples


@dataclass(frozen=True)
class Buffer:
    """A static tensor: a slot of the arena, or of the constants blob when ``constant``."""

    shape: tuple[int, ...]
    dtype: str
    offset: int
    constant: bool


@dataclass(frozen=True)
class Step:
    """One ``call_tir``: the PrimFunc's symbol and its buffers, output last."""

    function: str
    buffers: tuple[int, ...]  # indices into StaticPlan.buffers


@dataclass(frozen=True)
class StaticPlan:
    """What a C driver needs to run one sample: kernels, buffers, calls, in and out."""

    kernels: tvm.IRModule  # the PrimFuncs, each with its C symbol as global_symbol
    buffers: tuple[Buffer, ...]
    steps: tuple[Step, ...]
    input: int  # buffer index of the (float32) model input
    output: int  # buffer index of the (float32) model output
    arena_bytes: int
    constants: bytes  # the constant buffers' bytes (little endian), at their offsets


def plan_static(mod: tvm.IRModule, symbol_prefix: str, batch: int = BATCH) -> StaticPlan:
    """The plan of ``mod`` (a :func:`compilers.tvm.graph.to_relax` module) for ``batch``
    samples at a time; kernels get the symbols ``symbol_prefix + name``."""
    bound = tvm.IRModule(dict(mod.functions))  # the same global vars: the calls still find their kernels
    bound["main"] = _bind_batch(mod["main"], batch)
    mod = relax.transform.LegalizeOps()(bound)
    main = mod["main"]
    return _Planner(mod, symbol_prefix).plan(main)


def _bind_batch(main: relax.Function, value: int) -> relax.Function:
    """``main`` with its batch dimension (dimension 0 of its one input) fixed to ``value``."""
    if len(main.params) != 1:
        raise DeployError(f"a static plan takes models with one input, this one has {len(main.params)}")
    shape = main.params[0].ty.shape
    batch = shape[0] if shape is not None and len(shape) > 0 else None
    symbolic = list(relax.analysis.defined_symbolic_vars(main))
    if not isinstance(batch, tirx.Var) or [str(v) for v in symbolic] != [str(batch)]:
        raise DeployError(
            f"a static plan needs exactly one symbolic dimension, the input's batch; the input is {shape} and "
            f"the symbolic variables are {[str(v) for v in symbolic]}"
        )
    return main.bind_symbolic_vars({batch: value})


def _static_shape(ty: object, what: str) -> tuple[tuple[int, ...], str]:
    shape = getattr(ty, "shape", None)
    if not isinstance(ty, relax.TensorType) or shape is None:
        raise DeployError(f"{what}: a static plan holds tensors only, got {ty}")
    dims = []
    for d in shape:
        if not isinstance(d, tirx.IntImm):
            raise DeployError(f"{what}: shape {shape} is not static after fixing the batch")
        dims.append(int(d.value))
    return tuple(dims), str(ty.dtype)


class _Planner:
    """Walks the legalized ``main`` once, collecting buffers, constants and calls."""

    def __init__(self, mod: tvm.IRModule, prefix: str) -> None:
        self.mod, self.prefix = mod, prefix
        self.specs: list[tuple[tuple[int, ...], str]] = []
        self.constant_values: dict[int, np.ndarray] = {}  # buffer index -> value
        self.by_var: dict[int, int] = {}  # relax var handle -> buffer index
        self.by_const: dict[int, int] = {}  # constant handle -> buffer index
        self.calls: list[tuple[str, list[int]]] = []
        self.functions: dict[str, tirx.PrimFunc] = {}

    def plan(self, main: relax.Function) -> StaticPlan:
        x = main.params[0]
        self.by_var[x.__chandle__()] = self._new(_static_shape(x.ty, "the input"))
        body = main.body
        for block in body.blocks:
            for binding in block.bindings:
                self._bind(binding)
        result = body.body
        if not isinstance(result, relax.Var) or result.__chandle__() not in self.by_var:
            raise DeployError(f"a static plan returns one tensor computed by the model, got {_describe(result)}")
        inp, out = self.by_var[x.__chandle__()], self.by_var[result.__chandle__()]
        for index, what in ((inp, "input"), (out, "output")):
            if self.specs[index][1] != "float32":
                raise DeployError(f"the model's {what} is {self.specs[index][1]}; the C API converts float32")
        offsets, arena = _pack_arena(self.specs, self.calls, inp, out, set(self.constant_values))
        blob, const_offsets = _pack_constants(self.constant_values)
        buffers = tuple(
            Buffer(shape, dtype, const_offsets[i] if i in const_offsets else offsets[i], i in const_offsets)
            for i, (shape, dtype) in enumerate(self.specs)
        )  # fmt: skip
        steps = tuple(Step(self.prefix + name, tuple(args)) for name, args in self.calls)
        kernels = tvm.IRModule({self.prefix + n: f.with_attr("global_symbol", self.prefix + n)
                                for n, f in self.functions.items()})  # fmt: skip
        return StaticPlan(kernels, buffers, steps, inp, out, arena, blob)

    def _new(self, spec: tuple[tuple[int, ...], str]) -> int:
        self.specs.append(spec)
        return len(self.specs) - 1

    def _bind(self, binding: relax.Binding) -> None:
        var, value = binding.var, binding.value
        name = var.name
        if isinstance(value, relax.Var):  # an alias (the dataflow block's output)
            self.by_var[var.__chandle__()] = self._argument(value, name)
            return
        op = getattr(value, "op", None)
        if not isinstance(value, relax.Call) or not isinstance(op, tvm.ir.Op) or op.name != "relax.call_tir":
            raise DeployError(f"{name}: a static plan runs call_tir only, got {_describe(value)}")
        if len(value.args) > 2:
            raise DeployError(f"{name}: call_tir with symbolic shape arguments is not static")
        gv, args = value.args[0], value.args[1]
        func = self.mod[gv.name_hint]
        if not isinstance(func, tirx.PrimFunc):
            raise DeployError(f"{name}: call_tir of {gv.name_hint}, which is not a PrimFunc")
        self.functions[gv.name_hint] = func
        buffers = [self._argument(a, name) for a in args.fields]
        out = self._new(_static_shape(var.ty, name))
        self.by_var[var.__chandle__()] = out
        self.calls.append((gv.name_hint, [*buffers, out]))

    def _argument(self, arg: relax.Expr, where: str) -> int:
        if isinstance(arg, relax.Var):
            if arg.__chandle__() not in self.by_var:
                raise DeployError(f"{where}: argument {arg.name} is not a tensor the plan computed")
            return self.by_var[arg.__chandle__()]
        if isinstance(arg, tvm.ir.GenericConst):
            handle = arg.__chandle__()
            if handle not in self.by_const:
                value = np.ascontiguousarray(arg.value.numpy())
                index = self._new((tuple(int(d) for d in value.shape), str(value.dtype)))
                self.by_const[handle] = index
                self.constant_values[index] = value
            return self.by_const[handle]
        raise DeployError(f"{where}: a static plan passes tensors and constants to kernels, got {_describe(arg)}")


def _describe(node: object) -> str:
    op = getattr(node, "op", None)
    return f"{type(node).__name__} {getattr(op, 'name', '')}".strip()


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(spec: tuple[tuple[int, ...], str]) -> int:
    return int(np.prod(spec[0], dtype=np.int64)) * np.dtype(spec[1]).itemsize


def _pack_arena(
    specs: list[tuple[tuple[int, ...], str]], calls: list[tuple[str, list[int]]], inp: int, out: int,
    constants: set[int],
) -> tuple[dict[int, int], int]:
    """Arena offsets of every non-constant buffer by first fit over live ranges.

    The input lives from the start, the output to the end; every other buffer from
    the call that writes it to its last reader.  A buffer is freed after the call
    that reads it last, so a call's output never shares bytes with its inputs.
    """
    last = {i: step for step, (_, args) in enumerate(calls) for i in args[:-1]}
    last[out] = len(calls)
    live: dict[int, tuple[int, int]] = {}  # buffer -> (offset, size)
    offsets: dict[int, int] = {}
    end = 0

    def place(index: int) -> None:
        nonlocal end
        size = _aligned(max(_nbytes(specs[index]), 1))
        offset = 0
        for start, length in sorted(live.values()):
            if offset + size <= start:
                break
            offset = max(offset, start + length)
        live[index] = (offset, size)
        offsets[index] = offset
        end = max(end, offset + size)

    place(inp)
    for step, (_, args) in enumerate(calls):
        place(args[-1])
        for i in set(args[:-1]):
            if i not in constants and last.get(i) == step and i in live:
                del live[i]
    return offsets, end


def _pack_constants(values: dict[int, np.ndarray]) -> tuple[bytes, dict[int, int]]:
    blob = bytearray()
    offsets: dict[int, int] = {}
    for index, value in values.items():
        blob.extend(b"\0" * (_aligned(len(blob)) - len(blob)))
        offsets[index] = len(blob)
        blob.extend(value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes())
    return bytes(blob), offsets
