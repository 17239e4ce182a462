"""Static range analysis: exact integer intervals for every intermediate of an op.

Each op builds a :class:`RangeReport` from its config alone (bit widths, row length,
quantized parameters).  Construction refuses any config whose intermediates would
not fit int64; a target can ask for a narrower accumulator (``check(acc_bits=32)``),
and :func:`check_target` applies a target description's accumulator and
multiplier widths (which intermediates each bounds: the "target limits" section).
Bounds are exact Python-int intervals, so they hold for every input the declared
formats admit; the tests construct inputs that reach them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from qnorm.errors import QnormError
from qnorm.fixedpoint import DEFAULT_ROUND, Round, bits_for, div_round, int_range, rshift_round


# fixedpoint's rounding adds a half before shifting and doubles remainders, so its
# operands live in [-2^62, 2^62): one bit of an int64 is headroom, not range.  An
# intermediate marked ``unrounded`` is never such an operand (it only feeds exact
# additions and subtractions) and may fill the accumulator: int64's [-2^63, 2^63).
SAFE_INT64_BITS = 63


class OverflowRiskError(QnormError, ValueError):
    """A config whose intermediates cannot be proven to fit the accumulator."""


@dataclass(frozen=True)
class Interval:
    """Closed integer interval [lo, hi] (exact, unbounded Python ints).

    ``unrounded``: the value it bounds is an operand of exact additions and
    subtractions only, never of fixedpoint's rounding, so a check lets it use the
    accumulator's headroom bit too (:meth:`RangeReport.check`, :func:`check_target`).
    Only a report entry is marked (:meth:`as_unrounded`); every interval computed
    from one is an ordinary interval again.
    """

    lo: int
    hi: int
    unrounded: bool = field(default=False, compare=False, kw_only=True)

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

    def as_unrounded(self) -> "Interval":
        """This interval, marked as bounding a value no rounding takes as an operand."""
        return replace(self, unrounded=True)

    def fits(self, headroom_bits: int) -> bool:
        """Whether it fits ``headroom_bits``-bit integers (one bit more when unrounded)."""
        return self.bits <= headroom_bits + self.unrounded

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
        """Refuse the config if any intermediate needs more than ``acc_bits`` bits
        (``acc_bits + 1`` for an unrounded one: ``acc_bits`` keeps a bit of headroom)."""
        for name, iv in self.items.items():
            if not iv.fits(acc_bits):
                raise OverflowRiskError(
                    f"{self.op}: intermediate {name!r} spans [{iv.lo}, {iv.hi}], which needs "
                    f"{iv.bits} bits, but only {acc_bits}-bit integers are available; "
                    "reduce the row length or the bit widths, or pick a target with wider accumulators"
                )
        return self

    def table(self) -> str:
        rows = [f"| {k} | {v.lo} | {v.hi} | {v.bits} |" for k, v in self.items.items()]
        return "\n".join([f"| {self.op} intermediate | min | max | bits |", "|---|---|---|---|", *rows])


# --------------------------------------------------------------------------- target limits
#
# What a target's ``[hardware]`` widths mean, and which intermediates each one bounds:
#
# * ``accumulator_bits`` — the widest two's-complement value the target's datapath
#   adds, subtracts, compares and holds as one value, as the target description
#   deploys kernels (64 on CPUs; on the FPGA one DSP48E2 accumulator, the 48-bit P
#   register).  **Accumulators** are every named intermediate of ``op.ranges()``
#   (row sums, per-row statistics, per-element sums, products, outputs) and the
#   result of every product below, named or not.  Each must fit
#   ``accumulator_bits - 1`` bits: fixedpoint's rounding adds a half before a
#   shift and doubles remainders, so one bit is headroom (as SAFE_INT64_BITS is
#   for int64); an intermediate no rounding takes (``Interval.unrounded``) may
#   use that bit too.  A norm's per-row multiplier and offset in the narrow lanes
#   are a0 and c0 shifted left by the row's ``up`` and consumed modulo 2^lanes;
#   on a target whose kernels take them so (``wraps_lane_constants``) the
#   accumulators are a0 and c0 (``op.lane_wrapped()``), the shift being wiring.
# * ``multiplier_bits`` — the narrow operand width of one hardware multiply (the
#   18-bit port of a 27x18 DSP48E2; 64 on CPUs).  **Products** are the
#   multiplications of an op's body, which its class lists (``multiplications``)
#   and :func:`products` bounds, both operands' intervals.  A product is exact on the target when its
#   narrower operand fits ``multiplier_bits`` and its result fits the
#   accumulator: the wider operand then goes through the multiplier in slices
#   whose partial products the accumulator sums (the DSP48E2 cascade with its
#   17-bit shift).  Both operands wider than ``multiplier_bits`` needs a
#   multi-word product the target does not declare: refused.
#
# Shifts (by constants or per-row amounts) are not products.  The per-row
# inverse (``rsqrt`` / ``reciprocal``: one division, an isqrt and one r·r) is a
# sequential unit whose internals are not named intermediates and are not
# checked; ``has_divider`` is a cost hint for picking a norm variant, not an
# exactness limit (a divider built from LUTs is exact, only slow).


class TargetLimitError(OverflowRiskError):
    """A config whose accumulators or products exceed what a target declares."""


@dataclass(frozen=True)
class Product:
    """One multiplication of an op's body: ``a * b`` with both operands' bounds.

    ``intermediate`` names the range-report entry the product *is* (its proven
    bound, often tighter than ``a * b``); None for a product that only feeds one
    (x·x inside a row sum), whose bound is then ``a * b``.
    """

    formula: str  # how it is formed, for messages (e.g. "N·sum_sq")
    a: Interval
    b: Interval
    intermediate: str | None
    result: Interval

    @property
    def narrow_bits(self) -> int:
        return min(self.a.bits, self.b.bits)

    @property
    def label(self) -> str:
        return self.formula if self.intermediate is None else f"{self.intermediate} = {self.formula}"


def _product(rep: RangeReport, formula: str, a: Interval, b: Interval, intermediate: str | None = None) -> Product:
    return Product(formula, a, b, intermediate, a * b if intermediate is None else rep[intermediate])


def _square(formula: str, a: Interval) -> Product:
    """``a * a`` of one value (never negative: tighter than two independent operands)."""
    return Product(formula, a, a, None, a.square())


def _interval_of(values: Any) -> Interval:
    return Interval.hull(*(int(v) for v in np.asarray(values).ravel()))


def _in_interval(op: Any) -> Interval:
    return Interval(op.in_fmt.lo, op.in_fmt.hi)


def _membrane_leak(op: Any, rep: RangeReport) -> Product | None:
    if op.cfg.leak is None:
        return None
    state = rep["membrane_reset"].union(Interval.point(op.cfg.u_rest))
    return _product(rep, "membrane·leak", state, Interval.point(op.cfg.leak.m), "leak_product")


def _segment_curve(op: Any, rep: RangeReport) -> Product | None:
    """C·(t − h) of an activation's segment quadratic (:mod:`qnorm.ops.activation`); None for a table."""
    if op.segments is None:
        return None
    half = 1 << (op.segments.bits - 1)
    return _product(rep, "C·(t−h)", rep["segment_const_c"], Interval(-half, half - 1), "curve")


