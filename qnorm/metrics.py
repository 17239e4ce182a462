"""Error of an integer op against its float reference, in output LSB."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qnorm.qformat import QFormat


@dataclass(frozen=True)
class ErrorStats:
    """Error of integers against a float reference, measured in output LSB.

    The reference is first clipped to the representable range: saturation is a
    property of the chosen output format, reported separately as ``saturated``,
    not mixed into the arithmetic error.
    """

    max_lsb: float
    mean_lsb: float
    within_1lsb: float  # share of elements with |error| <= 1 LSB
    saturated: float  # share of reference values outside the output range
    count: int

    def as_row(self) -> list[str]:
        return [
            f"{self.max_lsb:.2f}",
            f"{self.mean_lsb:.3f}",
            f"{100 * self.within_1lsb:.2f} %",
            f"{100 * self.saturated:.2f} %",
        ]


def signed_error_lsb(y_int: np.ndarray, out_fmt: QFormat, y_float: np.ndarray) -> np.ndarray:
    """``y_int - clip(y_float / scale)`` element-wise, in LSB (for histograms)."""
    ref = np.asarray(y_float, dtype=np.float64) / out_fmt.scale
    return np.asarray(y_int, dtype=np.float64) - np.clip(ref, out_fmt.lo, out_fmt.hi)


def error_in_lsb(y_int: np.ndarray, out_fmt: QFormat, y_float: np.ndarray) -> ErrorStats:
    y_int = np.asarray(y_int)
    y_float = np.asarray(y_float, dtype=np.float64)
    if y_int.shape != y_float.shape:
        raise ValueError(f"shape mismatch: integers {y_int.shape} vs float reference {y_float.shape}")
    if y_int.size == 0:
        raise ValueError("cannot measure the error of an empty output")
    if not np.all(np.isfinite(y_float)):
        raise ValueError("float reference contains NaN or Inf")
    err = np.abs(signed_error_lsb(y_int, out_fmt, y_float))
    ref = y_float / out_fmt.scale
    sat = (ref < out_fmt.lo - 0.5) | (ref > out_fmt.hi + 0.5)
    return ErrorStats(
        max_lsb=float(err.max()),
        mean_lsb=float(err.mean()),
        within_1lsb=float((err <= 1.0).mean()),
        saturated=float(sat.mean()),
        count=int(err.size),
    )
