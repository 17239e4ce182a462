"""TVM kernels for the golden ops, bit-exact with ``op.forward`` and scheduled for CPUs.

``kernel_for(op)`` builds the kernel of one op instance (a :class:`~._base.Kernel`:
the scheduled IRModule and the per-channel constants it takes as arguments);
``kernel_for(op, schedule)`` lays its loops out for a kind of target
(:mod:`compilers.tvm.schedules`; the CPU one by default);
``kernel_for(op).build(target)`` compiles it through the build cache and returns
a callable that maps the op's integer input to its output.  Every constant and
stage comes from the op instance at build time (see :mod:`.norms`,
:mod:`.bnfold` and :mod:`.softmax` for which op functions run on TIR and which
are mirrored).
"""

from __future__ import annotations

from typing import Any

from compilers.tvm.kernels._base import CompiledKernel, Kernel
from compilers.tvm.kernels.activation import activation_kernel
from compilers.tvm.kernels.bnfold import (
    bnquant_kernel,
    lif_kernel,
    multithreshold_kernel,
)
from compilers.tvm.kernels.norms import norm_kernel
from compilers.tvm.kernels.softmax import softmax_kernel
from compilers.tvm.schedules import CPU, Schedule
from qnorm.ops._normcore import NormOp
from qnorm.ops.activation import IntActivation
from qnorm.ops.multithreshold import BNQuant, MultiThreshold
from qnorm.ops.softmax import IntSoftmax
from qnorm.ops.spiking import _LIFNeuron

_BUILDERS: tuple[tuple[type, Any], ...] = (
    (NormOp, norm_kernel),
    (MultiThreshold, multithreshold_kernel),
    (BNQuant, bnquant_kernel),
    (_LIFNeuron, lif_kernel),
    (IntActivation, activation_kernel),
    (IntSoftmax, softmax_kernel),
)


def kernel_for(op: Any, schedule: Schedule = CPU, *, row: int | None = None) -> Kernel:
    """The kernel of ``op`` (any golden op of qnorm.ops), its loops laid out by
    ``schedule`` (default: the vector CPU schedule).

    ``row``: the row length of an elementwise op's kernel (an activation has no row
    of its own; see :mod:`.activation`); the other ops' rows are their channels.
    """
    if isinstance(op, IntActivation) and row is not None:
        return activation_kernel(op, schedule, row)
    for cls, builder in _BUILDERS:
        if isinstance(op, cls):
            return builder(op, schedule)
    raise NotImplementedError(f"no TVM kernel for {type(op).__name__}")


__all__ = ["CompiledKernel", "Kernel", "kernel_for"]
