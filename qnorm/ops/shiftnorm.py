"""Shift-based LayerNorm: 1/σ and γ rounded to powers of two (adds and shifts only).

In the spirit of the shift-based BatchNorm of binarized networks.  The statistic
is LayerNorm's (exact V = N Σx² − (Σx)², d = N x − S; the squares are narrow
in×in products of the reduction; W = V · 4^g + ε_int with ε at fractional
resolution and the numerator shifted by g more, as for every norm — ``_normcore``,
stage 1).  What changes is the per-element path:

* **1/sqrt(W)** — W's leading-zero count gives W = M · 4^e with M in
  [2^(mb−1), 2^(mb+1)), i.e. M / 2^mb = X' in [1/2, 2).  ``mantissa_terms = 1``:
  1/sqrt(W) ≈ 2^-(e + mb/2), the power of two nearest in the log domain (the
  even-width split already rounds log2 sqrt(W) to nearest), error factor up to
  sqrt(2).  ``mantissa_terms = 2``: 1/sqrt(X') ≈ c with c = 2^a ± 2^b chosen among
  a few two-term values by comparing M with exact integer thresholds (the
  log-domain midpoints between neighbouring values; FINN-style threshold
  counting), worst-case error 9.5 % (between 5/4 and 3/2).
* **γ** — each per-channel gain γ_c / s_out becomes ±2^l_c (log-domain nearest)
  on one shared shift, so the multiply is a shift and a conditional negate.

So per element: N·x − S (N is a constant: shifts and adds), one shift by the
row exponent (minus g), one or two shifts and an add, a rounding shift, the channel's
shift and sign, + β, a rounding shift, saturation.  No multiplier, no divider.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np

from qnorm.analysis import Interval, RangeReport
from qnorm.fixedpoint import select
from qnorm.ops._normcore import (
    ChannelInts,
    FloatParams,
    NormConfig,
    NormOp,
    RowAnalysis,
    RowStageForm,
    StatBounds,
    mantissa_range,
)
from qnorm.ops._xp import const_like, row_sum
from qnorm.ops.base import Trace, record
from qnorm.ops.layernorm import (
    layer_norm_reference,
    sum_split,
    variance,
    variance_eps,
    variance_floor,
    variance_ranges,
)

# Fraction bits of the two-term mantissa: terms down to 2^-4 of the leading one.
# Finer terms only refine the values next to 1 and 1/2; the worst gap (5/4 to 3/2)
# would need a third term.
TWO_TERM_FRAC = 4


class Pow2Mantissa(NamedTuple):
    """``value = 2^hi + sign · 2^lo`` (sign 0: the single term 2^hi)."""

    value: int
    hi: int
    lo: int
    sign: int


@functools.cache
def mantissa_table(terms: int) -> tuple[int, tuple[Pow2Mantissa, ...]]:
    """(frac, candidates ordered by decreasing value) for 1/sqrt(X'), X' in [1/2, 2).

    A candidate v stands for c = v / 2^frac.  It is kept only if it is the
    log-nearest value for some X' in [1/2, 2): c_i wins on
    [1/(c_(i−1) c_i), 1/(c_i c_(i+1))).  One term: only c = 1.
    """
    if terms == 1:
        return 0, (Pow2Mantissa(1, 0, 0, 0),)
    frac = TWO_TERM_FRAC
    found: dict[int, Pow2Mantissa] = {}
    for hi in range(frac + 2):
        found.setdefault(1 << hi, Pow2Mantissa(1 << hi, hi, 0, 0))
    for sign in (1, -1):  # prefer 2^hi + 2^lo: its partial product never exceeds the total
        for hi in range(1, frac + 2):
            for lo in range(hi):
                v = (1 << hi) + sign * (1 << lo)
                found.setdefault(v, Pow2Mantissa(v, hi, lo, sign))
    ordered = sorted(found.values(), key=lambda c: -c.value)
    scale = Fraction(1 << frac)
    keep = []
    for i, cand in enumerate(ordered):
        c = cand.value / scale
        left = 1 / (ordered[i - 1].value / scale * c) if i > 0 else Fraction(0)
        right = 1 / (c * ordered[i + 1].value / scale) if i + 1 < len(ordered) else None
        if left < 2 and (right is None or right > Fraction(1, 2)):
            keep.append(cand)
    return frac, tuple(keep)


@functools.cache
def mantissa_thresholds(terms: int, mant_bits: int) -> tuple[int, ...]:
    """T_i: choose candidate i (not i − 1) iff M >= T_i = ceil(2^mb / (c_(i−1) c_i))."""
    frac, cands = mantissa_table(terms)
    num = 1 << (mant_bits + 2 * frac)
    return tuple(-(-num // (a.value * b.value)) for a, b in itertools.pairwise(cands))


@functools.cache
def mantissa_steps(terms: int, mant_bits: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """The inverse as a walk: the first candidate's value, then per threshold T_i the
    step to candidate i's value, added where M >= T_i (the candidates decrease, so
    the steps are negative and M's candidate is the last threshold it reaches)."""
    _, cands = mantissa_table(terms)
    steps = tuple(cur.value - prev.value for prev, cur in itertools.pairwise(cands))
    return cands[0].value, mantissa_thresholds(terms, mant_bits), steps


@functools.lru_cache(maxsize=256)
def candidate_parts(terms: int, mant_bits: int, lo: int, hi: int) -> tuple[tuple[Pow2Mantissa, int, int], ...]:
    """:meth:`ShiftLayerNorm._segments` for M in [lo, hi]: a function of these four
    integers alone.  Cached: every exponent but the lowest and the highest has the
    full mantissa range, so a derivation asks the same few keys over and over."""
    _, cands = mantissa_table(terms)
    cuts = (lo, *mantissa_thresholds(terms, mant_bits), hi + 1)
    out = []
    for i, cand in enumerate(cands):
        part_lo, part_hi = max(cuts[i], lo), min(cuts[i + 1] - 1, hi)
        if part_lo <= part_hi:
            out.append((cand, part_lo, part_hi))
    return tuple(out)


def negate_mask(sign: Any) -> Any:
    """-1 where ``sign`` (-1, 0 or 1) is negative, else 0: an arithmetic shift."""
    return sign >> 1


def nonzero_mask(sign: Any) -> Any:
    """-1 where ``sign`` (-1, 0 or 1) is not 0, else 0."""
    return -(sign & 1)


def signed_term(v: Any, neg: Any, keep: Any) -> Any:
    """``sign · v`` from the masks of ``sign``: ``(v XOR neg) − neg`` is the
    two's-complement negation where neg = −1 (and v where 0), ``AND keep`` zeroes
    it where sign = 0 — the conditional negate of hardware, without a multiplier,
    and element-wise without a select (``torch.where`` is an order of magnitude
    slower than these on int64 CPU tensors)."""
    return ((v ^ neg) - neg) & keep


@dataclass(frozen=True)
class ShiftNormConfig(NormConfig):
    """ShiftLayerNorm config: every gain is 0 or ±2^l; ``mantissa_terms`` in {1, 2}."""

    mantissa_terms: int = 2

    def _check_inverse(self) -> None:
        if self.mantissa_terms not in (1, 2):
            raise ValueError(f"mantissa_terms must be 1 or 2, got {self.mantissa_terms!r}")
        try:  # int64 two's complement: m & (m - 1) is 0 exactly for 0 and ±2^l (also -2^63)
            g = np.array(self.gain, dtype=np.int64)
            m = np.where(g < 0, -g, g)  # |g|; -2^63 stays -2^63, whose m & (m - 1) is 0 too
            bad = g[(m & (m - 1)) != 0].tolist()
        except OverflowError:  # a uint64 gain: Python ints
            bad = [g for g in self.gain if g and abs(g) & (abs(g) - 1)]
        if bad:
            raise ValueError(f"ShiftLayerNorm gains must be 0 or ±2^l, got {bad[:3]}")

    @property
    def inv_frac_bits(self) -> int:
        return self.mant_bits // 2 + mantissa_table(self.mantissa_terms)[0]

    def eps_exact(self, eps: float) -> Fraction:
        return variance_eps(self, eps)


def round_log2(v: Fraction) -> int:
    """The integer nearest to log2(v), ties up, for v > 0: floor(log2(2 v²) / 2)."""
    q = 2 * v * v
    k = q.numerator.bit_length() - q.denominator.bit_length()
    if q < Fraction(2) ** k:
        k -= 1
    return k // 2


# The float nearest sqrt(2) lies above it (1.41421356237309514547... > sqrt 2), and
# the float below it under: for a float m, m >= sqrt(2) exactly iff m >= SQRT2.
SQRT2 = math.sqrt(2.0)


def round_log2_floats(values: np.ndarray) -> np.ndarray:
    """:func:`round_log2` of |v| for each non-zero float64 v (0 where v = 0), vectorized.

    |v| = m 2^e with m in [1, 2): log2(2 v²) = 2e + 1 + 2 log2 m, whose floor is
    2e + 1 + [m >= sqrt 2], so round_log2 = e + [m >= sqrt 2] — exact, since the
    float comparison m >= SQRT2 decides m >= sqrt(2) exactly (no float lies in
    between) and ``np.frexp`` is exact, subnormals included.
    """
    f, e = np.frexp(np.abs(np.asarray(values, dtype=np.float64)))  # |v| = f 2^e, f in [1/2, 1)
    return np.where(f != 0, e - 1 + (2 * f >= SQRT2), 0).astype(np.int64)


class ShiftLayerNorm(NormOp):
    """LayerNorm with power-of-two 1/σ and γ (see the module docstring)."""

    name = "shift_layernorm"
    # scales by shifts; the per-row multiplier N·(2^hi ± 2^lo) (rounded by 2^-j
    # for long rows) is applied to x as in every norm
    multiplications = ("sum_sq", "n_sum_sq", "sum_squared", "square_high", "square_low", "mult", "offset", "offset_fraction", "xa")
    config_cls = ShiftNormConfig
    gain_form = "pow2"  # _quantize_gain's signed powers of two ±2^l_c
    inverse_name = "rsqrt_pow2"
    op_defaults = {"mantissa_terms": 2}

    def _assemble(self, config: NormConfig, params: FloatParams, row: RowAnalysis, ints: ChannelInts | None) -> None:
        super()._assemble(config, params, row, ints)
        g = self._gain
        self._sign = np.sign(g)
        # l = bit_length(|g|) − 1 (0 for g = 0): the exponent of ±2^l, exact in float64
        self._log2 = np.maximum(np.frexp(g.astype(np.float64))[1] - 1, 0).astype(np.int64)
        # _scale's conditional negate as masks: -1 where the gain is negative, and
        # 0 where it is zero (else -1)
        self._neg = negate_mask(self._sign)
        self._keep = nonzero_mask(self._sign)

    @classmethod
    def _quantize_gain(cls, gains: np.ndarray, mult_bits: int, max_shift: int) -> tuple[tuple[int, ...], int]:
        """±2^l_c, l_c = round(log2 |g_c|) + s in [0, mult_bits − 2].

        The shared shift s (at most ``max_shift``) gives the largest gain the top
        exponent; a gain whose exponent falls below the grid (l_c < 0) is flushed
        to 0, as a dyadic multiplier rounds to 0 below half its LSB.
        """
        gains = np.asarray(gains, dtype=np.float64)
        live = gains != 0
        if not live.any():
            return (0,) * len(gains), 0
        logs = round_log2_floats(gains)
        top = int(logs[live].max())
        s = min(max_shift, mult_bits - 2 - top)
        if s < 0:
            raise ValueError(f"a gain of 2^{top} per z LSB does not fit a {mult_bits}-bit power-of-two multiplier")
        l = logs + s  # <= mult_bits - 2
        keep = live & (l >= 0)
        out = np.where(keep, np.sign(gains).astype(np.int64) << np.where(keep, l, 0), 0)
        return tuple(out.tolist()), s

    def _statistic(self, x: Any, trace: Trace | None) -> tuple[Any, Any]:
        s = record(trace, "sum", row_sum(x))
        return variance(x, s, self.config, trace), s

    @classmethod
    def _statistic_ranges(cls, cfg: NormConfig, rep: RangeReport) -> StatBounds:
        return variance_ranges(cfg, rep)

    @classmethod
    def _stat_floor(cls, cfg: NormConfig) -> int:
        return variance_floor(cfg)

    def _inverse(self, m: Any, trace: Trace | None) -> Any:
        """Per row: count the thresholds M crosses; the chosen 2^hi ± 2^lo."""
        base, thresholds, steps = mantissa_steps(self.config.mantissa_terms, self.config.mant_bits)
        value = m * 0 + base
        for t, step in zip(thresholds, steps, strict=True):
            value = value + select(m >= t, step, 0)
        return record(trace, "rsqrt_pow2", value)

    def row_stage_form(self) -> RowStageForm:
        """The variance, then the table :meth:`_inverse` walks (:func:`mantissa_steps`)."""
        base, thresholds, steps = mantissa_steps(self.config.mantissa_terms, self.config.mant_bits)
        return RowStageForm("variance", "pow2_table", self.config.n, 0, thresholds, steps, base)

    def _scale(self, z: Any) -> Any:
        """z · (±2^l_c): a shift and a conditional negate."""
        mag = z << const_like(z, self._log2)
        return signed_term(mag, const_like(z, self._neg), const_like(z, self._keep))

    @classmethod
    def _inverse_range(cls, cfg: NormConfig, m_iv: Interval) -> Interval:
        vals = [c.value for c, _, _ in cls._segments(cfg, m_iv)]
        return Interval(min(vals), max(vals))

    @classmethod
    def _segments(cls, cfg: NormConfig, m_iv: Interval) -> tuple[tuple[Pow2Mantissa, int, int], ...]:
        """Each candidate with the part [lo, hi] of M's range on which it is chosen
        (plain integers: the range analysis asks this per exponent, every derivation)."""
        return candidate_parts(cfg.mantissa_terms, cfg.mant_bits, m_iv.lo, m_iv.hi)

    @classmethod
    def _product_bound(
        cls,
        cfg: NormConfig,
        stat: StatBounds,
        segs: dict[int, Interval],
        by_exp: dict[int, Interval],
        inv: Interval,
    ) -> int:
        """Per exponent e and candidate, on the candidate's part of M's range:
        |u| <= sqrt(ratio_e 4^H (M_hi + [e > 0])) + [e > H] (X < M + 1 when M is
        truncated; u = num 2^(H − e) is rounded when e > H, H = g the ε guard),
        capped by u's range; times the candidate's value.  In integers:
        ratio_e = n / d."""
        prod = 0
        h = cfg.num_shift
        for e, u_iv in by_exp.items():
            (rn, rd), u_cap = stat.ratio_terms(segs[e]), max(-u_iv.lo, u_iv.hi)
            for cand, _, hi in cls._segments(cfg, mantissa_range(e, segs[e], cfg)):  # u grows with M
                u = min(u_cap, math.isqrt((rn * (hi + (e > 0)) << (2 * h)) // rd) + (e > h))
                prod = max(prod, u * cand.value)
        return prod

    def float_reference(self, x: np.ndarray) -> np.ndarray:
        """Plain LayerNorm (the op this approximates), float64, float γ, β, ε."""
        return layer_norm_reference(self, x)

    def cost(self) -> dict[str, dict[str, int]]:
        n, terms = self.config.n, self.config.mantissa_terms
        split = sum_split(self.config)
        return {
            # Σx, Σx² (narrow in×in squares), N·Q and S² (in two products where Σx can
            # leave 18 bits: square_of_sum), V, (V << 2g) + ε, leading-zero count,
            # mantissa shift, threshold compares selecting the mantissa
            "per_row": {
                "add": 2 * (n - 1) + 2 + 3 * split,
                "mul": n + 2 + split,
                "div": 0,
                "sqrt": 0,
                "lzc": 1,
                "shift": 1 + (self.config.eps_shift > 0) + 3 * split,
                "compare": len(mantissa_table(terms)[1]) - 1,
            },
            # x·a multiplies by the row's N·(2^a ± 2^b) (rounded by 2^-j for long rows);
            # γ is a shift and a conditional negate
            "per_element": {**self.element_cost(), "mul": 1, "shift": 3, "negate": 1},
            "per_row_affine": self.row_affine_cost(),
        }
