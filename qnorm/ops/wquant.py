"""Symmetric per-output-channel weight quantization, as the integer ops with weights use it.

Takes a torch tensor (any device) or a numpy array without importing torch, so the
golden ops that quantize weights (:mod:`qnorm.ops.flashnorm`) stay numpy-only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qnorm.fixedpoint import DEFAULT_ROUND, Round, int_range, round_float
from qnorm.ops._xp import is_torch


def as_float64(values: Any) -> np.ndarray:
    """Float parameters (a numpy array, or a torch tensor on any device) as float64 numpy; exact widening."""
    if is_torch(values):
        values = values.detach().cpu().double().numpy()
    return np.asarray(values, dtype=np.float64)


def quantize_per_channel(
    weight: Any, bits: int = 8, mode: Round | str = DEFAULT_ROUND
) -> tuple[np.ndarray, np.ndarray]:
    """``(ints, scales)`` with ``weight[c] ~ ints[c] * scales[c]``; int64 and float64 numpy.

    ``weight``: a torch tensor or a numpy array (:func:`as_float64`).

    ``scales[c] = max |weight[c]| / (2^(bits-1) - 1)`` in float64 (narrow range, so
    ``-w`` quantizes to ``-ints``), then ``round(w / scale)`` by ``mode`` with the
    exact float rule of :func:`~qnorm.fixedpoint.round_float`.  An all-zero channel
    (e.g. gamma = 0 folded in) gets scale 0: a requantization multiplier derived
    from it is 0 and cannot inflate a shift shared with the other channels.
    Output channel = axis 0.
    """
    w = as_float64(weight)
    if not np.all(np.isfinite(w)):
        raise ValueError("weight contains NaN or Inf")
    hi = int_range(bits)[1]
    scales = np.abs(w.reshape(w.shape[0], -1)).max(axis=1) / hi
    t = w / np.where(scales > 0, scales, 1.0).reshape(-1, *([1] * (w.ndim - 1)))
    return np.clip(round_float(t, mode), -hi, hi).astype(np.int64), scales
