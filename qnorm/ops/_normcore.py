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
   smallest with ``(S_min + ε_S)·2^(p·g) >= 2^EPS_RESOLUTION_BITS``, S_min the
   least non-zero statistic of a row whose output ε moves (``_stat_floor``: N − 1
   for the variance, 2(N − 1) for L1's, 1 for Σx², 0 for a partial Σx² whose
   zero prefix leaves the other elements non-zero): ε's rounding then moves W by
   at most 2^-17 of itself.  It is lowered while the range analysis would refuse
   it or, in the narrow datapath, while W would leave ``NARROW_ROW_BITS`` (a
   DSP48's accumulator), and 0 when ε = 0 or ε is already that fine.  The numerator's pre-scale grows by g to
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
3. **Normalize, in the datapath's lanes.**  The normalized value in Q.F_z is
   ``z ≈ 2^(F_z + H) · num / W^(1/p) = 2^(F_z + h) · num / (S + ε_S)^(1/p)`` with
   ``H = h + g`` (``num_shift``: ``h`` an op's power-of-two pre-scale, g the ε
   guard of stage 1).  The numerator is ``num = N·x − Σx`` (centered ops) or
   ``x`` (RMSNorm), so per row the inverse is folded into one multiplier of the
   raw input and one offset (**mult**, **offset**, one shift **z_shift**)::

       a = round(N·r / 2^j),  c = round(Σx · r / 2^j),  K = F_r + e − F_z − H − j
       xa = x·a − c,          z = round(xa / 2^K)   (exact left shift when K <= 0)

   The constant ``j`` (``mult_shift``, from the row analysis) is the smallest
   that keeps ``xa`` inside the datapath's lanes (``lanes``: 32 for int4/int8
   inputs, so ``a`` has ~22 bits against an 8-bit x).  The per-element chain never
   carries the log2 N redundant bits of ``N·x − Σx``; a and c round once (error
   below |x| + 1 units of xa, bounded and measured), and with j = 0 they are exact.
4. **Affine output.**  ``acc = z · m_c + B_c``, ``y = round(acc / 2^s)``, saturate.
   ``m_c / 2^s`` folds γ_c, the op's constant factor and 1/s_out; ``B_c`` is β_c in
   units of ``2^-s`` output LSB, so β is added at full accumulator precision and
   the output is rounded once (error ≤ 1/2 LSB from this stage, not 1).  In the
   lanes this runs as ``zc = clamp(z, lo_c, hi_c) − o_c``, ``acc = zc · m_c + b_c``
   with ``b_c = B_c + o_c m_c`` (:class:`OutputWindow`): z is clamped to the
   channel's window outside which the output saturates anyway, and recentred, so
   every term stays narrow while the output is exactly the unclamped formula's.

The range analysis mirrors the stages: exact intervals where they are tight, and
for the normalized value a proven relational bound: every op shows
``|num|^p <= kappa · S`` for the elements its statistic sums (LayerNorm:
d² <= (N−1) V; L1: |d| <= A/2; RMS: x² <= Q), i.e. ``|num|^p <= kappa 2^(-p g)
(W − ε_int)`` in units of W, which bounds u, u · r and z per exponent of W
(:class:`StatBounds`).
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction
from typing import Any, ClassVar, TypeVar

import numpy as np

from qnorm import fixedpoint as fp
from qnorm.analysis import Interval, OverflowRiskError, RangeReport
from qnorm.fixedpoint import (
    DEFAULT_ROUND,
    Round,
    bit_length,
    clamp,
    div_round,
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
# ε is added to the statistic with this many bits below the least W it matters to
# (stage 1): its rounding moves W by <= 2^-17 of itself, below the 2^-16 of the rsqrt
# (inv_bits = 15) and of L1's reciprocal (inv_bits = 16).
EPS_RESOLUTION_BITS = 16
# Per-element datapaths (``NormConfig.lanes``): every per-element intermediate of
# the op must fit one lane less a bit of rounding headroom.  32 is what every
# target shares (x86/Arm/RISC-V int32 vector lanes, GPU int32, a DSP48's ports);
# 64 is the wide datapath (int16 inputs), a named choice.
LANES = (32, 64)
# The narrow datapath's per-row statistic W fits a DSP48's 48-bit accumulator, less the
# rounding bit every accumulator keeps: ε's guard bits stop there (eps_guard_bits).
NARROW_ROW_BITS = 47
# The per-element intermediates, in evaluation order: what ``lanes`` bounds.
ELEMENT_STAGES = ("xa", "z", "zc", "scaled", "acc", "y", "out")
# The definition's version, recorded with checkpoints and golden vectors (what each
# changed: DEFINITION_NOTES).
DEFINITION_VERSION = 3
# What each version changed (refusals of stored integers say it).
DEFINITION_NOTES = {
    2: "narrow lanes: the per-row inverse is folded into a multiplier and offset of the raw input, "
    "and the output stage runs in a clamped per-channel window",
    3: "eps guard bits sized against the least non-zero statistic, not eps alone, and for int4/int8 "
    "rows stopped where the statistic plus eps would leave a 48-bit accumulator",
}
# Gain multiplier widths: 16 bits for outputs of up to 8 bits (a gain LSB moves
# an int8 output by < 2^-8 LSB), 24 above.
MULT_BITS, WIDE_MULT_BITS = 16, 24


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
        return cls(g, b, cls.checked_eps(eps))

    @staticmethod
    def checked_eps(eps: Any) -> float:
        """ε as a float, refused unless it is a finite real scalar >= 0."""
        if type(eps) is float and 0.0 <= eps < math.inf:  # the common case, without an array
            return eps
        e = _real_array("eps", eps)
        if e.ndim != 0:
            raise ValueError(f"eps must be a scalar, got shape {e.shape}")
        if e < 0:
            raise ValueError(f"eps must be >= 0, got {float(e)!r}")
        return float(e)


def _real_array(name: str, value: Any) -> np.ndarray:
    """``value`` as a new float64 array, refused unless real-valued and finite."""
    a = np.asarray(value)
    if a.dtype.kind not in "fiu":  # a bool array's kind is "b"
        raise ValueError(f"{name} must be real-valued, got dtype {a.dtype}")
    a = a.astype(np.float64)
    if not np.isfinite(a).all():
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
    """Smallest k with 2^k >= v, for a finite v > 0, from the float's exact value."""
    if not math.isfinite(v):
        raise ValueError(f"ceil_log2 of {v}: a gain must be finite")
    f, k = math.frexp(v)  # v = f 2^k, f in [1/2, 1): 2^(k-1) <= v < 2^k, the lower end only at f = 1/2
    return k - 1 if f == 0.5 else k


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
    lanes: int = 64

    p: ClassVar[int] = 2  # the statistic is W ~ scale^p: 2 takes a square root
    default_mant_bits: ClassVar[int] = 30
    centered: ClassVar[bool] = True  # num = N·x − Σx (False: num = x)

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
        if self.lanes not in LANES:
            raise ValueError(f"lanes (the per-element datapath width) must be one of {LANES}, got {self.lanes!r}")
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

    @property
    def num_mult(self) -> int:
        """The multiplier of x in the numerator: N (``N·x − Σx``) or 1 (``x``)."""
        return self.n if self.centered else 1

    def gain_factor(self) -> float:
        """The op's real constant G folded into every γ multiplier (1 for LayerNorm)."""
        return 1.0

    @abc.abstractmethod
    def eps_exact(self, eps: float) -> Fraction:
        """ε_S: ε (real units of the normalized statistic) in units of S, exactly."""


NormConfigT = TypeVar("NormConfigT", bound=NormConfig)


def derived_config(cfg: NormConfigT, **changes: Any) -> NormConfigT:
    """``dataclasses.replace(cfg, **changes)`` without re-running the validation, for
    values the derivation formed itself and that pass it by construction (each
    caller says why).  A QAT layer derives its op every training step, and
    re-validating a config it just built is a large part of that cost.  The copy
    shares the other fields' values (immutable) but no property cached on ``cfg``
    (a ``cached_property`` may read a changed field), and refuses a name that is
    not a field."""
    names = _field_names(type(cfg))
    unknown = set(changes) - names
    if unknown:
        raise TypeError(f"{type(cfg).__name__} has no field(s) {sorted(unknown)}")
    new = object.__new__(type(cfg))
    new.__dict__.update({name: cfg.__dict__[name] for name in names})
    new.__dict__.update(changes)
    return new


@functools.cache
def _field_names(cfg_cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cfg_cls))


