"""What every op kernel shares: the kernel object, its runner, and exact dtype choice.

A kernel is a scheduled ``main(x, *consts, out)``.  The op's per-channel integers
(γ multipliers, biases, thresholds, …) are arguments rather than literals in the
TIR: a row of 768 channels is one small buffer, read from L1, and op instances
that differ only in those values share one module text, hence one entry of the
build cache.  :class:`Kernel` carries the arrays with the module, so callers
never assemble them.

Narrow types.  The fixedpoint bodies compute in int64.  Where an interval
proves a value narrower, :func:`fit` re-types it as ``int64(int32(v))``: exact
by that proof, and it tells LLVM the value is a sign-extended 32-bit word, so a
product of two such words becomes one ``vpmuldq`` instead of an emulated 64-bit
multiply (AVX2 has none; AVX-512DQ has ``vpmullq``, but ``vpmuldq`` is cheaper).
Buffers (inputs, per-channel constants, row statistics) take the narrowest
dtype their values need.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
from tvm import te, tirx

from compilers.tvm.build import Built, build
from compilers.tvm.schedules import scheduled_rowwise
from qnorm.analysis import Interval
from qnorm.ops.base import IntOp
from qnorm.qformat import QFormat
from qnorm.targets import Target

INT_DTYPES = ("int8", "int16", "int32", "int64")


def int_dtype(iv: Interval) -> str:
    """The narrowest signed integer dtype holding every value of ``iv``."""
    for name in INT_DTYPES:
        if iv.bits <= int(name[3:]):
            return name
    raise ValueError(f"[{iv.lo}, {iv.hi}] needs {iv.bits} bits; int64 is the widest kernel type")


def wider(*dtypes: str) -> str:
    return max(dtypes, key=lambda d: int(d[3:]))


def fmt_dtype(fmt: QFormat) -> str:
    """Container dtype of an integer format (an int4 input travels in int8)."""
    return int_dtype(Interval(fmt.lo, fmt.hi))


def fit(v: Any, iv: Interval) -> Any:
    """``v`` (int64) re-typed through the narrowest dtype holding ``iv`` (see module doc)."""
    narrow = int_dtype(iv)
    return v if narrow == "int64" else tirx.Cast("int64", tirx.Cast(narrow, v))


@dataclass(frozen=True)
class ChannelConst:
    """One per-channel constant: a kernel argument of the narrowest exact dtype."""

    name: str
    values: np.ndarray  # int64, one value per channel (or per channel and level)
    # a wider buffer dtype than the values need: the lanes of the loop that reads
    # them, so a vector load is not followed by a widening shuffle
    lanes: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", np.ascontiguousarray(self.values, dtype=np.int64))
        if self.lanes is not None and int(self.lanes[3:]) < int(self.narrowest[3:]):
            raise ValueError(f"{self.name}: values need {self.narrowest}, wider than the lanes' {self.lanes}")

    @property
    def narrowest(self) -> str:
        return int_dtype(Interval(int(self.values.min()), int(self.values.max())))

    @property
    def dtype(self) -> str:
        return self.narrowest if self.lanes is None else self.lanes

    def placeholder(self) -> te.Tensor:
        return te.placeholder(self.values.shape, self.dtype, name=self.name)

    def array(self) -> np.ndarray:
        return self.values.astype(self.dtype)


def check_mirrored_stages(op_name: str, op_stages: Sequence[str], kernel_stages: Sequence[str], builder: str) -> None:
    """Refuse a kernel whose recorded stages are not the op's range-report names, in
    order: the op's forward gained or lost a stage the kernel mirrors."""
    if list(kernel_stages) != list(op_stages):
        raise NotImplementedError(
            f"{op_name}'s stages {list(op_stages)} differ from the kernel's {list(kernel_stages)}: "
            f"the op's forward changed; update {builder}"
        )


