"""FlashNorm's integer form: a weightless RMSNorm + Linear with 1/rms applied after the matmul.

:class:`IntFlashNorm` is the golden op of :func:`qnorm.passes.flashnorm`'s result
(the RMSNorm gain folded into the Linear, ``W' = W diag(gamma)``); the inference
module running it is :class:`qnorm.passes.IntFlashNormLinear`.  For a row x of N
integers (scale s_x) and ``w = q(W')``, per-output-channel int8 weights with scales
s_w (:func:`~qnorm.ops.wquant.quantize_per_channel`):

    x / rms(x) = sqrt(N) x / sqrt(V),   V = sum x^2 + eps_int,  eps_int = round(eps N / s_x^2)
    V = M 2^(2e)  (M with 30 or 31 bits),   r = rsqrt(M, 30) ~ 2^30 / sqrt(M)
    acc_o = sum_i x_i w_oi                   (the integer matmul on the un-normalized x)
    y_o = sat(round((acc_o r m_o + B_o 2^(30+e)) / 2^(30+e+S)))

with ``m_o / 2^S ~ sqrt(N) s_w[o] / s_out`` (16-bit multipliers, one shared shift)
and ``B_o = round(b_o 2^S / s_out)``: after the exact integers the only roundings
are r (relative 2^-15.5), the multipliers (2^-15) and one final rounding, so the
normalization adds no rounding point of its own.  Normalizing first with the same
quantization points, ``u = x r`` (exact) then ``u w^T``, gives the same integers by
associativity (:meth:`IntFlashNorm.normalize_first`); a pipeline that rounds the
normalized activations to int8 before the matmul does not, and the tests measure
that difference in output LSB.

Golden only: no compiled kernel and no ``qnorm verify`` case (the README says why).
Numpy only, like every golden op: its float parameters may be torch tensors or
numpy arrays, and torch is imported only where a torch module is read
(:meth:`IntFlashNorm.from_modules`) or the float reference computed.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np

from qnorm import fixedpoint as fp
from qnorm.analysis import Interval, RangeReport
from qnorm.ops._xp import const_like, is_torch, row_sum
from qnorm.ops.base import IntOp, Trace, record
from qnorm.ops.wquant import as_float64, quantize_per_channel
from qnorm.qformat import QFormat

if TYPE_CHECKING:
    import torch
    from torch import nn

MANT_BITS = 30  # V's mantissa M has MANT_BITS or MANT_BITS + 1 bits
INV_FRAC = 30  # r = 2^INV_FRAC / sqrt(M): 15.5 significant bits (fixedpoint.rsqrt allows <= 30)


def rms_eps(norm: nn.RMSNorm) -> float:
    """The eps an RMSNorm uses: its own, or (None) the machine epsilon of its dtype, as torch does."""
    import torch

    if norm.eps is not None:
        return float(norm.eps)
    dtype = norm.weight.dtype if norm.weight is not None else torch.get_default_dtype()
    return float(torch.finfo(dtype).eps)


def gain_folded(weight: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``W diag(gamma)`` in ``W``'s dtype: each product exact in float64, rounded once."""
    return (weight.detach().double() * gamma.detach().double()).to(weight.dtype)


def _matmul(x: Any, w: Any) -> Any:
    """Integer ``x @ w.T`` over the last axis, exact in int64 on numpy and torch."""
    if is_torch(x) and x.device.type != "cpu":  # int64 matmul kernels exist on CPU only
        return (x.unsqueeze(-2) * w).sum(dim=-1)
    return x @ w.T