def _segment_slope(op: Any, rep: RangeReport) -> Product | None:
    """t·(B + C·(t − h)) of the same quadratic; None for a table."""
    if op.segments is None:
        return None
    return _product(rep, "t·slope", Interval(0, (1 << op.segments.bits) - 1), rep["slope"])


def _offset_fraction(op: Any, rep: RangeReport) -> Product | tuple[Product, ...]:
    """round(D·a0 / N) of a norm's offset: D·a0, or where the op splits it at k
    (qnorm.ops._normcore.offset_fraction) D·(a0 >> k), then D·(a0 mod 2^k) accumulated
    onto ρ·2^k (ρ < N): a multiply-accumulate whose result stays below N·2^(k+1)."""
    d, consts = Interval(0, op.config.n - 1), op.row_constants()
    k = consts.offset_split
    if not k:
        return _product(rep, "D·a0 (in offset)", d, consts.mult)
    low = Interval(0, (1 << k) - 1)
    return (
        _product(rep, "D·(a0 >> k) (in offset)", d, Interval(consts.mult.lo >> k, consts.mult.hi >> k)),
        Product("ρ·2^k + D·(a0 mod 2^k) (in offset)", d, low, None, Interval(0, (d.hi << k) + d.hi * low.hi)),
    )


# How each multiplication an op body can make is formed, by the name an op class
# lists in its ``multiplications`` (the op declares which it makes, next to its
# body; the analysis bounds them from the range report).  None: not made by this
# instance (a LIF neuron without leak).
_FORMULAS: dict[str, Callable[[Any, RangeReport], Product | tuple[Product, ...] | None]] = {
    "centered": lambda op, rep: _product(rep, "N·x (in centered)", Interval.point(op.config.n), _in_interval(op)),
    "sum_sq": lambda op, rep: _square("x·x (in sum_sq)", _in_interval(op)),
    "n_sum_sq": lambda op, rep: _product(rep, "N·sum_sq", Interval.point(op.config.n), rep["sum_sq"], "n_sum_sq"),
    # (Σx)²: S·S, or where S can leave an 18-bit port two products (qnorm.ops.layernorm.square_of_sum)
    "sum_squared": lambda op, rep: (
        None if "square_low" in rep.items else _product(rep, "sum·sum", rep["sum"], rep["sum"], "sum_squared")
    ),
    "square_high": lambda op, rep: (
        _product(rep, "sum_high·(sum + sum_low)", rep["sum_high"], rep["sum"] + rep["sum_low"], "square_high")
        if "square_high" in rep.items
        else None
    ),
    "square_low": lambda op, rep: (
        _product(rep, "sum_low·sum_low", rep["sum_low"], rep["sum_low"], "square_low")
        if "square_low" in rep.items
        else None
    ),
    # stage 3 per row (qnorm.ops._normcore.row_affine_parts): N·r, shifted right by j_r into
    # a0; c0 = a0·m + round(D·a0 / N) with m = floor(Σx / N), D = Σx − N·m in [0, N); then a
    # and c are a0 and c0 shifted left by up
    "mult": lambda op, rep: _product(
        rep, f"N·{op.inverse_name} (in mult)", Interval.point(op.config.num_mult), rep[op.inverse_name]
    ),
    "offset": lambda op, rep: _product(rep, "a0·mean (in offset)", op.row_constants().mult, _in_interval(op)),
    "offset_fraction": lambda op, rep: _offset_fraction(op, rep),
    "xa": lambda op, rep: _product(rep, "x·mult", _in_interval(op), rep["mult"], "xa"),
    "scaled": lambda op, rep: _product(rep, "zc·gain", rep["zc"], _interval_of(op.config.gain), "scaled"),
    "x_slope": lambda op, rep: _product(rep, "x·slope", _in_interval(op), _interval_of(op._slope), "bn_product"),
    "membrane_leak": _membrane_leak,
    "segment_curve": _segment_curve,
    "segment_slope": _segment_slope,
    # softmax: the two digits' table entries (int16 logits only), then e·r
    "exp_product": lambda op, rep: (
        _product(rep, "exp_lo·exp_hi", *(_interval_of(t) for t in op.tables), "exp_product")
        if "exp_product" in rep.items
        else None
    ),
    "prob_product": lambda op, rep: _product(rep, "exp·recip", rep["exp"], rep["recip"], "prob_product"),
    "membrane_slope": lambda op, rep: _product(
        rep, "membrane·slope", rep["membrane"], _interval_of(op._slope), "bn_product"
    ),
}


