"""L1 LayerNorm: σ replaced by the mean absolute deviation × sqrt(π/2).

The float op (ShiftQuant's fully quantized L1 normalization) is

    γ (x − μ) / (c · MAD + ε) + β,   MAD = mean |x − μ|,  c = sqrt(π/2)

(c makes c · MAD equal σ for Gaussian rows).  No squares and no square root:

    S = Σx,  d_i = N x_i − S,  A = Σ|d_i| = N² MAD (in LSB, exact)
    W = A 2^g + ε_int,  ε_int = round(ε_A 2^g),  ε_A = ε N² / (c s_in)
    z_i ≈ 2^(F_z + h + g) d_i / W = 2^(F_z + h) d_i / (A + ε_A),   h = ceil(log2 N)

with ONE reciprocal per row, on W's mantissa.  (x − μ)/(c MAD + ε) = (N/c) d/(A + ε_A):
N/c = 2^h G is a free shift 2^h (keeping z in units of the L1 scale, like the
other norms) times G = N / (c 2^h) in (1/(2c), 1/c], folded into the γ multipliers.
The guard g (``eps_shift``) gives ε fractional resolution (ε_A is 1.08 for int8
rows of 64 at s_in = 0.03); the numerator's shift gains g to compensate
(``_normcore``, stage 1).

Range facts: Σd = 0 makes the positive and the negative d each sum to A/2, so
|d_i| <= A/2 and |z| <= 2^(F_z + h − 1), reached by [a, b, …, b].  A is the sum
of |affine| functions, convex, so its maximum over the box is at a vertex: k
elements at one end give 2 k (N − k)(hi − lo), largest at k = floor(N/2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from qnorm.analysis import Interval, RangeReport
from qnorm.fixedpoint import reciprocal
from qnorm.ops._normcore import (
    NormConfig,
    NormOp,
    RowStageForm,
    StatBounds,
    centered,
    centered_ranges,
    check_int,
)
from qnorm.ops._xp import absolute, row_sum
from qnorm.ops.base import Trace, record

# 1/c = sqrt(2/π) as the float64 it rounds to: the one irrational constant, taken
# at its exact binary value (IEEE-754 sqrt is correctly rounded: reproducible).
INV_C = math.sqrt(2 / math.pi)
MAX_RECIP_FRAC = 60  # fixedpoint.reciprocal takes up to 61 fraction bits; we use F_r + 1


@dataclass(frozen=True)
class L1NormConfig(NormConfig):
    """L1LayerNorm config.  ``r = round(2^(F_r+1) / (2M + 1))``, F_r = mant_bits + inv_bits.

    Dividing by the mantissa's midpoint M + 1/2: when e > 0 the true W/2^e lies in
    [M, M + 1), and the midpoint halves the worst-case error.  It also keeps r off
    2^(inv_bits+1), which 1/M reaches at the single input M = 2^(mant_bits−1): with
    inv_bits >= mant_bits − 1, r lies in (2^inv_bits, 2^(inv_bits+1)) and needs
    exactly inv_bits + 1 bits.  For e <= 0 (exact M) the midpoint costs a relative
    bias below 2^-mant_bits.
    """

    inv_bits: int = 16

    p = 1
    default_mant_bits = 16

    def _check_inverse(self) -> None:
        check_int("inv_bits", self.inv_bits, 1)
        if self.inv_frac_bits > MAX_RECIP_FRAC:
            raise ValueError(
                f"mant_bits + inv_bits must be <= {MAX_RECIP_FRAC} (fixedpoint.reciprocal), "
                f"got mant_bits={self.mant_bits}, inv_bits={self.inv_bits}"
            )

    @property
    def inv_frac_bits(self) -> int:
        return self.mant_bits + self.inv_bits

    @property
    def pre_shift(self) -> int:
        return (self.n - 1).bit_length()  # ceil(log2 N)

    def gain_factor(self) -> float:
        return self.n * INV_C / (1 << self.pre_shift)

    def eps_exact(self, eps: float) -> Fraction:
        # c MAD + ε = c (A + ε N² / (c s_in)) s_in / N²
        return Fraction(eps) * self.n**2 * Fraction(INV_C) / Fraction(self.in_fmt.scale)


class L1LayerNorm(NormOp):
    """L1 LayerNorm over the last axis (see the module docstring)."""

    name = "l1_layernorm"
    multiplications = ("centered", "mult", "offset", "offset_fraction", "xa", "scaled")
    config_cls = L1NormConfig
    inverse_name = "recip"
    op_defaults = {"inv_bits": 16}
    wide_defaults = {"mant_bits": 24, "inv_bits": 24}

    def _statistic(self, x: Any, trace: Trace | None) -> tuple[Any, Any]:
        s, d = centered(x, self.config.n, trace)
        return record(trace, "sum_abs", row_sum(absolute(d))), s

    @classmethod
    def _stat_floor(cls, cfg: NormConfig) -> int:
        """A's least non-zero value: a row that is not constant, k elements apart from
        the rest, has A >= 2k (N − k) >= 2 (N − 1), reached by one element one LSB off;
        a constant row has A = 0 and every d_i = 0."""
        return 2 * (cfg.n - 1)

    @classmethod
    def _statistic_ranges(cls, cfg: NormConfig, rep: RangeReport) -> StatBounds:
        """|d_i| <= A/2 and |d_i| <= D = (N−1)(hi − lo); both reached together by
        [lo, hi, …, hi]."""
        d = centered_ranges(rep, cfg)
        span = cfg.in_fmt.hi - cfg.in_fmt.lo
        a = rep.add("sum_abs", Interval(0, 2 * (cfg.n // 2) * ((cfg.n + 1) // 2) * span))
        return StatBounds(a, rep["centered"], Fraction(1, 2), d)

    def _inverse(self, m: Any, trace: Trace | None) -> Any:
        cfg = self.config
        return record(trace, "recip", reciprocal(m + m + 1, cfg.inv_frac_bits + 1, cfg.rounding))

    def row_stage_form(self) -> RowStageForm:
        return RowStageForm("centered_abs", "reciprocal", 0, self.config.inv_frac_bits + 1)

    @classmethod
    def _inverse_range(cls, cfg: NormConfig, m_iv: Interval) -> Interval:
        f = cfg.inv_frac_bits + 1
        return Interval(reciprocal(2 * m_iv.hi + 1, f, cfg.rounding), reciprocal(2 * m_iv.lo + 1, f, cfg.rounding))

    def float_reference(self, x: np.ndarray) -> np.ndarray:
        """The true L1 norm in float64: γ (x − μ) / (sqrt(π/2) MAD + ε) + β.

        The row is shifted by its first element before its mean is taken (the norm is
        shift-invariant): a row of equal values then has every deviation exactly 0.  Taken
        directly, the mean of 4096 equal values was 1.8e-15 off them, which a small ε
        (1e-12: the deviation divided by MAD + ε) made a whole output LSB."""
        t = self.float_rows(x)
        t = t - t[..., :1]
        dev = t - t.mean(dim=-1, keepdim=True)
        mad = dev.abs().mean(dim=-1, keepdim=True)
        return self.float_affine(dev / (math.sqrt(math.pi / 2) * mad + self.params.eps))

    def cost(self) -> dict[str, dict[str, int]]:
        n = self.config.n
        return {
            # Σx, |d| and Σ|d|, (A << g) + ε, leading-zero count, mantissa shift, one division
            "per_row": {
                "add": 2 * (n - 1) + 1,
                "abs": n,
                "mul": 0,
                "div": 1,
                "sqrt": 0,
                "lzc": 1,
                "shift": 1 + (self.config.eps_shift > 0),
            },
            "per_element": self.element_cost(),
            "per_row_affine": self.row_affine_cost(),
        }
