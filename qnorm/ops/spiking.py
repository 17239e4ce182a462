"""Integer LIF neuron with membrane-potential BatchNorm (MPBN), unfolded and folded.

Dynamics (integer membrane potential u in input-current LSB, per neuron, t = 1..T):

    pre_t  = leak(post_{t-1}) + I_t          post_0 = u_rest
    s_t    = [BN(pre_t) >= V_th]   (or >)
    post_t = u_rest if s_t else pre_t                 (hard reset)
    post_t = pre_t - R if s_t else pre_t              (soft reset)

``leak(u) = dyadic_mul(u, m, s)`` = round_half_up(lambda u), lambda = m 2^-s in [0, 1],
or none.  The shift leak ``u - (u >> k)`` is lambda = Dyadic(2^k - 1, k); note that it
computes ceil(lambda u), this module rounds half up like every qnorm multiplier.
With ``saturate`` both pre and post clamp to the membrane width; without it the
range analysis must prove they fit, else the config is refused.  T = 0 is allowed
and gives an empty spike train.

**BN on the membrane.**  gamma, beta, mu, var + eps are quantized into the exact
rational :class:`~qnorm.ops.bnfold.RationalBN` (output scale 1, the units of
V_th), and V_th into ``V / 2^Fo``, so ``BN(u) = (P u + Q) / Den`` with integers
P, Q and Den > 0.  The **unfolded** neuron evaluates the comparison exactly:

    BN(u) >= V/2^Fo  <=>  P u + Q >= V D 2^S    (multiplied by Den = D 2^(S+Fo) > 0)

The **folded** neuron compares u with one integer threshold theta per neuron,
derived from the same integers with ``Fraction`` (RationalBN.fold_event):
gamma_q > 0: fire iff u >= theta, theta = ceil(r/P) for ``>=``, floor(r/P) + 1 for
``>``; gamma_q < 0: fire iff u <= theta, theta = floor(r/P) or ceil(r/P) - 1;
gamma_q = 0: constant, from ``0 >= r`` (``0 > r``); r = V D 2^S - Q.  r/P is the
float MPBN threshold mu + (V_th - beta) sigma / gamma evaluated on the quantized
parameters.

**Soft reset** subtracts the same integer R (membrane LSB) in both forms, stored in
:class:`MPBNParams`: by default R = round_half_up(r/P), the BN threshold mapped to
u units and rounded (0 where gamma_q = 0, where no such threshold exists); any
integer may be given instead.  R does not depend on the comparator or on theta,
so both forms apply identical arithmetic and their membrane traces are identical.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from qnorm import fixedpoint as fp
from qnorm.analysis import Interval, OverflowRiskError, RangeReport
from qnorm.fixedpoint import Dyadic, int_range
from qnorm.ops._xp import const_like
from qnorm.ops.base import IntOp, Trace, record
from qnorm.ops.bnfold import (
    FloatBN,
    FoldedEvent,
    RationalBN,
    check_bn_stats,
    fixed_ratio,
    real_params,
    to_fixed,
)
from qnorm.qformat import QFormat

RESETS = ("hard", "soft")
COMPARATORS = (">=", ">")
MAX_STEPS = 1 << 16
_BIG = 1 << 62  # "unbounded" end of a half-line in the interval analysis


@dataclass(frozen=True)
class LIFConfig:
    """Neuron dynamics: current format, membrane width, leak, reset, comparator."""

    in_fmt: QFormat
    membrane_bits: int = 16
    leak: Dyadic | None = None  # lambda = m 2^-s in [0, 1]; None: no leak
    reset: str = "hard"
    u_rest: int = 0  # initial potential and hard-reset target
    comparator: str = ">="
    saturate: bool = False
    max_steps: int = 256  # analysis horizon when the bound does not converge

    def __post_init__(self) -> None:
        if not isinstance(self.in_fmt, QFormat):
            raise ValueError(f"in_fmt must be a QFormat, got {type(self.in_fmt).__name__}")
        if not isinstance(self.membrane_bits, int) or not 2 <= self.membrane_bits <= 32:
            raise ValueError(f"membrane_bits must be an integer in [2, 32], got {self.membrane_bits!r}")
        if self.leak is not None:
            if not isinstance(self.leak, Dyadic):
                raise ValueError(f"leak must be a Dyadic or None, got {type(self.leak).__name__}")
            # lambda in [0, 1] keeps the leak a decay; s <= 31 bounds |u| m below 2^62.
            if not (0 <= self.leak.s <= 31 and 0 <= self.leak.m <= 1 << self.leak.s):
                raise ValueError(f"leak {self.leak} must be m 2^-s in [0, 1] with s <= 31")
        if self.reset not in RESETS:
            raise ValueError(f"reset must be one of {RESETS}, got {self.reset!r}")
        if self.comparator not in COMPARATORS:
            raise ValueError(f"comparator must be one of {COMPARATORS}, got {self.comparator!r}")
        lo, hi = self.membrane_range
        if not isinstance(self.u_rest, int) or not lo <= self.u_rest <= hi:
            raise ValueError(f"u_rest must be an integer in the membrane range [{lo}, {hi}], got {self.u_rest!r}")
        if not isinstance(self.max_steps, int) or not 1 <= self.max_steps <= MAX_STEPS:
            raise ValueError(f"max_steps must be an integer in [1, {MAX_STEPS}], got {self.max_steps!r}")

    @property
    def membrane_range(self) -> tuple[int, int]:
        return int_range(self.membrane_bits)

    # The neuron-independent part of one step (operators and fixedpoint only, so it
    # runs on numpy, torch and TIR operands); the neurons' ``charge`` is this.

    def rest_like(self, cur: Any) -> Any:
        """``post_0 = u_rest`` shaped (and placed) like one step's current."""
        return cur * 0 + self.u_rest

    def clamp(self, u: Any) -> Any:
        """Saturate to the membrane width if ``saturate``, else unchanged."""
        return fp.saturate(u, self.membrane_bits) if self.saturate else u

    def charge(self, prev: Any, cur: Any) -> Any:
        """``pre = clamp(leak(prev) + cur)``: the membrane before firing."""
        return self.clamp(_leak(self, prev) + cur)


