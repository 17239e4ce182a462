"""Integer tensor formats: a bit width, signedness and a real scale per LSB."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from qnorm.fixedpoint import DEFAULT_ROUND, Round, int_range, round_float


@dataclass(frozen=True)
class QFormat:
    """``real = int * scale`` with the integer in a ``bits``-wide (un)signed word."""

    bits: int = 8
    scale: float = 1.0
    signed: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.bits, int) or not 2 <= self.bits <= 32:
            raise ValueError(f"QFormat bits must be an integer in [2, 32], got {self.bits!r}")
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"QFormat scale must be a positive finite number, got {self.scale!r}")

    @classmethod
    def power_of_two(cls, bits: int, exponent: int, signed: bool = True) -> "QFormat":
        """A format whose scale is ``2**exponent`` (shift-only requantization)."""
        return cls(bits, math.ldexp(1.0, exponent), signed)

    @property
    def lo(self) -> int:
        return int_range(self.bits, self.signed)[0]

    @property
    def hi(self) -> int:
        return int_range(self.bits, self.signed)[1]

    @property
    def is_power_of_two(self) -> bool:
        return math.frexp(self.scale)[0] == 0.5

    def quantize(self, x: np.ndarray, mode: Round | str = DEFAULT_ROUND) -> np.ndarray:
        """Round ``x / scale`` by ``mode`` and saturate; NaN/Inf are refused.

        ``x / scale`` is one correctly rounded float64 division; the rounding of
        that value is then exact (``t - floor(t)`` is exact below 2**52), so no
        ``floor(t + 0.5)`` double-rounding error at ties.
        """
        x = np.asarray(x)
        if x.dtype.kind not in "fiu":
            raise ValueError(f"cannot quantize dtype {x.dtype}; expected a real-valued array")
        t = x.astype(np.float64) / self.scale
        bad = ~np.isfinite(t)
        if bad.any():
            raise ValueError(
                f"cannot quantize {int(bad.sum())} non-finite value(s) (NaN/Inf, or overflow of x/scale)"
            )
        t = np.clip(t, self.lo - 1.0, self.hi + 1.0)  # saturates anyway; keeps floor exact
        return np.clip(round_float(t, mode), self.lo, self.hi).astype(np.int64)

    def dequantize(self, q: np.ndarray) -> np.ndarray:
        return np.asarray(q, dtype=np.float64) * self.scale

    def check(self, q: np.ndarray, name: str = "input") -> np.ndarray:
        """Return ``q`` as int64 after refusing non-integer dtypes and out-of-range values."""
        q = np.asarray(q)
        if q.dtype.kind not in "iu" or q.dtype == np.bool_:
            raise ValueError(f"{name} must be an integer array, got dtype {q.dtype}")
        if q.size:
            qmin, qmax = int(q.min()), int(q.max())
            if qmin < self.lo or qmax > self.hi:
                kind = "signed" if self.signed else "unsigned"
                raise ValueError(
                    f"{name} holds values in [{qmin}, {qmax}], outside the declared "
                    f"{self.bits}-bit {kind} range [{self.lo}, {self.hi}]"
                )
        return q.astype(np.int64)
