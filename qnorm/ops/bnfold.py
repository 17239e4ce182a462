"""Exact rational BatchNorm and its folding into integer thresholds.

Shared by the multi-threshold activation, the MPBN spiking neuron and the BN
folding passes.  At construction every BN parameter becomes an integer,
deterministically and exactly (``Fraction`` of the float's binary value, rounded
half up):

    gamma / s_out  ~  G / 2^S          (per-channel multipliers, one shared shift S)
    mu / s_in      ~  M / 2^F          (mean in input LSB, F fraction bits)
    sqrt(var+eps) / s_in ~ D / 2^F,    D = isqrt_round(round((var+eps) 2^2F / s_in^2)) >= 1
    beta / s_out   ~  B / 2^Fo

so the BN output in output units is the exact rational

    z(x) = G (2^F x - M) / (D 2^S) + B / 2^Fo  =  (P x + Q) / Den,
    P = G 2^(F+Fo),   Q = B D 2^S - G 2^Fo M,   Den = D 2^(S+Fo) > 0.

``z(x) >= c  <=>  P x >= c Den - Q`` is a half-line in x (:meth:`RationalBN.fold_event`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

import numpy as np

from qnorm import fixedpoint as fp
from qnorm.fixedpoint import Round

MAX_FRAC_BITS = 30
MAX_GAMMA_SHIFT = 32


# --------------------------------------------------------------------------- parameters


def real_params(**named: object) -> dict[str, np.ndarray]:
    """Float parameters broadcast to one shape; non-real, NaN and Inf refused by name."""
    arrays = {}
    for name, value in named.items():
        a = np.asarray(value)
        if a.dtype.kind not in "fiu":
            raise ValueError(f"{name} must be real-valued, got dtype {a.dtype}")
        a = a.astype(np.float64)
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{name} contains NaN or Inf; a BN parameter needs a finite value")
        arrays[name] = a
    try:
        shape = np.broadcast_shapes(*(a.shape for a in arrays.values()))
    except ValueError:
        shapes = ", ".join(f"{k}{a.shape}" for k, a in arrays.items())
        raise ValueError(f"parameter shapes do not broadcast to one per-channel shape: {shapes}") from None
    return {k: np.broadcast_to(a, shape).copy() for k, a in arrays.items()}


def check_bn_stats(var: np.ndarray, eps: np.ndarray) -> None:
    if np.any(var < 0):
        raise ValueError(f"var must be >= 0, got min {float(var.min())!r}")
    if np.any(eps < 0):
        raise ValueError(f"eps must be >= 0, got min {float(eps.min())!r}")


def fixed_ratio(name: str, num: int, den: int, frac_bits: int) -> int:
    """``round_half_up(num / den * 2^frac_bits)`` for den > 0, exactly, refused beyond 62 bits."""
    q = round_ratio(num << frac_bits, den)
    if abs(q) >= 1 << 62:
        raise ValueError(f"{name} = {num / den!r} does not fit 62 bits at {frac_bits} fraction bits")
    return q


def to_fixed(name: str, value: Fraction, frac_bits: int) -> int:
    """``round_half_up(value * 2^frac_bits)`` exactly, refused beyond 62 bits."""
    return fixed_ratio(name, value.numerator, value.denominator, frac_bits)


def round_ratio(num: int, den: int) -> int:
    """``floor(num / den + 1/2)`` for den > 0: round half up of an exact rational, in Python ints."""
    return (2 * num + den) // (2 * den)


@dataclass(frozen=True, eq=False)
class FloatBN:
    """Original float BN parameters (the float reference), broadcast to one shape."""

    gamma: np.ndarray
    beta: np.ndarray
    mean: np.ndarray
    var: np.ndarray
    eps: np.ndarray

    def apply(self, x: np.ndarray) -> np.ndarray:
        """``gamma (x - mean) / sqrt(var + eps) + beta`` in float64 (real units)."""
        x = np.asarray(x, dtype=np.float64)
        return self.gamma * (x - self.mean) / np.sqrt(self.var + self.eps) + self.beta


@dataclass(frozen=True)
class FoldedEvent:
    """Where the event ``z(x) >= c`` (or ``>``) holds, as one integer bound per channel.

    ``negative``: the event is ``x <= theta`` (gamma < 0), else ``x >= theta``.
    ``direction``: sign of gamma (0: constant event, encoded as theta at the ends).
    """

    theta: np.ndarray
    negative: np.ndarray
    direction: np.ndarray


@dataclass(frozen=True, eq=False)
class RationalBN:
    """BN with quantized rational parameters (all int64 arrays of one shape).

    ``z(x) = G (2^F x - M) / (D 2^S) + B / 2^Fo`` in output units for an integer
    input x in input LSB; see the module docstring for how floats map here.
    """

    gamma_m: np.ndarray  # G
    gamma_shift: int  # S
    mean_q: np.ndarray  # M
    std_q: np.ndarray  # D >= 1
    frac_bits: int  # F
    beta_q: np.ndarray  # B
    out_frac_bits: int  # Fo

    def __post_init__(self) -> None:
        arrays = (self.gamma_m, self.mean_q, self.std_q, self.beta_q)
        for a in arrays:
            if not isinstance(a, np.ndarray) or a.dtype != np.int64:
                raise ValueError("RationalBN parameters must be int64 numpy arrays")
        if len({a.shape for a in arrays}) != 1:
            raise ValueError(f"RationalBN parameter shapes differ: {[a.shape for a in arrays]}")
        if np.any(self.std_q < 1):
            raise ValueError("RationalBN std_q (D) must be >= 1")
        if not 0 <= self.gamma_shift <= 62:
            raise ValueError(f"gamma_shift must be in [0, 62], got {self.gamma_shift}")
        for name in ("frac_bits", "out_frac_bits"):
            if not 0 <= getattr(self, name) <= MAX_FRAC_BITS:
                raise ValueError(f"{name} must be in [0, {MAX_FRAC_BITS}], got {getattr(self, name)}")

    @classmethod
    def from_float(
        cls,
        gamma: np.ndarray,
        beta: np.ndarray,
        mean: np.ndarray,
        var: np.ndarray,
        eps: np.ndarray,
        in_scale: float,
        out_scale: float,
        gamma_bits: int = 16,
        frac_bits: int = 8,
        out_frac_bits: int = 8,
    ) -> "RationalBN":
        """Quantize already validated float arrays of one shape (see :func:`real_params`).

        Every float is its exact binary value ``a / k`` (``float.as_integer_ratio``,
        k a power of two), so each constant is one exact Python-int rounding
        ``round(n / d) = floor((2n + d) / 2d)`` (half up, :func:`round_ratio`), no
        ``Fraction`` and no per-channel loop of ``fixedpoint.isqrt``:

            M = round(mean / s_in 2^F)        B = round(beta / s_out 2^Fo)
            D = isqrt_round(round((var + eps) / s_in^2 2^2F))

        with ``math.isqrt`` as the exact floor root and ``isqrt_round`` adding one
        iff v > r^2 + r (the rule of :func:`~qnorm.fixedpoint.isqrt_round`).  The
        gamma multipliers are :func:`~qnorm.fixedpoint.dyadic_vector` of
        ``gamma / s_out`` (one correctly rounded float64 division).  The result is
        the exact rational derivation with ``Fraction``, which the tests keep as the
        independent reference, at about 3 us per channel instead of 200 us.
        Constants beyond 62 bits and a zero standard deviation are refused
        (ValueError naming the parameter and its value).
        """
        if not 0 <= frac_bits <= MAX_FRAC_BITS or not 0 <= out_frac_bits <= MAX_FRAC_BITS:
            raise ValueError(f"frac_bits and out_frac_bits must be in [0, {MAX_FRAC_BITS}]")
        arrays = [np.asarray(a, dtype=np.float64) for a in (gamma, beta, mean, var, eps)]
        shape = arrays[0].shape
        if any(a.shape != shape for a in arrays):
            raise ValueError(f"BN parameter shapes differ: {[a.shape for a in arrays]} (see real_params)")
        gamma, beta, mean, var, eps = arrays
        # gamma / s_out is one correctly rounded float64 division: deterministic.  The
        # shared shift is capped so a vanishing |gamma| rounds to 0 (a constant channel)
        # instead of scaling every product of the layer past int64.
        g, shift = fp.dyadic_vector(gamma / float(out_scale), gamma_bits, MAX_GAMMA_SHIFT)
        in_n, in_d = float(in_scale).as_integer_ratio()
        out_n, out_d = float(out_scale).as_integer_ratio()
        ratios = [[v.as_integer_ratio() for v in a.ravel().tolist()] for a in (mean, beta, var, eps)]
        m = [fixed_ratio("mean / in_scale", a * in_d, k * in_n, frac_bits) for a, k in ratios[0]]
        b = [fixed_ratio("beta / out_scale", a * out_d, k * out_n, out_frac_bits) for a, k in ratios[1]]
        d = [_std_q(a1 * k2 + a2 * k1, k1 * k2, in_n, in_d, frac_bits) for (a1, k1), (a2, k2) in zip(*ratios[2:], strict=True)]
        gm, mq, dq, bq = (np.array(a, dtype=np.int64).reshape(shape) for a in (g, m, d, b))
        return cls(gm, shift, mq, dq, frac_bits, bq, out_frac_bits)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.gamma_m.shape

    def linear_form(self) -> tuple[list[int], list[int], list[int]]:
        """Exact Python-int (P, Q, Den) per flat channel: ``z(x) = (P x + Q) / Den``."""
        f, fo, s = self.frac_bits, self.out_frac_bits, self.gamma_shift
        g, m, d, b = (a.ravel().tolist() for a in (self.gamma_m, self.mean_q, self.std_q, self.beta_q))
        slope = [gi << (f + fo) for gi in g]
        offset = [(bi * di << s) - (gi * mi << fo) for gi, mi, di, bi in zip(g, m, d, b, strict=True)]
        den = [di << (s + fo) for di in d]
        return slope, offset, den

    def root(self, c: Fraction | Sequence[Fraction]) -> list[Fraction | None]:
        """The exact x with ``z(x) = c`` per channel (None where gamma_q = 0)."""
        slope, offset, den = self.linear_form()
        cs = _per_channel(c, len(slope))
        return [None if p == 0 else (ci * dn - q) / p for p, q, dn, ci in zip(slope, offset, den, cs, strict=True)]

    def fold_event(self, c: Fraction | Sequence[Fraction], strict: bool, lo: int, hi: int) -> FoldedEvent:
        """Fold ``z(x) >= c`` (``> c`` if strict) into one integer threshold per channel.

        ``z(x) >= c  <=>  P x + Q >= c Den  <=>  P x >= r`` with ``r = c Den - Q``
        (Den > 0, so nothing flips).  Then, with r/P an exact rational:

        * P > 0:  ``>=``: x >= ceil(r/P);          ``>``: x >= floor(r/P) + 1
        * P < 0 (dividing flips): ``>=``: x <= floor(r/P);  ``>``: x <= ceil(r/P) - 1
        * P = 0:  the event is the constant ``0 >= r`` (``0 > r``), for every x.

        On the grid (r/P an integer n) ``>=`` gives n and ``>`` gives n + 1, off the
        grid both give the same integer: the ceil vs floor + 1 trap.  Thresholds are
        clamped to [lo, hi + 1] (``x >= t``) or [lo - 1, hi] (``x <= t``), which
        changes nothing for inputs in [lo, hi] and keeps them one bit wider than x.
        A constant event becomes ``x >= lo`` (always) or ``x >= hi + 1`` (never), so
        the folded forward has no third case.
        """
        slope, offset, den = self.linear_form()
        cs = _per_channel(c, len(slope))
        theta, negative, direction = [], [], []
        for p, q, dn, ci in zip(slope, offset, den, cs, strict=True):
            r = ci * dn - q
            if p > 0:
                t = math.floor(r / p) + 1 if strict else math.ceil(r / p)
                theta.append(min(max(t, lo), hi + 1))
            elif p < 0:
                t = math.ceil(r / p) - 1 if strict else math.floor(r / p)
                theta.append(min(max(t, lo - 1), hi))
            else:
                holds = 0 > r if strict else 0 >= r
                theta.append(lo if holds else hi + 1)
            negative.append(p < 0)
            direction.append((p > 0) - (p < 0))
        return FoldedEvent(
            theta=np.array(theta, dtype=np.int64).reshape(self.shape),
            negative=np.array(negative, dtype=bool).reshape(self.shape),
            direction=np.array(direction, dtype=np.int8).reshape(self.shape),
        )

    def numerator_bounds(self, lo: Sequence[int], hi: Sequence[int]) -> list[tuple[int, int, int, int]]:
        """Per channel, exact (min, max) of ``P x`` and of ``P x + Q`` for x in [lo_c, hi_c]."""
        slope, offset, _ = self.linear_form()
        out = []
        for p, q, a, b in zip(slope, offset, lo, hi, strict=True):
            pa, pb = sorted((p * a, p * b))
            out.append((pa, pb, pa + q, pb + q))
        return out

    def as_float(self, in_scale: float, out_scale: float) -> FloatBN:
        """The quantized parameters as a float BN (eps = 0)."""
        f = float(1 << self.frac_bits)
        return FloatBN(
            gamma=self.gamma_m * (out_scale / float(1 << self.gamma_shift)),
            beta=self.beta_q * (out_scale / float(1 << self.out_frac_bits)),
            mean=self.mean_q * (in_scale / f),
            var=(self.std_q * (in_scale / f)) ** 2,
            eps=np.zeros(self.shape),
        )


def _std_q(num: int, den: int, in_n: int, in_d: int, frac_bits: int) -> int:
    """D = isqrt_round(round((var + eps) 2^2F / s_in^2)), var + eps = num / den, s_in = in_n / in_d.

    ``math.isqrt`` is the exact floor root; ``isqrt_round`` adds one iff v > r^2 + r
    (the rule of :func:`~qnorm.fixedpoint.isqrt_round`: sqrt(v) is never r + 1/2).
    """
    v = round_ratio(num * in_d * in_d << (2 * frac_bits), den * in_n * in_n)
    if v > 1 << 62:
        raise ValueError(f"var + eps = {num / den!r} is too large for frac_bits={frac_bits}")
    r = math.isqrt(v) if v > 0 else 0
    d = r + (v > r * r + r)
    if d < 1:
        raise ValueError(
            f"var + eps = {num / den!r} rounds to a zero standard deviation at "
            f"frac_bits={frac_bits}; raise frac_bits or eps"
        )
    return d


def _per_channel(c: Fraction | Sequence[Fraction], n: int) -> list[Fraction]:
    if isinstance(c, Fraction):
        return [c] * n
    cs = [Fraction(v) for v in c]
    if len(cs) != n:
        raise ValueError(f"expected {n} per-channel constants, got {len(cs)}")
    return cs


def level_event(mode: Round | str, k: int) -> tuple[Fraction, bool]:
    """``round(z) >= k  <=>  z >= c`` (strict False) or ``z > c`` (strict True).

    Every rounding rule is monotone, so the set is a half-line; its end and whether
    the end belongs to it follow from where the rule sends ties:
    HALF_UP  z >= k - 1/2 (the tie k - 1/2 rounds up to k)
    HALF_EVEN  k even: z >= k - 1/2; k odd: z > k - 1/2 (the tie goes to k - 1)
    HALF_AWAY  k >= 1: z >= k - 1/2; k <= 0: z > k - 1/2 (the tie is away from 0)
    FLOOR  z >= k          CEIL  z > k - 1
    TRUNC  k >= 1: z >= k; k <= 0: z > k - 1 (toward zero = ceil for negatives)
    """
    mode = Round.parse(mode)
    half = Fraction(2 * k - 1, 2)
    if mode is Round.HALF_UP:
        return half, False
    if mode is Round.HALF_EVEN:
        return half, k % 2 == 1
    if mode is Round.HALF_AWAY:
        return half, k <= 0
    if mode is Round.FLOOR:
        return Fraction(k), False
    if mode is Round.CEIL:
        return Fraction(k - 1), True
    return (Fraction(k), False) if k >= 1 else (Fraction(k - 1), True)  # TRUNC
