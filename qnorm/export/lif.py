"""The folded MPBN LIF neuron as QONNX nodes: the time loop unrolled, firing by MultiThreshold.

Input currents ``(T, N, C, *spatial)`` are quantized once (``Quantize``, the
layer's input quantizer), then each step t is the golden neuron's public step
(:class:`~qnorm.ops.spiking.FoldedLIFNeuron`: ``charge``, ``fires``, ``reset``) in
standard ONNX ops on float32 integers:

    current_t = Gather(q, t)                               (N, C, *spatial)
    pre_t     = Clip(leak(post_{t-1}) + current_t)         Clip only with saturation
    spike_t   = MultiThreshold(pre_t; theta)               one threshold per channel,
                                                           gamma < 0 channels negated
    post_t    = Where(spike_t, u_rest, pre_t)              hard reset
              = Clip(pre_t - spike_t * R)                  soft reset

and the spikes are stacked back to ``(T, N, C, *spatial)``.  ``leak(u)`` is the
golden ``rshift_round(u m, s)`` = ``Floor((u m + 2^(s-1)) 2^-s)`` with the dyadic
reduced to lowest terms (the rounded value depends on m / 2^s only); when
``|u| m + 2^(s-1)`` could pass 2^24 those four ops run in float64 (``Cast``), exact
below 2^53.  At t = 1 ``leak(u_rest)`` is a constant.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from onnx import TensorProto

from qnorm import fixedpoint as fp
from qnorm.export.graph import MAX_EXACT_BITS, LayerGraph, check_width
from qnorm.export.layers import multithreshold, quantize
from qnorm.nn.spiking import FoldedMPBNLIF
from qnorm.ops.spiking import LIFConfig

_FLOAT64_EXACT_BITS = 53


def reduced_leak(cfg: LIFConfig) -> tuple[int, int]:
    """The leak m 2^-s in lowest terms ((1, 0) without a leak).

    ``rshift_round(u m, s)`` is round-half-up of the rational ``u m / 2^s``, so lowest
    terms give the same integers with smaller products (0.5 = 16384 2^-15 is 1 2^-1).
    """
    if cfg.leak is None:
        return 1, 0
    m, s = cfg.leak.m, cfg.leak.s
    while s > 0 and m % 2 == 0:
        m, s = m // 2, s - 1
    return (0, 0) if m == 0 else (m, s)


class _Steps:
    """Emits the nodes of the time steps of one neuron layer (see the module docstring)."""

    def __init__(self, g: LayerGraph, layer: FoldedMPBNLIF, step_shape: Sequence[int]) -> None:
        self.g, self.op, self.shape = g, layer.golden(), tuple(step_shape)
        cfg = self.op.cfg
        check_width(g.prefix, "the membrane", cfg.membrane_bits)
        self.cfg = cfg
        self.lo, self.hi = cfg.membrane_range
        self.m, self.s = reduced_leak(cfg)
        self.leak_dtype = self._leak_dtype()

    def _leak_dtype(self) -> int | None:
        """float32 when ``|u| m + 2^(s-1)`` stays within 2^24, else float64; None: no multiply."""
        if (self.m, self.s) == (1, 0):
            return None
        peak = max(-self.lo, self.hi) * self.m + ((1 << self.s) >> 1)
        if peak <= 1 << MAX_EXACT_BITS:
            return TensorProto.FLOAT
        if peak <= 1 << _FLOAT64_EXACT_BITS:
            return TensorProto.DOUBLE
        raise ValueError(f"{self.g.prefix}: the leak product |u| m reaches {peak}, past float64's exact integers")

    def leak(self, u: str, t: int) -> str:
        """``rshift_round(u m, s)`` (half up) in the float type that holds it exactly."""
        dtype = self.leak_dtype
        if dtype is None:
            return u
        g, local = self.g, f"t{t}/leak"
        np_type = np.float32 if dtype == TensorProto.FLOAT else np.float64
        v = u
        if dtype == TensorProto.DOUBLE:
            v = g.node("Cast", [u], f"{local}_wide", self.shape, elem_type=dtype, to=dtype)
        v = g.node("Mul", [v, g.const("leak_m", np_type(self.m))], f"{local}_product", self.shape, elem_type=dtype)
        if self.s > 0:
            half, shift = g.const("leak_half", np_type(1 << (self.s - 1))), g.const("leak_shift", np_type(2.0**-self.s))
            v = g.node("Add", [v, half], f"{local}_rounded", self.shape, elem_type=dtype)
            v = g.node("Mul", [v, shift], f"{local}_scaled", self.shape, elem_type=dtype)
            v = g.node("Floor", [v], f"{local}_floor", self.shape, elem_type=dtype)
        if dtype == TensorProto.FLOAT:
            return v
        return g.node("Cast", [v], local, self.shape, to=TensorProto.FLOAT)

    def clamp(self, u: str, local: str) -> str:
        """Saturate to the membrane width when the neuron saturates, else unchanged (proven in range)."""
        if not self.cfg.saturate:
            return u
        lo, hi = self.g.const("membrane_lo", np.float32(self.lo)), self.g.const("membrane_hi", np.float32(self.hi))
        return self.g.node("Clip", [u, lo, hi], f"{local}_clamped", self.shape)

    def charge(self, prev: str | None, current: str, t: int) -> str:
        """``pre = clamp(leak(prev) + current)``; ``prev`` None: the first step, from u_rest."""
        if prev is None:
            rest = int(fp.rshift_round(np.int64(self.cfg.u_rest) * self.m, self.s))
            if rest == 0:
                return self.clamp(current, f"t{t}/membrane")
            leaked = self.g.const(f"t{t}/rest", np.float32(rest))
        else:
            leaked = self.leak(prev, t)
        pre = self.g.node("Add", [leaked, current], f"t{t}/membrane", self.shape)
        return self.clamp(pre, f"t{t}/membrane")

    def fire(self, pre: str, t: int) -> str:
        """0/1 spikes: one MultiThreshold threshold per channel."""
        event = self.op.event
        return multithreshold(
            self.g, pre, self.shape, event.theta[:, None], event.negative, f"t{t}/fire",
            out_dtype="BINARY", out_scale=1.0, out_bias=0.0,
        )  # fmt: skip

    def _reset_amount(self) -> np.ndarray:
        """R per channel, shaped to broadcast over (N, C, *spatial).

        An R past 2^membrane_bits only ever meets a membrane that the clamp saturates
        (without saturation the range analysis proves that channel never fires): clipping
        it there changes no result and keeps it a float32 integer.
        """
        bound = 1 << self.cfg.membrane_bits
        r = np.clip(self.op.params.reset_sub, -bound, bound).astype(np.float32)
        return r.reshape((-1,) + (1,) * (len(self.shape) - 2))

    def reset(self, pre: str, spikes: str, t: int) -> str:
        """``post``: u_rest where fired (hard), or ``clamp(pre - R)`` where fired (soft)."""
        g, local = self.g, f"t{t}/reset"
        if self.cfg.reset == "hard":
            fired = g.node("Cast", [spikes], f"{local}_fired", self.shape, elem_type=TensorProto.BOOL,
                           to=TensorProto.BOOL)  # fmt: skip
            return g.node("Where", [fired, g.const(f"{local}_rest", np.float32(self.cfg.u_rest)), pre], local,
                          self.shape)  # fmt: skip
        sub = g.node("Mul", [spikes, g.const("reset_amount", self._reset_amount())], f"{local}_amount", self.shape)
        return self.clamp(g.node("Sub", [pre, sub], local, self.shape), local)


def lower_lif(layer: FoldedMPBNLIF, g: LayerGraph, x: str, y: str, shape: Sequence[int]) -> None:
    """The unrolled neuron (module docstring); ``shape`` (T, N, C, *spatial)."""
    if layer.golden().params.bn.shape != (layer.channels,):
        raise ValueError(f"{g.prefix}: per-neuron thresholds have no MultiThreshold form; per-channel ones do")
    steps = _Steps(g, layer, shape[1:])
    currents = quantize(g, x, steps.cfg.in_fmt, shape)
    front = g.const("time_axis", np.array([0], dtype=np.int64))
    state, spikes = None, []
    for t in range(shape[0]):
        current = g.node("Gather", [currents, g.const(f"t{t}/index", np.array(t, dtype=np.int64))], f"t{t}/current",
                         steps.shape, axis=0)  # fmt: skip
        pre = steps.charge(state, current, t)
        fired = steps.fire(pre, t)
        if t + 1 < shape[0]:  # the last step's reset feeds nothing
            state = steps.reset(pre, fired, t)
        spikes.append(g.node("Unsqueeze", [fired, front], f"t{t}/spikes", (1, *steps.shape)))
    g.node("Concat", spikes, "spikes", (), output=y, axis=0)
