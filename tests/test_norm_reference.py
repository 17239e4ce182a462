"""The numpy golden norms against slow per-row re-implementations in Python ints.

The slow models below restate each integer algorithm from its docstring with
unbounded Python ints and exact ``Fraction`` rounding, one row at a time, without
numpy and without :mod:`qnorm.fixedpoint` — so an int64 wrap, a broadcasting slip
or a misuse of a fixedpoint primitive in a golden model shows up as a mismatch.
"""

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qnorm.fixedpoint import Round
from qnorm.ops import IntLayerNorm, IntRMSNorm, L1LayerNorm, ShiftLayerNorm
from qnorm.ops.shiftnorm import TWO_TERM_FRAC
from qnorm.qformat import QFormat
from exact_reference import ALL_MODES, exact_round


def exact_rsqrt(m: int, f: int, mode: Round) -> int:
    """2^f / sqrt(m) rounded by mode, decided on squares (a tie would need m(2r+1)^2 = 4^(f+1))."""
    r = math.isqrt((1 << (2 * f)) // m)
    while (r + 1) ** 2 * m <= 1 << (2 * f):
        r += 1
    while r * r * m > 1 << (2 * f):
        r -= 1
    if mode in (Round.FLOOR, Round.TRUNC):
        return r
    if mode is Round.CEIL:
        return r + (r * r * m != 1 << (2 * f))
    assert m * (2 * r + 1) ** 2 != 4 << (2 * f)
    return r + (m * (2 * r + 1) ** 2 < 4 << (2 * f))


def shift_candidates(terms: int) -> tuple[int, list[int]]:
    """Every value 2^a or 2^a ± 2^b (b < a <= frac + 1), no pruning: (frac, values)."""
    if terms == 1:
        return 0, [1]
    frac = TWO_TERM_FRAC
    vals = {1 << a for a in range(frac + 2)}
    vals |= {(1 << a) + s * (1 << b) for a in range(1, frac + 2) for b in range(a) for s in (1, -1)}
    return frac, sorted(vals)


def shift_mantissa(m: int, mant_bits: int, terms: int) -> int:
    """The candidate c closest to 1/sqrt(X') in the log domain, X' = m / 2^mb; a tie
    goes to the smaller value (the threshold rule: M >= T picks the next one)."""
    frac, vals = shift_candidates(terms)
    x = Fraction(m, 1 << mant_bits)

    def key(v: int) -> tuple[Fraction, int]:
        t = Fraction(v * v, 1 << (2 * frac)) * x
        return max(t, 1 / t), v

    return min(vals, key=key)


def slow_statistic(op, row: list[int]) -> tuple[int, list[int]]:
    """(S, numerators): the raw statistic, before ε."""
    cfg = op.config
    n = cfg.n
    if isinstance(op, IntRMSNorm):
        head = row[: cfg.prefix]
        return sum(v * v for v in head), list(row)
    s = sum(row)
    d = [n * v - s for v in row]
    if isinstance(op, L1LayerNorm):
        return sum(abs(v) for v in d), d
    return n * sum(v * v for v in row) - s * s, d


def slow_row(op, row: list[int]) -> tuple[int, list[int], list[int]]:
    """(r, z, out) of one row: the per-row inverse, the normalized values, the outputs.

    ε has g = eps_shift guard bits (per power p of the statistic): W = S 2^(p g) + ε_int.
    The narrow-lane stage 3: with K0 = F_r + e − F_z − (h + g), the row's multiplier
    shift j_r = clamp(K0, 0, j) (j: the op's mult_shift), a = round(N r / 2^j_r) and
    c = round(Σx a / N) (both times 2^up where K0 < j_r), z = round((x a − c) / 2^K).
    The output is the unclamped formula ``sat(round((z m + B) / 2^s))``: the op's
    clamp window must not change it."""
    cfg = op.config
    mode = cfg.rounding
    p = 1 if isinstance(op, L1LayerNorm) else 2
    stat, _ = slow_statistic(op, row)
    w = max(stat * 2 ** (p * cfg.eps_shift) + cfg.eps, 1)
    e = (w.bit_length() - cfg.mant_bits) // p
    m = w >> (p * e) if e > 0 else w << (-p * e)
    f = cfg.inv_frac_bits
    if isinstance(op, L1LayerNorm):
        r = exact_round(Fraction(1 << (f + 1), 2 * m + 1), mode)
    elif isinstance(op, ShiftLayerNorm):
        r = shift_mantissa(m, cfg.mant_bits, cfg.mantissa_terms)
    else:
        r = exact_rsqrt(m, f, mode)
    k0 = f + e - cfg.frac_bits - cfg.pre_shift - cfg.eps_shift
    jr = min(max(k0, 0), op._mult_shift)
    up = max(jr - k0, 0)
    k = k0 - jr + up
    centered = not isinstance(op, IntRMSNorm)
    a0 = exact_round(Fraction(r * (cfg.n if centered else 1), 1 << jr), mode)
    c = exact_round(Fraction(sum(row) * a0, cfg.n), mode) << up if centered else 0
    a = a0 << up
    zs, out = [], []
    for v, g, b in zip(row, cfg.gain, cfg.bias, strict=True):
        z = exact_round(Fraction(v * a - c, 1 << k), mode)
        y = exact_round(Fraction(z * g + b, 1 << cfg.shift), mode)
        zs.append(z)
        out.append(min(max(y, cfg.out_fmt.lo), cfg.out_fmt.hi))
    return r, zs, out


def assert_matches_slow(op, x: np.ndarray) -> None:
    """Outputs, normalized values and per-row inverses all equal the slow model's."""
    trace = {}
    y = op(x, trace)
    rows = [slow_row(op, r) for r in x.reshape(-1, x.shape[-1]).tolist()]
    assert np.array_equal(y, np.array([r[2] for r in rows], dtype=np.int64).reshape(x.shape))
    if rows:
        assert np.array_equal(trace["z"], np.array([r[1] for r in rows], dtype=np.int64).reshape(x.shape))
        inv = np.broadcast_to(trace[op.inverse_name], (*x.shape[:-1], 1))
        assert np.array_equal(inv.reshape(-1), np.array([r[0] for r in rows]))


def make_op(kind: str, n: int, rng: np.random.Generator, **kw):
    gamma = rng.normal(1.0, 0.5, n) * rng.choice([1.0, -1.0], n, p=[0.9, 0.1])
    beta = rng.normal(0, 0.5, n)
    if kind == "ln":
        return IntLayerNorm.from_float(gamma, beta, **kw)
    if kind == "l1":
        return L1LayerNorm.from_float(gamma, beta, **kw)
    if kind == "shift1":
        return ShiftLayerNorm.from_float(gamma, beta, mantissa_terms=1, **kw)
    if kind == "shift2":
        return ShiftLayerNorm.from_float(gamma, beta, mantissa_terms=2, **kw)
    if kind == "rms":
        return IntRMSNorm.from_float(gamma, beta, **kw)
    return IntRMSNorm.from_float(gamma, beta, partial=0.3, **kw)


KINDS = ["ln", "l1", "shift1", "shift2", "rms", "prms"]


def mixed_rows(rng: np.random.Generator, fmt: QFormat, rows: int, n: int) -> np.ndarray:
    """Uniform, Gaussian, constant, extremal and near-constant rows of one format."""
    lo, hi = fmt.lo, fmt.hi
    parts = [
        rng.integers(lo, hi + 1, (rows, n)),
        np.clip(np.round(rng.normal(rng.uniform(lo, hi, (rows, 1)) / 4, (hi - lo) / 16, (rows, n))), lo, hi),
        np.full((2, n), lo),
        np.full((2, n), hi),
        np.where(np.arange(n) == rng.integers(0, n), lo, hi)[None, :],
        np.clip(rng.integers(-1, 2, (rows, n)) + rng.integers(lo, hi + 1, (rows, 1)), lo, hi),
    ]
    return np.concatenate(parts).astype(np.int64)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,bits,scale", [(1, 8, 1.0), (7, 4, 0.5), (64, 8, 0.05), (768, 8, 0.02), (100, 16, 1e-3)])
def test_golden_equals_slow_reference(kind, n, bits, scale):
    rng = np.random.default_rng([n, bits, KINDS.index(kind)])
    fmt = QFormat(bits, scale)
    op = make_op(kind, n, rng, in_fmt=fmt)
    assert_matches_slow(op, mixed_rows(rng, fmt, 6, n))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("bits,eps", [(8, 1e-5), (16, 1e-5), (16, 1e3)])
def test_golden_equals_slow_reference_every_rounding_mode(kind, mode, bits, eps):
    """16-bit rows (and a large ε) give W > 2^(mant_bits + p·h): the numerator shift
    then rounds, so every mode is exercised at every rounding point."""
    rng = np.random.default_rng([7, ALL_MODES.index(mode), KINDS.index(kind), bits])
    fmt = QFormat(bits, 0.1)
    op = make_op(kind, 48, rng, in_fmt=fmt, eps=eps, rounding=mode)
    assert_matches_slow(op, mixed_rows(rng, fmt, 8, 48))


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(KINDS))
    n = draw(st.one_of(st.integers(1, 16), st.integers(17, 4096)))
    batch = draw(st.lists(st.integers(0, 3), min_size=0, max_size=2))
    while batch and int(np.prod(batch)) * n > 6000:
        batch.pop()
    bits = draw(st.integers(4, 16))
    scale = 2.0 ** draw(st.integers(-14, 4)) * draw(st.floats(1.0, 1.99))
    out_bits = draw(st.sampled_from([4, 8, 12, 16]))
    out_scale = 2.0 ** draw(st.integers(-12, 0))
    eps = draw(st.sampled_from([0.0, 1e-6, 1e-5, 1e-2, 1.0]))
    mode = draw(st.sampled_from(ALL_MODES))
    mant_bits = draw(st.sampled_from([None, 8, 20]))  # None: the op's default (30 or 16)
    frac_bits = draw(st.sampled_from([None, 0, 3] + ([] if mant_bits == 8 else [9])))  # <= F_r of every op
    widths = {"frac_bits": frac_bits, "mant_bits": mant_bits}
    seed = draw(st.integers(0, 2**32 - 1))
    return kind, n, tuple(batch), QFormat(bits, scale), QFormat(out_bits, out_scale), eps, mode, widths, seed


