"""The BN + activation units (MultiThreshold, BNQuant): one element per clock.

The op's own ``_forward`` runs on an :class:`~compilers.rtl.values.Hdl` element
that stands for one channel of the (rows, C) array: its per-channel constants
(thresholds and their directions, or BN slope, offset and denominator) become
ROMs read at the element's channel, a counter that wraps at C.

* MultiThreshold: L−1 compares against the channel's thresholds and a count
  (no multiplier, no divider): the hardware form of BN + quantizer.
* BNQuant: ``div_round(P·x + Q, D)`` with the channel's P, Q, D — a
  combinational divider (the unfolded definition; MultiThreshold is the form to
  deploy).

Combinational from ``in_data`` to the output register: latency 1 cycle, one
element per clock; ``in_ready`` follows ``out_ready`` (or an empty output
register).  Ports: see :mod:`compilers.rtl.unit`.
"""

from __future__ import annotations

import numpy as np
from amaranth.hdl import Module, Signal

from compilers.rtl.stream import StreamUnit
from compilers.rtl.values import Ctx, Graph, ProvenTrace
from qnorm.ops.multithreshold import BNQuant, MultiThreshold


class ElementwiseUnit(StreamUnit):
    """A per-channel map of a (rows, C) stream (see the module docstring)."""

    latency = 1

    def __init__(self, op: MultiThreshold | BNQuant) -> None:
        for cls in (MultiThreshold, BNQuant):
            if isinstance(op, cls) and type(op)._forward is not cls._forward:
                raise NotImplementedError(f"{type(op).__name__} overrides {cls.__name__}._forward")
        self.op = op
        self.channels = int(np.prod(op.bn.shape))
        graph = Graph(1, tuple(op.bn.shape))
        self.y = op._forward(graph.leaf(), ProvenTrace(dict(op.ranges().items)))
        self._make_streams(op.in_fmt, op.out_fmt)

    def elaborate(self, platform: object) -> Module:
        m = Module()
        chan = Signal(range(self.channels), name="chan")
        y = self.y.value(Ctx(m, self.in_data, chan))
        m.d.comb += self.in_ready.eq(~self.out_valid | self.out_ready)
        step = self.in_valid & self.in_ready
        with m.If(step):
            m.d.sync += [self.out_data.eq(y), self.out_valid.eq(1)]
            with m.If(chan == self.channels - 1):
                m.d.sync += chan.eq(0)
            with m.Else():
                m.d.sync += chan.eq(chan + 1)
        with m.Elif(self.out_ready):
            m.d.sync += self.out_valid.eq(0)
        return m
