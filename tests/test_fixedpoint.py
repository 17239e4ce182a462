"""The arithmetic specification against exact rational arithmetic."""

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from qnorm import fixedpoint as fp
from qnorm.fixedpoint import Round
from exact_reference import ALL_MODES, exact_round


BOUNDARY = [0, 1, -1, 2, -2, 3, -3, 5, -5, 7, -7, 8, -8, 127, -128, 2**31, -(2**31), 2**62 - 1, -(2**62)]


@pytest.mark.parametrize("mode", ALL_MODES)
def test_rshift_round_boundaries_all_shifts(mode):
    vals = np.array(BOUNDARY + [b + d for b in (2**20, -(2**20)) for d in range(-9, 10)], dtype=np.int64)
    for s in range(0, 63):
        got = fp.rshift_round(vals, s, mode)
        want = [exact_round(Fraction(int(v), 2**s), mode) for v in vals]
        assert got.tolist() == want, (s, mode)


@pytest.mark.parametrize("mode", ALL_MODES)
@given(v=st.integers(-(2**62), 2**62 - 1), s=st.integers(0, 62))
@settings(max_examples=300, deadline=None)
def test_rshift_round_random(mode, v, s):
    assert int(fp.rshift_round(np.array([v]), s, mode)[0]) == exact_round(Fraction(v, 2**s), mode)
    assert fp.rshift_round(v, s, mode) == exact_round(Fraction(v, 2**s), mode)


def test_rshift_round_per_element_shift():
    v = np.array([5, -5, 6, -6, 7, 1000], dtype=np.int64)
    s = np.array([0, 1, 2, 1, 3, 4], dtype=np.int64)
    want = [exact_round(Fraction(int(a), 2 ** int(b)), Round.HALF_UP) for a, b in zip(v, s, strict=True)]
    assert fp.rshift_round(v, s).tolist() == want


@pytest.mark.parametrize("mode", ALL_MODES)
@given(n=st.integers(-(2**62), 2**62 - 1), d=st.integers(1, 2**62))
@settings(max_examples=300, deadline=None)
def test_div_round_random(mode, n, d):
    assert fp.div_round(n, d, mode) == exact_round(Fraction(n, d), mode)
    assert int(fp.div_round(np.array([n]), np.array([d]), mode)[0]) == exact_round(Fraction(n, d), mode)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_div_round_ties_and_negatives(mode):
    ns = np.arange(-50, 51, dtype=np.int64)
    for d in (1, 2, 3, 4, 6, 7, 10):
        got = fp.div_round(ns, d, mode)
        assert got.tolist() == [exact_round(Fraction(int(n), d), mode) for n in ns]


def test_div_round_rejects_non_positive_divisor():
    with pytest.raises(OverflowError, match="divisor"):
        fp.div_round(np.array([3]), np.array([0]))
    with pytest.raises(OverflowError, match="divisor"):
        fp.div_round(3, -2)


def test_operands_must_be_integers():
    with pytest.raises(ValueError, match="integer"):
        fp.rshift_round(np.array([1.5]), 1)
    with pytest.raises(ValueError, match="integer"):
        fp.isqrt(np.array([4.0]))


@pytest.mark.parametrize("bits,signed", [(4, True), (8, True), (8, False), (16, True), (1, False)])
def test_saturate(bits, signed):
    lo, hi = fp.int_range(bits, signed)
    v = np.arange(lo - 40, hi + 40, dtype=np.int64)
    assert fp.saturate(v, bits, signed).tolist() == [min(max(int(x), lo), hi) for x in v]
    assert fp.saturate(hi + 5, bits, signed) == hi


def test_int_range_rejects_bad_width():
    with pytest.raises(ValueError, match="bit width"):
        fp.int_range(0)


def test_bits_for():
    assert fp.bits_for(-128, 127) == 8
    assert fp.bits_for(-129, 127) == 9
    assert fp.bits_for(0, 255) == 9
    assert fp.bits_for(0, 0) == 1


def test_isqrt_exhaustive_below_2_pow_24():
    """Both routes: the arrays' float-seeded one and the digit loop TIR and RTL run."""
    v = np.arange(1 << 24, dtype=np.int64)
    r = fp.isqrt(v, 24)
    assert np.all(r * r <= v) and np.all((r + 1) * (r + 1) > v)
    assert np.array_equal(r, fp.isqrt_digits(v, 24))
    assert np.array_equal(r, fp.isqrt_digits(v))  # the full-range digit loop agrees


def test_isqrt_squares_and_neighbours_whole_range():
    k = np.unique(np.concatenate([np.arange(1, 5000), np.geomspace(1, 2**31, 4000).astype(np.int64)]))
    k = k[k * k <= 2**62]
    for v, want in ((k * k, k), (k * k - 1, k - 1), (k * k + 1, k)):
        ok = (v >= 0) & (v <= 2**62)
        assert fp.isqrt(v[ok]).tolist() == want[ok].tolist()
        assert fp.isqrt_digits(v[ok]).tolist() == want[ok].tolist()
    assert int(fp.isqrt(np.array([2**62]))[0]) == 2**31
    assert int(fp.isqrt_digits(np.array([2**62]))[0]) == 2**31


