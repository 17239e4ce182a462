"""Contract of the four integer normalizations: ranges, edge cases, errors vs float."""

import dataclasses
import math
from fractions import Fraction

import numpy as np
import pytest

from qnorm.analysis import OverflowRiskError
from qnorm.fixedpoint import bits_for, rshift_round
from qnorm.metrics import error_in_lsb
from qnorm.ops import (
    NORMS,
    IntLayerNorm,
    IntRMSNorm,
    L1LayerNorm,
    ShiftLayerNorm,
)
from qnorm.ops import _normcore
from qnorm.ops._normcore import LANES, NARROW_ROW_BITS
from qnorm.ops.shiftnorm import mantissa_table
from qnorm.qformat import QFormat
from qnorm.report import gaussian_rows, input_format, output_format

OUT = QFormat.power_of_two(8, -5)


def build(cls, n, seed=0, **kw):
    rng = np.random.default_rng(seed)
    gamma = rng.normal(1.0, 0.3, n) * rng.choice([1.0, -1.0], n, p=[0.8, 0.2])
    return cls.from_float(gamma, rng.normal(0, 0.5, n), **kw)


def trace_of(op, x):
    trace = {}
    y = op(x, trace)
    return y, trace


# --------------------------------------------------------------------------- interface


@pytest.mark.parametrize("cls", NORMS)
def test_recorded_intermediates_are_exactly_the_ranges(cls):
    op = build(cls, 32, in_fmt=QFormat(8, 0.1))
    _, trace = trace_of(op, np.arange(-64, 64, dtype=np.int64).reshape(4, 32))
    assert list(trace) == list(op.ranges().items)


@pytest.mark.parametrize("cls", NORMS)
def test_output_shape_dtype_and_batch_dims(cls):
    op = build(cls, 16)
    x = np.random.default_rng(1).integers(-128, 128, (2, 3, 16), dtype=np.int8)
    y = op(x)
    assert y.shape == (2, 3, 16) and y.dtype == np.int64
    assert np.array_equal(y[1, 2], op(x[1, 2]))  # rows are independent
    assert op(np.zeros((0, 16), dtype=np.int64)).shape == (0, 16)
    assert op(np.zeros((2, 0, 16), dtype=np.int64)).shape == (2, 0, 16)


@pytest.mark.parametrize("cls", NORMS)
def test_config_is_frozen_and_from_float_deterministic(cls):
    a, b = build(cls, 24, seed=3), build(cls, 24, seed=3)
    assert a.config == b.config
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.config.shift = 3


EPS_BITS = 16  # the promised resolution: ε moves the least W it matters to by <= 2^-17 unless W's width forbids it


def exact_eps(op, eps: float) -> Fraction:
    """ε in units of the op's raw statistic S (V, A or Q), from the float definitions."""
    cfg = op.config
    s_in = Fraction(cfg.in_fmt.scale)
    if isinstance(op, IntRMSNorm):  # mean(x²) + ε = (Q + ε k / s_in²) s_in² / k
        return Fraction(eps) * cfg.prefix / s_in**2
    if isinstance(op, L1LayerNorm):  # c MAD + ε = c (A + ε N² / (c s_in)) s_in / N²
        return Fraction(eps) * cfg.n**2 * Fraction(math.sqrt(2 / math.pi)) / s_in
    return Fraction(eps) * cfg.n**2 / s_in**2  # σ² + ε = (V + ε N² / s_in²) s_in² / N²


@pytest.mark.parametrize("n", [2, 3, 5, 6])
def test_stat_floor_is_the_least_statistic_of_a_row_that_eps_moves(n):
    """Every int row of values in [−3, 3]: the least non-zero statistic is the op's
    ``_stat_floor`` (N − 1, 2(N − 1), 1), and a zero statistic has every numerator 0 —
    except partial RMSNorm, whose zero prefix leaves the rest (its floor: 0)."""
    rows = np.stack(np.meshgrid(*[np.arange(-3, 4)] * n, indexing="ij"), -1).reshape(-1, n).astype(np.int64)
    fmt = QFormat(4, 0.1)
    for op, stat in (
        (IntLayerNorm.from_float(np.ones(n), None, 1e-5, fmt), "var"),
        (ShiftLayerNorm.from_float(np.ones(n), None, 1e-5, fmt), "var"),
        (L1LayerNorm.from_float(np.ones(n), None, 1e-5, fmt), "sum_abs"),
        (IntRMSNorm.from_float(np.ones(n), None, 1e-5, fmt), "sum_sq"),
        (IntRMSNorm.from_float(np.ones(n), None, 1e-5, fmt, partial=0.5), "sum_sq"),
    ):
        trace: dict[str, np.ndarray] = {}
        op.forward(rows, trace)
        s = np.asarray(trace[stat]).reshape(-1)
        moved = (rows != 0).any(axis=1) if op.config.centered is False else (rows != rows[:, :1]).any(axis=1)
        floor = type(op)._stat_floor(op.config)
        if floor:
            assert s[s > 0].min() == floor and not (moved & (s == 0)).any()
        else:
            assert (moved & (s == 0)).any()


