"""Integer tensor formats: a bit width, signedness and a real scale per LSB."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from qnorm.fixedpoint import DEFAULT_ROUND, Round, int_range, round_float


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _torch() -> Any:
    import torch  # only reached with a torch operand: torch stays an optional dependency

    return torch


def _all_finite_tensor(torch: Any, t: Any) -> bool:
    """Every value of float tensor ``t`` is finite: its extremes are (``aminmax``
    propagates NaN), one fused reduction instead of a mask and a count."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool((lo > -math.inf) & (hi < math.inf))


def _clip(t: Any, lo: float, hi: float) -> Any:
    return t.clamp(lo, hi) if _is_torch(t) else np.clip(t, lo, hi)


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
    def real_range(self) -> tuple[float, float]:
        """The lowest and highest real values the format holds: ``lo · scale``, ``hi · scale``."""
        return self.lo * self.scale, self.hi * self.scale

    @property
    def is_power_of_two(self) -> bool:
        return math.frexp(self.scale)[0] == 0.5

    def quantize(self, x: Any, mode: Round | str = DEFAULT_ROUND) -> Any:
        """Round ``x / scale`` by ``mode`` and saturate; NaN/Inf are refused.

        ``x / scale`` is one correctly rounded float64 division; the rounding of
        that value is then exact (``t - floor(t)`` is exact below 2**52), so no
        ``floor(t + 0.5)`` double-rounding error at ties.

        Backend-neutral: a torch tensor is quantized with torch operations on its
        own device (int64 tensor out), anything else with numpy (int64 array out);
        the steps and the float64 values are the same, so are the integers.
        """
        return self._round_scaled(self.scaled(x), mode)

    def quantize_with_mask(self, x: Any, mode: Round | str = DEFAULT_ROUND, *, finite: bool = False) -> tuple[Any, Any]:
        """:meth:`quantize` and :meth:`in_range` from one scaling pass (the QAT input path).
        ``finite``: the caller has proven every ``x / scale`` finite (the QAT quantizer's
        max |x| over the scale), so the per-element NaN/Inf count is skipped."""
        t = self.scaled(x, finite=finite)
        return self._round_scaled(t, mode), (t >= self.lo) & (t <= self.hi)

    def _round_scaled(self, t: Any, mode: Round | str) -> Any:
        t = _clip(t, self.lo - 1.0, self.hi + 1.0)  # saturates anyway; keeps floor exact
        q = _clip(round_float(t, mode), self.lo, self.hi)
        return q.to(_torch().int64) if _is_torch(q) else q.astype(np.int64)

    def scaled(self, x: Any, *, finite: bool = False) -> Any:
        """``x / scale`` in float64 (torch stays torch), NaN/Inf refused (unless the caller
        proved them absent: ``finite``): what :meth:`quantize` rounds."""
        if _is_torch(x):
            torch = _torch()
            if x.dtype.is_complex or x.dtype == torch.bool:
                raise ValueError(f"cannot quantize dtype {x.dtype}; expected a real-valued tensor")
            t = x.detach().to(torch.float64) / self.scale
            bad = 0 if finite or _all_finite_tensor(torch, t) else int((~torch.isfinite(t)).sum())
        else:
            x = np.asarray(x)
            if x.dtype.kind not in "fiu":
                raise ValueError(f"cannot quantize dtype {x.dtype}; expected a real-valued array")
            with np.errstate(over="ignore"):  # an overflow is an Inf, counted and named just below
                t = np.divide(x, self.scale, dtype=np.float64)  # the cast inside the division: one pass
            bad = 0 if finite else int((~np.isfinite(t)).sum())
        if bad:
            raise ValueError(f"cannot quantize {bad} non-finite value(s) (NaN/Inf, or overflow of x/scale)")
        return t

    def in_range(self, x: Any) -> Any:
        """Where ``x / scale`` lies in [lo, hi], i.e. :meth:`quantize` does not saturate (the STE mask)."""
        t = self.scaled(x)
        return (t >= self.lo) & (t <= self.hi)

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