@given(st.integers(0, 2**62))
@settings(max_examples=2000, deadline=None)
def test_isqrt_random(v):
    assert fp.isqrt(v) == math.isqrt(v)


def test_isqrt_rejects_out_of_range():
    with pytest.raises(OverflowError, match="isqrt"):
        fp.isqrt(np.array([-1]))
    with pytest.raises(OverflowError, match="isqrt"):
        fp.isqrt(np.array([2**62 + 1]))
    with pytest.raises(OverflowError, match="isqrt"):
        fp.isqrt(np.array([17]), max_input_bits=4)


@given(st.integers(0, 2**62))
@settings(max_examples=500, deadline=None)
def test_isqrt_round(v):
    # r is the nearest integer to sqrt(v)  <=>  (r - 1/2)^2 <= v < (r + 1/2)^2
    r = fp.isqrt_round(v)
    assert max(2 * r - 1, 0) ** 2 <= 4 * v < (2 * r + 1) ** 2


def _exact_rsqrt(v: int, f: int, mode: Round) -> int:
    # ceil/floor/half-up of 2^f/sqrt(v) decided by integer comparisons of squares
    lo = math.isqrt((1 << (2 * f)) // v)
    if mode is Round.FLOOR:
        return lo
    if mode is Round.CEIL:
        return lo if lo * lo * v == (1 << (2 * f)) else lo + 1
    # (lo + 1/2)^2 <= 2^2f / v  <=>  v (2lo+1)^2 <= 4 * 2^2f
    return lo + 1 if v * (2 * lo + 1) ** 2 <= 4 << (2 * f) else lo


@pytest.mark.parametrize("mode", fp.RSQRT_MODES)
@given(v=st.integers(1, 2**62), f=st.integers(0, 30))
@settings(max_examples=400, deadline=None)
def test_rsqrt_exact(mode, v, f):
    assert fp.rsqrt(v, f, mode) == _exact_rsqrt(v, f, mode)


@pytest.mark.parametrize("mode", fp.RSQRT_MODES)
def test_rsqrt_small_and_extreme(mode):
    v = np.array([1, 2, 3, 4, 5, 15, 16, 17, 2**40, 2**62 - 1, 2**62], dtype=np.int64)
    for f in (0, 1, 15, 30):
        assert fp.rsqrt(v, f, mode).tolist() == [_exact_rsqrt(int(x), f, mode) for x in v]


def test_rsqrt_rejects():
    with pytest.raises(OverflowError, match="rsqrt"):
        fp.rsqrt(np.array([0]), 10)
    with pytest.raises(ValueError, match="frac_bits"):
        fp.rsqrt(5, 31)
    with pytest.raises(ValueError, match="supports"):
        fp.rsqrt(5, 8, Round.HALF_EVEN)


@pytest.mark.parametrize("mode", ALL_MODES)
@given(d=st.integers(1, 2**40), f=st.integers(0, 61))
@settings(max_examples=200, deadline=None)
def test_reciprocal(mode, d, f):
    assert fp.reciprocal(d, f, mode) == exact_round(Fraction(2**f, d), mode)


@given(x=st.floats(-1e4, 1e4, allow_nan=False), bits=st.integers(4, 32))
@settings(max_examples=300, deadline=None)
@example(x=1e300, bits=32)  # refused at shift 0, far past any int64
def test_dyadic_from_float_is_exact_and_fits(x, bits):
    limit = 1 << (bits - 1)
    try:
        d = fp.Dyadic.from_float(x, bits)
    except ValueError as err:
        assert "does not fit" in str(err)
        assert abs(round(x)) >= limit - 1
        return
    assert abs(d.m) < limit
    assert d.m == math.floor(Fraction(x) * 2**d.s + Fraction(1, 2))
    if d.s < 62 and x != 0:
        # one more bit of shift would overflow the multiplier: the shift is maximal
        assert abs(math.floor(Fraction(x) * 2 ** (d.s + 1) + Fraction(1, 2))) >= limit
        assert d.rel_error(x) <= 2.0 ** -(bits - 2)


def test_dyadic_rejects_nan_inf():
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="NaN and Inf"):
            fp.Dyadic.from_float(bad)


def test_dyadic_mul_matches_fraction():
    d = fp.Dyadic.from_float(0.7071067811865476, 16)
    v = np.arange(-1000, 1001, dtype=np.int64)
    want = [exact_round(Fraction(int(x)) * d.value, Round.HALF_UP) for x in v]
    assert fp.dyadic_mul(v, d.m, d.s).tolist() == want


def test_dyadic_vector_shares_shift():
    ms, s = fp.dyadic_vector(np.array([0.5, -1.25, 0.001, 0.0]), 12)
    assert np.abs(ms).max() < 2**11
    assert ms.tolist() == [math.floor(Fraction(x) * 2**s + Fraction(1, 2)) for x in (0.5, -1.25, 0.001, 0.0)]
    with pytest.raises(ValueError, match="NaN"):
        fp.dyadic_vector(np.array([1.0, np.nan]))


