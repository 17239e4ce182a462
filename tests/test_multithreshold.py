"""BN + quantized activation: exact rational definition == FINN-style multi-threshold."""

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qnorm import fixedpoint as fp
from qnorm.analysis import OverflowRiskError
from qnorm.fixedpoint import Round
from qnorm.ops.bnfold import MAX_GAMMA_SHIFT, RationalBN, level_event
from qnorm.ops.multithreshold import BNActConfig, BNQuant, MultiThreshold, measure_error
from qnorm.qformat import QFormat
from exact_reference import ALL_MODES, exact_round


def bn_z(bn: RationalBN, c: int, x: int) -> Fraction:
    """z(x) = G (2^F x - M) / (D 2^S) + B / 2^Fo for flat channel c, straight from the fields."""
    g, m, d, b = (int(a.ravel()[c]) for a in (bn.gamma_m, bn.mean_q, bn.std_q, bn.beta_q))
    return Fraction(g * ((x << bn.frac_bits) - m), d << bn.gamma_shift) + Fraction(b, 1 << bn.out_frac_bits)


def reference_levels(bn: RationalBN, cfg: BNActConfig, xs: np.ndarray) -> np.ndarray:
    """Exact BN + rounding + clamp for every x and channel (xs: (N, C))."""
    out = np.empty(xs.shape, dtype=np.int64)
    for c in range(xs.shape[1]):
        for i, x in enumerate(xs[:, c].tolist()):
            q = exact_round(bn_z(bn, c, x), cfg.mode)
            out[i, c] = min(max(q, cfg.out_fmt.lo), cfg.out_fmt.hi)
    return out


def make_bn(rows: list[tuple[int, int, int, int]], shift: int, frac: int, out_frac: int) -> RationalBN:
    """Channels given as (G, M, D, B) integers."""
    g, m, d, b = (np.array(col, dtype=np.int64) for col in zip(*rows, strict=True))
    return RationalBN(g, shift, m, d, frac, b, out_frac)


def adversarial_bn() -> RationalBN:
    """z(x) per channel (S = 2, F = 1, Fo = 1; z = G (2x - M) / (4 D) + B / 2):

    0: z = x/2: a rounding tie at every odd x      1: z = -x/2 (gamma < 0, ties)
    2: z = x/4 + 1/2: thresholds on the grid        3: gamma = 0, z = 3/2 (tie constant)
    4: gamma = 0, z = -7/2 (constant, clamped low)  5: steep z = 5x: thresholds packed
    6: flat z = x/32 - 1/2: thresholds beyond int4  7: z = -(x - 3)/3 + 1/2 (gamma < 0, off-grid)
    """
    rows = [(2, 0, 2, 0), (-2, 0, 2, 0), (1, 0, 2, 1), (0, 0, 1, 3), (0, 0, 1, -7),
            (40, 0, 4, 0), (1, 0, 16, -1), (-4, 6, 6, 1)]  # fmt: skip
    return make_bn(rows, shift=2, frac=1, out_frac=1)


OUT_FORMATS = [
    QFormat(4, 1.0, signed=False),
    QFormat(4, 1.0, signed=True),
    QFormat(2, 1.0, signed=False),
    QFormat(8, 1.0),
]


@pytest.mark.parametrize("in_bits", [8, 4])
@pytest.mark.parametrize("out_fmt", OUT_FORMATS, ids=str)
@pytest.mark.parametrize("mode", ALL_MODES)
def test_multithreshold_equals_definition_exhaustively(in_bits, out_fmt, mode):
    bn = adversarial_bn()
    cfg = BNActConfig(QFormat(in_bits, 1.0), out_fmt, mode)
    lo, hi = cfg.in_fmt.lo, cfg.in_fmt.hi
    xs = np.repeat(np.arange(lo, hi + 1, dtype=np.int64)[:, None], 8, axis=1)
    unfolded = BNQuant(cfg, bn)
    want = reference_levels(bn, cfg, xs)
    assert np.array_equal(unfolded(xs), want)
    assert np.array_equal(unfolded.fold()(xs), want)


