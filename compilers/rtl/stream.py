"""The streaming ports every integer RTL unit has.

Plain signals: ``in_valid``/``in_ready``/``in_data`` and
``out_valid``/``out_ready``/``out_data``, the data as wide as the op's input and
output formats; a transfer happens on a clock edge where valid and ready are both
high.
"""

from __future__ import annotations

from amaranth.hdl import Elaboratable, Shape, Signal, signed, unsigned

from qnorm.qformat import QFormat


def fmt_shape(fmt: QFormat) -> Shape:
    """The port shape of an integer format."""
    return signed(fmt.bits) if fmt.signed else unsigned(fmt.bits)


class StreamUnit(Elaboratable):
    """A unit with one input and one output stream of the op's integers."""

    def _make_streams(self, in_fmt: QFormat, out_fmt: QFormat) -> None:
        self.in_valid, self.in_ready = Signal(name="in_valid"), Signal(name="in_ready")
        self.in_data = Signal(fmt_shape(in_fmt), name="in_data")
        self.out_valid, self.out_ready = Signal(name="out_valid"), Signal(name="out_ready")
        self.out_data = Signal(fmt_shape(out_fmt), name="out_data")

    @property
    def ports(self) -> list[Signal]:
        return [self.in_valid, self.in_ready, self.in_data, self.out_valid, self.out_ready, self.out_data]