@dataclass(frozen=True, eq=False)
class MPBNParams:
    """Quantized MPBN: BN (in V_th units), threshold V / 2^Fo, soft-reset amount R."""

    bn: RationalBN
    v_th_q: np.ndarray  # int64, V
    reset_sub: np.ndarray  # int64, R in membrane LSB

    def __post_init__(self) -> None:
        for name in ("v_th_q", "reset_sub"):
            a = getattr(self, name)
            if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.shape != self.bn.shape:
                raise ValueError(f"{name} must be an int64 array of the BN parameter shape {self.bn.shape}")

    @property
    def v_th(self) -> list[Fraction]:
        return [Fraction(int(v), 1 << self.bn.out_frac_bits) for v in self.v_th_q.ravel()]


@dataclass(frozen=True, eq=False)
class FloatLIF:
    """Float parameters of the reference neuron (real units)."""

    bn: FloatBN
    v_th: np.ndarray
    reset_sub: np.ndarray


@dataclass(frozen=True, eq=False)
class MembraneBounds:
    """Per-neuron bounds of pre- and post-reset membrane; ``steps`` None: every T."""

    pre_lo: np.ndarray
    pre_hi: np.ndarray
    post_lo: np.ndarray
    post_hi: np.ndarray
    steps: int | None


def membrane_bounds(cfg: LIFConfig, event: FoldedEvent, reset_sub: np.ndarray, op: str) -> MembraneBounds:
    """Interval iteration of the dynamics, per neuron, from post_0 = u_rest.

    Each step: pre = [leak(lo) + I_lo, leak(hi) + I_hi] (leak is monotone), split into
    the non-firing part and the firing part (the folded threshold describes the firing
    set exactly for u in the membrane width), reset the firing part, take the hull.
    If post repeats, every later step repeats: the bounds hold for every T.  Without
    saturation a bound leaving the membrane width is refused, naming the intermediate.
    With saturation pre and post are clamped into the width every step, so the bound
    is the width itself, for every T: no iteration (the QAT layers build a neuron
    every training step; this keeps that construction cheap).
    """
    lo_w, hi_w = cfg.membrane_range
    th, neg = event.theta, event.negative
    if cfg.saturate:  # every pre and post is clamped into the width: that is the bound, for every T
        full = [np.full(th.shape, v, dtype=np.int64) for v in (lo_w, hi_w, lo_w, hi_w)]
        return MembraneBounds(*full, steps=None)
    fire_lo, fire_hi = np.where(neg, -_BIG, th), np.where(neg, th, _BIG)
    calm_lo, calm_hi = np.where(neg, th + 1, -_BIG), np.where(neg, _BIG, th - 1)
    post_lo = np.full(th.shape, cfg.u_rest, dtype=np.int64)
    post_hi = post_lo.copy()
    hull = None
    for step in range(1, cfg.max_steps + 1):
        pre_lo, pre_hi = _leak(cfg, post_lo) + cfg.in_fmt.lo, _leak(cfg, post_hi) + cfg.in_fmt.hi
        pre_lo, pre_hi = _fit(cfg, op, "membrane", pre_lo, pre_hi, step)
        c_lo, c_hi = np.maximum(pre_lo, calm_lo), np.minimum(pre_hi, calm_hi)
        f_lo, f_hi = np.maximum(pre_lo, fire_lo), np.minimum(pre_hi, fire_hi)
        if cfg.reset == "hard":
            f_lo, f_hi = np.where(f_lo <= f_hi, cfg.u_rest, f_lo), np.where(f_lo <= f_hi, cfg.u_rest, f_hi)
        else:
            f_lo, f_hi = f_lo - reset_sub, f_hi - reset_sub
        new_lo = np.minimum(np.where(c_lo <= c_hi, c_lo, _BIG), np.where(f_lo <= f_hi, f_lo, _BIG))
        new_hi = np.maximum(np.where(c_lo <= c_hi, c_hi, -_BIG), np.where(f_lo <= f_hi, f_hi, -_BIG))
        new_lo, new_hi = _fit(cfg, op, "membrane_reset", new_lo, new_hi, step)
        hull = _merge(hull, (pre_lo, pre_hi, new_lo, new_hi))
        if np.array_equal(new_lo, post_lo) and np.array_equal(new_hi, post_hi):
            return MembraneBounds(*hull, steps=None)
        post_lo, post_hi = new_lo, new_hi
    return MembraneBounds(*hull, steps=cfg.max_steps)