def test_round_parse():
    assert Round.parse("half_even") is Round.HALF_EVEN
    with pytest.raises(ValueError, match="unknown rounding mode"):
        Round.parse("stochastic")


def test_bit_length():
    """Both routes (the arrays' float exponent, the binary search TIR runs), at every
    power of two and its neighbours (where float64 rounding carries 2^k − 1 up)."""
    p = np.array([1 << k for k in range(62)], dtype=np.int64)
    v = np.unique(np.concatenate([[0], p - 1, p, p + 1, [2**62 - 1]]))
    v = v[v < 2**62]
    want = [int(x).bit_length() for x in v]
    assert fp.bit_length(v).tolist() == want and fp.bit_length_search(v, 62).tolist() == want
    small = np.arange(1 << 12, dtype=np.int64)
    assert fp.bit_length(small, 12).tolist() == [int(x).bit_length() for x in small]
    assert fp.bit_length_search(small, 12).tolist() == [int(x).bit_length() for x in small]
    with pytest.raises(OverflowError, match="bit_length"):
        fp.bit_length(np.array([1 << 12]), 12)


def test_same_bodies_on_torch_int64():
    """The QAT layers run these functions on torch tensors: results must be identical."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    v = rng.integers(-(2**40), 2**40, 5000)
    d = rng.integers(1, 2**20, 5000)
    for mode in ALL_MODES:
        assert fp.rshift_round(torch.from_numpy(v), 7, mode).numpy().tolist() == fp.rshift_round(v, 7, mode).tolist()
        assert fp.div_round(torch.from_numpy(v), torch.from_numpy(d), mode).numpy().tolist() == fp.div_round(v, d, mode).tolist()
    u = np.abs(v)
    assert fp.isqrt(torch.from_numpy(u)).numpy().tolist() == fp.isqrt(u).tolist()
    assert fp.rsqrt(torch.from_numpy(d), 20).numpy().tolist() == fp.rsqrt(d, 20).tolist()
    assert fp.bit_length(torch.from_numpy(u)).numpy().tolist() == fp.bit_length(u).tolist()
    assert fp.saturate(torch.from_numpy(v), 8).numpy().tolist() == fp.saturate(v, 8).tolist()
    with pytest.raises(ValueError, match="integer tensor"):
        fp.isqrt(torch.tensor([4.0]))


@pytest.mark.parametrize("mode", fp.RSQRT_MODES)
@given(v=st.integers(1, 2**62), f=st.integers(0, 30), k=st.integers(0, 61))
@settings(max_examples=300, deadline=None)
def test_rsqrt_with_a_declared_minimum_is_unchanged(mode, v, f, k):
    """min_input only shortens the isqrt: the result is the same exact rounding."""
    floor_v = 1 << min(k, v.bit_length() - 1)  # a true lower bound of v
    assert fp.rsqrt(v, f, mode, min_input=floor_v) == _exact_rsqrt(v, f, mode)
    assert fp.rsqrt(np.array([v]), f, mode, min_input=floor_v).tolist() == [_exact_rsqrt(v, f, mode)]


def test_rsqrt_refuses_operands_below_the_declared_minimum():
    with pytest.raises(OverflowError, match="must be >= 16"):
        fp.rsqrt(np.array([15, 16]), 20, min_input=16)
    with pytest.raises(ValueError, match="min_input"):
        fp.rsqrt(5, 10, min_input=0)


# The float extremes and ties: subnormals, the smallest normal, exact halves, 2^-40-scale values.
_EXTREMES = (5e-324, -2.2e-308, 1e-300, 2.5, -2.5, -0.5, 2.0**-40 * 3, 32767.5, -32768.5)


def _at_the_extremes(test):
    """``test`` with every extreme x at 2, 16 and 32 bits and the largest cap as explicit examples."""
    for x in _EXTREMES:
        for bits in (2, 16, 32):
            test = example(x=x, bits=bits, cap=62)(test)
    return test


@given(x=st.floats(-1e6, 1e6, allow_nan=False, allow_subnormal=True), bits=st.integers(2, 32), cap=st.integers(0, 62))
@settings(max_examples=2000, deadline=None)
@_at_the_extremes
def test_dyadic_shift_is_the_largest_fitting_one(x, bits, cap):
    """The closed-form shift equals the plain upward search it replaced (and the double
    arithmetic of ``from_float`` the exact rational's, from subnormals up)."""
    exact, limit = Fraction(x), 1 << (bits - 1)
    if exact == 0 or abs(math.floor(exact + Fraction(1, 2))) >= limit:
        return
    s = 0
    while s < cap and abs(math.floor(exact * 2 ** (s + 1) + Fraction(1, 2))) < limit:
        s += 1
    d = fp.Dyadic.from_float(x, bits, cap)
    assert (d.m, d.s) == (math.floor(exact * 2**s + Fraction(1, 2)), s)
