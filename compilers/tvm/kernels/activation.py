"""Kernels for the integer activations (IntGELU, IntSiLU): the op's own body on TIR.

``main(x, *tables, out)``: the op's tables (its exactly rounded outputs, or the
segment integers A, B, C) are constant argument buffers in their narrowest
dtypes, and every element runs :meth:`IntActivation.evaluate` itself, with
``load`` reading a buffer element at a computed index: a gather (a table lookup
on the CPU and GPU, a ROM read in the HLS C).  Nothing is mirrored.

An activation is elementwise and has no row of its own; its kernel maps rows of
``row`` elements, a static length the caller chooses (the schedules need one: a
vector of int8 or int16 lanes on the CPU, a block of threads on the GPU).  The
default, ``ELEMENT_ROW``, is one CPU vector; a whole-model compile passes the last
axis of the tensor the layer sees, so any shape maps without a reshape across rows.
"""

from __future__ import annotations

from typing import Any

from tvm import te

from compilers.tvm.kernels._base import ChannelConst, Kernel, fmt_dtype, load64
from compilers.tvm.schedules import CPU, Schedule
from qnorm.ops.activation import IntActivation

ELEMENT_ROW = 16


def activation_kernel(op: IntActivation, schedule: Schedule = CPU, row: int = ELEMENT_ROW) -> Kernel:
    """``main(x, *tables, out)``: x (rows, row) → activations (rows, row)."""
    if row < 1:
        raise ValueError(f"an activation kernel needs a row of at least one element, got {row}")
    if type(op)._forward is not IntActivation._forward or type(op).evaluate is not IntActivation.evaluate:
        raise NotImplementedError(f"{type(op).__name__} overrides the activation body this kernel runs")
    consts = [ChannelConst(name, values) for name, values in op.tables.items()]
    bufs = {c.name: c.placeholder() for c in consts}
    in_dtype, out_dtype = fmt_dtype(op.in_fmt), fmt_dtype(op.out_fmt)

    rows = te.var("rows", "int64")
    x = te.placeholder((rows, row), in_dtype, name="x")

    def element(r: Any, c: Any) -> Any:
        y = op.evaluate(load64(x, r, c), lambda name, i: load64(bufs[name], i))
        return y.astype(out_dtype)

    out = te.compute((rows, row), element, name="out")
    return Kernel.rowwise(op, schedule, x, list(bufs.values()), out, consts, in_dtype, out_dtype, (row,))