def _leak(cfg: LIFConfig, u: np.ndarray) -> np.ndarray:
    return u if cfg.leak is None else fp.dyadic_mul(u, cfg.leak.m, cfg.leak.s)


def _fit(
    cfg: LIFConfig, op: str, name: str, lo: np.ndarray, hi: np.ndarray, step: int
) -> tuple[np.ndarray, np.ndarray]:
    """Refuse a bound of the (non-saturating) membrane that leaves the width."""
    lo_w, hi_w = cfg.membrane_range
    if lo.min() < lo_w or hi.max() > hi_w:
        raise OverflowRiskError(
            f"{op}: intermediate {name!r} can reach [{int(lo.min())}, {int(hi.max())}] at time step "
            f"{step}, outside the {cfg.membrane_bits}-bit membrane range [{lo_w}, {hi_w}]; "
            "enable saturate=True, add a leak, narrow in_fmt, widen the membrane or lower max_steps"
        )
    return lo, hi


def _merge(hull: tuple | None, new: tuple) -> tuple:
    """Element-wise hull of (pre_lo, pre_hi, post_lo, post_hi) over time steps."""
    if hull is None:
        return new
    lo_hi = (np.minimum, np.maximum, np.minimum, np.maximum)
    return tuple(f(a, b) for f, a, b in zip(lo_hi, hull, new, strict=True))


