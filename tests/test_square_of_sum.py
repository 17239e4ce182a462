"""(Σx)² in two products whose narrower operands fit a DSP48's 18-bit port
(``qnorm.ops.layernorm.square_of_sum``): the same integer as S·S, and ranges that are
sound for every S of the interval (exact for h and h·(S + l))."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from qnorm.analysis import Interval, RangeReport, products
from qnorm.ops import IntLayerNorm
from qnorm.ops.layernorm import SQUARE_SPLIT_BITS, square_of_sum, square_of_sum_ranges, sum_split
from qnorm.qformat import QFormat

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
    for name in ("sum_high", "sum_low", "square_high", "square_low"):
        seen = trace[name]
        assert rep[name].lo <= seen.min() and seen.max() <= rep[name].hi, name
    for name in ("sum_high", "square_high"):
        assert (rep[name].lo, rep[name].hi) == (trace[name].min(), trace[name].max()), name
    assert -(1 << (K - 1)) <= rep["sum_low"].lo and rep["sum_low"].hi < 1 << (K - 1)  # an 18-bit port


def test_only_a_sum_that_can_leave_the_port_is_split() -> None:
    """Int8 rows of up to 1024 keep the one product S·S (|S| <= 2^17 fits the port's
    18 signed bits); from 1025 on, and for int16 rows of 5, S² is two products."""
    for n, bits, split in ((1024, 8, False), (1025, 8, True), (4, 16, False), (5, 16, True), (65536, 4, True)):
        op = IntLayerNorm.from_float(np.ones(n), None, 1e-5, QFormat(bits, 0.05))
        assert sum_split(op.config) is split, (n, bits)
        rep = op.ranges()
        assert ("square_low" in rep.items) is split and "sum_squared" in rep.items
        labels = [p.label for p in products(op)]
        assert ("sum_squared = sum·sum" in labels) is not split
        assert ("square_low = sum_low·sum_low" in labels) is split
        fmt = QFormat(bits, 0.05)
        x = np.array([[fmt.lo] * n, [fmt.hi] * n], dtype=np.int64)
        trace: dict[str, np.ndarray] = {}
        op.forward(x, trace)
        assert np.array_equal(trace["sum_squared"], trace["sum"] ** 2)
