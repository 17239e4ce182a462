"""The LIF neuron units (FoldedLIFNeuron, MPBNNeuron): one element per clock.

One time step of one neuron per clock, from the op's own public step
functions run on :class:`~compilers.rtl.values.Hdl` values::

    prev = u_rest at time step 0, else the channel's stored membrane
    pre  = neuron.charge(prev, cur)     # leak (dyadic multiply), add, saturate
    fire = neuron.fires(pre)            # folded: one compare with the channel's
                                        # threshold (direction from γ's sign);
                                        # unfolded: P·u + Q against the exact bound
    post = neuron.reset(pre, fire)      # hard: u_rest; soft: saturate(pre − R)

The membranes live in a C-entry memory of the membrane width (written with
``post``, read for the channel's next time step); per-channel constants are
ROMs.  Stream order per sample: T time steps of C channels; ``in_first`` marks
the sample's first element.  Latency 1 cycle (input to output register), one
element per clock.  Ports: see :mod:`compilers.rtl.unit`.
"""

from __future__ import annotations

import numpy as np
from amaranth.hdl import Module, Signal, signed
from amaranth.lib.memory import Memory

from compilers.rtl.stream import StreamUnit
from compilers.rtl.values import Ctx, Graph, Hdl
from qnorm import fixedpoint as fp
from qnorm.ops.spiking import _LIFNeuron


class NeuronUnit(StreamUnit):
    """C neurons, time-multiplexed (see the module docstring)."""

    latency = 1

    def __init__(self, op: _LIFNeuron) -> None:
        cls = type(op)
        for name in ("charge", "fires", "reset"):
            if getattr(cls, name) is not getattr(_LIFNeuron, name):
                raise NotImplementedError(f"{cls.__name__} overrides _LIFNeuron.{name}, which the RTL unit runs")
        self.op = op
        self.channels = int(np.prod(op.params.bn.shape))
        graph = Graph(1, tuple(op.params.bn.shape))
        cur, state, first = graph.leaf(), graph.leaf("state"), graph.leaf("first")
        prev = fp.select(first, op.cfg.u_rest, state)
        pre = op.charge(prev, cur)
        fire = op.fires(pre)
        self.post: Hdl = op.reset(pre, fire)
        self.spike: Hdl = fp.select(fire, 1, 0)
        self._make_streams(op.in_fmt, op.out_fmt)
        self.in_first = Signal(name="in_first")  # high with a sample's first element

    @property
    def ports(self) -> list[Signal]:
        return [*super().ports, self.in_first]

    def elaborate(self, platform: object) -> Module:
        m = Module()
        c_count = self.channels
        chan = Signal(range(c_count), name="chan_next")
        step0 = Signal(name="step0_next")  # the next element is still in time step 0
        here = Signal(range(c_count), name="chan")
        first = Signal(name="first")
        m.d.comb += [here.eq(0), first.eq(1)]
        with m.If(~self.in_first):
            m.d.comb += [here.eq(chan), first.eq(step0)]

        m.submodules.membrane = mem = Memory(shape=signed(self.op.cfg.membrane_bits), depth=c_count, init=[])
        rd, wr = mem.read_port(domain="comb"), mem.write_port()
        m.d.comb += rd.addr.eq(here)
        ctx = Ctx(m, self.in_data, here, extra={"state": rd.data, "first": first})
        post, spike = self.post.value(ctx), self.spike.value(ctx)

        m.d.comb += self.in_ready.eq(~self.out_valid | self.out_ready)
        step = self.in_valid & self.in_ready
        m.d.comb += [wr.addr.eq(here), wr.data.eq(post), wr.en.eq(step)]
        with m.If(step):
            m.d.sync += [self.out_data.eq(spike), self.out_valid.eq(1)]
            with m.If(here == c_count - 1):
                m.d.sync += [chan.eq(0), step0.eq(0)]
            with m.Else():
                m.d.sync += [chan.eq(here + 1), step0.eq(first)]
        with m.Elif(self.out_ready):
            m.d.sync += self.out_valid.eq(0)
        return m
