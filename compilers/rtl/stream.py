"""The streaming ports every RTL unit has, and the order a unit streams an op's array in.

Plain signals: ``in_valid``/``in_ready``/``in_data`` and
``out_valid``/``out_ready``/``out_data``, the data as wide as the op's input and
output formats (the FP16 reference unit: 16-bit fp16 words); a transfer happens on
a clock edge where valid and ready are both high.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from amaranth.hdl import Elaboratable, Shape, ShapeLike, Signal, signed, unsigned

from qnorm.ops.base import IntOp
from qnorm.qformat import QFormat


def fmt_shape(fmt: QFormat) -> Shape:
    """The port shape of an integer format."""
    return signed(fmt.bits) if fmt.signed else unsigned(fmt.bits)


class StreamUnit(Elaboratable):
    """A unit with one input and one output stream."""

    def _make_streams(self, in_fmt: QFormat, out_fmt: QFormat) -> None:
        """The ports of a unit of the op's integers."""
        self._make_stream_ports(fmt_shape(in_fmt), fmt_shape(out_fmt))

    def _make_stream_ports(self, in_shape: ShapeLike, out_shape: ShapeLike) -> None:
        self.in_valid, self.in_ready = Signal(name="in_valid"), Signal(name="in_ready")
        self.in_data = Signal(in_shape, name="in_data")
        self.out_valid, self.out_ready = Signal(name="out_valid"), Signal(name="out_ready")
        self.out_data = Signal(out_shape, name="out_data")

    @property
    def ports(self) -> list[Signal]:
        return [self.in_valid, self.in_ready, self.in_data, self.out_valid, self.out_ready, self.out_data]


def stream_order(op: IntOp, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, Callable[[np.ndarray], np.ndarray]]:
    """The unit's input stream for op-layout ``x``, its start-of-sample flags (neurons)
    and the map from the output stream back to the op's layout.

    Norms and BN units stream ``x`` flattened (channels last); a neuron's
    ``(T, *batch, *P)`` currents stream sample by sample, each sample's T steps of C
    channels, its first element flagged."""
    from qnorm.ops.spiking import _LIFNeuron

    if not isinstance(op, _LIFNeuron):
        return x.reshape(-1), None, lambda out: out.reshape(x.shape)
    t, c = x.shape[0], int(np.prod(op.params.bn.shape))
    samples = x.reshape(t, -1, c).transpose(1, 0, 2)
    first = np.zeros(samples.shape, dtype=bool)
    first[:, 0, 0] = True

    def restore(out: np.ndarray) -> np.ndarray:
        return out.reshape(samples.shape).transpose(1, 0, 2).reshape(x.shape)

    return samples.reshape(-1), first.reshape(-1), restore
