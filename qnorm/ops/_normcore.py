"""What the four integer normalizations share.

Every norm here turns a row of N integers (the last axis) into outputs in four
stages; only stage 1 and the per-row inverse in stage 2 differ between them.

1. **Statistic.**  A non-negative integer ``S`` per row (N² × variance, N² × mean
   absolute deviation, or the sum of squares — each exact, no 1/N anywhere) and a
   per-element numerator (the exactly centered ``d = N·x − Σx``, or ``x`` itself).
   ε is added here, with fractional resolution (one mechanism for every op,
   :func:`add_eps`): in units of S it is a rational ``ε_S`` (``eps_exact``; e.g.
   ε k / s_in² for RMSNorm, 0.7 for int8 rows of 64 at s_in = 0.03), and rounding
   it to an integer would put ε on a coarse grid.  So S is scaled by ``2^(p·g)``
   first::

       W = S · 2^(p·g) + ε_int,   ε_int = round(ε_S · 2^(p·g))

   ``g`` (``eps_shift``, chosen per config by :func:`eps_guard_bits`) is the
   smallest with ``ε_int >= 2^EPS_RESOLUTION_BITS`` (ε's relative error then
   <= 2^-17), lowered while the range analysis would refuse it, and 0 when ε = 0
   or ε_S is already that large.  The numerator's pre-scale grows by g to
   compensate (stage 3), so z is unchanged except for the finer ε.  The extra
   low bits of W cost nothing after stage 2 (the mantissa split keeps a fixed
   width); only W itself is p·g bits wider.
2. **Floating-point split of W.**  ``W ≈ M · 2^(p·e)`` with a leading-zero count
   (``fixedpoint.bit_length``) and a barrel shift, so the mantissa ``M`` always has
   ``mant_bits`` (or, for a square root, ``mant_bits + 1``) bits.  The one per-row
   inverse — ``r = rsqrt(M)`` (p = 2) or ``r = 1/M`` (p = 1) — therefore runs on a
   fixed-width input and yields a narrow ``r ≈ 2^F_r / M^(1/p)`` whatever N and
   the input width are.  When ``e > 0`` the dropped low bits of W are truncated,
   a relative error below ``2^(1 - mant_bits)``.
3. **Normalize.**  ``u = num · 2^(H − e)`` with ``H = h + g`` (``num_shift``: the
   numerator brought to the mantissa's scale; ``h`` is an op's power-of-two
   pre-scale, g the ε guard of stage 1), ``prod = u · r`` and
   ``z = round(prod / 2^(F_r − F_z))``: the normalized value in Q.F_z, i.e.
   ``z ≈ 2^(F_z + H) · num / W^(1/p) = 2^(F_z + h) · num / (S + ε_S)^(1/p)``.
4. **Affine output.**  ``acc = z · m_c + B_c``, ``y = round(acc / 2^s)``, saturate.
   ``m_c / 2^s`` folds γ_c, the op's constant factor and 1/s_out; ``B_c`` is β_c in
   units of ``2^-s`` output LSB, so β is added at full accumulator precision and
   the output is rounded once (error ≤ 1/2 LSB from this stage, not 1).

The range analysis mirrors the stages: exact intervals where they are tight, and
for the normalized value a proven relational bound: every op shows
``|num|^p <= kappa · S`` for the elements its statistic sums (LayerNorm:
d² <= (N−1) V; L1: |d| <= A/2; RMS: x² <= Q), i.e. ``|num|^p <= kappa 2^(-p g)
(W − ε_int)`` in units of W, which bounds u, u · r and z per exponent of W
(:class:`StatBounds`).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, ClassVar

import numpy as np

from qnorm import fixedpoint as fp
from qnorm.analysis import Interval, OverflowRiskError, RangeReport
from qnorm.fixedpoint import (
    DEFAULT_ROUND,
    Round,
    bit_length,
    rshift_round,
    saturate,
    select,
)
from qnorm.ops._xp import const_like, row_sum
from qnorm.ops.base import IntOp, Trace, record
from qnorm.qformat import QFormat

IN_BITS = (4, 16)
DEFAULT_IN = QFormat(8, 1.0)
DEFAULT_OUT = QFormat.power_of_two(8, -5)  # int8 covering [-4, 4): normalized values
# Default F_z puts the rounding of z this many bits below the output LSB of the
# channel with the largest gain, so z's rounding adds <= 2^-7 LSB.
GUARD_BITS = 6
# ε is added to the statistic with at least this many bits of its own (stage 1):
# ε_int >= 2^16, a relative error of ε <= 2^-17, below the 2^-16 of the rsqrt
# (inv_bits = 15) and of L1's reciprocal (inv_bits = 16).
EPS_RESOLUTION_BITS = 16


# --------------------------------------------------------------------------- parameters


@dataclass(frozen=True, eq=False)
class FloatParams:
    """The float γ, β, ε an op was quantized from: its float reference uses them."""

    gamma: np.ndarray
    beta: np.ndarray
    eps: float

    @classmethod
    def checked(cls, gamma: Any, beta: Any, eps: Any) -> FloatParams:
        g = _real_array("gamma", gamma)
        if g.ndim != 1 or g.size == 0:
            raise ValueError(f"gamma must be a non-empty 1-D vector, one value per row element; got shape {g.shape}")
        b = np.zeros_like(g) if beta is None else _real_array("beta", beta)
        if b.shape != g.shape:
            raise ValueError(f"beta has shape {b.shape} but gamma has {g.shape}: both need one value per row element")
        e = _real_array("eps", eps)
        if e.ndim != 0:
            raise ValueError(f"eps must be a scalar, got shape {e.shape}")
        if e < 0:
            raise ValueError(f"eps must be >= 0, got {float(e)!r}")
        return cls(g, b, float(e))


def _real_array(name: str, value: Any) -> np.ndarray:
    a = np.asarray(value)
    if a.dtype.kind not in "fiu" or a.dtype == np.bool_:
        raise ValueError(f"{name} must be real-valued, got dtype {a.dtype}")
    a = a.astype(np.float64)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains NaN or Inf; it needs a finite value")
    return a


# --------------------------------------------------------------------------- exact constants


def round_rational(q: Fraction) -> int:
    """Round half up, exactly (constants are derived with the default tie rule)."""
    return fp.round_fraction(q)


def ceil_root(q: Fraction, p: int) -> int:
    """Smallest integer c >= 0 with c^p >= q (q >= 0), exactly."""
    c = math.ceil(q)
    if p == 1:
        return c
    r = math.isqrt(c)
    return r if r * r >= c else r + 1  # r^2 >= q  <=>  r^2 >= ceil(q)


def floor_root(q: Fraction, p: int) -> int:
    """Largest integer c >= 0 with c^p <= q (q >= 0), exactly."""
    c = math.floor(q)
    return c if p == 1 else math.isqrt(c)  # r^2 <= q  <=>  r^2 <= floor(q)


def ceil_log2(v: float) -> int:
    """Smallest k with 2^k >= v, for v > 0, from the float's exact value."""
    q = Fraction(v)
    k = q.numerator.bit_length() - q.denominator.bit_length()
    while Fraction(2) ** k < q:
        k += 1
    while Fraction(2) ** (k - 1) >= q:
        k -= 1
    return k


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class NormConfig(abc.ABC):
    """The integer configuration of a normalization op (validated, immutable).

    ``gain``/``bias``/``shift``: per-channel output multipliers m_c, biases B_c (in
    ``2^-shift`` output LSB) and their one shared shift.  ``eps``: ε_int, the
    integer added to the scaled statistic, i.e. ε in units of ``2^(-p·eps_shift)``
    of the op's statistic S (module docstring, stage 1).  ``eps_shift``: g, the
    guard bits (per p) that give ε that fractional resolution.  ``frac_bits``: F_z
    of the normalized value.  ``mant_bits``: width of the mantissa fed to the
    per-row inverse.
    """

    n: int
    in_fmt: QFormat
    out_fmt: QFormat
    gain: tuple[int, ...]
    shift: int
    bias: tuple[int, ...]
    eps: int
    frac_bits: int
    mant_bits: int
    rounding: Round = DEFAULT_ROUND
    eps_shift: int = 0

    p: ClassVar[int] = 2  # the statistic is W ~ scale^p: 2 takes a square root
    default_mant_bits: ClassVar[int] = 30

    def __post_init__(self) -> None:
        object.__setattr__(self, "rounding", Round.parse(self.rounding))
        check_int("n", self.n, 1)
        for name in ("in_fmt", "out_fmt"):
            if not isinstance(getattr(self, name), QFormat):
                raise ValueError(f"{name} must be a QFormat, got {type(getattr(self, name)).__name__}")
        if not IN_BITS[0] <= self.in_fmt.bits <= IN_BITS[1]:
            raise ValueError(
                f"input formats of {IN_BITS[0]} to {IN_BITS[1]} bits are supported, got {self.in_fmt.bits}"
            )
        for name in ("gain", "bias"):
            object.__setattr__(self, name, _int_tuple(name, getattr(self, name), self.n))
        check_int("shift", self.shift, 0, 62)
        check_int("eps", self.eps, 0)
        check_int("eps_shift", self.eps_shift, 0, 62 // self.p)
        check_int("mant_bits", self.mant_bits, 2 * self.p, 40)
        if self.p == 2 and self.mant_bits % 2:
            # An even width keeps M in [2^(mb-1), 2^(mb+1)), whose rsqrt never lands on a
            # power of two: r needs exactly inv_bits + 1 bits.
            raise ValueError(f"mant_bits must be even for a square-root statistic, got {self.mant_bits}")
        self._check_inverse()
        check_int("frac_bits", self.frac_bits, 0, self.inv_frac_bits)

    @abc.abstractmethod
    def _check_inverse(self) -> None:
        """Op-specific limits of the per-row inverse (fixedpoint's operand ranges)."""

    @property
    @abc.abstractmethod
    def inv_frac_bits(self) -> int:
        """F_r: ``r ≈ 2^F_r / M^(1/p)``."""

    @property
    def pre_shift(self) -> int:
        """h: the op's power-of-two pre-scale of the numerator (z ≈ 2^(F_z+h) num / S^(1/p))."""
        return 0

    @property
    def num_shift(self) -> int:
        """H = h + g: the numerator's shift against W = S·2^(p g) + ε_int (stage 3)."""
        return self.pre_shift + self.eps_shift

    def gain_factor(self) -> float:
        """The op's real constant G folded into every γ multiplier (1 for LayerNorm)."""
        return 1.0

    @abc.abstractmethod
    def eps_exact(self, eps: float) -> Fraction:
        """ε_S: ε (real units of the normalized statistic) in units of S, exactly."""


def check_int(name: str, v: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo or (hi is not None and v > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be an integer {rng}, got {v!r}")


def _int_tuple(name: str, values: Any, n: int) -> tuple[int, ...]:
    a = np.asarray(values)
    if a.dtype.kind not in "iu" or a.shape != (n,):
        raise ValueError(f"{name} must be {n} integers (one per row element), got dtype {a.dtype} shape {a.shape}")
    return tuple(int(v) for v in a)


def rsqrt_mode(mode: Round) -> Round:
    """The rsqrt rounding matching ``mode``.

    2^F/sqrt(M) = k + 1/2 needs (2k+1)^2 to divide 4^(F+1), i.e. k = 0; here
    r >= 2^(inv_bits - 1/2) > 1, so there are no ties and every nearest mode is
    half up; r > 0, so truncation is floor.
    """
    if mode in (Round.FLOOR, Round.CEIL):
        return mode
    return Round.FLOOR if mode is Round.TRUNC else Round.HALF_UP


# --------------------------------------------------------------------------- shared statistics


def centered(x: Any, n: int, trace: Trace | None) -> tuple[Any, Any]:
    """Row sum S and the exactly centered d = N·x − S (= N (x − mean), no 1/N)."""
    s = record(trace, "sum", row_sum(x))
    return s, record(trace, "centered", n * x - s)


def centered_ranges(rep: RangeReport, cfg: NormConfig) -> int:
    """Adds sum and centered; returns D = max |d| = (N−1)(hi − lo).

    |d_i| = |Σ_j (x_i − x_j)| <= (N−1)(hi − lo), reached by one element at an end
    of the range and the others at the other end.
    """
    x = Interval(cfg.in_fmt.lo, cfg.in_fmt.hi)
    rep.add("sum", x * cfg.n)
    d = (cfg.n - 1) * (x.hi - x.lo)
    rep.add("centered", Interval(-d, d))
    return d


def eps_guard_bits(eps_s: Fraction, stat_hi: int, p: int) -> int:
    """g for ``W = S·2^(p g) + round(ε_S 2^(p g))`` (module docstring, stage 1).

    The smallest g >= 0 with ε_S 2^(p g) >= 2^EPS_RESOLUTION_BITS — 0 when ε = 0 —
    lowered until W's largest value, ``stat_hi·2^(p g) + ε_int``, fits the 63-bit
    check (< 2^62).  The op's full range analysis may lower it further
    (``NormOp._build``).
    """
    if eps_s <= 0:
        return 0
    q = Fraction(1 << EPS_RESOLUTION_BITS) / eps_s  # need 2^(p g) >= q
    k = max(q.numerator.bit_length() - q.denominator.bit_length() + 1, 0)  # 2^k >= q
    while k > 0 and Fraction(1 << (k - 1)) >= q:
        k -= 1
    g = min(-(-k // p), 61 // p)
    while g > 0 and (stat_hi << (p * g)) + round_rational(eps_s * (1 << (p * g))) >= 1 << 62:
        g -= 1
    return g


def add_eps(s: Any, cfg: NormConfig, trace: Trace | None) -> Any:
    """Stage 1's last step, the same for every op: ``W = S·2^(p g) + ε_int``."""
    pg = cfg.p * cfg.eps_shift
    return record(trace, "stat", (s << pg if pg else s) + cfg.eps)


def add_eps_ranges(rep: RangeReport, raw: StatBounds, cfg: NormConfig) -> StatBounds:
    """W's range, and the op's relation moved to units of W.

    The op proves ``|num|^p <= min(kappa S, cap)`` with S = (W − ε_int) / 2^(p g),
    so in units of W the slope is kappa / 2^(p g) and the offset ε_int.
    """
    pg = cfg.p * cfg.eps_shift
    w = rep.add("stat", Interval(raw.w.lo << pg, raw.w.hi << pg) + cfg.eps)
    return replace(raw, w=w, kappa=raw.kappa / (1 << pg), eps=cfg.eps)


# --------------------------------------------------------------------------- stages 2 and 3


def split_exponent(w: Any, cfg: NormConfig, stat_bits: int, trace: Trace | None) -> tuple[Any, Any]:
    """``W = M · 2^(p·e)`` with bit_length(M) in [mant_bits, mant_bits + p − 1].

    e = floor((bit_length(W) − mant_bits) / p); the shift is right (truncating
    low bits) for e > 0 and left (exact) for e < 0, written branch-free as one
    rounding shift by max(e, 0) and one left shift by max(−e, 0).  W = 0 (a
    constant row with ε = 0: every numerator is 0) is treated as 1; z is 0 then
    whatever r is.
    """
    p = cfg.p
    w = select(w > 0, w, w * 0 + 1)
    e = record(trace, "exp", (bit_length(w, stat_bits) - cfg.mant_bits) >> (p - 1))
    up = select(e > 0, e, e * 0)
    down = up - e
    m = rshift_round(w, up << (p - 1), Round.FLOOR) << (down << (p - 1))
    return e, record(trace, "mant", m)


def shift_numerator(num: Any, e: Any, cfg: NormConfig, trace: Trace | None) -> Any:
    """``u = num · 2^(H − e)``, H = h + g: exact for e <= H, rounded by the config's mode above."""
    t = e - cfg.num_shift
    up = select(t > 0, t, t * 0)
    return record(trace, "num_scaled", rshift_round(num, up, cfg.rounding) << (up - t))


def exponent_segments(w_iv: Interval, cfg: NormConfig) -> dict[int, Interval]:
    """For each exponent e a row can have, the values of W that give it.

    bit_length(W) in [mb + p e, mb + p e + p − 1] (W = 0 counts as 1).
    """
    p, mb = cfg.p, cfg.mant_bits
    w = Interval(max(w_iv.lo, 1), max(w_iv.hi, 1))
    out = {}
    for e in range((w.lo.bit_length() - mb) >> (p - 1), ((w.hi.bit_length() - mb) >> (p - 1)) + 1):
        lo = max(w.lo, 1 << max(mb + p * e - 1, 0))
        hi = min(w.hi, (1 << (mb + p * e + p - 1)) - 1)
        if lo <= hi:
            out[e] = Interval(lo, hi)
    return out


def mantissa_range(e: int, seg: Interval, cfg: NormConfig) -> Interval:
    """M over one exponent's segment: monotone in W (a floor shift or a left shift)."""
    return seg.rshift(cfg.p * e, Round.FLOOR) if e > 0 else seg * (1 << (-cfg.p * e))


@dataclass(frozen=True)
class StatBounds:
    """What stage 1 guarantees about a row's elements.

    ``w``: W's range; ``num``: the numerator's range.  Elements that enter the
    statistic satisfy ``|num|^p <= min(kappa (W − eps), cap)`` (``cap`` is
    max |num|^p).  ``outside``: elements that do not enter it (partial RMSNorm)
    only satisfy ``|num|^p <= outside``, whatever W is.  An op states this for its
    raw statistic S (``w`` = S's range, ``eps`` = 0, its proven kappa);
    :func:`add_eps_ranges` moves it to W = S·2^(p g) + ε_int.
    """

    w: Interval
    num: Interval
    kappa: Fraction
    cap: int
    outside: int | None = None
    eps: int = 0

    def ratio_on(self, seg: Interval) -> Fraction:
        """sup |num|^p / W over W in ``seg`` (seg.lo >= 1).

        min(kappa (W − eps), cap) / W increases with W up to the kink
        W* = cap/kappa + eps and decreases after it, so the sup is at the kink
        clipped to the segment.
        """
        best = Fraction(0)
        if self.kappa:
            kink = min(max(Fraction(self.cap) / self.kappa + self.eps, Fraction(seg.lo)), Fraction(seg.hi))
            best = max(min(self.kappa * (kink - self.eps), Fraction(self.cap)), Fraction(0)) / kink
        if self.outside is not None:
            best = max(best, Fraction(self.outside, seg.lo))
        return best


def numerator_by_exponent(cfg: NormConfig, stat: StatBounds, segs: dict[int, Interval]) -> dict[int, Interval]:
    """Range of u = num · 2^(H − e) for each exponent e (H = h + g: ``num_shift``).

    Absolute: num's range scaled by 2^(H − e) (rounded when e > H).
    Relational: |num|^p <= ratio_e · W with W <= W_hi(e), so the real u has
    |u|^p <= ratio_e · W_hi(e) · 2^(p (H−e)); rounding (e > H) adds at most 1.
    The relational side is what keeps u narrow: u tracks the normalized value,
    scaled to the mantissa, and rows with a large W cannot have a numerator near
    the format's limit scaled up by a small exponent.
    """
    p, h = cfg.p, cfg.num_shift
    out = {}
    for e, seg in segs.items():
        t = e - h
        rel = floor_root(stat.ratio_on(seg) * seg.hi * Fraction(2) ** (p * -t), p) + (t > 0)
        a = stat.num.rshift(t, cfg.rounding) if t > 0 else stat.num * (1 << -t)
        lo, hi = max(a.lo, -rel), min(a.hi, rel)
        if lo <= hi:
            out[e] = Interval(lo, hi)
    return out


def product_bound(
    cfg: NormConfig, stat: StatBounds, segs: dict[int, Interval], by_exp: dict[int, Interval], r_max: int
) -> int:
    """max |u · r| when r = round(2^F_r / M^(1/p)) (any rounding: error <= 1).

    Per exponent e, with X = W / 2^(p e) in [X_lo, X_hi] (real) and
    R^p = ratio_e · 2^(p H) (H = h + g):  M = X exactly when e <= 0, M > X − 1 when
    e > 0 (truncated); |u| <= R X^(1/p), plus 1 when u is rounded (e > H).  So

      |u r| <= (R X^(1/p) + 1) (2^F_r / (X − 1)^(1/p) + 1)
            = R 2^F_r (X/(X−1))^(1/p) + R X^(1/p) + 2^F_r/(X−1)^(1/p) + 1

    where X/(X−1) is largest at X_lo and each correction is dropped when its
    rounding cannot happen at that e.  The first term is the relational bound
    R 2^F_r itself, reached by the op's extremal row (LayerNorm's [a, b, …, b]);
    the others are below 2^-13 of it.  Where u's own range is small (large e),
    max|u| · max r is the tighter bound.
    """
    p, f, h = cfg.p, cfg.inv_frac_bits, cfg.num_shift
    best = 0
    for e, u in by_exp.items():
        seg, truncated, rounded = segs[e], e > 0, e > h
        rp = stat.ratio_on(seg) * (1 << (p * h))
        x_lo, x_hi = (Fraction(v) / Fraction(2) ** (p * e) for v in (seg.lo, seg.hi))
        main = ceil_root(rp * (1 << (p * f)) * x_lo / (x_lo - truncated), p)
        r_err = ceil_root(rp * x_hi, p)
        u_err = ceil_root(Fraction(1 << (p * f)) / (x_lo - truncated), p) + 1 if rounded else 0
        best = max(best, min(main + r_err + u_err, max(-u.lo, u.hi) * r_max))
    return best


# --------------------------------------------------------------------------- the op skeleton


class NormOp(IntOp):
    """A row normalization: statistic, one per-row inverse, affine output.

    Subclasses provide the statistic (``_statistic`` / ``_statistic_ranges``) and
    the per-row inverse (``_inverse`` / ``_inverse_range``); the rest is shared.
    """

    config_cls: ClassVar[type[NormConfig]]
    inverse_name: ClassVar[str]

    def __init__(self, config: NormConfig, params: FloatParams) -> None:
        if not isinstance(config, self.config_cls):
            raise ValueError(f"{type(self).__name__} needs a {self.config_cls.__name__}, got {type(config).__name__}")
        if params.gamma.shape != (config.n,):
            raise ValueError(f"float parameters have {params.gamma.size} channels, the config {config.n}")
        self.config = config
        self.params = params
        self.in_fmt = config.in_fmt
        self.out_fmt = config.out_fmt
        self._gain = np.asarray(config.gain, dtype=np.int64)
        self._bias = np.asarray(config.bias, dtype=np.int64)
        report = self.ranges().check()
        self._stat_bits = max(1, report["stat"].hi.bit_length())

    # ---- construction from floats

    @classmethod
    def _build(
        cls,
        gamma: Any,
        beta: Any,
        eps: Any,
        in_fmt: QFormat,
        out_fmt: QFormat,
        frac_bits: int | None,
        mant_bits: int | None,
        mult_bits: int,
        rounding: Round | str,
        **op_fields: Any,
    ) -> NormOp:
        """Quantize float parameters into a config, deterministically.

        γ_c · G / s_out (G: the op's constant) becomes ``m_c / 2^(s − F_z)``; ε
        becomes ``ε_int = round(ε_S 2^(p g))`` (exact rational, rounded half up) with
        the guard g of :func:`eps_guard_bits`, lowered further while the range
        analysis refuses the config (g = 0 is the plain integer ε); β_c becomes
        ``round(β_c 2^s / s_out)``, clipped where the output saturates anyway.
        """
        params = FloatParams.checked(gamma, beta, eps)
        n = params.gamma.size
        zeros = (0,) * n
        base = cls.config_cls(
            n=n,
            in_fmt=in_fmt,
            out_fmt=out_fmt,
            gain=zeros,
            shift=0,
            bias=zeros,
            eps=0,
            frac_bits=0,
            mant_bits=cls.config_cls.default_mant_bits if mant_bits is None else mant_bits,
            rounding=rounding,
            **op_fields,
        )
        real_gain = params.gamma * base.gain_factor() / out_fmt.scale
        if frac_bits is None:
            frac_bits = default_frac_bits(real_gain, base.inv_frac_bits)
        # A shift beyond 59 − out_bits would put the clipped bias past 62 bits; at
        # that shift a gain of one multiplier LSB moves the output by < 2^-30 LSB.
        max_shift = 59 - out_fmt.bits
        gain, shift = cls._quantize_gain(np.ldexp(real_gain, -frac_bits), mult_bits, max_shift)
        cfg = replace(base, gain=gain, shift=shift, frac_bits=frac_bits)
        eps_s = cfg.eps_exact(params.eps)
        rep = RangeReport(cls.name)
        stat_hi = cls._statistic_ranges(cfg, rep).w.hi
        rep.check()
        g = eps_guard_bits(eps_s, stat_hi, cfg.p)
        while True:
            cfg = replace(cfg, eps=round_rational(eps_s * (1 << (cfg.p * g))), eps_shift=g)
            try:
                z = cls(cfg, params).ranges()["z"]
                break
            except OverflowRiskError:
                if g == 0:
                    raise
                g -= 1
        return cls(replace(cfg, bias=_output_bias(params.beta, cfg, max(-z.lo, z.hi))), params)

    @classmethod
    def _quantize_gain(cls, gains: np.ndarray, mult_bits: int, max_shift: int) -> tuple[tuple[int, ...], int]:
        """Per-channel multipliers sharing one shift (a shift-only op overrides this)."""
        m, s = fp.dyadic_vector(gains, mult_bits, max_shift)
        return tuple(int(v) for v in m), s

    # ---- the integer forward

    def forward(self, x: np.ndarray, trace: Trace | None = None) -> np.ndarray:
        """Validate ``x`` (integer dtype, in ``in_fmt``, last axis N) and run the forward."""
        arr = np.asarray(x)
        if arr.ndim == 0 or arr.shape[-1] != self.config.n:
            raise ValueError(f"{self.name} normalizes rows of {self.config.n} elements; got input shape {arr.shape}")
        return self._forward(self.in_fmt.check(arr), trace)

    def _forward(self, x: Any, trace: Trace | None) -> Any:
        cfg = self.config
        s, num = self._statistic(x, trace)
        w = add_eps(s, cfg, trace)
        e, m = split_exponent(w, cfg, self._stat_bits, trace)
        inv = self._inverse(m, trace)
        u = shift_numerator(num, e, cfg, trace)
        prod = record(trace, "prod", self._product(u, inv, trace))
        z = record(trace, "z", rshift_round(prod, cfg.inv_frac_bits - cfg.frac_bits, cfg.rounding))
        return self._output(z, trace)

    def _product(self, u: Any, inv: Any, trace: Trace | None) -> Any:
        return u * inv

    def _scale(self, z: Any) -> Any:
        return z * const_like(z, self._gain)

    def _output(self, z: Any, trace: Trace | None) -> Any:
        cfg = self.config
        scaled = record(trace, "scaled", self._scale(z))
        acc = record(trace, "acc", scaled + const_like(scaled, self._bias))
        y = record(trace, "y", rshift_round(acc, cfg.shift, cfg.rounding))
        return record(trace, "out", saturate(y, cfg.out_fmt.bits, cfg.out_fmt.signed))

    # ---- static ranges

    def ranges(self) -> RangeReport:
        """Every intermediate's exact bounds.  The report is checked against 63 bits
        at stage ends, before a bound too wide for fixedpoint's operands is shifted."""
        cfg = self.config
        rep = RangeReport(self.name)
        stat = add_eps_ranges(rep, self._statistic_ranges(cfg, rep), cfg)
        rep.check()
        segs = exponent_segments(stat.w, cfg)
        rep.add("exp", Interval(min(segs), max(segs)))
        mants = [mantissa_range(e, seg, cfg) for e, seg in segs.items()]
        m_iv = rep.add("mant", Interval(min(m.lo for m in mants), max(m.hi for m in mants)))
        inv = rep.add(self.inverse_name, self._inverse_range(m_iv))
        z = self._normalized_ranges(stat, segs, inv, rep)
        self._output_ranges(rep, self._channel_z(stat, segs, inv, z))
        return rep

    def _normalized_ranges(
        self, stat: StatBounds, segs: dict[int, Interval], inv: Interval, rep: RangeReport | None
    ) -> Interval:
        """num_scaled, prod and z (recorded when ``rep`` is given)."""
        cfg = self.config
        by_exp = numerator_by_exponent(cfg, stat, segs)
        u = Interval(min(v.lo for v in by_exp.values()), max(v.hi for v in by_exp.values()))
        if rep is not None:
            rep.add("num_scaled", u)
        big = self._product_bound(stat, segs, by_exp, inv, rep)
        prod = Interval(-big, big)
        if rep is not None:
            rep.add("prod", prod)
            rep.check()
        z = prod.rshift(cfg.inv_frac_bits - cfg.frac_bits, cfg.rounding)
        return z if rep is None else rep.add("z", z)

    def _product_bound(
        self,
        stat: StatBounds,
        segs: dict[int, Interval],
        by_exp: dict[int, Interval],
        inv: Interval,
        rep: RangeReport | None,
    ) -> int:
        return product_bound(self.config, stat, segs, by_exp, inv.hi)

    def _channel_z(self, stat: StatBounds, segs: dict[int, Interval], inv: Interval, z: Interval) -> list[Interval]:
        """z's range per channel (an op whose channels differ overrides this)."""
        return [z] * self.config.n

    def _output_ranges(self, rep: RangeReport, zs: list[Interval]) -> None:
        """scaled, acc, y, out as hulls of per-channel ranges; a channel's z reaches
        both ends (the extremal row can put its odd element anywhere), so they are
        tight."""
        cfg = self.config
        prods = [z * m for z, m in zip(zs, cfg.gain)]
        rep.add("scaled", Interval(min(v.lo for v in prods), max(v.hi for v in prods)))
        sums = [v + b for v, b in zip(prods, cfg.bias)]
        acc = rep.add("acc", Interval(min(v.lo for v in sums), max(v.hi for v in sums)))
        rep.check()
        y = rep.add("y", acc.rshift(cfg.shift, cfg.rounding))
        rep.add("out", y.clamp(cfg.out_fmt.lo, cfg.out_fmt.hi))

    # ---- op hooks

    @abc.abstractmethod
    def _statistic(self, x: Any, trace: Trace | None) -> tuple[Any, Any]:
        """(S per row with keepdims, numerator per element), ε not yet added;
        records its intermediates."""

    @classmethod
    @abc.abstractmethod
    def _statistic_ranges(cls, cfg: NormConfig, rep: RangeReport) -> StatBounds:
        """Adds the statistic's intermediates; returns what they guarantee about
        S (``w``: S's range, ``eps`` 0).  A function of the config alone."""

    @abc.abstractmethod
    def _inverse(self, m: Any, trace: Trace | None) -> Any:
        """The per-row inverse of the mantissa (records it under ``inverse_name``)."""

    @abc.abstractmethod
    def _inverse_range(self, m_iv: Interval) -> Interval:
        """Exact range of the inverse over the mantissa's range."""

    @abc.abstractmethod
    def cost(self) -> dict[str, dict[str, int]]:
        """Operation counts: ``per_row`` (statistic reductions included) and
        ``per_element`` (the path each output element takes)."""

    # ---- float reference helpers

    def float_rows(self, x: np.ndarray) -> Any:
        import torch

        a = np.asarray(x, dtype=np.float64)
        if a.ndim == 0 or a.shape[-1] != self.config.n:
            raise ValueError(f"{self.name} normalizes rows of {self.config.n} elements; got input shape {a.shape}")
        return torch.from_numpy(a)

    def float_affine(self, normalized: Any) -> np.ndarray:
        import torch

        g = torch.from_numpy(self.params.gamma)
        b = torch.from_numpy(self.params.beta)
        return (normalized * g + b).numpy()


def default_frac_bits(real_gain: np.ndarray, limit: int) -> int:
    """F_z with z's rounding GUARD_BITS below the output LSB of the largest gain.

    z's LSB moves the output by |γ G / s_out| / 2^F_z LSB; rounding z costs half
    of that, so F_z = ceil(log2 max|γ G / s_out|) + GUARD_BITS keeps it below
    2^-(GUARD_BITS+1) LSB.  Limited to [0, F_r] (z cannot be finer than r).
    """
    big = float(np.max(np.abs(real_gain)))
    want = ceil_log2(big) + GUARD_BITS if big > 0 else GUARD_BITS
    return min(max(want, 0), limit)


def _output_bias(beta: np.ndarray, cfg: NormConfig, z_abs: int) -> tuple[int, ...]:
    """``B_c = round(β_c 2^s / s_out)``, clipped to where the output saturates anyway.

    With |z · m_c| <= Z_c, a bias B >= (hi + 1) 2^s + Z_c gives acc >= (hi + 1) 2^s,
    so y >= hi + 1 under every rounding mode and the output is hi — as it is for
    any larger B (y is monotone in B).  Symmetrically below.  So clipping B there
    changes no output and keeps acc inside the range check for any finite β.
    """
    s_out = Fraction(cfg.out_fmt.scale)
    top, bottom = (cfg.out_fmt.hi + 1) << cfg.shift, (cfg.out_fmt.lo - 1) << cfg.shift
    out = []
    for b, m in zip(beta.tolist(), cfg.gain):
        b_int = round_rational(Fraction(b) * (1 << cfg.shift) / s_out)
        reach = z_abs * abs(m)
        out.append(min(max(b_int, bottom - reach), top + reach))
    return tuple(out)
