"""Static range analysis: exact integer intervals for every intermediate of an op.

Each op builds a :class:`RangeReport` from its config alone (bit widths, row length,
quantized parameters).  Construction refuses any config whose intermediates would
not fit int64; a target can ask for a narrower accumulator (``check(acc_bits=32)``).
Bounds are exact Python-int intervals, so they hold for every input the declared
formats admit; the tests construct inputs that reach them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from qnorm.fixedpoint import DEFAULT_ROUND, Round, bits_for, div_round, int_range, rshift_round


# fixedpoint's rounding adds a half before shifting and doubles remainders, so its
# operands live in [-2^62, 2^62): one bit of an int64 is headroom, not range.
SAFE_INT64_BITS = 63


class OverflowRiskError(ValueError):
    """A config whose intermediates cannot be proven to fit the accumulator."""


@dataclass(frozen=True)
class Interval:
    """Closed integer interval [lo, hi] (exact, unbounded Python ints)."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if self.lo > self.hi:
            raise ValueError(f"empty interval [{self.lo}, {self.hi}]")

    @classmethod
    def point(cls, v: int) -> "Interval":
        return cls(int(v), int(v))

    @classmethod
    def of_width(cls, bits: int, signed: bool = True) -> "Interval":
        return cls(*int_range(bits, signed))

    @classmethod
    def hull(cls, *values: int) -> "Interval":
        return cls(min(int(v) for v in values), max(int(v) for v in values))

    def __add__(self, o: "Interval | int") -> "Interval":
        o = _iv(o)
        return Interval(self.lo + o.lo, self.hi + o.hi)

    __radd__ = __add__

    def __neg__(self) -> "Interval":
        return Interval(-self.hi, -self.lo)

    def __sub__(self, o: "Interval | int") -> "Interval":
        return self + (-_iv(o))

    def __rsub__(self, o: "Interval | int") -> "Interval":
        return _iv(o) - self

    def __mul__(self, o: "Interval | int") -> "Interval":
        o = _iv(o)
        return Interval.hull(self.lo * o.lo, self.lo * o.hi, self.hi * o.lo, self.hi * o.hi)

    __rmul__ = __mul__

    def square(self) -> "Interval":
        """x*x for one x (tighter than self * self when 0 is inside)."""
        a = self.abs()
        return Interval(a.lo * a.lo, a.hi * a.hi)

    def abs(self) -> "Interval":
        if self.lo >= 0:
            return self
        if self.hi <= 0:
            return -self
        return Interval(0, max(-self.lo, self.hi))

    def union(self, o: "Interval") -> "Interval":
        return Interval(min(self.lo, o.lo), max(self.hi, o.hi))

    def clamp(self, lo: int, hi: int) -> "Interval":
        return Interval(min(max(self.lo, lo), hi), max(min(self.hi, hi), lo))

    def rshift(self, s: int, mode: Round | str = DEFAULT_ROUND) -> "Interval":
        """Bounds of a rounding right shift (monotone, so endpoints suffice)."""
        return Interval(rshift_round(self.lo, s, mode), rshift_round(self.hi, s, mode))

    def div(self, d: "Interval | int", mode: Round | str = DEFAULT_ROUND) -> "Interval":
        """Bounds of ``div_round(self, d)`` for a positive divisor interval."""
        d = _iv(d)
        if d.lo <= 0:
            raise ValueError(f"divisor interval [{d.lo}, {d.hi}] must be positive")
        corners = [div_round(n, q, mode) for n in (self.lo, self.hi) for q in (d.lo, d.hi)]
        return Interval.hull(*corners)

    def map_monotone(self, f: Callable[[int], int], increasing: bool = True) -> "Interval":
        a, b = f(self.lo), f(self.hi)
        return Interval(a, b) if increasing else Interval(b, a)

    @property
    def bits(self) -> int:
        """Signed two's-complement width needed to hold every value."""
        return bits_for(self.lo, self.hi)

    def __contains__(self, v: int) -> bool:
        return self.lo <= v <= self.hi


def _iv(v: "Interval | int") -> Interval:
    return v if isinstance(v, Interval) else Interval.point(v)


class RangeReport:
    """Named intervals of one op config, in evaluation order."""

    def __init__(self, op: str) -> None:
        self.op = op
        self.items: dict[str, Interval] = {}

    def add(self, name: str, interval: Interval) -> Interval:
        if name in self.items:
            raise ValueError(f"{self.op}: intermediate {name!r} recorded twice")
        self.items[name] = interval
        return interval

    def __getitem__(self, name: str) -> Interval:
        return self.items[name]

    def widths(self) -> dict[str, int]:
        return {k: v.bits for k, v in self.items.items()}

    @property
    def max_bits(self) -> int:
        return max(self.widths().values(), default=1)

    def check(self, acc_bits: int = SAFE_INT64_BITS) -> "RangeReport":
        """Refuse the config if any intermediate needs more than ``acc_bits`` bits."""
        for name, iv in self.items.items():
            if iv.bits > acc_bits:
                raise OverflowRiskError(
                    f"{self.op}: intermediate {name!r} spans [{iv.lo}, {iv.hi}], which needs "
                    f"{iv.bits} bits, but only {acc_bits}-bit integers are available; "
                    "reduce the row length or the bit widths, or pick a target with wider accumulators"
                )
        return self

    def table(self) -> str:
        rows = [f"| {k} | {v.lo} | {v.hi} | {v.bits} |" for k, v in self.items.items()]
        return "\n".join([f"| {self.op} intermediate | min | max | bits |", "|---|---|---|---|", *rows])