class _LIFNeuron(IntOp):
    """Dynamics, analysis, validation and float reference shared by both forms.

    Subclasses differ only in ``_fires(u)``, the firing predicate on the membrane.
    One time step is public (operators and fixedpoint only, so it runs on numpy
    int64 arrays and torch int64 tensors alike, and is what the QAT layer runs):

        pre  = neuron.charge(prev, cur)      # clamp(leak(prev) + I_t), prev = u_rest at t = 1
        fire = neuron.fires(pre)             # boolean firing predicate
        post = neuron.reset(pre, fire)       # u_rest (hard) or clamp(pre - R) (soft)

    ``_forward`` is exactly this loop over T.
    """

    out_fmt = QFormat(2, 1.0, signed=False)  # spikes are 0/1; 2 bits is QFormat's narrowest word

    def __init__(self, cfg: LIFConfig, params: MPBNParams, reference: FloatLIF | None = None) -> None:
        self.cfg, self.params, self.in_fmt = cfg, params, cfg.in_fmt
        lo, hi = cfg.membrane_range
        self.event = params.bn.fold_event(params.v_th, cfg.comparator == ">", lo, hi)
        self.bounds = membrane_bounds(cfg, self.event, params.reset_sub, self.name)
        self.ranges().check()
        self.reference = reference if reference is not None else _float_from_quantized(cfg, params)

    @classmethod
    def from_float(
        cls,
        gamma: object,
        beta: object,
        mean: object,
        var: object,
        eps: object,
        v_th: object,
        cfg: LIFConfig,
        *,
        gamma_bits: int = 16,
        frac_bits: int = 8,
        out_frac_bits: int = 8,
        reset_sub: object = None,
    ) -> "_LIFNeuron":
        """Quantize float MPBN parameters; their broadcast shape is the neuron shape.

        A shape (C,) is per channel (channel axis last), the full trailing shape of
        the input is per neuron.  ``reset_sub`` (integers, membrane LSB) overrides
        the default soft-reset amount.
        """
        p = real_params(gamma=gamma, beta=beta, mean=mean, var=var, eps=eps, v_th=v_th)
        check_bn_stats(p["var"], p["eps"])
        bn = RationalBN.from_float(
            p["gamma"], p["beta"], p["mean"], p["var"], p["eps"],
            cfg.in_fmt.scale, 1.0, gamma_bits, frac_bits, out_frac_bits,
        )  # fmt: skip
        fbn = FloatBN(p["gamma"], p["beta"], p["mean"], p["var"], p["eps"])
        vq = quantize_threshold(p["v_th"], out_frac_bits)
        return cls.from_rational(cfg, bn, vq, reset_sub, reference=fbn, v_th=p["v_th"])

    @classmethod
    def from_rational(
        cls,
        cfg: LIFConfig,
        bn: RationalBN,
        v_th_q: object,
        reset_sub: object = None,
        reference: FloatBN | None = None,
        v_th: object = None,
    ) -> "_LIFNeuron":
        """The neuron of already quantized parameters: BN ``bn`` (output scale 1), threshold ``V / 2^Fo``.

        ``v_th_q``: the integers V (broadcast to the BN shape).  ``reset_sub``: the
        soft-reset override (integers, membrane LSB), None for the default R (see the
        module docstring).  ``reference``: the original float BN the float reference
        neuron uses, with ``v_th`` its float threshold (default ``V / 2^Fo``); None:
        the reference is the quantized neuron itself.
        """
        vq = np.asarray(v_th_q)
        if vq.dtype.kind not in "iu":
            raise ValueError(f"v_th_q must be integers (units of 2^-{bn.out_frac_bits}), got dtype {vq.dtype}")
        try:
            vq = np.broadcast_to(vq.astype(np.int64), bn.shape).copy()
        except ValueError:
            raise ValueError(f"v_th_q shape {vq.shape} does not broadcast to {bn.shape}") from None
        params = MPBNParams(bn, vq, _reset_amount(cfg, bn, vq, reset_sub))
        if reference is None:
            return cls(cfg, params)
        v = vq / float(1 << bn.out_frac_bits) if v_th is None else np.broadcast_to(np.asarray(v_th, np.float64), bn.shape)
        return cls(cfg, params, FloatLIF(reference, v, _float_reset(cfg, reference, v, reset_sub, params)))

    # ------------------------------------------------------------------ one time step

    def charge(self, prev: Any, cur: Any) -> Any:
        """``pre = clamp(leak(prev) + cur)`` (:meth:`LIFConfig.charge`)."""
        return self.cfg.charge(prev, cur)

    def fires(self, pre: Any) -> Any:
        """Boolean firing predicate on the pre-reset membrane (the form's own rule)."""
        return self._fires(pre)

    def reset(self, pre: Any, fire: Any) -> Any:
        """``post``: u_rest where fired (hard), or ``clamp(pre - R)`` where fired (soft)."""
        if self.cfg.reset == "hard":
            return fp.select(fire, self.cfg.u_rest, pre)
        return self._saturate(pre - fp.select(fire, const_like(pre, self.params.reset_sub), 0))

    # ------------------------------------------------------------------ analysis

    def ranges(self) -> RangeReport:
        b, report = self.bounds, RangeReport(self.name)
        report.add("membrane", Interval(int(b.pre_lo.min()), int(b.pre_hi.max())))
        report.add("membrane_reset", Interval(int(b.post_lo.min()), int(b.post_hi.max())))
        if self.cfg.leak is not None:
            state = report["membrane_reset"].union(Interval.point(self.cfg.u_rest))
            report.add("leak_product", state * self.cfg.leak.m)
        self._add_ranges(report)
        return report

    @abc.abstractmethod
    def _add_ranges(self, report: RangeReport) -> None:
        """Add the form-specific intermediates."""

    # ------------------------------------------------------------------ forward

    def forward(self, x: np.ndarray, trace: Trace | None = None) -> np.ndarray:
        """Spikes (int8 0/1) of shape (T, ..., *P) for integer currents of that shape."""
        return super().forward(x, trace).astype(np.int8)

    def _check_shape(self, shape: tuple[int, ...]) -> None:
        p = self.params.bn.shape
        if len(shape) < 1 + len(p) or tuple(shape[len(shape) - len(p):]) != p:
            raise ValueError(
                f"input shape {tuple(shape)} must be (T, ..., *{p}): time first, then the parameter shape"
            )

    def _check_input(self, shape: tuple[int, ...]) -> None:
        self._check_shape(shape)
        steps = self.bounds.steps
        if steps is not None and shape[0] > steps:
            raise ValueError(
                f"T = {shape[0]} time steps exceed the {steps} steps the membrane range analysis "
                "covers (max_steps); raise max_steps, add a leak or enable saturation"
            )

    def _forward(self, x: np.ndarray, trace: Trace | None) -> np.ndarray:
        """Spikes as int64 0/1: :meth:`charge`, :meth:`fires`, :meth:`reset` per step (numpy or torch)."""
        self._check_input(tuple(x.shape))
        pre_all, post_all, spikes = x * 0, x * 0, x * 0
        state = None
        for t in range(x.shape[0]):
            cur = x[t]
            pre = self.charge(self.cfg.rest_like(cur) if state is None else state, cur)
            fire = self.fires(pre)
            state = self.reset(pre, fire)
            pre_all[t], post_all[t], spikes[t] = pre, state, fp.select(fire, 1, 0)
        record(trace, "membrane", pre_all)
        record(trace, "membrane_reset", post_all)
        return spikes

    def _saturate(self, u: np.ndarray) -> np.ndarray:
        return self.cfg.clamp(u)

    @abc.abstractmethod
    def _fires(self, u: np.ndarray) -> np.ndarray:
        """Boolean firing predicate on the (pre-reset) membrane potential."""

    # ------------------------------------------------------------------ float reference

    def float_reference(self, x: np.ndarray) -> np.ndarray:
        """Float64 LIF with the original BN parameters and lambda = leak value (0/1 spikes).

        Real units throughout (u = input scale x membrane integer); no saturation.
        """
        x = np.asarray(x, dtype=np.float64)
        shape = x.shape
        self._check_shape(shape)
        cfg, ref = self.cfg, self.reference
        lam = 1.0 if cfg.leak is None else float(cfg.leak.value)
        rest = cfg.u_rest * cfg.in_fmt.scale
        u = np.full(shape[1:], rest)
        out = np.zeros(shape)
        for t in range(shape[0]):
            u = lam * u + x[t]
            y = ref.bn.apply(u)
            fire = y >= ref.v_th if cfg.comparator == ">=" else y > ref.v_th
            u = np.where(fire, rest, u) if cfg.reset == "hard" else u - np.where(fire, ref.reset_sub, 0.0)
            out[t] = fire
        return out