@given(cases())
@settings(max_examples=60, deadline=None)
def test_property_golden_slow_format_and_ranges(case):
    kind, n, batch, in_fmt, out_fmt, eps, mode, widths, seed = case
    rng = np.random.default_rng(seed)
    op = make_op(kind, n, rng, eps=eps, in_fmt=in_fmt, out_fmt=out_fmt, rounding=mode, **widths)
    x = rng.integers(in_fmt.lo, in_fmt.hi + 1, (*batch, n))
    if x.size and rng.random() < 0.5:  # rows with a small spread stress the exponent split
        x = np.clip(x[..., :1] + rng.integers(-2, 3, x.shape), in_fmt.lo, in_fmt.hi)
    assert_matches_slow(op, x)
    trace = {}
    y = op(x, trace)
    assert y.shape == x.shape
    if x.size:
        assert out_fmt.lo <= y.min() and y.max() <= out_fmt.hi
        bounds = op.ranges()
        for name, v in trace.items():
            iv = bounds[name]
            assert iv.lo <= int(v.min()) and int(v.max()) <= iv.hi, (name, iv, int(v.min()), int(v.max()))


@pytest.mark.parametrize("kind", KINDS)
def test_same_forward_body_on_torch_int64(kind):
    """The QAT layers run ``_forward`` on torch int64 tensors: identical integers and traces."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(KINDS.index(kind))
    fmt = QFormat(8, 0.05)
    op = make_op(kind, 96, rng, in_fmt=fmt)
    x = mixed_rows(rng, fmt, 16, 96)[:52].reshape(4, 13, 96)
    t_np, t_torch = {}, {}
    y = op._forward(x, t_np)
    yt = op._forward(torch.from_numpy(x), t_torch)
    assert isinstance(yt, torch.Tensor) and yt.dtype == torch.int64
    assert np.array_equal(yt.numpy(), y)
    assert t_np.keys() == t_torch.keys()
    for name, value in t_np.items():
        assert np.array_equal(np.broadcast_to(t_torch[name], np.shape(value)), value), name


@pytest.mark.parametrize("terms", [1, 2])
def test_shift_mantissa_selection_at_every_threshold(terms):
    """M on and next to each threshold picks the log-nearest candidate (ties to the
    smaller value), as the slow model decides it by comparing distances exactly."""
    from qnorm.ops.shiftnorm import mantissa_thresholds

    op = make_op(f"shift{terms}", 8, np.random.default_rng(0))
    mb = op.config.mant_bits
    edges = [1 << (mb - 1), (1 << (mb + 1)) - 1]
    m = np.array(sorted({v for t in mantissa_thresholds(terms, mb) for v in (t - 1, t, t + 1)} | set(edges)))
    value = op._inverse(m.reshape(-1, 1), None)
    assert np.broadcast_to(value, (m.size, 1))[:, 0].tolist() == [shift_mantissa(int(v), mb, terms) for v in m]


@pytest.mark.parametrize("kind", KINDS)
def test_unsigned_input_and_output_formats(kind):
    rng = np.random.default_rng(KINDS.index(kind))
    for in_fmt, out_fmt in ((QFormat(8, 0.1, False), QFormat(8, 1 / 32)), (QFormat(8, 0.1), QFormat(8, 1 / 64, False))):
        op = make_op(kind, 40, rng, in_fmt=in_fmt, out_fmt=out_fmt)
        x = mixed_rows(rng, in_fmt, 8, 40)
        assert_matches_slow(op, x)
        trace = {}
        y = op(x, trace)
        assert out_fmt.lo <= y.min() and y.max() <= out_fmt.hi
        for name, v in trace.items():
            assert op.ranges()[name].lo <= int(v.min()) and int(v.max()) <= op.ranges()[name].hi, name


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ALL_MODES)
def test_exhaustive_tiny_rows(kind, mode):
    """Every row of 3 four-bit values (and, for two modes, every row of 2 eight-bit
    values): golden == slow model, and no intermediate leaves its bound."""
    rng = np.random.default_rng([KINDS.index(kind), ALL_MODES.index(mode)])
    shapes = ((3, 4), (2, 8)) if mode in (Round.HALF_UP, Round.TRUNC) else ((3, 4),)
    for n, bits in shapes:
        fmt = QFormat(bits, 0.1)
        op = make_op(kind, n, rng, in_fmt=fmt, eps=1e-3, rounding=mode)
        axes = [np.arange(fmt.lo, fmt.hi + 1)] * n
        x = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, n)
        assert_matches_slow(op, x)
        trace = {}
        op(x, trace)
        rep = op.ranges()
        for name, v in trace.items():
            assert rep[name].lo <= int(v.min()) and int(v.max()) <= rep[name].hi, name
