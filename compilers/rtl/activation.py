"""The activation units (IntGELU, IntSiLU): one element per clock.

The op's own :meth:`~qnorm.ops.activation.IntActivation.evaluate` runs on an
:class:`~compilers.rtl.values.Hdl` element, its ``load(name, index)`` a ROM of
that table's values at their exact width (:class:`Rom`), read at the HDL index:

* table (inputs of at most 12 bits): ``T[x − lo]``, one ROM read;
* segments (13 to 16 bits): the segment's C, B and A ROMs read at ``j = u >> k``,
  ``A + t·(B + C·(t − h))``, one rounding shift and a saturation.

Pipelined like the norms' element chain (:class:`~compilers.rtl.values.Ctx`):
every value the op records (``segment``, ``curve``, ``slope``, ``numerator``,
``output``: each exactly as wide as ``op.ranges()`` proves) or reuses is a
register, so each multiply ends in a register, and :class:`Ctx` adds a register
where an estimated path would outgrow a clock.  L levels (1 for a table; 12 for
the int16 GELU's segments: the offset, the position in the segment and the rounded
level are reused, so they are registers too, and a product whose operands are both
wider than a DSP port is four registered limb products), then the output register: latency L + 1
cycles, one element per clock; the whole chain stalls while the output waits
(``in_ready`` = output empty or taken).
Ports: see :mod:`compilers.rtl.unit`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from amaranth.hdl import Array, Const, Module, Signal, Value, signed

from compilers.rtl.stream import StreamUnit, fmt_shape
from compilers.rtl.values import Ctx, Graph, Hdl, ProvenTrace, const
from qnorm.fixedpoint import bits_for
from qnorm.ops.activation import IntActivation


class Rom(Hdl):
    """One of the op's tables read at an HDL index: a ROM of the values' exact width.

    The index is proven to lie in ``[0, len(values))`` (the op's offsets and segment
    numbers), so its low ``bits(len − 1)`` bits are the address."""

    def __init__(self, values: np.ndarray, index: Hdl) -> None:
        self.values = [int(v) for v in np.asarray(values, dtype=np.int64).reshape(-1)]
        super().__init__(index.graph, self._read, (index,), index.pass_, index.per_row)

    def _read(self, ctx: Ctx, index: Value) -> Value:
        lo, hi = min(self.values), max(self.values)
        if lo == hi:
            return const(lo)
        shape = signed(bits_for(lo, hi))
        address = index.as_unsigned()[: max(1, (len(self.values) - 1).bit_length())]
        return Array(Const(v, shape) for v in self.values)[address]


class ActivationUnit(StreamUnit):
    """An elementwise activation of any stream (see the module docstring)."""

    def __init__(self, op: IntActivation) -> None:
        self._MustUse__silence = True  # Amaranth's unused-unit warning: not for a refused op
        if type(op)._forward is not IntActivation._forward:
            raise NotImplementedError(f"{type(op).__name__} overrides IntActivation._forward, which the RTL unit mirrors")
        self.op = op
        graph = Graph(1)

        def load(name: str, index: Any) -> Hdl:
            return Rom(op.tables[name], index)

        self.trace = ProvenTrace(dict(op.ranges().items))
        self.y: Hdl = op.evaluate(graph.leaf(), load, self.trace)
        self._MustUse__silence = False
        self._make_streams(op.in_fmt, op.out_fmt)
        self.depth = self._depth()

    @property
    def latency(self) -> int:
        """First input accepted to first output valid: the L levels and the output register."""
        return self.depth + 1

    def _depth(self) -> int:
        """L: the register levels of the chain, from a trial elaboration."""
        m = Module()
        m._MustUse__silence = True  # built only to count its levels
        ctx = Ctx(m, Signal(fmt_shape(self.op.in_fmt)), Const(0), pipelined=True, enable=Signal())
        return self.y.staged(ctx)[1]

    def elaborate(self, platform: object) -> Module:
        m = Module()
        advance = ~self.out_valid | self.out_ready
        m.d.comb += self.in_ready.eq(advance)
        ctx = Ctx(m, self.in_data, Const(0), pipelined=True, enable=advance)
        y, level = self.y.staged(ctx)
        if level != self.depth:
            raise RuntimeError(f"{self.op.name}: the chain's depth differs from its trial elaboration")
        valid = ctx.delay(self.in_valid & advance, 0, level)
        with m.If(advance):
            m.d.sync += [self.out_data.eq(y), self.out_valid.eq(valid)]
        return m
