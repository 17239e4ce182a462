"""Symmetric per-output-channel weight quantization, as the integer passes use it."""

from __future__ import annotations

import numpy as np
import torch

from qnorm.fixedpoint import DEFAULT_ROUND, Round, int_range, round_float


def quantize_per_channel(
    weight: torch.Tensor, bits: int = 8, mode: Round | str = DEFAULT_ROUND
) -> tuple[np.ndarray, np.ndarray]:
    """``(ints, scales)`` with ``weight[c] ~ ints[c] * scales[c]``; int64 and float64 numpy.

    ``scales[c] = max |weight[c]| / (2^(bits-1) - 1)`` in float64 (narrow range, so
    ``-w`` quantizes to ``-ints``), then ``round(w / scale)`` by ``mode`` with the
    exact float rule of :func:`~qnorm.fixedpoint.round_float`.  An all-zero channel
    (e.g. gamma = 0 folded in) gets scale 0: a requantization multiplier derived
    from it is 0 and cannot inflate a shift shared with the other channels.
    Output channel = axis 0.
    """
    w = weight.detach().to("cpu", torch.float64).numpy()
    if not np.all(np.isfinite(w)):
        raise ValueError("weight contains NaN or Inf")
    hi = int_range(bits)[1]
    scales = np.abs(w.reshape(w.shape[0], -1)).max(axis=1) / hi
    t = w / np.where(scales > 0, scales, 1.0).reshape(-1, *([1] * (w.ndim - 1)))
    return np.clip(round_float(t, mode), -hi, hi).astype(np.int64), scales