def test_adversarial_channels_hit_ties_and_grid():
    """The exhaustive test really exercises ties, on-grid thresholds and clamping."""
    bn = adversarial_bn()
    xs = range(-128, 128)
    assert any(bn_z(bn, 0, x).denominator == 2 for x in xs)  # z on a tie (k - 1/2)
    assert any(bn_z(bn, 1, x).denominator == 2 for x in xs)
    assert any(bn_z(bn, 2, x) - Fraction(1, 2) == round(bn_z(bn, 2, x) - Fraction(1, 2)) for x in xs)
    mt = MultiThreshold(BNActConfig(QFormat(4, 1.0), QFormat(4, 1.0, signed=False)), bn)
    assert mt.direction.tolist() == [1, -1, 1, 0, 0, 1, 1, -1]
    assert set(mt.thresholds[6].tolist()) <= {-8, 8}  # flat channel: clamped to the int4 ends


@pytest.mark.parametrize("mode", ALL_MODES)
def test_level_event_matches_rounding(mode):
    zs = [Fraction(n, 4) for n in range(-40, 41)]
    for k in range(-6, 7):
        c, strict = level_event(mode, k)
        for z in zs:
            assert (exact_round(z, mode) >= k) == (z > c if strict else z >= c), (mode, k, z)


def test_thresholds_sorted_in_crossing_order():
    bn = adversarial_bn()
    mt = MultiThreshold(BNActConfig(QFormat(8, 1.0), QFormat(4, 1.0, signed=False)), bn)
    for t, d in zip(mt.thresholds, mt.direction, strict=True):
        steps = np.diff(t)
        assert np.all(steps <= 0) if d < 0 else np.all(steps >= 0)


def test_from_float_ties_on_the_grid():
    # z = 0.5 x / 1 + 0: every odd x is exactly a tie; half up sends 1/2 to 1, -1/2 to 0.
    cfg = BNActConfig(QFormat(8, 1.0), QFormat(4, 1.0), Round.HALF_UP)
    op = BNQuant.from_float([0.5, -0.5], 0.0, 0.0, 1.0, 0.0, cfg)
    x = np.array([[1, 1], [-1, -1], [3, 3], [-3, -3]])
    assert op(x).tolist() == [[1, 0], [0, 1], [2, -1], [-1, 2]]
    assert np.array_equal(op.fold()(x), op(x))
    mt = op.fold()
    assert mt.thresholds[0, 8].item() == 1  # level 1 (k - 1/2 = 1/2) exactly at x = 1


gammas = st.one_of(st.just(0.0), st.floats(-4, 4, allow_nan=False, width=32))