def products(op: Any, rep: RangeReport | None = None) -> list[Product]:
    """Every multiplication of ``op``'s integer body (``rep``: its range report, if at hand),
    as the op's class lists them in ``multiplications``.

    An op class that lists none is refused rather than assumed product-free.
    """
    names = getattr(type(op), "multiplications", None)
    if names is None:
        raise ValueError(
            f"op {op.name!r} does not list its multiplications ({type(op).__name__}.multiplications)"
        )
    unknown = [n for n in names if n not in _FORMULAS]
    if unknown:
        raise ValueError(f"op {op.name!r} lists multiplications the analysis cannot bound: {unknown}")
    rep = op.ranges() if rep is None else rep
    made = (_FORMULAS[name](op, rep) for name in names)
    return [p for m in made if m is not None for p in (m if isinstance(m, tuple) else (m,))]


def check_target(op: Any, target: Any) -> RangeReport:
    """Refuse ``op`` if ``target`` (a :class:`qnorm.targets.Target`) cannot compute it
    exactly with its declared accumulator and multiplier widths (the rules above).

    Returns the op's range report; raises :class:`TargetLimitError` naming the op,
    the intermediate, its bits and the target's limit.
    """
    hw, rep = target.hardware, op.ranges()
    prods = products(op, rep)
    where = f"{target.name} ({target.path})"
    limit = hw.accumulator_bits - 1
    # where the target takes them modulo its lanes, an op's shifted per-row constants
    # are held as the values accumulated before their shift
    wrapped = op.lane_wrapped() if hw.wraps_lane_constants and hasattr(op, "lane_wrapped") else {}
    named = [(f"{n} before its left shift" if n in wrapped else n, wrapped.get(n, iv)) for n, iv in rep.items.items()]
    held = [*named, *((p.formula, p.result) for p in prods if p.intermediate is None)]
    for name, iv in held:
        if not iv.fits(limit):
            holds = (
                f"{hw.accumulator_bits}-bit accumulator holds {hw.accumulator_bits}"
                if iv.unrounded
                else f"{hw.accumulator_bits}-bit accumulator holds {limit} (hardware.accumulator_bits "
                "less one bit of rounding headroom)"
            )
            raise TargetLimitError(
                f"{op.name} cannot run exactly on {where}: intermediate {name!r} spans "
                f"[{iv.lo}, {iv.hi}], which needs {iv.bits} bits, but the target's {holds}; "
                "shorten the row, narrow the formats, or pick a target with wider accumulators"
            )
    for p in prods:
        if p.narrow_bits > hw.multiplier_bits:
            raise TargetLimitError(
                f"{op.name} cannot run exactly on {where}: product {p.label!r} multiplies "
                f"[{p.a.lo}, {p.a.hi}] ({p.a.bits} bits) by [{p.b.lo}, {p.b.hi}] ({p.b.bits} bits), "
                f"but the target's multiplier takes at most {hw.multiplier_bits} bits on its "
                "narrow side (hardware.multiplier_bits); narrow the formats or pick a target "
                "with a wider multiplier"
            )
    return rep
