"""BatchNorm + uniform quantized activation, and its folding into multi-thresholds.

The float op, per channel c (channel axis last, or one parameter set per neuron):

    q = clamp(round((gamma (x s_in - mu) / sqrt(var + eps) + beta) / s_act), q_lo, q_hi)

**Quantized rational BN** (:class:`~qnorm.ops.bnfold.RationalBN`, shared with the MPBN spiking neuron).
At construction every parameter becomes an integer, deterministically and exactly
(``Fraction`` of the float's binary value, rounded half up):

    gamma / s_out  ~  G / 2^S          (per-channel multipliers, one shared shift S)
    mu / s_in      ~  M / 2^F          (mean in input LSB, F fraction bits)
    sqrt(var+eps) / s_in ~ D / 2^F,    D = isqrt_round(round((var+eps) 2^2F / s_in^2)) >= 1
    beta / s_out   ~  B / 2^Fo

so the BN output in output units is the exact rational

    z(x) = G (2^F x - M) / (D 2^S) + B / 2^Fo  =  (P x + Q) / Den,
    P = G 2^(F+Fo),   Q = B D 2^S - G 2^Fo M,   Den = D 2^(S+Fo) > 0.

**Unfolded (the definition)**: ``q = clamp(div_round(P x + Q, Den, mode))``: one
exact integer numerator, one exactly rounded division, a clamp. No float.

**Folded**: ``round(z) >= k`` is, for every rounding mode, a half-line ``z >= c`` or
``z > c`` (:func:`level_event`), and ``z(x) >= c  <=>  P x >= c Den - Q`` is a
half-line in x (:meth:`RationalBN.fold_event`).  Level k = q_lo + j is reached iff
threshold j is crossed, so ``q = q_lo + #{j : x crosses t_j}``: FINN's multi-threshold.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qnorm import fixedpoint as fp
from qnorm.analysis import Interval, RangeReport
from qnorm.fixedpoint import DEFAULT_ROUND, Round
from qnorm.metrics import ErrorStats, error_in_lsb
from qnorm.ops._xp import const_like
from qnorm.ops.base import IntOp, Trace, record
from qnorm.ops.bnfold import FloatBN, RationalBN, check_bn_stats, level_event, real_params
from qnorm.qformat import QFormat

MAX_FOLD_LEVELS = 1 << 10  # 2^10 thresholds per channel: beyond that a multi-threshold is not a sane unit


# --------------------------------------------------------------------------- ops


@dataclass(frozen=True)
class BNActConfig:
    """Input format, activation format (its word range is the level range), tie rule."""

    in_fmt: QFormat
    out_fmt: QFormat
    mode: Round = DEFAULT_ROUND

    def __post_init__(self) -> None:
        for name in ("in_fmt", "out_fmt"):
            if not isinstance(getattr(self, name), QFormat):
                raise ValueError(f"{name} must be a QFormat, got {type(getattr(self, name)).__name__}")
        object.__setattr__(self, "mode", Round.parse(self.mode))

    @property
    def levels(self) -> int:
        return self.out_fmt.hi - self.out_fmt.lo + 1


class _BNActBase(IntOp):
    """Shared parts: config, parameter-shape check, float reference."""

    def __init__(self, cfg: BNActConfig, bn: RationalBN, reference: FloatBN | None = None) -> None:
        self.cfg, self.bn = cfg, bn
        self.in_fmt, self.out_fmt = cfg.in_fmt, cfg.out_fmt
        self.reference = reference if reference is not None else bn.as_float(cfg.in_fmt.scale, cfg.out_fmt.scale)

    @classmethod
    def from_float(
        cls,
        gamma: object,
        beta: object,
        mean: object,
        var: object,
        eps: object,
        cfg: BNActConfig,
        *,
        gamma_bits: int = 16,
        frac_bits: int = 8,
        out_frac_bits: int = 8,
    ) -> "_BNActBase":
        """Quantize float BN parameters (per channel, or per neuron: any shape).

        NaN/Inf, var < 0, eps < 0 and shapes that do not broadcast are refused
        (ValueError naming the parameter).
        """
        p = real_params(gamma=gamma, beta=beta, mean=mean, var=var, eps=eps)
        check_bn_stats(p["var"], p["eps"])
        bn = RationalBN.from_float(
            p["gamma"], p["beta"], p["mean"], p["var"], p["eps"],
            cfg.in_fmt.scale, cfg.out_fmt.scale, gamma_bits, frac_bits, out_frac_bits,
        )
        return cls.from_rational(cfg, bn, FloatBN(p["gamma"], p["beta"], p["mean"], p["var"], p["eps"]))

    @classmethod
    def from_rational(cls, cfg: BNActConfig, bn: RationalBN, reference: FloatBN | None = None) -> "_BNActBase":
        """The op of an already quantized BN (output units of ``cfg.out_fmt``).

        ``reference``: the original float BN the float reference uses; None: the
        quantized parameters themselves (:meth:`RationalBN.as_float`).
        """
        return cls(cfg, bn, reference)

    def _check_shape(self, shape: tuple[int, ...]) -> None:
        p = self.bn.shape
        if len(shape) < len(p) or tuple(shape[len(shape) - len(p):]) != p:
            raise ValueError(f"input shape {tuple(shape)} must end with the parameter shape {p}")

    def float_reference(self, x: np.ndarray) -> np.ndarray:
        """Float64 BN with the original parameters, then the same quantizer, in real units."""
        self._check_shape(np.shape(x))
        return self.out_fmt.dequantize(self.out_fmt.quantize(self.reference.apply(x), self.cfg.mode))


class BNQuant(_BNActBase):
    """Unfolded BN + quantizer: the exact rational definition, evaluated in integers."""

    name = "bn_quant"
    multiplications = ("x_slope",)

    def __init__(self, cfg: BNActConfig, bn: RationalBN, reference: FloatBN | None = None) -> None:
        super().__init__(cfg, bn, reference)
        self.ranges()  # refuses an overflowing config, naming the intermediate, before any int64 cast
        slope, offset, den = bn.linear_form()
        self._slope, self._offset, self._den = (
            np.array(v, dtype=np.int64).reshape(bn.shape) for v in (slope, offset, den)
        )

    def ranges(self) -> RangeReport:
        report = RangeReport(self.name)
        n = int(np.prod(self.bn.shape))
        bounds = self.bn.numerator_bounds([self.in_fmt.lo] * n, [self.in_fmt.hi] * n)
        _, _, den = self.bn.linear_form()
        report.add("bn_product", Interval.hull(*(v for b in bounds for v in b[:2])))
        report.add("bn_numerator", Interval.hull(*(v for b in bounds for v in b[2:])))
        report.add("bn_denominator", Interval.hull(*den))
        report.check()  # refuse before dividing: div_round takes numerators within +-2^62
        # the level is monotone in the numerator for a fixed positive denominator
        levels = [fp.div_round(v, d, self.cfg.mode) for b, d in zip(bounds, den, strict=True) for v in b[2:]]
        report.add("level", Interval.hull(*levels))
        report.add("output", report["level"].clamp(self.out_fmt.lo, self.out_fmt.hi))
        return report

    def _forward(self, x: np.ndarray, trace: Trace | None) -> np.ndarray:
        self._check_shape(x.shape)
        num = record(trace, "bn_numerator", x * const_like(x, self._slope) + const_like(x, self._offset))
        level = record(trace, "level", fp.div_round(num, const_like(x, self._den), self.cfg.mode))
        return fp.saturate(level, self.out_fmt.bits, self.out_fmt.signed)

    def fold(self) -> "MultiThreshold":
        return MultiThreshold(self.cfg, self.bn, self.reference)


class MultiThreshold(_BNActBase):
    """Folded form: ``q = q_lo + #{j : x crosses t_j}``, thresholds shape ``(*P, L-1)``.

    Threshold j (level q_lo + j) is the fold of the event ``round(z) >= q_lo + j``
    (:func:`level_event` then :meth:`RationalBN.fold_event`); the clamp never bites
    for those levels because q_lo < q_lo + j <= q_hi.  Crossing means ``x >= t_j``
    for gamma_q >= 0 and ``x <= t_j`` for gamma_q < 0; gamma_q = 0 puts every t_j
    at an end of the input range, so the level is the constant clamp(round(B/2^Fo)).
    """

    name = "multithreshold"
    multiplications = ()  # threshold compares only

    def __init__(self, cfg: BNActConfig, bn: RationalBN, reference: FloatBN | None = None) -> None:
        super().__init__(cfg, bn, reference)
        if cfg.levels > MAX_FOLD_LEVELS:
            raise ValueError(
                f"a {cfg.out_fmt.bits}-bit activation has {cfg.levels} levels; multi-threshold "
                f"folding is limited to {MAX_FOLD_LEVELS} (use BNQuant)"
            )
        lo, hi = cfg.in_fmt.lo, cfg.in_fmt.hi
        events = [
            bn.fold_event(*level_event(cfg.mode, cfg.out_fmt.lo + j), lo, hi) for j in range(1, cfg.levels)
        ]
        self.thresholds = np.stack([e.theta for e in events], axis=-1)
        self.negative = events[0].negative
        self.direction = events[0].direction
        self.ranges().check()

    def ranges(self) -> RangeReport:
        report = RangeReport(self.name)
        report.add("threshold", Interval(int(self.thresholds.min()), int(self.thresholds.max())))
        report.add("count", Interval(0, self.cfg.levels - 1))
        return report

    def _forward(self, x: np.ndarray, trace: Trace | None) -> np.ndarray:
        self._check_shape(x.shape)
        neg = const_like(x, self.negative.astype(np.int64)) == 1
        thr = const_like(x, self.thresholds)
        count = x * 0
        for j in range(self.cfg.levels - 1):
            t = thr[..., j]
            count = count + fp.select(fp.select(neg, x <= t, x >= t), 1, 0)
        record(trace, "count", count)
        return count + self.out_fmt.lo


def measure_error(op: _BNActBase, x: np.ndarray) -> ErrorStats:
    """Error of the integer op against its float reference on integer inputs ``x``, in LSB."""
    return error_in_lsb(op.forward(x), op.out_fmt, op.float_reference(op.in_fmt.dequantize(x)))
