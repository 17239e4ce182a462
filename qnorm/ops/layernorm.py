"""Integer LayerNorm (L2): γ (x − μ) / sqrt(σ² + ε) + β with an exact integer rsqrt.

Per row of N integers x (any width 4–16 bits, any positive scale s_in):

    S = Σx,  Q = Σx²,  d_i = N x_i − S,  V = N Q − S²  (= N² σ² in LSB², exact)
    W = V · 4^g + ε_int,  ε_int = round(ε_V 4^g),  ε_V = ε N² / s_in²
    z_i ≈ 2^(F_z + g) d_i / sqrt(W)   (= 2^F_z (x_i − μ)/sqrt(σ² + ε), in Q.F_z)

with one exact ``fixedpoint.rsqrt`` per row on W's 30/31-bit mantissa, then the
shared affine stage.  The guard g (``eps_shift``) gives ε fractional resolution —
ε_V is often not near an integer (44.48 for int8 rows of 64 at s_in = 0.03) — and
the numerator's shift gains g to compensate (``_normcore``, stage 1).  Two facts
carry the range analysis:

* V = Σ_{i<j} (x_i − x_j)², so 0 <= V <= floor(N/2) ceil(N/2) (hi − lo)²: V is
  convex in each x_i, so its maximum over the box sits at a vertex, and a vertex
  with k elements at one end gives k (N − k)(hi − lo)².
* Σ d_i = 0, so by Cauchy–Schwarz d_i² <= (N−1) Σ_{j≠i} d_j² = (N−1)(N V − d_i²),
  i.e. d_i² <= (N−1) V: |z| <= sqrt(N−1) 2^F_z, reached by a row [a, b, …, b].

N = 1 is legal: d = 0, so every output is β (rounded to the output grid).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from qnorm.analysis import Interval, RangeReport
from qnorm.fixedpoint import Round, rsqrt
from qnorm.ops._normcore import (
    NormConfig,
    NormOp,
    RowStageForm,
    StatBounds,
    centered_ranges,
    check_int,
    rsqrt_mode,
)
from qnorm.ops._xp import row_sum
from qnorm.ops.base import Trace, record

# fixedpoint.rsqrt forms 2^(2 F_r) in int64, so F_r = mant_bits/2 + inv_bits <= 30.
MAX_RSQRT_FRAC = 30
# (Σx)² is formed from S = h·2^k + l with −2^(k−1) <= l < 2^(k−1) (:func:`square_of_sum`):
# l fits the narrowest multiplier port of the targets, a DSP48's 18-bit signed one.
SQUARE_SPLIT_BITS = 18


@dataclass(frozen=True)
class RsqrtConfig(NormConfig):
    """A config whose per-row inverse is ``r = rsqrt(M, mant_bits/2 + inv_bits)``.

    With M in [2^(mb−1), 2^(mb+1)), r lies in [2^(inv_bits − 1/2), 2^(inv_bits + 1/2)]:
    a relative precision of 2^-inv_bits from an (inv_bits + 1)-bit unsigned value.
    """

    inv_bits: int = 15

    def _check_inverse(self) -> None:
        check_int("inv_bits", self.inv_bits, 1)
        if self.inv_frac_bits > MAX_RSQRT_FRAC:
            raise ValueError(
                f"mant_bits/2 + inv_bits must be <= {MAX_RSQRT_FRAC} (fixedpoint.rsqrt), "
                f"got mant_bits={self.mant_bits}, inv_bits={self.inv_bits}"
            )

    @property
    def inv_frac_bits(self) -> int:
        return self.mant_bits // 2 + self.inv_bits


@functools.lru_cache(maxsize=1024)
def _rsqrt_of(m: int, frac_bits: int, mode: Round) -> int:
    """``fixedpoint.rsqrt`` of one Python int, memoized: the mantissa's ends are
    the same few values for almost every config, and the digit-by-digit root on
    a Python int costs a millisecond."""
    return int(rsqrt(m, frac_bits, mode))


@dataclass(frozen=True)
class LayerNormConfig(RsqrtConfig):
    """IntLayerNorm config: the statistic is V = N Σx² − (Σx)², W = V 4^g + ε_int."""

    def eps_exact(self, eps: float) -> Fraction:
        return variance_eps(self, eps)


def variance_eps(cfg: NormConfig, eps: float) -> Fraction:
    """σ² + ε = (V + ε N² / s_in²) s_in² / N²: ε in units of V, exactly."""
    return Fraction(eps) * cfg.n**2 / Fraction(cfg.in_fmt.scale) ** 2


def variance(x: Any, s: Any, cfg: NormConfig, trace: Trace | None) -> Any:
    """V = N Σx² − (Σx)² (exact; ε is added by ``_normcore.add_eps``)."""
    q = record(trace, "sum_sq", row_sum(x * x))
    nq = record(trace, "n_sum_sq", cfg.n * q)
    ss = square_of_sum(s, trace) if sum_split(cfg) else record(trace, "sum_squared", s * s)
    return record(trace, "var", nq - ss)


def sum_split(cfg: NormConfig) -> bool:
    """Whether Σx can leave [−2^(k−1), 2^(k−1)), an 18-bit signed port (int8 rows over
    1024), so that :func:`square_of_sum` forms its square; elsewhere it is S·S."""
    half = 1 << (SQUARE_SPLIT_BITS - 1)
    return not (-half <= cfg.n * cfg.in_fmt.lo and cfg.n * cfg.in_fmt.hi < half)


def square_of_sum(s: Any, trace: Trace | None) -> Any:
    """S² as two products whose narrower operands fit an 18-bit signed multiplier port.

    S has up to 7 + log2 N + 1 bits for int8 rows (20 at N = 4096), so S·S would need
    a multiplier wider on both sides than a DSP48's 27×18.  With
    ``h = (S + 2^(k−1)) >> k`` and ``l = S − h·2^k`` (−2^(k−1) <= l < 2^(k−1),
    k = SQUARE_SPLIT_BITS), ``h·2^k = S − l``, so
    ``S² = (S − l)(S + l) + l² = h·(S + l)·2^k + l²``: h has log2 N − 10 bits for int8
    rows (at most 6), l at most k.  The same integer as S·S on every target, formed so
    only where S can leave the port (:func:`sum_split`).
    """
    h, low = split_sum(s)
    h, low = record(trace, "sum_high", h), record(trace, "sum_low", low)
    high = record(trace, "square_high", h * (s + low))
    return record(trace, "sum_squared", (high << SQUARE_SPLIT_BITS) + record(trace, "square_low", low * low))


def split_sum(s: Any) -> tuple[Any, Any]:
    """``(h, l)`` with ``S = h·2^k + l`` and −2^(k−1) <= l < 2^(k−1) (k = SQUARE_SPLIT_BITS),
    on any integer values: Python ints, numpy, torch, TIR, HDL."""
    k = SQUARE_SPLIT_BITS
    h = (s + (1 << (k - 1))) >> k
    return h, s - (h << k)


def variance_ranges(cfg: NormConfig, rep: RangeReport) -> StatBounds:
    """Ranges of the variance pipeline and the relation for d = N·x − S (the
    numerator stage 3 folds into the per-row multiplier and offset).

    d_i² <= (N−1) V (module docstring) and |d_i| <= D = (N−1)(hi − lo); both are
    reached together by [lo, hi, …, hi].  The element products x·x are bounded by
    sum_sq and need no entry of their own.
    """
    d = centered_ranges(rep, cfg, record_centered=False)
    x = Interval(cfg.in_fmt.lo, cfg.in_fmt.hi)
    q = rep.add("sum_sq", x.square() * cfg.n)
    # N·Σx² and (Σx)² only form V's subtraction: they may fill int64 (2^62 each for int16
    # rows of 65536, all -32768), while V itself, which the rounding takes on, keeps headroom.
    rep.add("n_sum_sq", (q * cfg.n).as_unrounded())
    if sum_split(cfg):
        square_of_sum_ranges(rep)
    rep.add("sum_squared", rep["sum"].square().as_unrounded())  # only V's subtraction takes it, like N·Σx²
    span = x.hi - x.lo
    v = rep.add("var", Interval(0, (cfg.n // 2) * ((cfg.n + 1) // 2) * span * span))
    return StatBounds(v, Interval(-d, d), Fraction(cfg.n - 1), d * d)


def variance_floor(cfg: NormConfig) -> int:
    """V's least non-zero value: V = Σ_{i<j} (x_i − x_j)², so a row that is not constant
    has V >= k (N − k) >= N − 1 (k elements apart from the rest), reached by one element
    one LSB off; a constant row has V = 0 and every d_i = 0."""
    return cfg.n - 1


def square_of_sum_ranges(rep: RangeReport) -> None:
    """Ranges of :func:`square_of_sum`'s parts before their sum, from S's ("sum"), exact.

    ``f(S) = h·(S + l) = h²·2^k + 2h·l`` is 0 where h = 0 and never negative: for
    h != 0, |2h·l| <= |h|·2^k <= h²·2^k.  Within a block of one h it is linear in S,
    and from one block to the next it moves on the same way (a block's first value
    is 2h more than the previous block's last, h >= 1, and likewise below 0), so it
    never decreases for S >= 0 and never increases for S < 0: its least value is at
    the S of the range nearest 0, its largest at an end.
    """
    half = 1 << (SQUARE_SPLIT_BITS - 1)
    s = rep["sum"]
    (h_lo, l_lo), (h_hi, l_hi) = split_sum(s.lo), split_sum(s.hi)
    rep.add("sum_high", Interval(h_lo, h_hi))
    # l = S − h 2^k exactly within one block; across blocks it takes every value of the port
    low = rep.add("sum_low", Interval(l_lo, l_hi) if h_lo == h_hi else Interval(-half, half - 1))

    def f(v: int) -> int:
        h, low = split_sum(v)
        return h * (v + low)

    rep.add("square_high", Interval(f(min(max(0, s.lo), s.hi)), max(f(s.lo), f(s.hi))))
    rep.add("square_low", low.square())


def layer_norm_reference(op: NormOp, x: np.ndarray) -> np.ndarray:
    """torch.nn.functional.layer_norm in float64 with the op's float γ, β, ε."""
    import torch
    import torch.nn.functional as F

    p = op.params
    t = op.float_rows(x)
    return F.layer_norm(t, (op.config.n,), torch.from_numpy(p.gamma), torch.from_numpy(p.beta), p.eps).numpy()


class RsqrtNorm(NormOp):
    """A norm whose per-row inverse is an exactly rounded rsqrt of W's mantissa
    (IntLayerNorm, IntRMSNorm; their configs are :class:`RsqrtConfig`)."""

    inverse_name = "rsqrt"

    def _inverse(self, m: Any, trace: Trace | None) -> Any:
        cfg = self.config
        # split_exponent normalizes every mantissa (W = 0 included) to >= 2^(mant_bits-1).
        min_mant = 1 << (cfg.mant_bits - 1)
        return record(trace, "rsqrt", rsqrt(m, cfg.inv_frac_bits, rsqrt_mode(cfg.rounding), min_input=min_mant))

    @classmethod
    def _inverse_range(cls, cfg: NormConfig, m_iv: Interval) -> Interval:
        mode = rsqrt_mode(cfg.rounding)
        return Interval(_rsqrt_of(m_iv.hi, cfg.inv_frac_bits, mode), _rsqrt_of(m_iv.lo, cfg.inv_frac_bits, mode))


class IntLayerNorm(RsqrtNorm):
    """Integer LayerNorm over the last axis (see the module docstring)."""

    name = "int_layernorm"
    multiplications = ("sum_sq", "n_sum_sq", "sum_squared", "square_high", "square_low", "mult", "offset", "offset_fraction", "xa", "scaled")
    config_cls = LayerNormConfig
    op_defaults = {"inv_bits": 15}
    wide_defaults = {"mant_bits": 22, "inv_bits": 19}

    def _statistic(self, x: Any, trace: Trace | None) -> tuple[Any, Any]:
        s = record(trace, "sum", row_sum(x))
        return variance(x, s, self.config, trace), s

    def row_stage_form(self) -> RowStageForm:
        return RowStageForm("variance", "rsqrt", self.config.n, self.config.inv_frac_bits)

    @classmethod
    def _statistic_ranges(cls, cfg: NormConfig, rep: RangeReport) -> StatBounds:
        return variance_ranges(cfg, rep)

    @classmethod
    def _stat_floor(cls, cfg: NormConfig) -> int:
        return variance_floor(cfg)

    def float_reference(self, x: np.ndarray) -> np.ndarray:
        return layer_norm_reference(self, x)

    def cost(self) -> dict[str, dict[str, int]]:
        n, split = self.config.n, sum_split(self.config)
        return {
            # Σx, Σx² (N squares), N·Q and S² (in two products where Σx can leave
            # 18 bits: square_of_sum), V, (V << 2g) + ε, leading-zero count, mantissa
            # shift, rsqrt (one division and one isqrt inside fixedpoint.rsqrt)
            "per_row": {
                "add": 2 * (n - 1) + 2 + 3 * split,
                "mul": n + 2 + split,
                "div": 1,
                "sqrt": 1,
                "lzc": 1,
                "shift": 1 + (self.config.eps_shift > 0) + 3 * split,
            },
            "per_element": self.element_cost(),
            "per_row_affine": self.row_affine_cost(),
        }
