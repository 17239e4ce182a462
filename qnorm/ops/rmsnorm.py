"""Integer RMSNorm γ x / sqrt(mean(x²) + ε) + β, and partial RMSNorm.

``partial = p`` in (0, 1] takes the statistic from the first k = ceil(p N)
elements of each row and applies it to the whole row (pRMSNorm).  Per row:

    Q = Σ_{i<k} x_i²,  W = Q 4^g + ε_int,  ε_int = round(ε_Q 4^g),  ε_Q = ε k / s_in²
    z_i ≈ 2^(F_z + h + g) x_i / sqrt(W) = 2^(F_z + h) x_i / sqrt(Q + ε_Q)

with one exact ``fixedpoint.rsqrt`` on W's mantissa.  x / sqrt(Q/k + ε/s_in²) =
sqrt(k) x / sqrt(Q + ε_Q): the factor sqrt(k) = 2^h · G is split into a free shift
(h = ceil(log2(k) / 2), which keeps z in units of the RMS like LayerNorm's z) and
a constant G = sqrt(k) / 2^h in (1/sqrt(2), 1] folded into the γ multipliers.
ε_Q is usually far below 1 (0.7 for int8 rows of 64 at s_in = 0.03; 0.17 with
p = 0.25), where an integer ε would be 1 or 0 — up to 19 LSB of error on
near-constant rows.  The guard g (``eps_shift``) gives it fractional resolution
and the numerator's shift gains g to compensate (``_normcore``, stage 1).

Range facts: an element inside the prefix has x_i² <= Q, so |z| <= 2^(F_z + h)
(reached by a row with one non-zero element); an element outside it is bounded
only by the format, against the smallest W (a zero prefix, W = ε_int; with ε = 0
W = 0 counts as 1 and that is x_max · 2^(F_z + h)) — statistics from a prefix can
blow up the rest of the row, and the analysis says by how much.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

import numpy as np

from qnorm.analysis import Interval, RangeReport
from qnorm.ops._normcore import (
    NormConfig,
    RowStageForm,
    StatBounds,
)
from qnorm.ops._xp import row_sum, take_prefix
from qnorm.ops.base import Trace, record
from qnorm.ops.layernorm import RsqrtConfig, RsqrtNorm


@dataclass(frozen=True)
class RMSNormConfig(RsqrtConfig):
    """IntRMSNorm config; ``partial`` in (0, 1] selects the statistic's prefix."""

    partial: float = 1.0

    centered = False  # the numerator is x itself

    def __post_init__(self) -> None:
        p = self.partial
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 < p <= 1:
            raise ValueError(f"partial must be a number in (0, 1], got {p!r}")
        super().__post_init__()

    @functools.cached_property
    def prefix(self) -> int:
        """k = ceil(p N), exactly (from the float's binary value), at least 1.  Cached:
        the range analysis reads it (through the numerator's shift) per exponent, and
        n and partial are frozen."""
        return math.ceil(Fraction(self.partial) * self.n)

    @property
    def pre_shift(self) -> int:
        return ((self.prefix - 1).bit_length() + 1) // 2  # ceil(ceil(log2 k) / 2)

    def gain_factor(self) -> float:
        return math.sqrt(self.prefix) / (1 << self.pre_shift)

    def eps_exact(self, eps: float) -> Fraction:
        # mean(x²) + ε = (Q + ε k / s_in²) s_in² / k
        return Fraction(eps) * self.prefix / Fraction(self.in_fmt.scale) ** 2


class IntRMSNorm(RsqrtNorm):
    """Integer (partial) RMSNorm over the last axis (see the module docstring)."""

    name = "int_rmsnorm"
    multiplications = ("sum_sq", "mult", "xa", "scaled")
    config_cls = RMSNormConfig
    op_defaults = {"partial": 1.0, "inv_bits": 15}
    wide_defaults = {"mant_bits": 22, "inv_bits": 19}

    def _statistic(self, x: Any, trace: Trace | None) -> tuple[Any, Any]:
        head = take_prefix(x, self.config.prefix)
        return record(trace, "sum_sq", row_sum(head * head)), None

    def row_stage_form(self) -> RowStageForm:
        return RowStageForm("prefix_squares", "rsqrt", self.config.prefix, self.config.inv_frac_bits)

    @classmethod
    def _stat_floor(cls, cfg: NormConfig) -> int:
        """Q >= 1 unless every x is 0 — over the whole row only: a zero prefix of a
        partial norm leaves the other elements as they are, divided by ε alone."""
        return 1 if cfg.prefix == cfg.n else 0

    @classmethod
    def _statistic_ranges(cls, cfg: NormConfig, rep: RangeReport) -> StatBounds:
        """Inside the prefix x_i² <= Q and x_i² <= X² (X = max |x|): a lone X
        reaches both.  Outside it only x_i² <= X², against the smallest W (a zero
        prefix)."""
        x = Interval(cfg.in_fmt.lo, cfg.in_fmt.hi)
        q = rep.add("sum_sq", x.square() * cfg.prefix)
        top = x.square().hi
        return StatBounds(q, x, Fraction(1), top, top if cfg.prefix < cfg.n else None)

    @classmethod
    def _channel_z(
        cls, cfg: NormConfig, stat: StatBounds, segs: dict[int, Interval], inv: Interval, j: int, z: Interval
    ) -> tuple[tuple[int, int, Interval], ...]:
        """Channels inside the prefix keep |z| <= 2^(F_z + h); only the rest can blow up."""
        k, n = cfg.prefix, cfg.n
        if k == n:
            return ((0, n, z),)
        inside = cls._normalized_ranges(cfg, cls._products(cfg, replace(stat, outside=None), segs, inv), j, None)
        return ((0, k, inside), (k, n, z))

    def float_reference(self, x: np.ndarray) -> np.ndarray:
        """torch.nn.functional.rms_norm (float64, float γ and ε) + β; for p < 1 the
        same formula with the mean square of the prefix."""
        import torch
        import torch.nn.functional as F

        p, k = self.params, self.config.prefix
        t = self.float_rows(x)
        if k == self.config.n:
            return (F.rms_norm(t, (k,), torch.from_numpy(p.gamma), p.eps) + torch.from_numpy(p.beta)).numpy()
        ms = (t[..., :k] ** 2).mean(dim=-1, keepdim=True)
        return self.float_affine(t / torch.sqrt(ms + p.eps))

    def cost(self) -> dict[str, dict[str, int]]:
        k = self.config.prefix
        return {
            # k squares and their sum, (Q << 2g) + ε, leading-zero count, mantissa
            # shift, rsqrt
            "per_row": {"add": k, "mul": k, "div": 1, "sqrt": 1, "lzc": 1, "shift": 1 + (self.config.eps_shift > 0)},
            "per_element": self.element_cost(),
            "per_row_affine": self.row_affine_cost(),
        }