def load_as(t: te.Tensor, dtype: str, *idx: Any) -> Any:
    """An element of ``t`` in ``dtype`` (a buffer holds its values exactly: widening is exact)."""
    v = tvm.runtime.convert(t[idx])
    return v if str(t.dtype) == dtype else v.astype(dtype)


def load64(t: te.Tensor, *idx: Any) -> Any:
    """An element of ``t`` as int64 (the per-row fixedpoint bodies compute in int64)."""
    return load_as(t, "int64", *idx)


@dataclass(frozen=True, eq=False)
class Kernel:
    """A scheduled integer kernel for one op instance.

    ``mod["main"]`` takes ``(x, *consts, out)``: ``x`` and ``out`` of shape
    ``(rows, *row_shape)`` (``(T, rows, *row_shape)`` for spiking neurons, whose
    time axis comes first), ``rows`` symbolic; ``consts`` are the op's
    per-channel integers in their buffer dtypes.
    """

    op: IntOp
    mod: tvm.IRModule
    consts: tuple[np.ndarray, ...]
    in_dtype: str
    out_dtype: str
    row_shape: tuple[int, ...]
    time_major: bool = False
    check_shape: Callable[[tuple[int, ...]], None] | None = None  # the op's own shape rules

    @classmethod
    def rowwise(
        cls, op: IntOp, schedule: Any, x: te.Tensor, buffers: Sequence[te.Tensor], out: te.Tensor,
        consts: Sequence[Any], in_dtype: str, out_dtype: str, row_shape: Sequence[int],
    ) -> Kernel:
        """The kernel ``out = f(x, *buffers)``, its rows laid out by ``schedule`` (once per
        kernel text: :func:`~compilers.tvm.schedules.scheduled_rowwise`); ``consts``
        (each with ``array()``) fill ``buffers`` at run time."""
        func = te.create_prim_func([x, *buffers, out])
        arrays = tuple(c.array() for c in consts)
        mod = scheduled_rowwise(schedule, func, "out")
        return cls(op, mod, arrays, in_dtype, out_dtype, tuple(row_shape))

    def build(self, target: Target) -> CompiledKernel:
        return CompiledKernel(self, build(self.mod, target))


@dataclass(frozen=True, eq=False)
class CompiledKernel:
    """A built kernel that runs on numpy arrays of the op's input shape."""

    kernel: Kernel
    built: Built

    def __call__(self, x: np.ndarray) -> np.ndarray:
        k = self.kernel
        x = np.asarray(x)
        lead = 1 if k.time_major else 0
        if (
            x.ndim < lead + len(k.row_shape)
            or tuple(x.shape[x.ndim - len(k.row_shape) :]) != k.row_shape
        ):
            raise ValueError(
                f"{k.op.name} kernel takes rows of shape {k.row_shape}; got input shape {x.shape}"
            )
        if k.check_shape is not None:
            k.check_shape(x.shape)
        k.op.in_fmt.check(x)  # the narrow container would wrap an out-of-format value silently
        rows = int(np.prod(x.shape[lead : x.ndim - len(k.row_shape)]))
        flat = x.reshape(*x.shape[:lead], rows, int(np.prod(k.row_shape))).astype(k.in_dtype)
        out = self.run(tvm.runtime.tensor(np.ascontiguousarray(flat)))
        return out.numpy().reshape(x.shape)

    def device_args(self) -> list[Any]:
        """The constant arguments, converted once (callers timing the kernel reuse them)."""
        return [tvm.runtime.tensor(c) for c in self.kernel.consts]

    def run(self, x: Any, consts: Sequence[Any] | None = None, out: Any = None) -> Any:
        """Run on a ``tvm.runtime.Tensor`` already in kernel layout; returns ``out``."""
        if out is None:
            out = tvm.runtime.empty(tuple(x.shape), self.kernel.out_dtype)
        self.built(x, *(self.device_args() if consts is None else consts), out)
        return out
