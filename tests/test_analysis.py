import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qnorm.analysis import Interval, OverflowRiskError, RangeReport
from qnorm.fixedpoint import Round, div_round, rshift_round

small = st.integers(-50, 50)


@st.composite
def intervals(draw):
    a, b = sorted((draw(small), draw(small)))
    return Interval(a, b)


def _points(iv: Interval) -> range:
    return range(iv.lo, iv.hi + 1)


@given(intervals(), intervals())
def test_arithmetic_is_sound_and_exact_on_corners(a, b):
    for op in ("__add__", "__sub__", "__mul__"):
        got = getattr(a, op)(b)
        vals = [getattr(x, op)(y) for x, y in itertools.product(_points(a), _points(b))]
        assert (got.lo, got.hi) == (min(vals), max(vals))


@given(intervals())
def test_unary_bounds_are_exact(a):
    assert (a.square().lo, a.square().hi) == (min(x * x for x in _points(a)), max(x * x for x in _points(a)))
    assert (a.abs().lo, a.abs().hi) == (min(abs(x) for x in _points(a)), max(abs(x) for x in _points(a)))
    r = a.rshift(2, Round.HALF_UP)
    vals = [rshift_round(x, 2) for x in _points(a)]
    assert (r.lo, r.hi) == (min(vals), max(vals))


@given(intervals(), st.integers(1, 20), st.integers(0, 20))
def test_division_bounds(a, d0, extra):
    d = Interval(d0, d0 + extra)
    got = a.div(d)
    vals = [div_round(x, y) for x in _points(a) for y in _points(d)]
    assert (got.lo, got.hi) == (min(vals), max(vals))


def test_division_needs_positive_divisor():
    with pytest.raises(ValueError, match="positive"):
        Interval(1, 2).div(Interval(0, 3))


def test_bits_and_empty():
    assert Interval(-128, 127).bits == 8
    assert Interval.of_width(16).bits == 16
    assert Interval(0, 255).bits == 9
    with pytest.raises(ValueError, match="empty"):
        Interval(3, 2)


def test_report_refuses_with_name_and_numbers():
    rep = RangeReport("demo-op")
    rep.add("sum_sq", Interval(0, 2**40))
    rep.add("x", Interval(-128, 127))
    assert rep.check(64) is rep
    assert rep.widths() == {"sum_sq": 42, "x": 8}
    with pytest.raises(OverflowRiskError, match=r"demo-op: intermediate 'sum_sq' spans \[0, 1099511627776\], which needs 42 bits, but only 32-bit"):
        rep.check(32)
    with pytest.raises(ValueError, match="twice"):
        rep.add("x", Interval(0, 1))
    assert "| sum_sq | 0 | 1099511627776 | 42 |" in rep.table()