class MPBNNeuron(_LIFNeuron):
    """Unfolded: the exact integer BN comparison ``P u + Q >= V D 2^S`` every step."""

    name = "mpbn_lif"
    multiplications = ("membrane_leak", "membrane_slope")

    def __init__(self, cfg: LIFConfig, params: MPBNParams, reference: FloatLIF | None = None) -> None:
        super().__init__(cfg, params, reference)  # checks the ranges before any int64 cast
        slope, offset, _ = params.bn.linear_form()
        shape = params.bn.shape
        self._slope = np.array(slope, dtype=np.int64).reshape(shape)
        self._offset = np.array(offset, dtype=np.int64).reshape(shape)
        self._bn_threshold = np.array(self._threshold_ints(), dtype=np.int64).reshape(shape)

    def _threshold_ints(self) -> list[int]:
        """V D 2^S = (V / 2^Fo) Den: the BN threshold times the BN denominator."""
        bn = self.params.bn
        return [v * d << bn.gamma_shift for v, d in zip(self.params.v_th_q.ravel().tolist(), bn.std_q.ravel().tolist(), strict=True)]

    def _add_ranges(self, report: RangeReport) -> None:
        b = self.bounds
        bounds = self.params.bn.numerator_bounds(b.pre_lo.ravel().tolist(), b.pre_hi.ravel().tolist())
        report.add("bn_product", Interval.hull(*(v for c in bounds for v in c[:2])))
        report.add("bn_numerator", Interval.hull(*(v for c in bounds for v in c[2:])))
        report.add("bn_threshold", Interval.hull(*self._threshold_ints()))

    def _forward(self, x: np.ndarray, trace: Trace | None) -> np.ndarray:
        spikes = super()._forward(x, trace)
        if trace is not None:
            u = trace["membrane"]
            record(trace, "bn_numerator", u * const_like(u, self._slope) + const_like(u, self._offset))
        return spikes

    def _fires(self, u: np.ndarray) -> np.ndarray:
        num = u * const_like(u, self._slope) + const_like(u, self._offset)
        k = const_like(u, self._bn_threshold)
        return num >= k if self.cfg.comparator == ">=" else num > k

    def fold(self) -> "FoldedLIFNeuron":
        return FoldedLIFNeuron(self.cfg, self.params, self.reference)