@given(
    gamma=st.lists(gammas, min_size=1, max_size=5),
    data=st.data(),
    mode=st.sampled_from(ALL_MODES),
    signed_out=st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_from_float_fold_exhaustive_int8(gamma, data, mode, signed_out):
    n = len(gamma)

    def vec(lo: float, hi: float) -> np.ndarray:
        return np.array(data.draw(st.lists(st.floats(lo, hi, width=32), min_size=n, max_size=n)))

    cfg = BNActConfig(QFormat(8, 0.05), QFormat(4, 0.25, signed_out), mode)
    op = BNQuant.from_float(gamma, vec(-2, 2), vec(-3, 3), vec(0, 4), 1e-3, cfg)
    xs = np.repeat(np.arange(-128, 128, dtype=np.int64)[:, None], n, axis=1)
    want = op(xs)
    assert np.array_equal(op.fold()(xs), want)
    assert np.array_equal(want, reference_levels(op.bn, cfg, xs))


def test_per_neuron_parameters_and_batches():
    rng = np.random.default_rng(3)
    shape = (3, 4)
    cfg = BNActConfig(QFormat(8, 0.1), QFormat(3, 0.5, signed=False))
    op = BNQuant.from_float(rng.normal(0, 1, shape), rng.normal(0, 1, shape), rng.normal(0, 1, shape),
                            rng.uniform(0.1, 2, shape), 1e-5, cfg)  # fmt: skip
    x = rng.integers(-128, 128, (10, 3, 4))
    assert np.array_equal(op.fold()(x), op(x))
    assert op.fold().thresholds.shape == (3, 4, 7)


def test_same_body_on_torch_int64():
    torch = pytest.importorskip("torch")
    cfg = BNActConfig(QFormat(8, 1.0), QFormat(4, 1.0, signed=False))
    op = BNQuant(cfg, adversarial_bn())
    mt = op.fold()
    x = np.repeat(np.arange(-128, 128, dtype=np.int64)[:, None], 8, axis=1)
    tx = torch.from_numpy(x)
    assert torch.equal(mt._forward(tx, None), torch.from_numpy(mt(x)))
    assert torch.equal(op._forward(tx, None), torch.from_numpy(op(x)))


def test_ranges_reached_exhaustively_and_never_exceeded():
    cfg = BNActConfig(QFormat(8, 1.0), QFormat(4, 1.0, signed=False))
    op = BNQuant(cfg, adversarial_bn())
    x = np.repeat(np.arange(-128, 128, dtype=np.int64)[:, None], 8, axis=1)
    rep, trace = op.ranges(), {}
    op(x, trace)
    for name in ("bn_numerator", "level"):
        assert int(trace[name].min()) == rep[name].lo and int(trace[name].max()) == rep[name].hi, name
    mt_trace = {}
    mt = op.fold()
    mt(x, mt_trace)
    assert mt_trace["count"].min() >= 0 and mt_trace["count"].max() <= mt.ranges()["count"].hi


def test_overflowing_numerator_refused():
    bn = make_bn([(30000, 0, 1, 0)], shift=40, frac=30, out_frac=10)
    with pytest.raises(OverflowRiskError, match="'bn_"):
        BNQuant(BNActConfig(QFormat(16, 1.0), QFormat(4, 1.0)), bn)


def test_error_against_float_is_measured():
    rng = np.random.default_rng(0)
    c = 16
    cfg = BNActConfig(QFormat(8, 0.05), QFormat(4, 0.25, signed=False))
    op = BNQuant.from_float(rng.normal(1, 0.3, c), rng.normal(0, 0.5, c), rng.normal(0, 1, c),
                            rng.uniform(0.5, 2, c), 1e-5, cfg)  # fmt: skip
    x = rng.integers(-128, 128, (4096, c))
    stats = measure_error(op.fold(), x)
    assert stats.max_lsb <= 1.0 and stats.within_1lsb == 1.0  # parameter rounding moves a level by <= 1
    assert 0.0 <= stats.mean_lsb < 0.01


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(gamma=[1.0, np.nan]), "gamma"),
        (dict(beta=np.inf), "beta"),
        (dict(mean=[np.nan]), "mean"),
        (dict(var=[np.nan, 1.0]), "var"),
        (dict(eps=np.inf), "eps"),
        (dict(var=[-1.0, 1.0]), "var must be >= 0"),
        (dict(eps=-1e-5), "eps must be >= 0"),
        (dict(gamma=[1.0, 2.0, 3.0]), "broadcast"),
        (dict(gamma=["a", "b"]), "real-valued"),
        (dict(var=[0.0, 0.0], eps=0.0), "zero standard deviation"),
    ],
)
def test_bad_parameters(kwargs, match):
    base = dict(gamma=[1.0, -1.0], beta=[0.0, 0.0], mean=[0.0, 0.0], var=[1.0, 1.0], eps=1e-5)
    base.update(kwargs)
    cfg = BNActConfig(QFormat(8, 1.0), QFormat(4, 1.0))
    with pytest.raises(ValueError, match=match):
        BNQuant.from_float(**base, cfg=cfg)