def test_eps_in_integer_units_of_each_statistic():
    """ε_int = round(ε_S 2^(p g)): ε in units of 2^(-p g) of S (p = 2 for V and Q, 1 for A)."""
    n, s_in = 64, 0.05
    fmt = QFormat(8, s_in)
    ones = np.ones(n)
    for op, eps, p in (
        (IntLayerNorm.from_float(ones, eps=1e-5, in_fmt=fmt), 1e-5, 2),
        (ShiftLayerNorm.from_float(ones, eps=1e-5, in_fmt=fmt), 1e-5, 2),
        (IntRMSNorm.from_float(ones, eps=1e-3, in_fmt=fmt, partial=0.25), 1e-3, 2),
        (L1LayerNorm.from_float(ones, eps=1e-3, in_fmt=fmt), 1e-3, 1),
    ):
        cfg = op.config
        assert cfg.p == p
        assert cfg.eps == math.floor(exact_eps(op, eps) * 2 ** (p * cfg.eps_shift) + Fraction(1, 2))
    # LayerNorm: ε_V = 1e-5 · 64² / 0.05² = 16.384 and V >= N − 1 = 63 on a row ε moves:
    # 4^5 · (63 + 16.384) = 81289 >= 2^16, so g = 5 and ε_int = round(4^5 · 16.384) = 16777
    cfg = IntLayerNorm.from_float(ones, eps=1e-5, in_fmt=fmt).config
    assert (cfg.eps_shift, cfg.eps) == (5, 16777)


RESOLUTION_CASES = [  # (op, N, input bits, s_in, ε, kw)
    (IntLayerNorm, 64, 8, 0.03, 1e-5, {}),
    (IntLayerNorm, 4096, 8, 0.03, 1e-5, {}),  # ε_V already >= 2^16: g = 0
    (IntLayerNorm, 4096, 16, 1.0, 1e-5, {}),  # V needs 55 bits: the 63-bit check caps g
    (IntLayerNorm, 64, 8, 0.03, 0.0, {}),
    (IntLayerNorm, 64, 8, 0.03, 1e3, {}),
    (L1LayerNorm, 64, 8, 0.03, 1e-5, {}),
    (L1LayerNorm, 4096, 16, 30.0, 1e-6, {}),
    (L1LayerNorm, 8, 8, 0.05, 4e-4, {"mant_bits": 8}),
    (ShiftLayerNorm, 768, 8, 0.03, 1e-5, {"mantissa_terms": 1}),
    (ShiftLayerNorm, 4, 12, 0.02, 1e-5, {}),
    (IntRMSNorm, 64, 8, 0.03, 1e-5, {}),
    (IntRMSNorm, 64, 4, 0.3, 1e-6, {}),
    (IntRMSNorm, 768, 8, 0.03, 1e-5, {"partial": 0.25}),
    (IntRMSNorm, 4096, 16, 31.0, 1e-6, {"partial": 0.3}),  # ε_Q ~ 1e-6: capped
    (IntRMSNorm, 7, 16, 2.0**-14, 1.0, {}),  # ε_Q huge: g = 0
]


@pytest.mark.parametrize("cls,n,bits,s_in,eps,kw", RESOLUTION_CASES)
def test_eps_resolution(cls, n, bits, s_in, eps, kw):
    """ε's promised resolution: its rounding moves W by at most 2^-17 of the least W
    a row that ε moves can have, (S_min + ε_S) 2^(p g) with S_min the op's least
    non-zero statistic — unless one more guard bit would make the config refused by
    the range analysis or, for int4/int8, W leave the 48-bit accumulator; and g is no
    larger than needed."""
    op = build(cls, n, eps=eps, in_fmt=QFormat(bits, s_in), **kw)
    cfg, e_s = op.config, exact_eps(op, eps)
    floor = cls._stat_floor(cfg)
    pg = cfg.p * cfg.eps_shift
    assert cfg.eps == math.floor(e_s * 2**pg + Fraction(1, 2))
    if eps == 0:
        assert (cfg.eps_shift, cfg.eps) == (0, 0)
        return
    assert cfg.eps_shift == 0 or (floor + e_s) * 2 ** (pg - cfg.p) < 2**EPS_BITS  # minimal
    if (floor + e_s) * 2**pg >= 2**EPS_BITS:
        assert abs(Fraction(cfg.eps, 2**pg) - e_s) <= (floor + e_s) * Fraction(1, 2 ** (EPS_BITS + 1))
    else:  # capped: one more guard bit does not fit
        g = cfg.eps_shift + 1
        more = dataclasses.replace(cfg, eps_shift=g, eps=math.floor(e_s * 2 ** (cfg.p * g) + Fraction(1, 2)))
        stat_hi = op.ranges()["stat"].hi - cfg.eps
        if cfg.lanes == LANES[0] and (stat_hi << (cfg.p * g)) + more.eps >= 1 << (NARROW_ROW_BITS - 1):
            return
        with pytest.raises(OverflowRiskError):
            cls(more, op.params)


