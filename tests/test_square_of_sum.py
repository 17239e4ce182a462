"""(Σx)² in two products whose narrower operands fit a DSP48's 18-bit port
(``qnorm.ops.layernorm.square_of_sum``): the same integer as S·S, and ranges that are
sound for every S of the interval (exact for h and h·(S + l))."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from qnorm.analysis import Interval, RangeReport
from qnorm.ops.layernorm import SQUARE_SPLIT_BITS, square_of_sum, square_of_sum_ranges

K = SQUARE_SPLIT_BITS
# the ends of S that matter: 0, the blocks' edges and their neighbours
EDGES = [m * (1 << K) + d for m in (-3, -1, 0, 1, 2) for d in (-(1 << (K - 1)) - 1, -(1 << (K - 1)), -1, 0, 1)]


@settings(max_examples=300, deadline=None)
@given(
    start=st.one_of(st.integers(-(1 << 31), 1 << 31), st.sampled_from(EDGES)),  # |Σx| <= 2^31: int16 rows of 65536
    width=st.one_of(st.integers(0, 64), st.integers(0, 3 << K)),
)
def test_the_parts_give_s_squared_and_their_ranges_hold(start: int, width: int) -> None:
    s = np.arange(start, start + width + 1, dtype=np.int64)[:, None]
    trace: dict[str, np.ndarray] = {}
    assert np.array_equal(square_of_sum(s, trace), s * s)
    rep = RangeReport("square")
    rep.add("sum", Interval(start, start + width))
    square_of_sum_ranges(rep)
    for name in ("sum_high", "sum_low", "square_high", "square_low", "sum_squared"):
        seen = trace[name]
        assert rep[name].lo <= seen.min() and seen.max() <= rep[name].hi, name
    for name in ("sum_high", "square_high"):
        assert (rep[name].lo, rep[name].hi) == (trace[name].min(), trace[name].max()), name
    assert -(1 << (K - 1)) <= rep["sum_low"].lo and rep["sum_low"].hi < 1 << (K - 1)  # an 18-bit port


def test_short_int8_rows_keep_the_one_product() -> None:
    """|S| < 2^17 (int8 rows up to 1024): h = 0 and l = S, so S·S as before."""
    rep = RangeReport("square")
    rep.add("sum", Interval(-128 * 1024, 127 * 1024))
    square_of_sum_ranges(rep)
    assert (rep["sum_high"].lo, rep["sum_high"].hi) == (0, 0) and (rep["square_high"].lo, rep["square_high"].hi) == (0, 0)
    assert (rep["sum_low"].lo, rep["sum_low"].hi) == (-128 * 1024, 127 * 1024)