def test_bad_inputs():
    op = BNQuant.from_float([1.0, 2.0], 0.0, 0.0, 1.0, 1e-5, BNActConfig(QFormat(8, 1.0), QFormat(4, 1.0)))
    mt = op.fold()
    for f in (op, mt):
        with pytest.raises(ValueError, match="integer"):
            f(np.zeros((3, 2)))
        with pytest.raises(ValueError, match="outside the declared"):
            f(np.array([[128, 0]]))
        with pytest.raises(ValueError, match="must end with the parameter shape"):
            f(np.zeros((3, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="levels"):
        MultiThreshold(BNActConfig(QFormat(8, 1.0), QFormat(12, 1.0)), op.bn)
    with pytest.raises(ValueError, match="QFormat"):
        BNActConfig(8, QFormat(4, 1.0))
    with pytest.raises(ValueError, match="unknown rounding mode"):
        BNActConfig(QFormat(8, 1.0), QFormat(4, 1.0), "stochastic")
    with pytest.raises(ValueError, match="std_q"):
        make_bn([(1, 0, 0, 0)], 0, 0, 0)


# --------------------------------------------------------------------------- RationalBN.from_float vs Fraction


def fraction_rational_bn(gamma, beta, mean, var, eps, in_scale, out_scale, gamma_bits=16, frac_bits=8, out_frac_bits=8):
    """Independent reference for RationalBN.from_float: the definition in ``Fraction``s,
    rounded half up with ``fixedpoint.round_fraction``, D with ``fixedpoint.isqrt_round``
    (the digit-by-digit root), one channel at a time.  Slow (~0.2 ms per channel)."""
    if not 0 <= frac_bits <= 30 or not 0 <= out_frac_bits <= 30:
        raise ValueError("frac_bits and out_frac_bits must be in [0, 30]")
    s_in, s_out = Fraction(in_scale), Fraction(out_scale)
    g, shift = fp.dyadic_vector(gamma / float(out_scale), gamma_bits, MAX_GAMMA_SHIFT)

    def fixed(name: str, value: Fraction, bits: int) -> int:
        q = fp.round_fraction(value * (1 << bits))
        if abs(q) >= 1 << 62:
            raise ValueError(f"{name} = {float(value)!r} does not fit 62 bits at {bits} fraction bits")
        return q

    def std(var_eps: Fraction) -> int:
        v = fp.round_fraction(var_eps / (s_in * s_in) * (1 << (2 * frac_bits)))
        if v > 1 << 62:
            raise ValueError(f"var + eps = {float(var_eps)!r} is too large for frac_bits={frac_bits}")
        d = int(fp.isqrt_round(v))
        if d < 1:
            raise ValueError(
                f"var + eps = {float(var_eps)!r} rounds to a zero standard deviation at "
                f"frac_bits={frac_bits}; raise frac_bits or eps"
            )
        return d

    m = [fixed("mean / in_scale", Fraction(float(v)) / s_in, frac_bits) for v in mean.ravel()]
    b = [fixed("beta / out_scale", Fraction(float(v)) / s_out, out_frac_bits) for v in beta.ravel()]
    d = [std(Fraction(float(v)) + Fraction(float(e))) for v, e in zip(var.ravel(), eps.ravel(), strict=True)]
    shape = gamma.shape
    return RationalBN(
        np.asarray(g, dtype=np.int64).reshape(shape), shift, np.array(m, dtype=np.int64).reshape(shape),
        np.array(d, dtype=np.int64).reshape(shape), frac_bits, np.array(b, dtype=np.int64).reshape(shape),
        out_frac_bits,
    )  # fmt: skip


def fields(bn: RationalBN) -> tuple:
    arrays = (bn.gamma_m, bn.mean_q, bn.std_q, bn.beta_q)
    return tuple(a.tolist() for a in arrays) + (bn.gamma_shift, bn.frac_bits, bn.out_frac_bits)


def outcome(derive, *args):
    try:
        return fields(derive(*args))
    except ValueError as err:
        return ("error", str(err))


@st.composite
def bn_case(draw):
    c = draw(st.integers(1, 5))
    f, fo = draw(st.integers(0, 16)), draw(st.integers(0, 16))
    pow2 = draw(st.booleans())
    s_in = 2.0 ** draw(st.integers(-8, 3)) if pow2 else draw(st.floats(1e-3, 8.0))
    s_out = 2.0 ** draw(st.integers(-8, 3)) if pow2 else draw(st.floats(1e-3, 8.0))
    big = draw(st.sampled_from([10.0, 1e4, 1e4, 1e16]))  # 1e16: constants beyond 62 bits (the error path)
    reals = st.floats(-big, big, allow_nan=False)

    def tie(scale: float, frac: int) -> float:  # exactly k + 1/2 units of 2^-frac (power-of-two scale)
        return (draw(st.integers(-300, 300)) + 0.5) * scale / 2.0**frac

    special = st.sampled_from([0.0, 1e-12, -1.5])  # zero, vanishing (rounds to 0), negative
    gamma = [draw(special) if draw(st.booleans()) else draw(st.floats(-4, 4)) for _ in range(c)]
    mean = [tie(s_in, f) if draw(st.booleans()) else draw(reals) for _ in range(c)]
    beta = [tie(s_out, fo) if draw(st.booleans()) else draw(reals) for _ in range(c)]
    var = [abs(tie(s_in * s_in, 2 * f)) if draw(st.booleans()) else draw(st.floats(0, big)) for _ in range(c)]
    eps = [draw(st.sampled_from([0.0, 1e-5, 1e-3, 0.1])) for _ in range(c)]
    arrays = [np.array(v, dtype=np.float64) for v in (gamma, beta, mean, var, eps)]
    return (*arrays, s_in, s_out, draw(st.integers(3, 24)), f, fo)


@given(bn_case())
@settings(max_examples=400, deadline=None)
def test_rational_bn_from_float_equals_fraction_derivation(case):
    """Same integers, or the same error message, as the Fraction definition."""
    assert outcome(RationalBN.from_float, *case) == outcome(fraction_rational_bn, *case)


def test_rational_bn_from_float_ties_and_errors():
    """Half-up ties in every constant (both signs), and every refusal with its message."""
    s = 0.5  # F = 2: units of 1/8 of the input scale
    mean = np.array([2.5, -2.5, 0.0]) * s / 4  # M = 2.5 -> 3, -2.5 -> -2
    beta = np.array([0.5, -0.5, 1.5]) / 256  # B at Fo = 8: 0.5 -> 1, -0.5 -> 0, 1.5 -> 2
    var = np.array([6.5, 0.5, 2.5]) * s * s / 16  # v = 6.5 -> 7, 0.5 -> 1, 2.5 -> 3
    args = (np.ones(3), beta, mean, var, np.zeros(3), s, 1.0, 16, 2, 8)
    got = RationalBN.from_float(*args)
    assert fields(got) == fields(fraction_rational_bn(*args))
    assert got.mean_q.tolist() == [3, -2, 0] and got.beta_q.tolist() == [1, 0, 2]
    assert got.std_q.tolist() == [3, 1, 2]  # isqrt_round(7, 1, 3)
    one, zero = np.ones(1), np.zeros(1)
    bad = [
        ((one, zero, zero, zero, zero, 1.0, 1.0, 16, 8, 8), "zero standard deviation"),
        ((one, zero, np.array([1e16]), one, zero, 1.0, 1.0, 16, 16, 8), r"mean / in_scale = 1e\+16 does not fit"),
        ((one, np.array([-1e16]), zero, one, zero, 1.0, 1.0, 16, 8, 16), r"beta / out_scale = -1e\+16"),
        ((one, zero, zero, np.array([1e16]), zero, 1.0, 1.0, 16, 16, 8), "too large"),
        ((one, zero, zero, one, zero, 1.0, 1.0, 16, 31, 8), "frac_bits"),
    ]
    for case, match in bad:
        with pytest.raises(ValueError, match=match):
            RationalBN.from_float(*case)
        assert outcome(RationalBN.from_float, *case) == outcome(fraction_rational_bn, *case)
    with pytest.raises(ValueError, match="shapes differ"):
        RationalBN.from_float(np.ones(2), *args[1:])


def test_rational_bn_from_float_per_neuron_shape():
    rng = np.random.default_rng(5)
    shape = (3, 4)
    args = (rng.normal(0, 1, shape), rng.normal(0, 1, shape), rng.normal(0, 1, shape),
            rng.uniform(0.1, 2, shape), np.full(shape, 1e-5), 0.05, 0.25)  # fmt: skip
    got = RationalBN.from_float(*args)
    assert got.shape == shape and fields(got) == fields(fraction_rational_bn(*args))