def check_int(name: str, v: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo or (hi is not None and v > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be an integer {rng}, got {v!r}")


def _int_tuple(name: str, values: Any, n: int) -> tuple[int, ...]:
    if type(values) is tuple and len(values) == n and set(map(type, values)) == {int}:
        try:  # a tuple of Python ints that fit int64 (what replace() passes on): kept as it is
            np.array(values, dtype=np.int64)
            return values
        except OverflowError:
            pass  # the general rule below decides (uint64 or refused)
    a = np.asarray(values)
    if a.dtype.kind not in "iu" or a.shape != (n,):
        raise ValueError(f"{name} must be {n} integers (one per row element), got dtype {a.dtype} shape {a.shape}")
    return tuple(a.tolist())  # Python ints, as int(v) would give, without a loop in Python


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


def centered_ranges(rep: RangeReport, cfg: NormConfig, record_centered: bool = True) -> int:
    """Adds sum (and centered, for a statistic that forms d); returns
    D = max |d| = (N−1)(hi − lo), the numerator's bound.

    |d_i| = |Σ_j (x_i − x_j)| <= (N−1)(hi − lo), reached by one element at an end
    of the range and the others at the other end.
    """
    x = Interval(cfg.in_fmt.lo, cfg.in_fmt.hi)
    rep.add("sum", x * cfg.n)
    d = (cfg.n - 1) * (x.hi - x.lo)
    if record_centered:
        rep.add("centered", Interval(-d, d))
    return d


def round_scaled(q: Fraction, shift: int) -> int:
    """:func:`round_rational` of ``q · 2^shift`` (shift >= 0) in integers:
    ``floor(n 2^s / d + 1/2) = floor((2 n 2^s + d) / (2 d))`` for q = n / d, d > 0.
    A calibrating QAT layer forms ε_int this way every step."""
    d = q.denominator
    return ((q.numerator << (shift + 1)) + d) // (d << 1)


def eps_guard_bits(eps_s: Fraction, stat_hi: int, p: int, stat_floor: int, stat_bits: int) -> int:
    """g for ``W = S·2^(p g) + round(ε_S 2^(p g))`` (module docstring, stage 1).

    ε's rounding moves W by at most 1/2; g makes that at most 2^-(EPS_RESOLUTION_BITS+1)
    of W for every row whose output depends on it.  Those rows have S >= ``stat_floor``
    (the op's :meth:`NormOp._stat_floor`: its least non-zero statistic, or 0 where a zero
    statistic leaves non-zero numerators), so g is the smallest >= 0 with
    ``(stat_floor + ε_S)·2^(p g) >= 2^EPS_RESOLUTION_BITS`` — 0 when ε = 0 —, lowered
    until W's largest value, ``stat_hi·2^(p g) + ε_int``, fits ``stat_bits`` signed bits
    (63, or the narrow datapath's :data:`NARROW_ROW_BITS`).  The op's full range
    analysis may lower it further
    (:meth:`NormOp.channel_rule`).  In integers (stat_floor + ε_S = n / d): the smallest
    k >= 0 with ``n 2^k >= d 2^EPS_RESOLUTION_BITS``, then g = ceil(k / p).
    """
    if eps_s <= 0:
        return 0
    d = eps_s.denominator
    n = eps_s.numerator + stat_floor * d
    need = d << EPS_RESOLUTION_BITS
    # with a, b the bit lengths of n and need, n 2^(b−a−1) < 2^(b−1) <= need <= n 2^(b−a+1):
    # k is b − a or one more (0 when b < a: then n > need)
    k = max(need.bit_length() - n.bit_length(), 0)
    k = k + 1 if n << k < need else k
    g = min(-(-k // p), 61 // p)
    while g > 0 and (stat_hi << (p * g)) + round_scaled(eps_s, p * g) >= 1 << (stat_bits - 1):
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


def row_affine(
    s1: Any, r: Any, e: Any, cfg: NormConfig, mult_shift: int, trace: Trace | None, offset_split: int
) -> tuple[Any, Any, Any]:
    """Stage 3's per-row constants: multiplier a, offset c (0 for an uncentered
    numerator) and the shift K of ``z = round((x·a − c) / 2^K)``.

    With K0 = F_r + e − F_z − H the exact ``z = num · r / 2^K0``.  The row's own
    multiplier shift ``j_r = clamp(K0, 0, j)`` never exceeds K0, so K0 − j_r is
    negative only where j_r = 0 and a, c are exact: the rounding of a and c is
    divided by 2^K, never multiplied.  A negative K0 − j_r (rows of tiny
    variance) is folded into a and c as an exact left shift, so K >= 0 and the
    per-element path has one right shift.  ``c = round(Σx · a / N)``, formed as
    ``a·m + round(D·a / N)`` with ``m = floor(Σx / N)``, ``D = Σx − N m`` (no
    product wider than the row's own values; ``offset_split``: see
    :func:`offset_fraction`): x·a − c then equals ``num · a / N`` within 1, so a
    constant row gives exactly 0.
    """
    a0, c0, up, k = row_affine_parts(s1, r, e, cfg, mult_shift, offset_split)
    a = record(trace, "mult", a0 << up)
    c = record(trace, "offset", c0 << up) if cfg.centered else 0
    return a, c, record(trace, "z_shift", k)


def row_affine_parts(
    s1: Any, r: Any, e: Any, cfg: NormConfig, mult_shift: int, offset_split: int
) -> tuple[Any, Any, Any, Any]:
    """:func:`row_affine` before its exact left shift: ``(a0, c0, up, K)`` with
    ``a = a0 · 2^up`` and ``c = c0 · 2^up`` (c0 = 0 for an uncentered numerator).

    Where up > 0 the row's K is 0 (up = j_r − K0 only where K0 < j_r = 0), so
    ``z = x·a − c = (x·a0 − c0) · 2^up``: a per-element path may run the narrower
    ``x·a0 − c0`` and shift its z left (:mod:`qnorm.nn.elementchain` does)."""
    mode = cfg.rounding
    k0 = e + z_shift_base(cfg)
    jr = clamp(k0, 0, mult_shift)
    up = clamp(jr - k0, 0, 62)  # 2^-(K0 − j_r) folded into a and c where K0 < j_r
    a0 = rshift_round(r * cfg.num_mult, jr, mode)
    if cfg.centered:
        m = div_round(s1, cfg.n, Round.FLOOR)
        c0 = a0 * m + offset_fraction(s1 - m * cfg.n, a0, cfg.n, mode, offset_split)
    else:
        c0 = 0
    return a0, c0, up, k0 - jr + up


def offset_fraction(d: Any, a0: Any, n: int, mode: Round, split: int) -> Any:
    """``round(D·a0 / N)`` for 0 <= D < N and a0 >= 0: the offset's fraction of a row.

    With ``split`` = k >= 1 (:func:`offset_split_bits`: where D·a0 could leave the
    narrow datapath's row accumulator) it is formed from ``a0 = h·2^k + l`` in two
    narrower products: ``D·h = q·N + ρ`` with 0 <= ρ < N, so
    ``D·a0 = q·N·2^k + (ρ·2^k + D·l)`` and ``round(D·a0 / N) = q·2^k + round((ρ·2^k + D·l) / N)``
    in every rounding mode (q·2^k is an even integer: half-even's ties see the same
    parity), with ρ·2^k + D·l < N·2^(k+1).  The same integer on every target, on any
    integer values (numpy, torch, TIR, HDL)."""
    if not split:
        return div_round(d * a0, n, mode)
    h = a0 >> split
    dh = d * h
    q = div_round(dh, n, Round.FLOOR)
    return (q << split) + div_round(((dh - q * n) << split) + d * (a0 - (h << split)), n, mode)


def z_shift_base(cfg: NormConfig) -> int:
    """K0 − e = F_r − F_z − H: the constant part of the row's total shift."""
    return cfg.inv_frac_bits - cfg.frac_bits - cfg.num_shift


def normalize(x: Any, a: Any, c: Any, k: Any, cfg: NormConfig, trace: Trace | None) -> Any:
    """Stage 3 per element: ``z = round((x·a − c) / 2^K)``, in the datapath's lanes."""
    xa = record(trace, "xa", x * a - c)
    return record(trace, "z", rshift_round(xa, k, cfg.rounding))


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
    """M over one exponent's segment: monotone in W (a floor shift or a left shift).

    Python's ``>>`` on ints is the floor shift (``rshift_round(·, s, FLOOR)``)."""
    pe = cfg.p * e
    return Interval(seg.lo >> pe, seg.hi >> pe) if e > 0 else Interval(seg.lo << -pe, seg.hi << -pe)


def _ceil_root_of(num: int, den: int, p: int) -> int:
    """:func:`ceil_root` of ``num / den`` (num >= 0, den > 0) in integers."""
    c = -(-num // den)
    if p == 1:
        return c
    r = math.isqrt(c)
    return r if r * r >= c else r + 1


def _floor_root_of(num: int, den: int, p: int) -> int:
    """:func:`floor_root` of ``num / den`` (num >= 0, den > 0) in integers."""
    c = num // den
    return c if p == 1 else math.isqrt(c)


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
    # ratio_terms per segment (lo, hi): a pure function of the frozen fields and the
    # segment, asked twice per exponent (u's bound and the product bound).  Not an
    # init field, so replace() starts a new instance with an empty memo.
    _ratios: dict[tuple[int, int], tuple[int, int]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def ratio_on(self, seg: Interval) -> Fraction:
        """sup |num|^p / W over W in ``seg`` (seg.lo >= 1); see :meth:`ratio_terms`."""
        return Fraction(*self.ratio_terms(seg))

    def ratio_terms(self, seg: Interval) -> tuple[int, int]:
        """:meth:`ratio_on` as integers ``(n, d)``, d > 0 (not reduced): the sup is n / d.

        min(kappa (W − eps), cap) / W increases with W up to the kink
        W* = cap/kappa + eps and decreases after it, so the sup is at the kink
        clipped to the segment: cap / W* at the kink itself (kappa (W* − eps) =
        cap), cap / lo when the kink lies below the segment (there kappa (lo − eps)
        > cap), max(kappa (hi − eps), 0) / hi when it lies above.  Exact integer
        arithmetic (kappa = kn / kd), so the analysis needs no rationals per row
        exponent; ``tests/test_norm_speed_exact.py`` checks it against the
        rational definition.
        """
        lo, hi = seg.lo, seg.hi
        got = self._ratios.get((lo, hi))
        if got is None:
            got = self._ratios[lo, hi] = self._ratio_terms(lo, hi)
        return got

    def _ratio_terms(self, lo: int, hi: int) -> tuple[int, int]:
        num, den = 0, 1
        kn, kd = self.kappa.numerator, self.kappa.denominator
        if kn:
            kink = self.cap * kd + self.eps * kn  # W* = kink / kn
            if kink < lo * kn:
                num, den = self.cap, lo
            elif kink > hi * kn:
                top = kn * (hi - self.eps)
                if top > 0:
                    num, den = top, kd * hi
            else:
                num, den = self.cap * kn, kink
        if self.outside is not None and self.outside * den > num * lo:
            num, den = self.outside, lo
        return num, den


def numerator_by_exponent(cfg: NormConfig, stat: StatBounds, segs: dict[int, Interval]) -> dict[int, Interval]:
    """Range of u = num · 2^(H − e) for each exponent e (H = h + g: ``num_shift``).

    Absolute: num's range scaled by 2^(H − e) (rounded when e > H).
    Relational: |num|^p <= ratio_e · W with W <= W_hi(e), so the real u has
    |u|^p <= ratio_e · W_hi(e) · 2^(p (H−e)); rounding (e > H) adds at most 1.
    The relational side is what keeps u narrow: u tracks the normalized value,
    scaled to the mantissa, and rows with a large W cannot have a numerator near
    the format's limit scaled up by a small exponent.  (Integers throughout:
    ratio_e = n / d from :meth:`StatBounds.ratio_terms`.)
    """
    p, h = cfg.p, cfg.num_shift
    out = {}
    for e, seg in segs.items():
        t = e - h
        rn, rd = stat.ratio_terms(seg)
        q = rn * seg.hi
        rel = _floor_root_of(q, rd << (p * t), p) + 1 if t > 0 else _floor_root_of(q << (-p * t), rd, p)
        a = stat.num.rshift(t, cfg.rounding) if t > 0 else Interval(stat.num.lo << -t, stat.num.hi << -t)
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

    Evaluated in integers: with ratio_e = n / d and X_lo = x_lo / x_d, X_hi =
    x_hi / x_d (x_d = 2^(p e) for e > 0, else 1), each term is the ceiling root
    of one integer quotient, exactly the rational term's.
    """
    p, f, h = cfg.p, cfg.inv_frac_bits, cfg.num_shift
    best = 0
    for e, u in by_exp.items():
        seg, truncated, rounded = segs[e], e > 0, e > h
        rn, rd = stat.ratio_terms(seg)
        pe = p * e
        if pe > 0:
            xd, xl, xh = 1 << pe, seg.lo, seg.hi
        else:
            xd, xl, xh = 1, seg.lo << -pe, seg.hi << -pe
        below = xl - xd if truncated else xl  # (X_lo − [e > 0]) · x_d
        main = _ceil_root_of((rn * xl) << (p * (h + f)), rd * below, p)
        r_err = _ceil_root_of((rn * xh) << (p * h), rd * xd, p)
        u_err = _ceil_root_of(xd << (p * f), below, p) + 1 if rounded else 0
        best = max(best, min(main + r_err + u_err, max(-u.lo, u.hi) * r_max))
    return best


# --------------------------------------------------------------------------- the op skeleton


@dataclass(frozen=True)
class RowAnalysis:
    """The range analysis of stages 1–3 (everything up to z), a function of the
    structural config alone (:func:`row_key`): not of γ, β, the output shift or
    the output format, and of the input format only through its integer range.

    ``items``: the report's entries through ``z``, in order; ``channel_z``: z's
    range per run of channels, ``(start, stop, interval)`` covering 0..N;
    ``stat_bits``: the bit length of W's largest value; ``mult_shift``: j, the
    constant shift of the per-row multiplier and offset (stage 3);
    ``row_constants``: a0 and c0, the multiplier and offset before their left shift.
    """

    items: tuple[tuple[str, Interval], ...]
    z: Interval
    channel_z: tuple[tuple[int, int, Interval], ...]
    stat_bits: int
    mult_shift: int
    row_constants: RowConstants


# Config fields that only the output stage (stage 4) reads; every other field,
# and the input format's integer range, is the row analysis' key.
_OUTPUT_FIELDS = frozenset({"gain", "bias", "shift", "in_fmt", "out_fmt"})
ROW_CACHE_SIZE = 1024


@functools.cache
def _row_fields(cfg_cls: type[NormConfig]) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cfg_cls) if f.name not in _OUTPUT_FIELDS)


def row_key(cfg: NormConfig) -> tuple[Any, ...]:
    """The hashable structural key of ``cfg``'s row analysis: the config class, the
    input's bit width and signedness, and every field but the output stage's.

    **ε_int is in the key exactly, not by an interval or a coarser quantity.**  A
    calibrating QAT layer's input scale moves every training step, and with it
    ε_int = round(ε N²/s_in² · 4^g) (at 2^-16 resolution), so its analysis misses
    the cache every step.  Could one analysis serve an interval [ε1, ε2] of ε_int?
    As a proof, yes: every row with ε in it satisfies |num|^p <= κ(W − ε1) and has
    W in [S_lo 4^g + ε1, S_hi 4^g + ε2], so the analysis of that relation and range
    is sound for all of them.  But the row analysis does not only prove a config
    safe, it *defines* constants of the op: j (:func:`mult_shift`, the smallest
    shift the analysis proves), the z bound that clips each B_c (a recorded
    constant) and sets the output window, and the report's entries.  The interval's
    bounds are looser than each exact ε's, so at its edges the smallest provable j
    can be one larger and z's bound differs: other integers and constants, i.e. a
    different definition (golden vectors and checkpoints would no longer re-derive),
    not a cache.  A coarser key whose every ε provably gives the *same* analysis
    would need the computed bounds to be monotone in ε.  They are for every exponent
    segment but the top one (on the others the relation's sup over the segment
    only falls as ε grows, and the integer roots and floors applied to it keep
    that order), while the top segment's upper end S_hi 4^g + ε grows with ε (a new
    top exponent can even appear), and the recorded bounds move with ε anyway.  So
    the exact ε_int stays in the key: a training step whose calibrated scale
    moved pays one exact analysis (the bisection in :func:`mult_shift` and
    :func:`shifts_of`'s once-per-config base keep it short), and every forward
    whose scale did not move — a fixed ``in_fmt``, a power-of-two scale (``pow2``),
    a calibrating quantizer's steps inside its dead band (``InputQuantizer.tolerance``:
    its format moves every ~25 steps, not every step), an IntQuantTensor's scale,
    eval — hits."""
    return (type(cfg), cfg.in_fmt.bits, cfg.in_fmt.signed, *(getattr(cfg, f) for f in _row_fields(type(cfg))))


def _config_of_key(key: tuple[Any, ...]) -> NormConfig:
    """A config with exactly ``key``'s structural fields (unit gains' stand-ins:
    zero gain and bias, shift 0, input scale 1, the default output format)."""
    cfg_cls, bits, signed, *values = key
    n = values[_row_fields(cfg_cls).index("n")]
    zeros = (0,) * n
    return cfg_cls(
        in_fmt=QFormat(bits, 1.0, signed),
        out_fmt=DEFAULT_OUT,
        gain=zeros,
        shift=0,
        bias=zeros,
        **dict(zip(_row_fields(cfg_cls), values, strict=True)),
    )


@functools.lru_cache(maxsize=ROW_CACHE_SIZE)
def _cached_row_analysis(op_cls: type[NormOp], key: tuple[Any, ...]) -> RowAnalysis | str:
    """The row analysis of ``key`` computed from a config built from the key alone
    (so the result cannot depend on anything else), or the refusal's message."""
    try:
        return op_cls._row_ranges(_config_of_key(key))
    except OverflowRiskError as err:
        return str(err)


# The fields that carry ε (stage 1's ε_int and its guard bits g).
_EPS_FIELDS = frozenset({"eps", "eps_shift"})


def raw_stat_key(cfg: NormConfig) -> tuple[Any, ...]:
    """:func:`row_key` with ε_int and g set to 0: the key of the statistic's own ranges.

    ``_statistic_ranges`` bounds S before ε is added (N, the input's integer range,
    the op's own fields such as the RMS prefix); ε enters only in
    :func:`add_eps_ranges`.  Computed from a config whose ε fields are 0, the
    result cannot depend on them, so one entry serves every ε_int a calibrating
    layer's moving input scale gives."""
    cfg_cls = type(cfg)
    values = (0 if f in _EPS_FIELDS else getattr(cfg, f) for f in _row_fields(cfg_cls))
    return (cfg_cls, cfg.in_fmt.bits, cfg.in_fmt.signed, *values)


@functools.lru_cache(maxsize=ROW_CACHE_SIZE)
def _cached_raw_statistic(
    op_cls: type[NormOp], key: tuple[Any, ...]
) -> tuple[tuple[tuple[str, Interval], ...], StatBounds] | str:
    """The statistic's report entries (checked) and bounds before ε for
    :func:`raw_stat_key` ``key``, or the refusal's message."""
    rep = RangeReport(op_cls.name)
    stat = op_cls._statistic_ranges(_config_of_key(key), rep)
    try:
        rep.check()
    except OverflowRiskError as err:
        return str(err)
    return tuple(rep.items.items()), stat


def raw_statistic(op_cls: type[NormOp], cfg: NormConfig) -> tuple[tuple[tuple[str, Interval], ...], StatBounds]:
    """:func:`_cached_raw_statistic` of ``cfg``; raises :class:`OverflowRiskError` for a refused one."""
    got = _cached_raw_statistic(op_cls, raw_stat_key(cfg))
    if isinstance(got, str):
        raise OverflowRiskError(got)
    return got


def row_cache_clear() -> None:
    """Forget every cached row analysis and derivation structure (tests use it to
    compare cold and warm)."""
    _cached_row_analysis.cache_clear()
    _cached_raw_statistic.cache_clear()
    _cached_structure.cache_clear()


STRUCTURE_CACHE_SIZE = 64  # each entry holds tuples of N zeros: bounded for N up to 65536


def _structure(op_cls: type[NormOp], key: tuple[Any, ...], eps: float | None = None,
               frac_bits: int | None = None) -> NormConfig:  # fmt: skip
    """What :meth:`NormOp.channel_rule` derives without γ and β, cached per argument.

    ``key = (n, in_fmt, out_fmt, mant_bits, rounding, lanes, op fields)``.  Without
    ``eps``: the config with zero gains, biases, ε and F_z (validated, so a config
    refused by its fields raises here).  With ``eps`` and ``frac_bits``: the config with
    F_z and ε_int = round(ε_S 2^(p g)) for the guard g of :func:`eps_guard_bits`,
    lowered while the row analysis refuses the config (g = 0 is the plain integer ε;
    raises if that is refused too).  Neither depends on γ or β, and a training step
    re-derives its op from new γ and β with the same format and ε: the cache spares
    it the validation and the guard search (the row analysis is cached on its own).
    Arguments that do not hash (an option passed as a list) are derived uncached."""
    args = key, eps, frac_bits
    try:
        hash(args)
    except TypeError:
        return _cached_structure.__wrapped__(op_cls, (), args)
    return _cached_structure(op_cls, _typed(args), args)


def _typed(value: Any) -> Any:
    """The type of every scalar in ``value``, nested as ``value`` is: beside the values, the
    cache's key.  Equal values of other types must not share an entry (``partial=True``
    equals ``partial=1.0`` and hashes alike, but the validation refuses the first)."""
    return tuple(_typed(v) for v in value) if isinstance(value, tuple) else type(value)


@functools.lru_cache(maxsize=STRUCTURE_CACHE_SIZE)
def _cached_structure(op_cls: type[NormOp], types: Any, args: tuple[Any, ...]) -> NormConfig:
    """:func:`_structure` of ``args``; ``types`` (their :func:`_typed`) only keys the cache."""
    key, eps, frac_bits = args
    n, in_fmt, out_fmt, mant_bits, rounding, lanes, op_items = key
    zeros = (0,) * n
    cfg = op_cls.config_cls(
        n=n, in_fmt=in_fmt, out_fmt=out_fmt, gain=zeros, shift=0, bias=zeros, eps=0,
        frac_bits=0 if frac_bits is None else frac_bits, mant_bits=mant_bits, rounding=rounding, lanes=lanes,
        **dict(op_items),
    )  # fmt: skip
    if eps is None:
        return cfg
    eps_s = cfg.eps_exact(eps)
    stat_hi = op_cls._raw_stat_hi(cfg)
    row_bits = NARROW_ROW_BITS if cfg.lanes == LANES[0] else 63
    g = eps_guard_bits(eps_s, stat_hi, cfg.p, op_cls._stat_floor(cfg), row_bits)
    while True:
        # ε_S >= 0 (ε >= 0 was checked) and 0 <= g <= 61 // p (eps_guard_bits): both valid
        cfg = derived_config(cfg, eps=round_scaled(eps_s, cfg.p * g), eps_shift=g)
        try:
            op_cls.row_analysis(cfg)
            return cfg
        except OverflowRiskError as err:
            if g > 0:
                g -= 1
            elif cfg.eps > stat_hi:
                raise OverflowRiskError(_eps_too_large(op_cls, cfg, eps, stat_hi)) from err
            else:
                raise


def _eps_too_large(op_cls: type[NormOp], cfg: NormConfig, eps: float, stat_hi: int) -> str:
    """The refusal of a config whose W = S + ε_int leaves 63 bits because of ε alone: the
    generic advice (a shorter row, narrower formats) would not help there."""
    return (
        f"{op_cls.name}: eps = {eps!r} is {cfg.eps} in units of the statistic at input scale "
        f"{cfg.in_fmt.scale!r} (N = {cfg.n}), more than any row's own statistic ({stat_hi}), and "
        f"statistic + eps does not fit 63-bit integers; eps is far outside the input's range: "
        f"lower eps or use a larger input scale"
    )


def _check_options(op_cls: type[NormOp], options: dict[str, Any]) -> None:
    """Refuse options that are not the op's own fields."""
    unknown = sorted(set(options) - set(op_cls.op_defaults))
    if unknown:
        raise ValueError(f"{op_cls.__name__} has no option(s) {unknown}; its options: {sorted(op_cls.op_defaults)}")


@dataclass(frozen=True, eq=False)
class ChannelStructure:
    """Everything of one derivation but γ and β at one F_z: the config (gains, shift and
    biases as placeholders), its row analysis, max |z| (the bias clip's
    reach) and what the gains are quantized to (``mult_bits``, ``max_shift``)."""

    op_cls: type[NormOp]
    config: NormConfig
    row: RowAnalysis
    z_abs: int
    mult_bits: int
    max_shift: int


@dataclass(frozen=True, eq=False)
class ChannelInts:
    """The per-channel integers of one γ, β: the multipliers, their shared shift and the
    biases, and — where the writing that formed them computed them too — their output
    window and stage-4 hulls (None: the op forms them)."""

    gain: tuple[int, ...]
    shift: int
    bias: tuple[int, ...]
    window: OutputWindow | None = None
    hulls: StageHulls | None = None


# A second writing of the per-channel derivation (ChannelRule.op's numpy part): the
# integers, window and hulls for a structure, the scaled gains γ G / s_out 2^-F_z and β,
# or None where it does not apply (the definition's numpy part then runs).
ChannelWriter = Callable[[ChannelStructure, np.ndarray, np.ndarray], "ChannelInts | None"]


@dataclass(frozen=True, eq=False)
class ChannelRule:
    """:meth:`NormOp.from_float`'s arguments but γ and β, resolved
    (:meth:`NormOp.channel_rule`): ``key`` = (n, in_fmt, out_fmt, mant_bits, rounding,
    lanes, op fields), ε, an explicit F_z or None (the default rule), the gains'
    multiplier width and shift limit, G and s_out, F_r."""

    op_cls: type[NormOp]
    key: tuple[Any, ...]
    eps: float
    frac_bits: int | None
    mult_bits: int
    max_shift: int
    gain_factor: float
    out_scale: float
    inv_frac_bits: int
    _structures: dict[int, ChannelStructure] = field(default_factory=dict, repr=False)

    def structure(self, frac_bits: int) -> ChannelStructure:
        """The structure at F_z = ``frac_bits`` (kept per F_z; a refused one raises each time)."""
        got = self._structures.get(frac_bits)
        if got is None:
            cfg = _structure(self.op_cls, self.key, self.eps, frac_bits)
            row = self.op_cls.row_analysis(cfg)
            z_abs = max(-row.z.lo, row.z.hi)
            got = self._structures[frac_bits] = ChannelStructure(
                self.op_cls, cfg, row, z_abs, self.mult_bits, self.max_shift
            )
        return got

    def op(self, params: FloatParams, writer: ChannelWriter | None = None) -> NormOp:
        """The op for ``params`` (N channels, this rule's ε).  ``writer``: a second writing
        of the per-channel part, held equal to the one here by its own tests; where it
        answers None (or the structure is refused) the numpy part below runs."""
        if params.gamma.shape != (self.key[0],) or params.eps != self.eps:
            raise ValueError(
                f"the rule derives {self.key[0]} channels at eps = {self.eps!r}; "
                f"got {params.gamma.size} at eps = {params.eps!r}"
            )
        real_gain = params.gamma * self.gain_factor / self.out_scale
        frac_bits = default_frac_bits(real_gain, self.inv_frac_bits) if self.frac_bits is None else self.frac_bits
        scaled = np.ldexp(real_gain, -frac_bits)
        ints = None
        if writer is not None:
            try:
                st = self.structure(frac_bits)
            except ValueError:  # OverflowRiskError among them
                st = None  # refused: raised below, in the definition's order
            ints = None if st is None else writer(st, scaled, params.beta)
        if ints is None:
            gain, shift = self.op_cls._quantize_gain(scaled, self.mult_bits, self.max_shift)
            # The multipliers are N Python ints of mult_bits (<= 32) bits and 0 <= shift <= max_shift
            # (_quantize_gain's contract): valid by construction; F_z and ε were checked by _structure.
            st = self.structure(frac_bits)
            bias = _output_bias(params.beta, derived_config(st.config, gain=gain, shift=shift), st.z_abs)
            ints = ChannelInts(gain, shift, bias)
        # n Python ints; the check left is int64's range (the exact path can exceed it: refused by replace)
        cfg = derived_config(st.config, gain=ints.gain, shift=ints.shift)
        fits = -(1 << 63) <= min(ints.bias) and max(ints.bias) < 1 << 63
        cfg = derived_config(cfg, bias=ints.bias) if fits else replace(cfg, bias=ints.bias)
        return self.op_cls._assembled(cfg, params, st, ints)  # the output stage is checked there, with β


@dataclass(frozen=True)
class RowStageForm:
    """Stages 1 and 2 of an op under the half-up rule, as data: what a compiled per-row
    stage (:mod:`qnorm.nn.jitchain`) computes to give :meth:`NormOp.row_inverse`'s values.

    ``statistic``: ``"variance"`` (N Σx² − (Σx)²), ``"centered_abs"`` (Σ|N x − Σx|) or
    ``"prefix_squares"`` (Σx² over the first ``prefix`` elements; ``prefix`` counts the
    elements whose squares the statistic sums: N for the variance, 0 for L1).  Then
    ``W = S·2^(p g) + ε_int`` and :func:`split_exponent`.  ``inverse`` of the mantissa M:
    ``"rsqrt"`` (``fixedpoint.rsqrt(M, frac_bits)``, half up), ``"reciprocal"``
    (``fixedpoint.reciprocal(2M + 1, frac_bits)``, half up) or ``"pow2_table"``
    (``base`` plus ``steps[i]`` for every ``thresholds[i] <= M``).
    """

    statistic: str
    inverse: str
    prefix: int
    frac_bits: int
    thresholds: tuple[int, ...] = ()
    steps: tuple[int, ...] = ()
    base: int = 0


class NormOp(IntOp):
    """A row normalization: statistic, one per-row inverse, affine output.

    Subclasses provide the statistic (``_statistic`` / ``_statistic_ranges``) and
    the per-row inverse (``_inverse`` / ``_inverse_range``); the rest is shared.

    The range analysis has two parts.  Stages 1–3 (:meth:`row_analysis`) depend
    only on the structural config (:func:`row_key`: N, the input's width, F_z, the
    mantissa and inverse widths, ε_int and its guard bits, the rounding mode, the
    op's own fields) and are cached per key; stage 4 (:func:`output_ranges`)
    needs only the extremes of m_c and B_c and runs vectorized per call.  Both
    are exact: the report is the one the unsplit analysis produced.

    ``structure``: the :class:`ChannelStructure` an op derived by a :class:`ChannelRule`
    was formed at (ops that share one differ only in their gains, shift and biases),
    None for an op constructed from a config.
    """

    config_cls: ClassVar[type[NormConfig]]
    inverse_name: ClassVar[str]
    definition = DEFINITION_VERSION
    # _quantize_gain's rule as data, for a second writing of it (qnorm.nn.jitderive):
    # "dyadic" multipliers sharing one shift; an op that overrides _quantize_gain names its own.
    gain_form: ClassVar[str] = "dyadic"
    op_defaults: ClassVar[dict[str, Any]]  # the op's own from_float options and defaults
    # what outputs wider than 8 bits default to instead (may also name mant_bits)
    wide_defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, config: NormConfig, params: FloatParams) -> None:
        if not isinstance(config, self.config_cls):
            raise ValueError(f"{type(self).__name__} needs a {self.config_cls.__name__}, got {type(config).__name__}")
        if params.gamma.shape != (config.n,):
            raise ValueError(f"float parameters have {params.gamma.size} channels, the config {config.n}")
        self.structure: ChannelStructure | None = None
        self._assemble(config, params, self.row_analysis(config), None)

    @classmethod
    def _assembled(
        cls, config: NormConfig, params: FloatParams, structure: ChannelStructure, ints: ChannelInts
    ) -> NormOp:
        """The op of a config formed at ``structure`` by its :class:`ChannelRule` (valid by
        construction), with the output window and hulls ``ints`` carries when the writing
        that formed its integers computed them too."""
        op = object.__new__(cls)
        op.structure = structure
        op._assemble(config, params, structure.row, ints)
        return op

    def _assemble(self, config: NormConfig, params: FloatParams, row: RowAnalysis, ints: ChannelInts | None) -> None:
        """Every constructor's work: the output window of the gains and biases, and the
        range checks (63 bits, the lanes per element), which refuse the config."""
        self.config = config
        self.params = params
        self.in_fmt = config.in_fmt
        self.out_fmt = config.out_fmt
        self._gain = np.asarray(config.gain, dtype=np.int64)
        self._bias = np.asarray(config.bias, dtype=np.int64)
        formed = ints is not None and ints.window is not None
        self._window = ints.window if formed else output_window(config, self._gain, self._bias, row.channel_z)
        self._stat_bits = row.stat_bits
        self._mult_shift = row.mult_shift
        self._offset_split = row.row_constants.offset_split
        hulls = ints.hulls if formed else None
        self._report(config, self._gain, self._bias, self._window, row=row, hulls=hulls)  # checked

    # ---- construction from floats

    @classmethod
    def from_float(
        cls,
        gamma: Any,
        beta: Any = None,
        eps: float = 1e-5,
        in_fmt: QFormat = DEFAULT_IN,
        out_fmt: QFormat = DEFAULT_OUT,
        **rule_args: Any,
    ) -> NormOp:
        """Quantize float γ (N,), β (N,) or None, and ε >= 0 into an op.

        ε is in the real units of the op's statistic: σ² for LayerNorm and the shift
        norm, x² for RMSNorm, σ for L1.  ``rule_args``: the keywords of
        :meth:`channel_rule` (``frac_bits``, ``mant_bits``, ``mult_bits``,
        ``rounding``, ``lanes`` and the op's own options).
        """
        params = FloatParams.checked(gamma, beta, eps)
        return cls.channel_rule(params.gamma.size, params.eps, in_fmt, out_fmt, **rule_args).op(params)

    @classmethod
    def channel_rule(
        cls,
        n: int,
        eps: float = 1e-5,
        in_fmt: QFormat = DEFAULT_IN,
        out_fmt: QFormat = DEFAULT_OUT,
        *,
        frac_bits: int | None = None,
        mant_bits: int | None = None,
        mult_bits: int | None = None,
        rounding: Round | str = DEFAULT_ROUND,
        lanes: int | None = None,
        **options: Any,
    ) -> ChannelRule:
        """What :meth:`from_float` does with every argument but γ and β, resolved once:
        ``from_float(γ, β, ε, …)`` is ``channel_rule(len(γ), ε, …).op(params)`` with
        ``params = FloatParams.checked(γ, β, ε)``.  A QAT layer keeps its rule while its
        formats and ε are unchanged and derives each step's op from it.

        ``options`` are the op's own fields with their defaults in ``op_defaults``
        (``inv_bits``; ``partial`` for RMSNorm; ``mantissa_terms`` for the shift norm).
        ``lanes``: the per-element datapath (:data:`LANES`); by default 32 for inputs
        and outputs of up to 8 bits (the datapath every target shares) and 64 above.
        A config whose intermediates do not fit it is refused
        (:class:`OverflowRiskError`), never widened silently.  Outputs wider than 8 bits
        (±2^15 LSB for int16) need relative precision near 2^-20 in the inverse and the
        gains: their defaults are the op's ``wide_defaults`` (a wider mantissa /
        inverse) and 24-bit gain multipliers.

        γ_c · G / s_out (G: the op's constant) becomes ``m_c / 2^(s − F_z)``; ε
        becomes ``ε_int = round(ε_S 2^(p g))`` (exact rational, rounded half up) with
        the guard g of :func:`eps_guard_bits`, lowered further while the range
        analysis refuses the config (g = 0 is the plain integer ε); β_c becomes
        ``round(β_c 2^s / s_out)``, clipped where the output saturates anyway.
        Each guard tried is the full analysis of the op with zero β (as
        constructing it would run), its row part from the cache.
        """
        _check_options(cls, options)
        check_int("n", n, 1)
        eps = FloatParams.checked_eps(eps)
        wide = out_fmt.bits > 8
        defaults = {**cls.op_defaults, **(cls.wide_defaults if wide else {})}
        default_mant = defaults.pop("mant_bits", None)  # a width of the rule's own, not an op option
        mant_bits = default_mant if mant_bits is None else mant_bits
        if mult_bits is None:
            mult_bits = WIDE_MULT_BITS if wide else MULT_BITS
        key = (
            n, in_fmt, out_fmt, cls.config_cls.default_mant_bits if mant_bits is None else mant_bits, rounding,
            default_lanes(in_fmt, out_fmt) if lanes is None else lanes, tuple(sorted({**defaults, **options}.items())),
        )  # fmt: skip
        base = _structure(cls, key)
        # A shift beyond 59 − out_bits would put the clipped bias past 62 bits; at
        # that shift a gain of one multiplier LSB moves the output by < 2^-30 LSB.
        # In the lanes, acc's window [(lo − 1) 2^s − |m|, (hi + 1) 2^s + |m|] needs
        # out_bits + s + 1 bits, less one of rounding headroom: s <= lanes − 3 − out_bits
        # (a gain that then falls below the multiplier's LSB is a constant channel).
        max_shift = min(59, base.lanes - 3) - out_fmt.bits
        return ChannelRule(
            cls, key, eps, frac_bits, mult_bits, max_shift, base.gain_factor(), out_fmt.scale, base.inv_frac_bits
        )

    @classmethod
    def _stat_floor(cls, cfg: NormConfig) -> int:
        """The least non-zero statistic S of a row whose outputs depend on ε (ε's guard
        bits make its rounding small against it: :func:`eps_guard_bits`).  0, the
        safe answer, unless an op knows better: a row whose statistic is 0 must then
        have every numerator 0."""
        return 0

    @classmethod
    def _raw_stat_hi(cls, cfg: NormConfig) -> int:
        """S's largest value (before ε), checked against 63 bits; cached per :func:`raw_stat_key`."""
        return raw_statistic(cls, cfg)[1].w.hi

    @classmethod
    def _quantize_gain(cls, gains: np.ndarray, mult_bits: int, max_shift: int) -> tuple[tuple[int, ...], int]:
        """Per-channel multipliers sharing one shift (a shift-only op overrides this)."""
        m, s = fp.dyadic_vector(gains, mult_bits, max_shift)
        return tuple(m.tolist()), s

    # ---- the integer forward

    def forward(self, x: np.ndarray, trace: Trace | None = None) -> np.ndarray:
        """Validate ``x`` (integer dtype, in ``in_fmt``, last axis N) and run the forward."""
        arr = np.asarray(x)
        if arr.ndim == 0 or arr.shape[-1] != self.config.n:
            raise ValueError(f"{self.name} normalizes rows of {self.config.n} elements; got input shape {arr.shape}")
        return self._forward(self.in_fmt.check(arr), trace)

    def _forward(self, x: Any, trace: Trace | None) -> Any:
        cfg = self.config
        a, c, k = row_affine(*self.row_inverse(x, trace), cfg, self._mult_shift, trace, self._offset_split)
        z = normalize(x, a, c, k, cfg, trace)
        return self._output(z, trace)

    def row_inverse(self, x: Any, trace: Trace | None = None) -> tuple[Any, Any, Any]:
        """Stages 1 and 2 per row: ``(Σx or None, r, e)``, what :func:`row_affine`
        (or :func:`row_affine_parts`) turns into the row's multiplier and offset."""
        cfg = self.config
        s, s1 = self._statistic(x, trace)
        w = add_eps(s, cfg, trace)
        e, m = split_exponent(w, cfg, self._stat_bits, trace)
        return s1, self._inverse(m, trace), e

    def row_stage_form(self) -> RowStageForm | None:
        """What :meth:`row_inverse` computes, as data (None: no such description; a
        subclass that overrides ``_statistic`` or ``_inverse`` describes them here too)."""
        return None

    def _scale(self, zc: Any) -> Any:
        return zc * const_like(zc, self._gain)

    def _output(self, z: Any, trace: Trace | None) -> Any:
        cfg, win = self.config, self._window
        zc = clamp(z, const_like(z, win.lo), const_like(z, win.hi)) - const_like(z, win.off)
        del z  # each per-element intermediate is dropped once used: less memory in flight
        zc = record(trace, "zc", zc)
        scaled = record(trace, "scaled", self._scale(zc))
        del zc
        acc = record(trace, "acc", scaled + const_like(scaled, win.bias))
        del scaled
        y = record(trace, "y", rshift_round(acc, cfg.shift, cfg.rounding))
        del acc
        return record(trace, "out", saturate(y, cfg.out_fmt.bits, cfg.out_fmt.signed))

    # ---- static ranges

    def ranges(self) -> RangeReport:
        """Every intermediate's exact bounds.  The report is checked against 63 bits
        at stage ends, before a bound too wide for fixedpoint's operands is shifted,
        and every per-element stage against the datapath's lanes."""
        return self._report(self.config, self._gain, self._bias, self._window)

    def row_constants(self) -> RowConstants:
        """a0's and c0's ranges: stage 3's per-row multiplier and offset before their exact
        left shift by up (:func:`row_affine_parts`)."""
        return self.row_analysis(self.config).row_constants

    def lane_wrapped(self) -> dict[str, Interval]:
        """The named intermediates a target that wraps lane constants holds as what the row
        accumulates: in the narrow lanes ``x·a − c`` is formed modulo 2^lanes (proven to
        fit), so a and c are taken modulo 2^lanes, and the row accumulates a0 and c0, whose
        exact left shift by up keeps their low lanes bits.  None in the wide lanes, whose
        element stage takes the whole values."""
        if self.config.lanes != LANES[0]:
            return {}
        consts = self.row_constants()
        return {"mult": consts.mult} | ({} if consts.offset is None else {"offset": consts.offset})

    @classmethod
    def _report(
        cls, cfg: NormConfig, gain: np.ndarray, bias: np.ndarray, window: OutputWindow | None = None, *,
        row: RowAnalysis | None = None, hulls: StageHulls | None = None,
    ) -> RangeReport:  # fmt: skip
        """The report of ``cfg`` with int64 multipliers and biases ``gain``, ``bias``
        (``window``, ``row``, ``hulls``: their output window, the config's row analysis
        and the window's :func:`channel_hulls`, when already at hand)."""
        row = cls.row_analysis(cfg) if row is None else row
        rep = RangeReport(cls.name)
        rep.items.update(row.items)
        window = output_window(cfg, gain, bias, row.channel_z) if window is None else window
        output_ranges(rep, cfg, channel_hulls(gain, window) if hulls is None else hulls)
        check_lanes(rep, cfg)
        return rep

    @classmethod
    def row_analysis(cls, cfg: NormConfig) -> RowAnalysis:
        """Stages 1–3 of ``cfg``'s analysis, cached per :func:`row_key`; raises
        :class:`OverflowRiskError` (every time) for a refused key."""
        got = _cached_row_analysis(cls, row_key(cfg))
        if isinstance(got, str):
            raise OverflowRiskError(got)
        return got

    @classmethod
    def _row_ranges(cls, cfg: NormConfig) -> RowAnalysis:
        """Stages 1–3, uncached: checked against 63 bits after the statistic and
        after the product, as the unsplit analysis did, and once more with z."""
        items, raw = raw_statistic(cls, cfg)  # checked already; the same for every ε
        rep = RangeReport(cls.name)
        rep.items.update(items)
        stat = add_eps_ranges(rep, raw, cfg)
        rep.check()
        segs = exponent_segments(stat.w, cfg)
        rep.add("exp", Interval(min(segs), max(segs)))
        mants = [mantissa_range(e, seg, cfg) for e, seg in segs.items()]
        m_iv = rep.add("mant", Interval(min(m.lo for m in mants), max(m.hi for m in mants)))
        inv = rep.add(cls.inverse_name, cls._inverse_range(cfg, m_iv))
        products = cls._products(cfg, stat, segs, inv)
        j = mult_shift(cfg, products)
        constants = row_affine_ranges(rep, cfg, inv, segs, j)
        rep.check()
        z = cls._normalized_ranges(cfg, products, j, rep)
        rep.check()  # every entry handed on is checked
        chans = cls._channel_z(cfg, stat, segs, inv, j, z)
        return RowAnalysis(tuple(rep.items.items()), z, chans, max(1, rep["stat"].hi.bit_length()), j, constants)

    @classmethod
    def _products(
        cls, cfg: NormConfig, stat: StatBounds, segs: dict[int, Interval], inv: Interval
    ) -> dict[int, tuple[int, int, int]]:
        """Per exponent e: max |num · r| as the fraction ``n / d`` and max |u · r|.

        The op's product bound covers |u r| with u = num 2^(H − e), rounded when
        e > H (r_max more covers the exact value there), so
        |num r| <= (bound_e + [e > H] r_max) 2^(e − H): the numerator's size and
        the inverse's size are not both extreme in one row."""
        by_exp = numerator_by_exponent(cfg, stat, segs)
        out, h = {}, cfg.num_shift
        for e, u in by_exp.items():
            pb = cls._product_bound(cfg, stat, {e: segs[e]}, {e: u}, inv) + (inv.hi if e > h else 0)
            out[e] = (pb << max(e - h, 0), 1 << max(h - e, 0), pb)
        return out

    @classmethod
    def _normalized_ranges(
        cls, cfg: NormConfig, products: dict[int, tuple[int, int, int]], j: int, rep: RangeReport | None
    ) -> Interval:
        """xa and z (recorded when ``rep`` is given).

        z is the exact normalized value ``num · r / 2^K0`` plus what the datapath
        adds: where j_r > 0, a and c are rounded, ``xa = num·a/N + δ`` and
        ``a = N r / 2^j_r + δa`` (|δ|, |δa| < 1), an error below |num|/N + 1 <=
        span + 1 units of xa, divided by 2^K (K >= 0 there); and z's own rounding
        when K > 0.  The exact part, per exponent, is the op's product bound
        (``|u r|`` with ``u = num 2^(H − e)``) over 2^(F_r − F_z).
        """
        if rep is not None:
            xa = xa_bound(cfg, products, j)
            rep.add("xa", Interval(-xa, xa))
        t, d, base = 0, cfg.inv_frac_bits - cfg.frac_bits, z_shift_base(cfg)
        for e, (*_, pb) in products.items():
            jr, _, k = shifts_of(e + base, j)
            # pb / 2^d, plus the datapath's error: a and c rounded (j_r > 0, then K >= 0)
            # and z rounded (K > 0); floor of one integer quotient
            err = span_of(cfg) + 1 if jr else 0
            t = max(t, ((pb << k) + (err << d)) // (1 << (d + k)) + (1 if k > 0 else 0))
        z = Interval(-t, t)
        return z if rep is None else rep.add("z", z)

    @classmethod
    def _product_bound(
        cls,
        cfg: NormConfig,
        stat: StatBounds,
        segs: dict[int, Interval],
        by_exp: dict[int, Interval],
        inv: Interval,
    ) -> int:
        """max |u · r|, u = num 2^(H − e): bounds the exact normalized value."""
        return product_bound(cfg, stat, segs, by_exp, inv.hi)

    @classmethod
    def _channel_z(
        cls, cfg: NormConfig, stat: StatBounds, segs: dict[int, Interval], inv: Interval, j: int, z: Interval
    ) -> tuple[tuple[int, int, Interval], ...]:
        """z's range per run of channels, ``(start, stop, interval)`` (an op whose
        channels differ overrides this)."""
        return ((0, cfg.n, z),)

    # ---- op hooks

    @abc.abstractmethod
    def _statistic(self, x: Any, trace: Trace | None) -> tuple[Any, Any]:
        """(S per row with keepdims, ε not yet added; Σx per row for a centered
        numerator, else None); records its intermediates."""

    @classmethod
    @abc.abstractmethod
    def _statistic_ranges(cls, cfg: NormConfig, rep: RangeReport) -> StatBounds:
        """Adds the statistic's intermediates; returns what they guarantee about
        S (``w``: S's range, ``eps`` 0).  A function of the config alone."""

    @abc.abstractmethod
    def _inverse(self, m: Any, trace: Trace | None) -> Any:
        """The per-row inverse of the mantissa (records it under ``inverse_name``)."""

    @classmethod
    @abc.abstractmethod
    def _inverse_range(cls, cfg: NormConfig, m_iv: Interval) -> Interval:
        """Exact range of the inverse over the mantissa's range."""

    def element_cost(self) -> dict[str, int]:
        """The per-element path of stages 3 and 4: x·a (− c), z's rounding shift, the
        output window (clamp, − off), ·m_c (a shift and negate for ShiftLayerNorm's
        power-of-two gains: ``_scale``), + b_c, y's rounding shift, saturation."""
        return {"mul": 2, "add": 2 + self.config.centered, "shift": 2, "clamp": 1, "saturate": 1}

    def row_affine_cost(self) -> dict[str, int]:
        """Stage 3's per-row work: N·r, Σx·a / N (a·⌊Σx/N⌋ + round(D·a/N): two
        divisions by the constant N), the shifts."""
        return {"mul": 2 + self.config.centered, "div": 2 * self.config.centered, "shift": 3}

    @abc.abstractmethod
    def cost(self) -> dict[str, dict[str, int]]:
        """Operation counts: ``per_row`` (statistic reductions included) and
        ``per_row_affine`` (stage 3's multiplier and offset) and ``per_element`` (the
        path each output element takes)."""

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


def shifts_of(k0: int, j: int) -> tuple[int, int, int]:
    """(j_r, up, K) of a row with K0 = e + :func:`z_shift_base` (:func:`row_affine`):
    the multiplier's right shift, the left shift folded into a and c, and z's right
    shift.  (The analysis forms the base once per config.)"""
    jr = min(max(k0, 0), j)
    up = max(jr - k0, 0)
    return jr, up, k0 - jr + up


def mult_shift(cfg: NormConfig, products: dict[int, tuple[int, int, int]]) -> int:
    """j: the smallest cap of the per-row multiplier shift that keeps
    ``xa = x·a − c`` inside the lanes (less a bit of rounding headroom).

    Found by bisection over j >= 1 after trying j = 0, which gives the same j as
    trying 0, 1, 2, … in turn: from j = 1 on, :func:`xa_bound` never grows with j.
    A row with K0 <= 0 has j_r = 0 whatever j is (its term is constant); one with
    K0 >= 1 has j_r = min(K0, j) >= 1, up = 0 and the term
    ``|num r| / 2^j_r + span + 1``, which only shrinks as j_r grows.  (From 0 to 1
    the bound can grow: the ``span + 1`` of the rounded a and c appears.)
    """
    limit = 1 << (cfg.lanes - 2)

    def fits(j: int) -> bool:
        return xa_bound(cfg, products, j) < limit

    if fits(0):
        return 0
    lo, hi = 1, 62
    if not fits(hi):
        raise OverflowRiskError(f"{cfg.n}-element rows do not fit a {cfg.lanes}-bit datapath at any multiplier shift")
    while lo < hi:  # fits(hi) holds; the answer lies in [lo, hi]
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def xa_bound(cfg: NormConfig, products: dict[int, tuple[int, int, int]], j: int) -> int:
    """max |x·a − c| over the row's exponents: |num·r| 2^up / 2^j_r, plus span + 1
    where a and c are rounded (j_r > 0; exact otherwise)."""
    span, base, out = span_of(cfg), z_shift_base(cfg), 0
    for e, (num, den, _) in products.items():
        jr, up, _ = shifts_of(e + base, j)
        out = max(out, (num << up) // (den << jr) + (span + 1 if jr else 0))
    return out


def span_of(cfg: NormConfig) -> int:
    """max |x − x'| over the input format: bounds |num| / N (centered) and |x| (not)."""
    return cfg.in_fmt.hi - cfg.in_fmt.lo if cfg.centered else max(-cfg.in_fmt.lo, cfg.in_fmt.hi)


@dataclass(frozen=True)
class RowConstants:
    """The per-row multiplier and offset as stage 3 forms them, before their exact left
    shift by ``up`` (:func:`row_affine_parts`): ``a0 = round(N·r / 2^j_r)`` and
    ``c0 = a0·m + round(D·a0 / N)`` (None for an uncentered numerator)."""

    mult: Interval
    offset: Interval | None
    offset_split: int = 0  # k of offset_fraction's two products (0: one product)


def offset_split_bits(cfg: NormConfig, mult: Interval) -> int:
    """k for :func:`offset_fraction`: 0 where D·a0 (D < N) fits the narrow datapath's
    row accumulator (``NARROW_ROW_BITS``) or the lanes are wide, else the least k >= 1
    that puts D·(a0 >> k) there (the other part, below N·2^(k+1), is then narrower)."""
    fits = (1 << (NARROW_ROW_BITS - 1)) - 1  # NARROW_ROW_BITS signed bits
    if not cfg.centered or cfg.lanes != LANES[0] or (cfg.n - 1) * mult.hi <= fits:
        return 0
    k = 1
    while (cfg.n - 1) * (mult.hi >> k) > fits:
        k += 1
    return k


def row_affine_ranges(
    rep: RangeReport, cfg: NormConfig, inv: Interval, segs: dict[int, Interval], j: int
) -> RowConstants:
    """mult, offset and z_shift: the per-row constants of stage 3, over the
    exponents' own multiplier shifts j_r = clamp(e + base, 0, j); returns a0's and
    c0's ranges before the left shift.

    The per-element product x·a runs in the lanes modulo 2^lanes where a is wider
    than a lane (rows of tiny variance: j_r < j): exact, since xa itself fits."""
    base = z_shift_base(cfg)
    shifts = [shifts_of(e + base, j) for e in segs]
    # Plain integers (one pair per distinct (j_r, up), every derivation): a0's ends
    # are the rounding shifts of N·r's ends (the shift is monotone).
    lo_nr, hi_nr, mode = inv.lo * cfg.num_mult, inv.hi * cfg.num_mult, cfg.rounding
    mults = [
        (rshift_round(lo_nr, jr, mode), rshift_round(hi_nr, jr, mode), up)
        for jr, up in sorted({(jr, up) for jr, up, _ in shifts})
    ]
    rep.add("mult", Interval(min(lo << up for lo, _, up in mults), max(hi << up for _, hi, up in mults)))
    row_mult = Interval(min(lo for lo, *_ in mults), max(hi for _, hi, _ in mults))
    row_offset = None
    if cfg.centered:
        # Σx / N in [x_lo, x_hi]: c0 = round(Σx·a0/N) lies in mean·a0 ± 1, the product's
        # ends at the corners; c = c0 2^up
        x_lo, x_hi = cfg.in_fmt.lo, cfg.in_fmt.hi
        ends = []
        for lo, hi, up in mults:
            corners = (x_lo * lo, x_lo * hi, x_hi * lo, x_hi * hi)
            ends.append((min(corners) - 1, max(corners) + 1, up))
        rep.add("offset", Interval(min(lo << up for lo, _, up in ends), max(hi << up for _, hi, up in ends)))
        row_offset = Interval(min(lo for lo, *_ in ends), max(hi for _, hi, _ in ends))
    rep.add("z_shift", Interval(min(k for *_, k in shifts), max(k for *_, k in shifts)))
    return RowConstants(row_mult, row_offset, offset_split_bits(cfg, row_mult))


def check_lanes(rep: RangeReport, cfg: NormConfig) -> None:
    """Refuse the config if a per-element stage does not fit the datapath's lanes
    (less one bit of rounding headroom, as every limit here)."""
    for name in ELEMENT_STAGES:
        iv = rep[name]
        if iv.bits > cfg.lanes - 1:
            raise OverflowRiskError(
                f"{rep.op}: per-element intermediate {name!r} spans [{iv.lo}, {iv.hi}], which needs "
                f"{iv.bits} bits, but the {cfg.lanes}-bit datapath holds {cfg.lanes - 1}; "
                f"shorten the row, narrow the formats, or choose lanes={LANES[-1]}"
            )


@dataclass(frozen=True, eq=False)
class OutputWindow:
    """Stage 4 in narrow lanes: ``zc = clamp(z, lo_c, hi_c) − off_c``,
    ``acc = zc · m_c + bias_c`` (per-channel int64 vectors, or Python-int object
    arrays where a value needs more than 60 bits)."""

    lo: np.ndarray
    hi: np.ndarray
    off: np.ndarray
    bias: np.ndarray


def output_window(
    cfg: NormConfig, gain: np.ndarray, bias: np.ndarray, channel_z: tuple[tuple[int, int, Interval], ...]
) -> OutputWindow:
    """The clamp window and recentring of every channel; the outputs are exactly
    those of ``sat(round((z · m_c + B_c) / 2^s))``.

    With ``off = −floor(B / m)`` and ``b = B + off·m`` (|b| < |m|), the output is
    ``sat(round((w m + b) / 2^s))`` in ``w = z − off``.  acc >= top = (hi + 1) 2^s
    gives y >= hi + 1 and acc <= bot = (lo − 1) 2^s gives y <= lo − 1 under every
    rounding mode (exact multiples of 2^s), so with ``[wl, wh]`` the smallest
    integer window whose ends reach top and bot, clamping w to it changes no
    output: beyond an end the output is saturated to that end's value.  The
    window is intersected with z's proven range; a channel whose whole range lies
    beyond one end is a constant: zc = 0 and the bias alone saturates (top or
    bot).  A zero gain is a constant channel too (the bias was already clipped
    to [bot, top]).
    """
    n = cfg.n
    top, bot = (cfg.out_fmt.hi + 1) << cfg.shift, (cfg.out_fmt.lo - 1) << cfg.shift
    z_abs = max(max(-z.lo, z.hi) for *_, z in channel_z)
    b_abs = max(-int(bias.min()), int(bias.max())) if n else 0
    m_abs = max(-int(gain.min()), int(gain.max())) if n else 0
    wide = max(top, -bot, b_abs, z_abs, m_abs * z_abs) + m_abs >= 1 << 60
    dt = object if wide else np.int64
    z_lo, z_hi = np.empty(n, dtype=dt), np.empty(n, dtype=dt)
    for start, stop, z in channel_z:
        z_lo[start:stop], z_hi[start:stop] = z.lo, z.hi
    m, b0 = gain.astype(dt), bias.astype(dt)
    live = m != 0
    ms = np.where(live, m, 1)
    off = np.where(live, -(b0 // ms), 0)
    b = b0 + off * m
    up = m > 0
    wl = np.where(up, bot - b, top - b) // ms
    wh = -((np.where(up, b - top, b - bot)) // ms)
    fl, fh = z_lo - off, z_hi - off
    lo, hi = np.maximum(wl, fl), np.minimum(wh, fh)
    const = live & (lo > hi)
    saturates_high = up == (fl > wh)  # the range lies beyond the end that gives hi
    b = np.where(const, np.where(saturates_high, top, bot), b)
    keep = live & ~const
    zero = np.zeros(n, dtype=dt)
    off = np.where(keep, off, zero)
    return OutputWindow(
        lo=np.where(keep, lo + off, zero), hi=np.where(keep, hi + off, zero), off=off, bias=np.where(live, b, b0)
    )


@dataclass(frozen=True)
class StageHulls:
    """zc, scaled and acc over every channel: the hulls of the per-channel ranges of
    stage 4 (a channel's zc reaches both ends of its window, so they are tight)."""

    zc: Interval
    scaled: Interval
    acc: Interval


def channel_hulls(gain: np.ndarray, win: OutputWindow) -> StageHulls:
    """Stage 4's hulls for the multipliers ``gain`` and their output window."""
    wl, wh = win.lo - win.off, win.hi - win.off
    m = gain.astype(win.lo.dtype)
    p, q = wl * m, wh * m
    s_lo, s_hi = np.minimum(p, q), np.maximum(p, q)
    return StageHulls(
        zc=Interval(int(wl.min()), int(wh.max())),
        scaled=Interval(int(s_lo.min()), int(s_hi.max())),
        acc=Interval(int((s_lo + win.bias).min()), int((s_hi + win.bias).max())),
    )


def output_ranges(rep: RangeReport, cfg: NormConfig, hulls: StageHulls) -> None:
    """Stage 4: zc, scaled, acc (checked against 63 bits), then y and out."""
    # The row analysis' entries passed their checks: only the new ones remain.
    stage = RangeReport(rep.op)
    stage.add("zc", hulls.zc)
    stage.add("scaled", hulls.scaled)
    acc = stage.add("acc", hulls.acc)
    stage.check()
    rep.items.update(stage.items)
    y = rep.add("y", acc.rshift(cfg.shift, cfg.rounding))
    rep.add("out", y.clamp(cfg.out_fmt.lo, cfg.out_fmt.hi))


def default_lanes(in_fmt: QFormat, out_fmt: QFormat) -> int:
    """The narrow datapath for inputs and outputs of up to 8 bits, the wide one above
    (a 16-bit output needs ~24-bit products in its output stage)."""
    return LANES[0] if max(in_fmt.bits, out_fmt.bits) <= 8 else LANES[1]


def default_frac_bits(real_gain: np.ndarray, limit: int) -> int:
    """F_z with z's rounding GUARD_BITS below the output LSB of the largest gain.

    z's LSB moves the output by |γ G / s_out| / 2^F_z LSB; rounding z costs half
    of that, so F_z = ceil(log2 max|γ G / s_out|) + GUARD_BITS keeps it below
    2^-(GUARD_BITS+1) LSB.  Limited to [0, F_r] (z cannot be finer than r).
    """
    big = float(np.max(np.abs(real_gain)))
    want = ceil_log2(big) + GUARD_BITS if big > 0 else GUARD_BITS
    return min(max(want, 0), limit)


def scaled_round(values: np.ndarray, shift: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """``round_half_up(v · 2^shift / scale)`` of float64 ``values``, exactly, where cheap.

    Returns (int64 results, mask of the values left for exact rational rounding).
    ``v · 2^shift`` is exact (np.ldexp) unless it overflows; dividing by a power of
    two is exact too, so for a power-of-two ``scale`` t is the exact value and
    ``fixedpoint.round_float`` rounds it exactly (every |t| < 2^62).  Otherwise
    the division is correctly rounded, t = x (1 + δ) with |δ| <= 2^-53, and t's
    rounding is x's unless x and t straddle the one half-integer next to t: t is
    kept only if its distance to it (exact up to 2^-53 for |t| < 2^36) exceeds
    2^-40 (1 + |t|), far above |x − t| < |t| 2^-52 + 2^-1074.  Ties, near-ties,
    huge and non-finite values are left to the caller (mask True).
    """
    with np.errstate(over="ignore", invalid="ignore"):
        t = np.ldexp(values, shift) / scale
        size = np.abs(t)
        if math.frexp(scale)[0] == 0.5:
            keep = size < 2.0**62
        else:
            frac = t - np.floor(t)
            keep = (size < 2.0**36) & (np.abs(frac - 0.5) > np.ldexp(size + 1.0, -40))
        k = np.where(keep, fp.round_float(np.where(keep, t, 0.0)), 0.0).astype(np.int64)
    return k, ~keep


def _output_bias(beta: np.ndarray, cfg: NormConfig, z_abs: int) -> tuple[int, ...]:
    """``B_c = round(β_c 2^s / s_out)``, clipped to where the output saturates anyway.

    With |z · m_c| <= Z_c, a bias B >= (hi + 1) 2^s + Z_c gives acc >= (hi + 1) 2^s,
    so y >= hi + 1 under every rounding mode and the output is hi — as it is for
    any larger B (y is monotone in B).  Symmetrically below.  So clipping B there
    changes no output and keeps acc inside the range check for any finite β.

    Vectorized (:func:`scaled_round`, int64 clipping) where the clip bounds fit
    62 bits; the values :func:`scaled_round` leaves, and configs beyond that, take
    the exact rational rule of :func:`_output_bias_exact` — equal by construction,
    and ``tests/test_norm_speed_exact.py`` checks it on ties and near-ties.
    """
    shift = cfg.shift
    top, bottom = (cfg.out_fmt.hi + 1) << shift, (cfg.out_fmt.lo - 1) << shift
    gain = np.asarray(cfg.gain, dtype=np.int64)
    m_abs = max(-int(gain.min()), int(gain.max()))
    if max(top, -bottom) + z_abs * m_abs >= 1 << 62:
        return _output_bias_exact(beta, cfg, z_abs)
    reach = np.abs(gain) * z_abs
    lo, hi = bottom - reach, top + reach
    b_int, exact = scaled_round(beta, shift, cfg.out_fmt.scale)
    out = np.minimum(np.maximum(b_int, lo), hi)
    if exact.any():
        s_out = Fraction(cfg.out_fmt.scale)
        for i in np.flatnonzero(exact).tolist():
            b = round_rational(Fraction(float(beta[i])) * (1 << shift) / s_out)
            out[i] = min(max(b, int(lo[i])), int(hi[i]))
    return tuple(out.tolist())


def _output_bias_exact(beta: np.ndarray, cfg: NormConfig, z_abs: int) -> tuple[int, ...]:
    """:func:`_output_bias` channel by channel in exact rationals (the definition)."""
    s_out = Fraction(cfg.out_fmt.scale)
    top, bottom = (cfg.out_fmt.hi + 1) << cfg.shift, (cfg.out_fmt.lo - 1) << cfg.shift
    out = []
    for b, m in zip(beta.tolist(), cfg.gain, strict=True):
        b_int = round_rational(Fraction(b) * (1 << cfg.shift) / s_out)
        reach = z_abs * abs(m)
        out.append(min(max(b_int, bottom - reach), top + reach))
    return tuple(out)