def eps_dominated_rows(rng: np.random.Generator, n: int, fmt: QFormat) -> np.ndarray:
    """Near-constant rows: an offset (small for half of them, so the row is ~0) plus
    noise of one LSB — σ² is a few LSB², comparable to ε."""
    count = 4000
    off = np.concatenate([rng.integers(-3, 4, (count // 2, 1)), rng.integers(fmt.lo, fmt.hi + 1, (count // 2, 1))])
    noise = rng.choice([-1, 0, 0, 0, 0, 1], (count, n))
    return np.clip(off + noise, fmt.lo, fmt.hi).astype(np.int64)


EPS_DOMINATED = [  # (kind, N, s_in, ε): ε_S off its integer grid
    ("ln", 8, 0.0135, 1e-5),  # ε_V = 3.51 (was 4: 2.0 LSB)
    ("ln", 64, 0.0304, 1e-5),  # ε_V = 44.3
    ("l1", 8, 0.05, 4e-4),  # ε_A = 0.41 (was 0: 3.1 LSB)
    ("rms", 16, 0.05, 1e-5),  # ε_Q = 0.064 (was 0: 1.3 LSB)
    ("rms", 64, 0.0304, 1e-5),  # ε_Q = 0.69 (was 1)
    ("prms", 64, 0.0304, 1e-5),  # ε_Q = 0.17 (was 0: 1.9 LSB)
]


@pytest.mark.parametrize("kind,n,s_in,eps", EPS_DOMINATED)
def test_error_where_eps_dominates(kind, n, s_in, eps):
    """Rows whose variance is comparable to ε: the exact ops stay within the half LSB
    of the output rounding plus their internal rounding (< 0.02 LSB), as on
    Gaussian rows — ε's rounding moves W by <= 2^-17 of itself."""
    rng = np.random.default_rng([n, int(s_in * 1e4)])
    gamma, beta = 1.0 + 0.1 * rng.normal(size=n), 0.1 * rng.normal(size=n)
    fmt = QFormat(8, s_in)
    op = error_op(kind, gamma, beta, fmt, OUT, eps)
    x = eps_dominated_rows(rng, n, fmt)
    stats = error_in_lsb(op(x), OUT, op.float_reference(fmt.dequantize(x)))
    assert stats.max_lsb <= 0.52, stats


def shift_choice(op, w: Fraction) -> tuple[int, int]:
    """(exponent, mantissa candidate) ShiftLayerNorm's rule gives the real W: e from
    W's binary exponent, M = floor(W / 4^e) (M >= T_i  <=>  W / 4^e >= T_i for the
    integer thresholds), the candidate from the op's own threshold selection."""
    mb = op.config.mant_bits
    k = math.floor(math.log2(w))  # refined exactly below
    while Fraction(2) ** k > w:
        k -= 1
    while Fraction(2) ** (k + 1) <= w:
        k += 1
    e = (k + 1 - mb) // 2
    m = math.floor(w / Fraction(4) ** e)
    value = op._inverse(np.array([[m]], dtype=np.int64), None)[0]
    return e, int(np.asarray(value).reshape(-1)[0])


@pytest.mark.parametrize("terms", [1, 2])
def test_shift_norm_picks_its_power_of_two_for_exact_eps(terms):
    """ShiftLayerNorm approximates 1/sqrt(V + ε_V) by 2^-(e + mb/2) · c: the split and
    the candidate must be those of the exact real V + ε_V (times 4^g), not of an ε
    rounded to an integer (ε_V = 0.45 here, which rounds to 0)."""
    n, fmt = 4, QFormat(8, 0.0189)
    rng = np.random.default_rng(terms)
    op = ShiftLayerNorm.from_float(np.ones(n), None, 1e-5, fmt, OUT, mantissa_terms=terms)
    x = eps_dominated_rows(rng, n, fmt)
    trace = {}
    op(x, trace)
    e_s, g = exact_eps(op, 1e-5), op.config.eps_shift
    assert 0 < e_s < Fraction(1, 2)
    got = list(zip(trace["exp"].reshape(-1).tolist(), np.broadcast_to(trace["rsqrt_pow2"], (len(x), 1))[:, 0].tolist(), strict=True))
    s, q = x.sum(axis=1).tolist(), (x * x).sum(axis=1).tolist()
    want = [shift_choice(op, (n * qi - si * si + e_s) * 4**g) for si, qi in zip(s, q, strict=True)]
    assert got == want


def test_gamma_constants_are_folded_into_the_multipliers():
    """sqrt(k)/2^h (RMS) and N sqrt(2/π)/2^h (L1) live in m_c / 2^(s − F_z), never at run time."""
    n = 768
    for op, g in (
        (IntLayerNorm.from_float(np.ones(n)), 1.0),
        (IntRMSNorm.from_float(np.ones(n)), math.sqrt(n) / 32),
        (IntRMSNorm.from_float(np.ones(n), partial=0.5), math.sqrt(384) / 32),
        (L1LayerNorm.from_float(np.ones(n)), n * math.sqrt(2 / math.pi) / 1024),
    ):
        cfg = op.config
        real = cfg.gain[0] / 2 ** (cfg.shift - cfg.frac_bits) * OUT.scale
        assert abs(real - g) <= g * 2.0**-14


def test_cost_tables():
    n = 64
    ln, l1 = build(IntLayerNorm, n).cost(), build(L1LayerNorm, n).cost()
    sh, rms = build(ShiftLayerNorm, n).cost(), build(IntRMSNorm, n, partial=0.5).cost()
    assert (ln["per_row"]["sqrt"], ln["per_row"]["div"], ln["per_element"]["mul"]) == (1, 1, 2)
    assert (l1["per_row"]["sqrt"], l1["per_row"]["div"], l1["per_row"]["mul"]) == (0, 1, 0)
    assert (sh["per_row"]["div"], sh["per_row"]["sqrt"], sh["per_element"]["mul"]) == (0, 0, 1)
    assert sh["per_row"]["compare"] == len(mantissa_table(2)[1]) - 1
    assert rms["per_row"]["mul"] == 32 and rms["per_element"]["add"] == ln["per_element"]["add"] - 1


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("cls", NORMS)
def test_input_validation(cls):
    op = build(cls, 8)
    with pytest.raises(ValueError, match="integer array"):
        op(np.zeros((2, 8), dtype=np.float32))
    with pytest.raises(ValueError, match="integer array"):
        op(np.zeros((2, 8), dtype=bool))
    with pytest.raises(ValueError, match="outside the declared"):
        op(np.full((1, 8), 128))
    with pytest.raises(ValueError, match="rows of 8 elements"):
        op(np.zeros((2, 7), dtype=np.int64))
    with pytest.raises(ValueError, match="rows of 8 elements"):
        op(np.zeros((2, 0), dtype=np.int64))
    with pytest.raises(ValueError, match="rows of 8 elements"):
        op(np.int64(3))
    with pytest.raises(ValueError, match="rows of 8 elements"):
        op.float_reference(np.zeros((1, 9)))


@pytest.mark.parametrize("cls", NORMS)
def test_parameter_validation(cls):
    g = np.ones(8)
    for bad, name in ((np.array([1.0, np.nan] * 4), "gamma"), (np.array([np.inf] * 8), "gamma")):
        with pytest.raises(ValueError, match=f"{name} contains NaN or Inf"):
            cls.from_float(bad)
    with pytest.raises(ValueError, match="beta contains NaN or Inf"):
        cls.from_float(g, np.full(8, -np.inf))
    with pytest.raises(ValueError, match="eps contains NaN or Inf"):
        cls.from_float(g, None, float("nan"))
    with pytest.raises(ValueError, match="eps must be >= 0"):
        cls.from_float(g, None, -1e-5)
    with pytest.raises(ValueError, match="gamma must be a non-empty 1-D"):
        cls.from_float(np.ones((2, 4)))
    with pytest.raises(ValueError, match="gamma must be a non-empty 1-D"):
        cls.from_float(np.ones(0))  # N = 0
    with pytest.raises(ValueError, match="beta has shape"):
        cls.from_float(g, np.ones(7))
    with pytest.raises(ValueError, match="real-valued"):
        cls.from_float(np.array(["a"] * 8))
    with pytest.raises(ValueError, match="input formats of 4 to 16 bits"):
        cls.from_float(g, in_fmt=QFormat(17, 1.0))
    with pytest.raises(ValueError, match="input formats of 4 to 16 bits"):
        cls.from_float(g, in_fmt=QFormat(3, 1.0))
    with pytest.raises(ValueError, match="unknown rounding mode"):
        cls.from_float(g, rounding="stochastic")
    with pytest.raises(ValueError, match="frac_bits must be an integer"):
        cls.from_float(g, frac_bits=99)


def test_op_specific_validation():
    g = np.ones(8)
    for p in (0.0, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="partial must be a number in"):
            IntRMSNorm.from_float(g, partial=p)
    with pytest.raises(ValueError, match="mantissa_terms must be 1 or 2"):
        ShiftLayerNorm.from_float(g, mantissa_terms=3)
    cfg = ShiftLayerNorm.from_float(g).config
    with pytest.raises(ValueError, match="gains must be 0 or ±2"):
        dataclasses.replace(cfg, gain=(3,) * 8)
    with pytest.raises(ValueError, match="mant_bits must be even"):
        IntLayerNorm.from_float(g, mant_bits=29)
    with pytest.raises(ValueError, match=r"fixedpoint.rsqrt"):
        IntLayerNorm.from_float(g, mant_bits=30, inv_bits=16)
    with pytest.raises(ValueError, match="needs a RMSNormConfig"):
        IntRMSNorm(IntLayerNorm.from_float(g).config, IntLayerNorm.from_float(g).params)


def test_the_derivation_cache_keeps_every_check():
    """from_float caches what it derives without γ and β (per format, ε, F_z and options):
    warm and cold derivations give equal configs, and a value equal to a cached one but
    of a type the validation refuses (True == 1) is still refused."""
    g = np.linspace(0.5, 1.5, 8)
    IntRMSNorm.from_float(g, partial=1.0)
    IntLayerNorm.from_float(g, frac_bits=1)
    with pytest.raises(ValueError, match="partial must be a number in"):
        IntRMSNorm.from_float(g, partial=True)
    with pytest.raises(ValueError, match="frac_bits must be an integer"):
        IntLayerNorm.from_float(g, frac_bits=True)
    for cls in (IntLayerNorm, L1LayerNorm, ShiftLayerNorm, IntRMSNorm):
        warm = [cls.from_float(g * k, g - 1, 1e-5, QFormat(8, 0.03 * k)).config for k in (1, 2, 1)]
        _normcore.row_cache_clear()
        cold = [cls.from_float(g * k, g - 1, 1e-5, QFormat(8, 0.03 * k)).config for k in (1, 2, 1)]
        assert warm == cold and warm[0] == warm[2] and warm[0] != warm[1]


def test_overflow_prone_configs_are_refused_naming_the_intermediate():
    # 16-bit inputs, N = 2^17: N·Σx² reaches 2^64
    with pytest.raises(OverflowRiskError, match="'n_sum_sq'"):
        IntLayerNorm.from_float(np.ones(1 << 17), in_fmt=QFormat(16, 1.0))
    # an ε of 10^30 real units is beyond any integer statistic: the refusal names ε (the
    # advice to shorten the row or narrow the formats would not help), its cause 'stat'
    for cls in (IntLayerNorm, L1LayerNorm, ShiftLayerNorm, IntRMSNorm):
        with pytest.raises(OverflowRiskError, match=r"eps = 1e\+30 is \d+ in units .* lower eps") as refused:
            cls.from_float(np.ones(8), eps=1e30)
        assert "'stat'" in str(refused.value.__cause__)
    # a 32-bit accumulator target cannot run int8 LayerNorm over 768 elements
    op = IntLayerNorm.from_float(np.ones(768), in_fmt=QFormat(8, 0.05))
    with pytest.raises(OverflowRiskError, match=r"'n_sum_sq' spans \[0, 9663676416\], which needs 35 bits"):
        op.ranges().check(32)
    assert op.ranges()["n_sum_sq"].bits == 35


# --------------------------------------------------------------------------- edge cases


def grid(beta: np.ndarray, fmt: QFormat) -> np.ndarray:
    """β on the output grid, rounded half up from the exact rational, saturated."""
    q = [math.floor(Fraction(b) / Fraction(fmt.scale) + Fraction(1, 2)) for b in beta]
    return np.clip(q, fmt.lo, fmt.hi)


@pytest.mark.parametrize("cls", [IntLayerNorm, L1LayerNorm, ShiftLayerNorm])
@pytest.mark.parametrize("eps", [0.0, 1e-5, 1.0])
def test_constant_rows_give_beta(cls, eps):
    """σ = 0: every centered value is 0, so z = 0 and the output is β (also for ε = 0,
    where the float op divides 0 by 0)."""
    n = 24
    beta = np.linspace(-3.9, 3.9, n) + 0.01
    op = cls.from_float(np.linspace(-2, 2, n), beta, eps, QFormat(8, 0.1))
    x = np.array([[-128] * n, [127] * n, [0] * n, [5] * n])
    assert np.array_equal(op(x), np.broadcast_to(grid(beta, OUT), x.shape))


@pytest.mark.parametrize("cls", [IntLayerNorm, L1LayerNorm, ShiftLayerNorm])
def test_row_length_one_gives_beta(cls):
    op = cls.from_float([1.7], [0.43], 1e-5)
    assert np.array_equal(op(np.arange(-128, 128).reshape(-1, 1)), np.full((256, 1), grid([0.43], OUT)[0]))


def test_rmsnorm_zero_rows_and_sign_rows():
    """A zero row (ε = 0) gives β.  A row of length 1, or a constant row of k = 4^j
    elements with a power-of-two value, normalizes to ±1 exactly: y = round((±m 2^F_z + B)/2^s)."""
    op = IntRMSNorm.from_float([1.3], [0.2], 0.0)
    cfg = op.config
    plus = rshift_round((cfg.gain[0] << cfg.frac_bits) + cfg.bias[0], cfg.shift)
    minus = rshift_round(-(cfg.gain[0] << cfg.frac_bits) + cfg.bias[0], cfg.shift)
    y = op(np.arange(-128, 128).reshape(-1, 1))[:, 0]
    assert y.tolist() == [minus] * 128 + [grid([0.2], OUT)[0]] + [plus] * 127
    op = build(IntRMSNorm, 64, eps=0.0)
    cfg = op.config
    g, b = np.array(cfg.gain), np.array(cfg.bias)
    assert np.array_equal(op(np.zeros((1, 64), dtype=np.int64))[0], grid(op.params.beta, OUT))
    assert np.array_equal(
        op(np.full((1, 64), -128))[0], np.clip(rshift_round(-(g << cfg.frac_bits) + b, cfg.shift), -128, 127)
    )
    assert np.array_equal(
        op(np.full((1, 64), 64))[0], np.clip(rshift_round((g << cfg.frac_bits) + b, cfg.shift), -128, 127)
    )


@pytest.mark.parametrize("cls", NORMS)
def test_zero_gamma_gives_beta_and_huge_beta_saturates(cls):
    n = 16
    x = np.random.default_rng(2).integers(-128, 128, (5, n))
    beta = np.array([0.3, -0.7] * 8)
    assert np.array_equal(cls.from_float(np.zeros(n), beta)(x), np.broadcast_to(grid(beta, OUT), x.shape))
    assert np.array_equal(cls.from_float(np.full(n, 1e-15), beta)(x), np.broadcast_to(grid(beta, OUT), x.shape))
    op = cls.from_float(np.ones(n), np.array([1e12, -1e12] * 8))
    assert np.array_equal(op(x), np.broadcast_to([127, -128] * 8, x.shape))
    assert op.ranges()["acc"].bits < 40  # β is clipped where the output saturates anyway


def test_extreme_single_outlier_row_reaches_sqrt_n_minus_1():
    """[−128, 0, …, 0]: the outlier's z is −sqrt(N−1) σ = −8 σ for N = 65, and with
    W = 64 · 128² a power of 4 every step is exact; the others are 1/8 σ."""
    n = 65
    op = IntLayerNorm.from_float(np.ones(n), None, 0.0, QFormat(8, 1.0), QFormat(16, 2.0**-10))
    x = np.zeros((1, n), dtype=np.int64)
    x[0, 0] = -128
    y, trace = trace_of(op, x)
    assert int(trace["z"][0, 0]) == -(8 << op.config.frac_bits)
    assert y[0, 0] == -8 << 10 and np.all(y[0, 1:] == 1 << 7)


# --------------------------------------------------------------------------- ranges are tight


def deltas(fmt: QFormat) -> np.ndarray:
    span = fmt.hi - fmt.lo
    if span <= 255:
        return np.arange(1, span + 1)
    return np.unique(
        np.concatenate([np.arange(1, 64), np.geomspace(64, span, 200).astype(np.int64), span - np.arange(64)])
    )


def channels(op) -> list[int]:
    """Channels where an extreme of scaled/acc is reached."""
    cfg = op.config
    g, b = np.array(cfg.gain, dtype=object), np.array(cfg.bias, dtype=object)
    z = op.ranges()["z"]
    top = [max(z.lo * m, z.hi * m) + c for m, c in zip(g, b, strict=True)]
    bottom = [min(z.lo * m, z.hi * m) + c for m, c in zip(g, b, strict=True)]
    return sorted({0, int(np.argmax(g)), int(np.argmin(g)), int(np.argmax(top)), int(np.argmin(bottom))})


def odd_one_rows(n: int, pos: list[int], pairs: list[tuple[int, int]]) -> list[np.ndarray]:
    rows = []
    for c in pos:
        for a, b in pairs:
            r = np.full(n, b)
            r[c] = a
            rows.append(r)
    return rows


def centered_family(op) -> np.ndarray:
    """Constant rows, half/half rows, and [b, …, a, …, b] with every spread |b − a|
    at every channel where an output-stage extreme sits."""
    cfg = op.config
    n, lo, hi = cfg.n, cfg.in_fmt.lo, cfg.in_fmt.hi
    rows = [np.full(n, lo), np.full(n, hi), np.full(n, 0), np.where(np.arange(n) < n // 2, lo, hi)]
    pairs = [p for d in deltas(cfg.in_fmt) for p in ((lo, lo + d), (hi, hi - d))]
    rows += odd_one_rows(n, channels(op), pairs)
    return np.array(rows, dtype=np.int64)


def rms_family(op) -> np.ndarray:
    """Zero/constant rows, one non-zero element of every value (in the prefix), and
    zero prefixes with the rest at one value."""
    cfg = op.config
    n, lo, hi, k = cfg.n, cfg.in_fmt.lo, cfg.in_fmt.hi, cfg.prefix
    values = np.concatenate([lo + deltas(cfg.in_fmt) - 1, [hi]])
    rows = [np.full(n, lo), np.full(n, hi), np.zeros(n)]
    rows += odd_one_rows(n, [c for c in channels(op) if c < k], [(v, 0) for v in values])
    for v in (lo, hi):
        r = np.zeros(n)
        r[k:] = v
        rows.append(r)
    return np.array(rows, dtype=np.int64)


# Bounds that pair the numerator's largest size (or the smallest row shift) with the
# inverse's largest value (r at the bottom of its exponent's mantissa range): one row reaches both only
# where the relational kink falls on a segment's bottom, so the worst-case rows
# here reach them within a factor of two (the mantissa spans a factor of 4, its
# square root 2).
# The low part of Σx in (Σx)²'s split (layernorm.square_of_sum) reaches −2^17, and its
# square 2^34, only at a Σx of h·2^18 − 2^17, which the rows here need not sum to.
WITHIN_ONE_BIT = {"xa", "offset", "mult", "sum_low", "square_low"}
# The output window's stages: a channel's zc spans its saturation window, reached
# by z values the worst-case rows need not produce (test_output_window_* checks
# the window itself).
WINDOWED = {"zc", "scaled", "acc"}


def assert_tight(name, iv, lo, hi):
    """Sound, and the observed values need the bound's bit width — or, where a
    relational sup sits within rounding slack of a power of two (L1's |d|/W <= 1/2
    times 2^h; RMS's lone power-of-two element), the bound exceeds what the rows
    reach by at most 2^-12 relative."""
    assert iv.lo <= lo and hi <= iv.hi, (name, iv, lo, hi)
    big, seen = max(-iv.lo, iv.hi), max(-lo, hi)
    if name in WINDOWED:
        return
    if name in WITHIN_ONE_BIT:
        assert big <= 2 * seen + 2, (name, iv, lo, hi)
        return
    assert bits_for(lo, hi) == iv.bits or big <= seen * (1 + 2.0**-12) + 2, (name, iv, lo, hi)


TIGHT_CASES = [
    (IntLayerNorm, 64, 8, 1e-5, {}),
    (IntLayerNorm, 768, 8, 1e-5, {}),
    (IntLayerNorm, 10, 4, 0.0, {}),
    (IntLayerNorm, 65, 8, 1e-5, {}),
    (IntLayerNorm, 200, 16, 1e-5, {}),
    (L1LayerNorm, 64, 8, 1e-5, {}),
    (L1LayerNorm, 768, 8, 0.0, {}),
    (L1LayerNorm, 300, 12, 1e-5, {}),
    (L1LayerNorm, 17, 8, 1e-5, {}),
    (ShiftLayerNorm, 64, 8, 1e-5, {"mantissa_terms": 1}),
    (ShiftLayerNorm, 768, 8, 1e-5, {"mantissa_terms": 2}),
    (ShiftLayerNorm, 200, 16, 0.0, {"mantissa_terms": 2}),
    (IntRMSNorm, 64, 8, 0.0, {}),
    (IntRMSNorm, 768, 8, 1e-2, {}),
    (IntRMSNorm, 768, 8, 1e-3, {"partial": 0.25}),
    (IntRMSNorm, 100, 16, 1e-5, {"partial": 0.5}),
]


@pytest.mark.parametrize("cls,n,bits,eps,kw", TIGHT_CASES)
def test_ranges_are_sound_and_tight(cls, n, bits, eps, kw):
    """Constructed worst-case rows reach the bit width of every bound."""
    op = build(cls, n, eps=eps, in_fmt=QFormat(bits, 0.05), **kw)
    family = rms_family(op) if cls is IntRMSNorm else centered_family(op)
    _, trace = trace_of(op, family)
    rep = op.ranges()
    for name, v in trace.items():
        assert_tight(name, rep[name], int(v.min()), int(v.max()))


@pytest.mark.parametrize("cls", NORMS)
def test_random_rows_stay_inside_the_ranges(cls):
    rng = np.random.default_rng(5)
    op = build(cls, 257, in_fmt=QFormat(8, 0.03))
    x = np.concatenate([rng.integers(-128, 128, (300, 257)), gaussian_rows(rng, 300, 257).round().clip(-128, 127)])
    _, trace = trace_of(op, x.astype(np.int64))
    rep = op.ranges()
    for name, v in trace.items():
        assert rep[name].lo <= int(v.min()) and int(v.max()) <= rep[name].hi, name


# --------------------------------------------------------------------------- error vs float


def measured(op, rows: np.ndarray, in_fmt: QFormat, out_fmt: QFormat):
    xq = in_fmt.quantize(rows)
    return error_in_lsb(op(xq), out_fmt, op.float_reference(in_fmt.dequantize(xq)))


# Measured with exactly this test's rows (2^17 elements per N, report.gaussian_rows,
# per-tensor max-abs int8 input, int8 output covering ±4; γ = 1 + 0.1 N(0,1),
# β = 0.1 N(0,1)); error in output LSB against the float op, reference clipped to
# the output range: max / mean / share within 1 LSB
#   IntLayerNorm        N=64: 0.504 / 0.250 / 100 %    N=768: 0.504 / 0.250 / 100 %
#   L1LayerNorm         N=64: 0.507 / 0.250 / 100 %    N=768: 0.505 / 0.250 / 100 %
#   IntRMSNorm          N=64: 0.505 / 0.250 / 100 %    N=768: 0.503 / 0.250 / 100 %
#   IntRMSNorm p=0.25   N=64: 0.505 / 0.249 / 100 %    N=768: 0.505 / 0.250 / 100 %
#   Shift, 1 term       N=64: 54.8  / 4.81  / 23.9 %   N=768: 49.2  / 4.60  / 25.4 %
#   Shift, 2 terms      N=64: 26.3  / 2.00  / 44.3 %   N=768: 28.5  / 2.21  / 43.2 %
# The exact ops are within half an LSB plus < 0.01 LSB of internal rounding: the
# output rounding dominates.  The shift norm's error is dominated by rounding
# γ ≈ 1 ± 0.1 to a power of two (with γ = 1: max 36 / 9.8 LSB for 1 / 2 terms at
# N=768); the next test bounds its 1/σ approximation alone.
ERROR_BOUNDS = {  # max LSB, mean LSB, minimum share within 1 LSB
    "ln": (0.52, 0.26, 1.0),
    "l1": (0.52, 0.26, 1.0),
    "rms": (0.52, 0.26, 1.0),
    "prms": (0.52, 0.26, 1.0),
    "shift1": (60.0, 5.3, 0.21),
    "shift2": (32.0, 2.5, 0.40),
}


def error_op(kind, gamma, beta, in_fmt, out_fmt, eps=1e-5):
    cls, kw = {
        "ln": (IntLayerNorm, {}),
        "l1": (L1LayerNorm, {}),
        "rms": (IntRMSNorm, {}),
        "prms": (IntRMSNorm, {"partial": 0.25}),
        "shift1": (ShiftLayerNorm, {"mantissa_terms": 1}),
        "shift2": (ShiftLayerNorm, {"mantissa_terms": 2}),
    }[kind]
    return cls.from_float(gamma, beta, eps, in_fmt, out_fmt, **kw)


@pytest.mark.parametrize("kind", list(ERROR_BOUNDS))
@pytest.mark.parametrize("n", [64, 768])
def test_error_against_float_op(kind, n):
    rng = np.random.default_rng([0, n])
    rows = gaussian_rows(rng, (1 << 17) // n, n)
    gamma, beta = 1.0 + 0.1 * rng.normal(size=n), 0.1 * rng.normal(size=n)
    in_fmt, out_fmt = input_format(rows, 8), output_format(8)
    stats = measured(error_op(kind, gamma, beta, in_fmt, out_fmt), rows, in_fmt, out_fmt)
    max_lsb, mean_lsb, within = ERROR_BOUNDS[kind]
    assert stats.max_lsb <= max_lsb and stats.mean_lsb <= mean_lsb and stats.within_1lsb >= within, stats


@pytest.mark.parametrize("terms,rel", [(1, math.sqrt(2) - 1), (2, math.sqrt(1.2) - 1)])
def test_shift_norm_error_is_its_power_of_two_mantissa(terms, rel):
    """With γ = ±2^k the only approximation is 1/σ: c/(1/sqrt(X')) lies within the
    table's worst log gap (sqrt(2) for one term, sqrt(6/5) between 5/4 and 3/2 for
    two), so |y − y_float| <= rel · |y_float − β| + 1/2 + (z's own rounding)."""
    n = 768
    rng = np.random.default_rng(terms)
    rows = gaussian_rows(rng, 128, n)
    gamma = rng.choice([-2.0, -1.0, 0.5, 1.0, 2.0], n)
    beta = 0.1 * rng.normal(size=n)
    in_fmt, out_fmt = input_format(rows, 8), QFormat.power_of_two(16, -8)
    op = ShiftLayerNorm.from_float(gamma, beta, 1e-5, in_fmt, out_fmt, mantissa_terms=terms)
    xq = in_fmt.quantize(rows)
    ref = op.float_reference(in_fmt.dequantize(xq)) / out_fmt.scale
    err = np.abs(op(xq) - ref)
    allowed = rel * np.abs(ref - beta / out_fmt.scale) + 0.52
    assert np.all(err <= allowed)
    # and the worst case of the table is actually hit: the bound is not loose
    assert np.max((err - 0.52) / np.abs(ref - beta / out_fmt.scale)) > 0.9 * rel