class FoldedLIFNeuron(_LIFNeuron):
    """Folded: fire iff ``u >= theta`` (gamma_q >= 0) or ``u <= theta`` (gamma_q < 0).

    gamma_q = 0 has theta at an end of the membrane range (always / never fires).
    """

    name = "folded_lif"
    multiplications = ("membrane_leak",)  # the BN is folded into the threshold

    def _add_ranges(self, report: RangeReport) -> None:
        report.add("threshold", Interval(int(self.event.theta.min()), int(self.event.theta.max())))

    def _fires(self, u: np.ndarray) -> np.ndarray:
        theta = const_like(u, self.event.theta)
        neg = const_like(u, self.event.negative.astype(np.int64)) == 1
        return fp.select(neg, u <= theta, u >= theta)


def quantize_threshold(v_th: object, out_frac_bits: int) -> np.ndarray:
    """``V = round_half_up(v_th 2^Fo)`` per element, exactly (int64, v_th's shape)."""
    v = np.asarray(v_th, dtype=np.float64)
    q = [fixed_ratio("v_th", *float(x).as_integer_ratio(), out_frac_bits) for x in v.ravel().tolist()]
    return np.array(q, dtype=np.int64).reshape(v.shape)


def _reset_amount(cfg: LIFConfig, bn: RationalBN, vq: np.ndarray, reset_sub: object) -> np.ndarray:
    """Soft-reset R per neuron: the override, else round_half_up(root of BN(u) = V_th)."""
    if reset_sub is not None:
        r = np.asarray(reset_sub)
        if r.dtype.kind not in "iu":
            raise ValueError(f"reset_sub must be integers (membrane LSB), got dtype {r.dtype}")
        try:
            return np.broadcast_to(r.astype(np.int64), bn.shape).copy()
        except ValueError:
            raise ValueError(f"reset_sub shape {r.shape} does not broadcast to {bn.shape}") from None
    if cfg.reset == "hard":
        return np.zeros(bn.shape, dtype=np.int64)
    v = [Fraction(int(q), 1 << bn.out_frac_bits) for q in vq.ravel()]
    roots = bn.root(v)
    r = [0 if x is None else to_fixed("soft-reset threshold (mu + (V_th - beta) sigma / gamma)", x, 0) for x in roots]
    return np.array(r, dtype=np.int64).reshape(bn.shape)


def _float_reset(cfg: LIFConfig, fbn: FloatBN, v_th: np.ndarray, reset_sub: object, params: MPBNParams) -> np.ndarray:
    """The float neuron's soft-reset amount (real units): the unrounded threshold."""
    if reset_sub is not None or cfg.reset == "hard":
        return params.reset_sub * cfg.in_fmt.scale
    with np.errstate(divide="ignore", invalid="ignore"):
        theta = fbn.mean + (v_th - fbn.beta) * np.sqrt(fbn.var + fbn.eps) / fbn.gamma
    return np.where(fbn.gamma == 0, 0.0, theta)


def _float_from_quantized(cfg: LIFConfig, params: MPBNParams) -> FloatLIF:
    bn = params.bn
    v_th = params.v_th_q / float(1 << bn.out_frac_bits)
    return FloatLIF(bn.as_float(cfg.in_fmt.scale, 1.0), v_th, params.reset_sub * cfg.in_fmt.scale)


def spike_agreement(neuron: _LIFNeuron, x: np.ndarray) -> float:
    """Share of (time, neuron) entries where the integer and float neurons agree."""
    ints = neuron.forward(x)
    floats = neuron.float_reference(neuron.in_fmt.dequantize(x))
    return float(np.mean(ints == floats)) if ints.size else 1.0