class IntFlashNorm(IntOp):
    """Golden integer FlashNorm: weightless RMSNorm + Linear with 1/rms after the matmul.

    ``weight``: (O, N) integers; ``mult``/``shift``: per-output multipliers with one
    shift; ``bias``: (O,) in ``2^-shift`` output LSB; ``eps``: eps in units of
    ``sum x^2``.  ``w_float``/``b_float``/``eps_float``: the float layer, for the
    reference.  Construction checks every intermediate's range (int64).
    """

    name = "flashnorm_linear"

    def __init__(
        self,
        in_fmt: QFormat,
        out_fmt: QFormat,
        weight: np.ndarray,
        mult: np.ndarray,
        shift: int,
        bias: np.ndarray,
        eps: int,
        w_float: np.ndarray,
        b_float: np.ndarray,
        eps_float: float,
    ) -> None:
        self.in_fmt, self.out_fmt = in_fmt, out_fmt
        self.weight = np.asarray(weight, dtype=np.int64)
        self.mult = np.asarray(mult, dtype=np.int64)
        self.bias = np.asarray(bias, dtype=np.int64)
        self.shift, self.eps = int(shift), int(eps)
        self.w_float, self.b_float, self.eps_float = w_float, b_float, float(eps_float)
        out, n = self.weight.shape
        if self.mult.shape != (out,) or self.bias.shape != (out,) or self.eps < 0 or self.shift < 0:
            raise ValueError("IntFlashNorm needs (O, N) weights, (O,) multipliers and biases, eps >= 0, shift >= 0")
        self.n = n
        self._stat_bits = max(1, self.ranges().check()["stat"].hi.bit_length())

    @classmethod
    def from_float(
        cls,
        weight: np.ndarray | torch.Tensor,
        bias: np.ndarray | torch.Tensor | None,
        eps: float,
        in_fmt: QFormat,
        out_fmt: QFormat,
        *,
        weight_bits: int = 8,
        mult_bits: int = 16,
    ) -> IntFlashNorm:
        """From the folded float Linear ``W' = W diag(gamma)`` (see :func:`qnorm.passes.flashnorm`)."""
        if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
            raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
        w_int, s_w = quantize_per_channel(weight, weight_bits)
        out, n = w_int.shape
        b = np.zeros(out) if bias is None else as_float64(bias)
        if not np.all(np.isfinite(b)):
            raise ValueError("bias contains NaN or Inf")
        eps_int = fp.round_fraction(Fraction(eps) * n / Fraction(in_fmt.scale) ** 2)
        peak = max(-in_fmt.lo, in_fmt.hi)
        # The final shift 30 + e + S must stay <= 62 for the largest row exponent e.
        max_shift = 62 - INV_FRAC - max(_exponent(n * peak * peak + eps_int), 0)
        if max_shift < 0:
            raise ValueError(f"rows of {n} elements of {in_fmt.bits} bits leave no room for the output shift")
        mult, shift = fp.dyadic_vector(math.sqrt(n) * s_w / out_fmt.scale, mult_bits, max_shift)
        b_int = [fp.round_fraction(Fraction(v) * (1 << shift) / Fraction(out_fmt.scale)) for v in b.tolist()]
        w_f = as_float64(weight)
        return cls(in_fmt, out_fmt, w_int, mult, shift, np.array(b_int, dtype=np.int64), eps_int, w_f, b, eps)

    @classmethod
    def from_modules(
        cls, norm: nn.RMSNorm, linear: nn.Linear, in_fmt: QFormat, out_fmt: QFormat, **kw: Any
    ) -> IntFlashNorm:
        """From ``RMSNorm -> Linear`` as they are, folding a gain first (as :func:`qnorm.passes.flashnorm`)."""
        if len(norm.normalized_shape) != 1 or norm.normalized_shape[0] != linear.in_features:
            raise ValueError(
                f"RMSNorm over {tuple(norm.normalized_shape)} does not feed a Linear of {linear.in_features} inputs"
            )
        weight = linear.weight if norm.weight is None else gain_folded(linear.weight, norm.weight)
        return cls.from_float(weight, linear.bias, rms_eps(norm), in_fmt, out_fmt, **kw)

    # ---- integer forward

    def row_inverse(self, x: Any, trace: Trace | None = None) -> tuple[Any, Any]:
        """``(r, e)`` per row: ``1 / sqrt(V) ~ r 2^-(30 + e)``, both with the row axis kept."""
        q = record(trace, "sum_sq", row_sum(x * x))
        v = record(trace, "stat", q + self.eps)
        v = fp.select(v > 0, v, v * 0 + 1)  # V = 0 only for an all-zero row: acc = 0 then
        e = record(trace, "exp", (fp.bit_length(v, self._stat_bits) - MANT_BITS) >> 1)
        up = fp.select(e > 0, e, e * 0)
        m = record(trace, "mant", fp.rshift_round(v, up << 1, fp.Round.FLOOR) << ((up - e) << 1))
        return record(trace, "rsqrt", fp.rsqrt(m, INV_FRAC)), e

    def _requantize(self, prod: Any, e: Any, trace: Trace | None) -> Any:
        """``sat(round((prod m_o + B_o 2^(30+e)) / 2^(30+e+S)))``: the one output rounding."""
        frac = e + INV_FRAC
        num = record(trace, "num", prod * const_like(prod, self.mult) + (const_like(prod, self.bias) << frac))
        y = fp.rshift_round(num, frac + self.shift)
        return fp.saturate(y, self.out_fmt.bits, self.out_fmt.signed)

    def _forward(self, x: Any, trace: Trace | None) -> Any:
        r, e = self.row_inverse(x, trace)
        acc = record(trace, "acc", _matmul(x, const_like(x, self.weight)))
        return self._requantize(record(trace, "prod", acc * r), e, trace)

    def forward(self, x: np.ndarray, trace: Trace | None = None) -> np.ndarray:
        arr = np.asarray(x)
        if arr.ndim == 0 or arr.shape[-1] != self.n:
            raise ValueError(f"{self.name} takes rows of {self.n} elements; got input shape {arr.shape}")
        return self._forward(self.in_fmt.check(arr), trace)

    def normalize_first(self, x: np.ndarray) -> np.ndarray:
        """The same integers computed in the textbook order: ``u = x r`` (exact), then ``u w^T``."""
        x = self.in_fmt.check(x)
        r, e = self.row_inverse(x)
        return self._requantize(_matmul(x * r, self.weight), e, None)

    # ---- ranges and reference

    def ranges(self) -> RangeReport:
        """Interval bounds of every intermediate (per output channel, then the hull)."""
        rep = RangeReport(self.name)
        lo, hi = self.in_fmt.lo, self.in_fmt.hi
        peak = max(-lo, hi)
        q = rep.add("sum_sq", Interval(0, self.n * peak * peak))
        v = rep.add("stat", q + self.eps)
        e_lo, e_hi = _exponent(max(v.lo, 1)), _exponent(v.hi)
        rep.add("exp", Interval(e_lo, e_hi))
        m = rep.add("mant", Interval(1 << (MANT_BITS - 1), (1 << (MANT_BITS + 1)) - 1))
        r = rep.add("rsqrt", Interval(fp.rsqrt(m.hi, INV_FRAC), fp.rsqrt(m.lo, INV_FRAC)))
        accs = [
            Interval(int(np.minimum(w * lo, w * hi).sum()), int(np.maximum(w * lo, w * hi).sum())) for w in self.weight
        ]
        rep.add("acc", Interval(min(a.lo for a in accs), max(a.hi for a in accs)))
        prods = [a * r for a in accs]
        rep.add("prod", Interval(min(p.lo for p in prods), max(p.hi for p in prods)))
        bias_scale = Interval(1 << (INV_FRAC + e_lo), 1 << (INV_FRAC + e_hi))
        nums = [p * int(m_o) + bias_scale * int(b_o) for p, m_o, b_o in zip(prods, self.mult, self.bias, strict=True)]
        rep.add("num", Interval(min(v.lo for v in nums), max(v.hi for v in nums)))
        return rep

    def float_reference(self, x: np.ndarray) -> np.ndarray:
        """``rms_norm(x) W'^T + b`` in float64 (real units), W' the folded float weight."""
        import torch

        t = torch.from_numpy(np.asarray(x, dtype=np.float64))
        z = torch.nn.functional.rms_norm(t, (self.n,), None, self.eps_float)
        return (z @ torch.from_numpy(self.w_float).T + torch.from_numpy(self.b_float)).numpy()


def _exponent(v: int) -> int:
    """e with ``v = M 2^(2e)``, M of MANT_BITS or MANT_BITS + 1 bits (v >= 1)."""
    return (int(v).bit_length() - MANT_BITS) >> 1
