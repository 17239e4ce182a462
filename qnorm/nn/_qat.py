"""Shared machinery of the qnorm QAT layers: exact integer forward, surrogate backward.

Every layer in :mod:`qnorm.nn` follows one recipe, and this module provides each step:

1. **Input -> integers.**  :class:`InputQuantizer` turns a float tensor (quantized with a
   fixed :class:`~qnorm.qformat.QFormat`, or with a per-tensor scale calibrated from a
   running max-abs in training and frozen in eval) or a Brevitas ``IntQuantTensor``
   (Brevitas' own integers ``qt.int()`` and per-tensor ``qt.scale``) into a
   :class:`QuantizedInput`: int64 integers, their format, and the dequantized value.
2. **Golden op** for the current float parameters, re-derived deterministically in every
   forward with the op's own derivation (``layer.golden()`` returns it).
3. **Exact forward**: the golden op's own ``_forward`` body, run on torch int64 tensors
   (:mod:`qnorm.fixedpoint` and :mod:`qnorm.ops._xp` run unchanged on them), so the
   result equals ``golden_op.forward(x_int)`` by construction, not by a second
   implementation.  The float output is ``ints.to(dtype) * out_scale`` in the input's
   float dtype: exactly what the golden integers mean.
4. **Backward**: :func:`exact_forward` wraps (3) in a custom autograd Function whose
   backward is the vector-Jacobian product of the layer's differentiable float
   *surrogate*, evaluated at the dequantized input with the float parameters; the
   input quantizer contributes a straight-through estimator that is zero where it
   clipped.  (``y_float + (y_q - y_float).detach()`` is avoided on purpose: that sum
   is rounded in float arithmetic and is not bit-identical to ``y_q``.)
5. **Output**: a float tensor, or an ``IntQuantTensor`` (zero point 0) with
   ``return_quant_tensor=True``, so a layer sits between Brevitas layers without glue.

**Data-parallel training.**  With ``torch.distributed`` initialized, a training
forward reduces what it learns from the batch over the ranks: the calibrating
quantizer's batch max |x| (all-reduce max), and the BN layers' exact integer sums
``S``, ``sum x^2`` and the count (all-reduce sum, :func:`batch_stats`), whose float
surrogate then normalizes over the ranks too (:func:`synced_batch_norm`).  So every
replica computes the statistics of the global batch, bit for bit those of one
process on the concatenated batch, and the buffers never diverge.

**Why int64 and not float.**  Float arithmetic is exact only while every intermediate
(products, BN numerators, membrane potentials, ...) stays below 2^24 in magnitude
(float32) or 2^53 (float64).  The golden ops' intermediates (e.g. ``P x + Q`` of a
rational BN) need far more bits, so the layers compute in ``compute_dtype = int64``;
every golden op runs ``ranges().check()`` at construction, which proves each
intermediate fits int64 for every input its formats admit.

A norm layer built on this module (see :class:`QATModule`)::

    class IntLayerNorm(QATModule):
        channel_dim, min_ndim = -1, 1        # the golden op normalizes the last axis
        def __init__(self, n, out_fmt, in_fmt=None, eps=1e-5):
            super().__init__(n, InputQuantizer(in_fmt), return_quant_tensor=False)
            self.out_fmt, self.eps = out_fmt, eps
            self.weight, self.bias = nn.Parameter(torch.ones(n)), nn.Parameter(torch.zeros(n))
        def golden(self, in_fmt=None):
            fmt = self.input_format(in_fmt)
            return ops.IntLayerNorm.from_float(param_array(self.weight), param_array(self.bias),
                                               self.eps, fmt, self.out_fmt)
        def _constants(self, op):
            return {"gain": op.config.gain, "shift": op.config.shift, "bias": op.config.bias}
        def forward(self, x):
            q = self.quantize_input(x)
            op = self.golden(q.fmt)
            ints = self.run_golden(op, q.ints)
            surrogate = lambda xd, w, b: F.layer_norm(xd, (self.channels,), w.to(xd.dtype), b.to(xd.dtype), self.eps)
            return self.finish(q, ints, op.out_fmt, surrogate, (self.weight, self.bias))
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from qnorm.extras import install_hint
from qnorm.fixedpoint import Round
from qnorm.ops.base import IntOp
from qnorm.ops.bnfold import RationalBN, check_bn_stats, real_params
from qnorm.qformat import QFormat

COMPUTE_DTYPE = torch.int64

Output = torch.Tensor | Any  # Any: a brevitas IntQuantTensor (brevitas is optional)
Surrogate = Callable[..., torch.Tensor]


# --------------------------------------------------------------------------- helpers


def param_array(p: torch.Tensor) -> np.ndarray:
    """A parameter or buffer as float64 numpy (exact: float32 -> float64 widens)."""
    return p.detach().to("cpu", torch.float64).numpy()


def fmt_metadata(fmt: QFormat) -> dict[str, Any]:
    return {"bits": fmt.bits, "scale": float(fmt.scale), "signed": bool(fmt.signed)}


def jsonable(value: Any) -> Any:
    """numpy / Round / tuples -> plain JSON values (integer constants stay exact ints)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (np.integer, np.bool_)):
        return value.item()
    if isinstance(value, Round):
        return value.value
    if isinstance(value, QFormat):
        return fmt_metadata(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def power_of_two_ceil(scale: float) -> float:
    """The smallest power of two >= ``scale`` (> 0), exactly (``frexp``/``ldexp``, no log)."""
    mantissa, exponent = math.frexp(scale)
    return scale if mantissa == 0.5 else math.ldexp(1.0, exponent)


def to_op_layout(t: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """Golden ops take their parameter axis last: move the layer's channel axis there."""
    return t.movedim(channel_dim, -1)


def from_op_layout(t: torch.Tensor, channel_dim: int) -> torch.Tensor:
    return t.movedim(-1, channel_dim)


# --------------------------------------------------------------------------- input side


@dataclass(frozen=True, eq=False)
class QuantizedInput:
    """What a layer computes on: integers, their format, and where gradients go.

    ``value``: the tensor the input gradient is returned for (the float input, or the
    IntQuantTensor's ``value``).  ``dequant``: ``ints * scale`` in ``value``'s dtype,
    detached; the surrogate is evaluated there.  ``pass_mask``: the quantizer's
    straight-through mask (1 where it did not clip; None for IntQuantTensor input,
    whose quantizer is upstream and already shaped ``value``'s gradient).
    """

    ints: torch.Tensor
    fmt: QFormat
    value: torch.Tensor
    dequant: torch.Tensor
    pass_mask: torch.Tensor | None


def check_finite_float(x: torch.Tensor, name: str = "input") -> None:
    """Refuse non-float dtypes and NaN/Inf values, naming the problem."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a float torch.Tensor or a Brevitas IntQuantTensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor (or a Brevitas IntQuantTensor), got dtype {x.dtype}")
    if torch.isnan(x).any():
        raise ValueError(f"{name} contains NaN; NaN has no fixed-point value")
    if torch.isinf(x).any():
        raise ValueError(f"{name} contains Inf; Inf has no fixed-point value")


def quantize_float(x: torch.Tensor, fmt: QFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`QFormat.quantize` (round half up, saturate) of a torch tensor, and the STE mask.

    The spec's own quantizer on the float64 tensor (torch operations on the input's
    device, the same float64 steps as on numpy, so the same integers), and
    :meth:`QFormat.in_range`: True where ``x / scale`` was not clipped.
    """
    return fmt.quantize_with_mask(x.detach().to(torch.float64))


def _brevitas_int_quant_tensor() -> type:
    try:
        from brevitas.quant_tensor import IntQuantTensor
    except ImportError as err:  # brevitas is an optional dependency
        raise ValueError(f"IntQuantTensor input/output needs brevitas: {install_hint('brevitas')}") from err
    return IntQuantTensor


def is_quant_tensor(x: Any) -> bool:
    """True for any Brevitas QuantTensor (checked by module, so brevitas stays unimported)."""
    return type(x).__module__.startswith("brevitas")


def from_quant_tensor(qt: Any) -> QuantizedInput:
    """Brevitas' own integers and per-tensor scale; refuses what has no QFormat."""
    if not isinstance(qt, _brevitas_int_quant_tensor()):
        raise ValueError(f"only Brevitas IntQuantTensor inputs are supported, got {type(qt).__name__}")
    check_finite_float(qt.value, "IntQuantTensor value")
    if qt.scale.numel() != 1:
        raise ValueError(
            f"IntQuantTensor has a per-channel scale of shape {tuple(qt.scale.shape)}; "
            "qnorm layers need one per-tensor scale"
        )
    if bool((qt.zero_point != 0).any()):
        raise ValueError("IntQuantTensor has a non-zero zero point; qnorm layers need symmetric (zero point 0) input")
    bits = float(qt.bit_width)
    if not bits.is_integer():
        raise ValueError(f"IntQuantTensor bit width {bits} is not an integer")
    fmt = QFormat(int(bits), float(qt.scale.detach()), bool(qt.signed))
    try:
        ints = qt.int().to(COMPUTE_DTYPE)
    except RuntimeError as err:  # Brevitas refuses a value that is not on its integer grid
        raise ValueError(f"IntQuantTensor is not valid: {err}") from err
    if ints.numel() and (int(ints.min()) < fmt.lo or int(ints.max()) > fmt.hi):
        raise ValueError(
            f"IntQuantTensor integers span [{int(ints.min())}, {int(ints.max())}], outside its "
            f"declared {fmt.bits}-bit range [{fmt.lo}, {fmt.hi}]"
        )
    return QuantizedInput(ints, fmt, qt.value, qt.value.detach(), None)


class InputQuantizer(nn.Module):
    """Float or IntQuantTensor in; int64 integers, their format and the STE mask out.

    ``fmt`` given: a fixed format.  ``fmt`` None: a per-tensor scale
    ``running_max_abs / hi`` for a ``bits``-wide (un)signed word, where
    ``running_max_abs`` is an exponential moving average (``momentum``) of each
    training batch's max |x|, started at the first non-zero batch and frozen in eval
    (a never-calibrated quantizer refuses eval input).  The update runs in Python
    float64 on the host, so the scale is the same on every device.

    An IntQuantTensor input brings its own format (Brevitas' integers are used as they
    are: the rounding that made them, half to even, is upstream).  A fixed-format
    quantizer refuses one whose format differs; a calibrating quantizer adopts it.
    Rounding of float input is half up (qnorm's default, :meth:`QFormat.quantize`).

    ``pow2``: the calibrated scale is rounded *up* to a power of two (so max |x| still
    fits).  A power-of-two scale makes ``x / scale`` exact in any float format, which
    is what lets a compiled float graph around the layer reproduce its integers
    (:mod:`qnorm.deploy`).  Fixed formats are used as given.

    Under ``torch.distributed`` (initialized, training) the batch max |x| is the max
    over all ranks (one all-reduce MAX in ``process_group``, default the world), so
    every replica calibrates the same scale, the one single-process training on the
    concatenated batch would; ``sync_stats = False`` keeps it per rank.

    **Outlier batches are refused.**  Once a range is calibrated, a training batch
    whose max |x| exceeds it more than ``max_jump`` (2^10) times raises a ValueError
    and leaves the calibration as it was.  One such batch (a diverged activation, an
    input scaled by 1e30) would otherwise lift the scale so far that every later input
    rounds to 0 and the layer outputs only β.  Refusing, rather than warning and
    skipping the update, stops training at the batch that caused it: a skipped update
    keeps training on with a range that may no longer fit, behind a warning that
    scrolls by.  Legitimate ranges move by a few times at most between batches (the
    calibration is a moving average); where a range really jumps, set ``max_jump``
    higher on that quantizer (``math.inf`` turns the check off).
    """

    running_max_abs: torch.Tensor
    max_jump: float = 2.0**10

    def __init__(
        self,
        fmt: QFormat | None = None,
        *,
        bits: int = 8,
        signed: bool = True,
        momentum: float = 0.1,
        pow2: bool = False,
    ) -> None:
        super().__init__()
        if fmt is not None and not isinstance(fmt, QFormat):
            raise ValueError(f"fmt must be a QFormat or None, got {type(fmt).__name__}")
        if not 0.0 < momentum <= 1.0:
            raise ValueError(f"momentum must be in (0, 1], got {momentum!r}")
        self.fixed = fmt
        self.bits, self.signed = (fmt.bits, fmt.signed) if fmt is not None else (bits, signed)
        self.hi = QFormat(self.bits, 1.0, self.signed).hi  # also validates bits
        self.momentum = momentum
        self.pow2 = bool(pow2)
        self.register_buffer("running_max_abs", torch.zeros((), dtype=torch.float64))
        self._qt_fmt: QFormat | None = None
        self.sync_stats, self.process_group = True, None  # see the class docstring

    @property
    def fmt(self) -> QFormat | None:
        """The current input format: fixed, else the last IntQuantTensor's, else calibrated."""
        if self.fixed is not None:
            return self.fixed
        if self._qt_fmt is not None:
            return self._qt_fmt
        peak = float(self.running_max_abs)
        if peak <= 0:
            return None
        scale = peak / self.hi
        return QFormat(self.bits, power_of_two_ceil(scale) if self.pow2 else scale, self.signed)

    def forward(self, x: torch.Tensor | Any) -> QuantizedInput:
        if is_quant_tensor(x):
            q = from_quant_tensor(x)
            if self.fixed is not None and q.fmt != self.fixed:
                raise ValueError(
                    f"IntQuantTensor format {q.fmt} differs from this layer's fixed input format {self.fixed}"
                )
            self._qt_fmt = q.fmt if self.fixed is None else None
            return q
        check_finite_float(x)
        self._qt_fmt = None
        if self.training and self.fixed is None:
            self._calibrate_on(x)
        fmt = self.fmt
        if fmt is None:
            raise ValueError(
                "the input quantizer is not calibrated: run training batches with non-zero input "
                "first, or give the layer a fixed in_fmt"
            )
        ints, inside = quantize_float(x, fmt)
        dequant = ints.to(x.dtype) * fmt.scale
        return QuantizedInput(ints, fmt, x, dequant, inside.to(x.dtype))

    def _calibrate_on(self, x: torch.Tensor) -> None:
        """Update the calibration with the batch max |x|, the max over all ranks under torch.distributed."""
        sync = self.sync_stats and distributed()
        if not (x.numel() or sync):
            return
        peak = x.detach().abs().max().to(torch.float64) if x.numel() else x.new_zeros((), dtype=torch.float64)
        if sync:  # every rank joins the reduction (an empty shard with 0), so none waits forever
            peak = all_reduce_max(peak, self.process_group)
        self._calibrate(float(peak))

    def _calibrate(self, batch_max: float) -> None:
        if batch_max <= 0.0:  # an all-zero batch says nothing about the range
            return
        old = float(self.running_max_abs)
        if old > 0.0 and batch_max > self.max_jump * old:
            raise ValueError(
                f"input batch max |x| = {batch_max:.6g} is {batch_max / old:.3g} times the calibrated range "
                f"{old:.6g} (max_jump = {self.max_jump:g}); refusing to calibrate on it, since later inputs would "
                "round to 0: check the input for a blow-up, or raise this input quantizer's max_jump if the range "
                "really grew"
            )
        new = batch_max if old == 0.0 else (1.0 - self.momentum) * old + self.momentum * batch_max
        self.running_max_abs.fill_(new)

    def extra_repr(self) -> str:
        if self.fixed is not None:
            return f"fmt={self.fixed}"
        pow2 = ", power-of-two scale" if self.pow2 else ""
        return f"bits={self.bits}, signed={self.signed}, calibrated (momentum={self.momentum}{pow2})"


# --------------------------------------------------------------------------- exact forward, surrogate backward


class _ExactSurrogate(torch.autograd.Function):
    """Forward: ``ints * scale`` (exact).  Backward: VJP of ``surrogate`` at the dequantized input."""

    @staticmethod
    def forward(ctx: Any, ints: torch.Tensor, out_scale: float, surrogate: Surrogate, dequant: torch.Tensor,
                pass_mask: torch.Tensor | None, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # fmt: skip
        ctx.surrogate = surrogate
        ctx.has_mask = pass_mask is not None
        ctx.save_for_backward(dequant, *((pass_mask,) if ctx.has_mask else ()), *params)
        return ints.to(x.dtype) * out_scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        dequant, mask = saved[0], saved[1] if ctx.has_mask else None
        params = saved[1 + ctx.has_mask:]
        needs = ctx.needs_input_grad[5:]  # x, *params
        with torch.enable_grad():
            leaves = [dequant.detach().requires_grad_(needs[0])]
            leaves += [p.detach().requires_grad_(n) for p, n in zip(params, needs[1:])]
            y = ctx.surrogate(*leaves)
            wanted = [t for t in leaves if t.requires_grad]
            found = iter(torch.autograd.grad(y, wanted, grad, allow_unused=True) if wanted else ())
        grads = [next(found) if t.requires_grad else None for t in leaves]
        if grads[0] is not None and mask is not None:
            grads[0] = grads[0] * mask
        return (None, None, None, None, None, *grads)


def exact_forward(
    ints: torch.Tensor, out_scale: float, surrogate: Surrogate, q: QuantizedInput, params: Sequence[torch.Tensor]
) -> torch.Tensor:
    """``ints.to(dtype) * out_scale`` with the gradient of ``surrogate(dequant, *params)``.

    ``surrogate`` must be differentiable in all its arguments and side-effect free (it
    runs again in backward); it receives the detached dequantized input and detached
    copies of ``params`` and should cast parameters to the input's dtype itself.
    """
    return _ExactSurrogate.apply(ints, float(out_scale), surrogate, q.dequant, q.pass_mask, q.value, *params)


def to_output(y: torch.Tensor, fmt: QFormat, quant_tensor: bool, training: bool) -> Output:
    """Float ``y``, or an IntQuantTensor of it (per-tensor scale, zero point 0)."""
    if not quant_tensor:
        return y
    int_quant_tensor = _brevitas_int_quant_tensor()
    return int_quant_tensor(
        value=y,
        scale=torch.tensor(fmt.scale, dtype=y.dtype, device=y.device),
        zero_point=torch.zeros((), dtype=y.dtype, device=y.device),
        bit_width=torch.tensor(float(fmt.bits), dtype=y.dtype, device=y.device),
        signed=fmt.signed,
        training=training,
    )


# --------------------------------------------------------------------------- module bases


class IntModule(nn.Module, abc.ABC):
    """What every qnorm integer module shares: layout, shape check, metadata.

    ``channel_dim``: the axis holding the golden op's parameter axis (moved last for
    the op); ``min_ndim``: the fewest input dimensions the layer accepts.
    """

    compute_dtype: ClassVar[torch.dtype] = COMPUTE_DTYPE
    channel_dim: ClassVar[int]
    min_ndim: ClassVar[int]

    def __init__(self, channels: int, input_quant: InputQuantizer, return_quant_tensor: bool) -> None:
        super().__init__()
        if not isinstance(channels, int) or channels < 1:
            raise ValueError(f"channels must be a positive integer, got {channels!r}")
        self.channels = channels
        self.input_quant = input_quant
        self.return_quant_tensor = bool(return_quant_tensor)

    @abc.abstractmethod
    def golden(self) -> IntOp:
        """The golden op equal to this module's eval-mode forward for its current state."""

    @abc.abstractmethod
    def _constants(self, op: IntOp) -> dict[str, Any]:
        """The op's integer constants for :meth:`qnorm_metadata` (numpy arrays allowed)."""

    def quantize_input(self, x: torch.Tensor | Any) -> QuantizedInput:
        """Quantize and check the shape: at least ``min_ndim`` dims, ``channels`` on ``channel_dim``."""
        q = self.input_quant(x)
        shape = tuple(q.ints.shape)
        if len(shape) < self.min_ndim or shape[self.channel_dim] != self.channels:
            raise ValueError(
                f"{type(self).__name__} expects at least {self.min_ndim} dims with {self.channels} "
                f"channels on dim {self.channel_dim}, got input shape {shape}"
            )
        return q

    def run_golden(self, op: IntOp, ints: torch.Tensor) -> torch.Tensor:
        """The golden op's own integer body on int64 torch tensors (bit-identity by construction)."""
        return from_op_layout(op._forward(to_op_layout(ints, self.channel_dim), None), self.channel_dim)

    def qnorm_metadata(self) -> dict[str, Any]:
        """JSON-ready description: formats, integer constants and rounding of :meth:`golden`.

        ``golden`` is None while the input format is unknown (an uncalibrated
        quantizer that has seen no input yet).
        """
        meta: dict[str, Any] = {
            "layer": type(self).__name__,
            "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
            "channels": self.channels,
            "channel_dim": self.channel_dim,
            **self._config_metadata(),
        }
        if self.input_quant.fmt is None:
            meta["golden"] = None
            return meta
        op = self.golden()
        meta["golden"] = {
            "op": op.name,
            "definition": op.definition,
            "in_fmt": fmt_metadata(op.in_fmt),
            "out_fmt": fmt_metadata(op.out_fmt),
            "constants": jsonable(self._constants(op)),
        }
        return meta

    def _config_metadata(self) -> dict[str, Any]:
        """Layer settings worth recording (override to add)."""
        return {}


class QATModule(IntModule):
    """A trainable layer: exact integer forward, surrogate backward (see the module docstring).

    Subclasses implement :meth:`golden` (usually ``golden(in_fmt=None, ...)`` using
    :meth:`input_format`), ``_constants`` and ``forward``; ``forward`` calls
    :meth:`quantize_input`, :meth:`run_golden` (or the op's body in another way that is
    tested equal) and :meth:`finish`.
    """

    def input_format(self, in_fmt: QFormat | None = None) -> QFormat:
        """``in_fmt`` if given, else the input quantizer's current format."""
        fmt = in_fmt if in_fmt is not None else self.input_quant.fmt
        if fmt is None:
            raise ValueError(
                f"{type(self).__name__} has no input format yet: calibrate it on training batches or give in_fmt"
            )
        return fmt

    def finish(
        self,
        q: QuantizedInput,
        ints: torch.Tensor,
        out_fmt: QFormat,
        surrogate: Surrogate,
        params: Sequence[torch.Tensor],
    ) -> Output:
        """Exact output ``ints * out_fmt.scale`` with the surrogate's gradient, wrapped."""
        y = exact_forward(ints, out_fmt.scale, surrogate, q, params)
        return to_output(y, out_fmt, self.return_quant_tensor, self.training)


class IntInference(IntModule):
    """A frozen golden op as an inference-only torch module (what ``fold()`` returns).

    Runs the op's body on int64 tensors with its fixed input format; an IntQuantTensor
    input must carry exactly that format.  No gradients: the integer op has none.
    Subclasses set ``channel_dim``/``min_ndim`` and ``_constants`` for their op.
    """

    def __init__(self, op: IntOp, channels: int, return_quant_tensor: bool = False) -> None:
        super().__init__(channels, InputQuantizer(op.in_fmt), return_quant_tensor)
        self.op = op

    def golden(self) -> IntOp:
        return self.op

    @torch.no_grad()
    def forward(self, x: torch.Tensor | Any) -> Output:
        q = self.quantize_input(x)
        y = self.run_golden(self.op, q.ints).to(q.value.dtype) * self.op.out_fmt.scale
        return to_output(y, self.op.out_fmt, self.return_quant_tensor, self.training)


# --------------------------------------------------------------------------- batch norm (MPBNLIF, BNQuantAct)


@dataclass(frozen=True, eq=False)
class BatchStats:
    """Per-channel BN statistics in real units (float64): what normalizes, what is tracked."""

    mean: np.ndarray
    var: np.ndarray  # biased: the batch is normalized with it
    var_unbiased: np.ndarray  # the running variance tracks it (as torch BN)


def batch_stats(ints: torch.Tensor, scale: float, *, sync: bool = False, group: Any = None) -> BatchStats:
    """BN statistics of integers (channels on the last axis, ``real = int * scale``).

    With n values per channel, ``S = sum x`` and ``V = n sum x^2 - S^2`` are exact
    integers; the mean is the float64 nearest ``S s / n`` and the variance the float64
    nearest ``V s^2 / n^2`` (unbiased: ``/ (n (n - 1))``), by Python's correctly rounded
    int / int division.  So the statistics, and the integer constants derived from
    them, are the same on every device and for every reduction order.

    ``sync``: first all-reduce (sum) the exact integers ``S``, ``sum x^2`` and ``n``
    over the ranks of ``group`` (torch.distributed, default the world; plus one
    all-reduce max of ``max |x|`` for the overflow check), so every rank gets the
    statistics of the global batch, bit for bit those of the concatenated batch
    (integer sums do not depend on the order).  Every check runs after the
    reductions, on global values, so all ranks accept or refuse together.
    """
    flat = ints.reshape(-1, ints.shape[-1])
    n, c = flat.shape
    peak = flat.abs().max() if flat.numel() else flat.new_zeros(())
    sums, squares = flat.sum(0), (flat * flat).sum(0)  # squares may wrap: then the check below refuses
    if sync:
        peak = all_reduce_max(peak, group)
        packed = torch.cat([sums, squares, flat.new_tensor([n])])
        dist.all_reduce(packed, group=group)
        sums, squares, n = packed[:c], packed[c: 2 * c], int(packed[-1])
    if n < 2:
        raise ValueError(f"BatchNorm in training needs more than one value per channel, got {n}")
    peak = int(peak)
    if peak * peak * n >= 1 << 63:
        raise ValueError(f"batch too large for exact int64 statistics: {n} values up to |{peak}| per channel")
    sums, squares = sums.tolist(), squares.tolist()
    num, den = float(scale).as_integer_ratio()
    dev = [n * q - s * s for s, q in zip(sums, squares)]
    return BatchStats(
        mean=np.array([s * num / (n * den) for s in sums]),
        var=np.array([v * num * num / (n * n * den * den) for v in dev]),
        var_unbiased=np.array([v * num * num / (n * (n - 1) * den * den) for v in dev]),
    )


def distributed() -> bool:
    """True when torch.distributed is initialized (the statistics are then synchronized in training)."""
    return dist.is_available() and dist.is_initialized()


def all_reduce_max(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The element-wise max of ``t`` over the ranks of ``group`` (a reduced copy; exact)."""
    out = t.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


class _AllReduceSum(torch.autograd.Function):
    """Differentiable sum over ranks: the gradient of a sum is the sum of the gradients."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = t.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=ctx.group)
        return out, None


def synced_moments(h: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel ``(centered, mean, biased var, count)`` of (N, C, ...) ``h`` over all ranks.

    Two all-reduces, differentiable like ``SyncBatchNorm``: the sum (with the element
    count) for the mean, then the sum of squared deviations; two passes instead of
    E[x^2] - E[x]^2 avoid cancellation, and all-reduce results are bitwise equal on
    every rank.  Shared by :func:`synced_batch_norm` and
    :class:`qnorm.train.distributed.GlooSyncBatchNorm`.
    """
    c = h.shape[1]
    dims = [0, *range(2, h.dim())]
    shape = [1, c] + [1] * (h.dim() - 2)
    total = _AllReduceSum.apply(torch.cat([h.sum(dims), h.new_tensor([h.numel() // c])]), group)
    count = total[c]
    mean = total[:c] / count
    centered = h - mean.view(shape)
    var = _AllReduceSum.apply((centered * centered).sum(dims), group) / count
    return centered, mean, var, count


def synced_batch_norm(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float, group: Any = None) -> torch.Tensor:
    """Float BN of (N, C, ...) ``h`` with the biased statistics of the batch over all ranks.

    The surrogate of a synchronized BN layer (the float twin of ``batch_stats(sync=True)``):
    with DDP's gradient averaging the gradients are those of one process on the
    concatenated batch (up to float summation order).
    """
    centered, _, var, _ = synced_moments(h, group)
    shape = [1, h.shape[1]] + [1] * (h.dim() - 2)
    return centered * torch.rsqrt(var + eps).view(shape) * w.view(shape) + b.view(shape)


def rational_bn_constants(bn: RationalBN) -> dict[str, Any]:
    """The integer fields of a RationalBN, for metadata."""
    return {
        "gamma_m": bn.gamma_m,
        "gamma_shift": bn.gamma_shift,
        "mean_q": bn.mean_q,
        "std_q": bn.std_q,
        "frac_bits": bn.frac_bits,
        "beta_q": bn.beta_q,
        "out_frac_bits": bn.out_frac_bits,
    }


class BNQATModule(QATModule):
    """Per-channel BatchNorm state shared by the BN-based QAT layers.

    ``weight`` (gamma) and ``bias`` (beta) are learnable floats; ``running_mean`` and
    ``running_var`` track the batch statistics of the *quantized* integers seen in
    training (:func:`batch_stats`), ``r <- (1 - momentum) r + momentum b`` computed in
    float64 on the host, unbiased variance, as torch BN.  ``eps`` is in real units of
    the variance.  ``gamma_bits``/``frac_bits``/``out_frac_bits`` are the precision of
    the derived :class:`~qnorm.ops.bnfold.RationalBN` constants.

    Under ``torch.distributed`` the batch statistics are those of the global batch
    (:meth:`training_stats`: the exact integer sums are all-reduced over
    ``process_group``, default the world; ``sync_stats = False`` keeps them per rank),
    so the running statistics stay bitwise identical across replicas.
    """

    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor

    def __init__(
        self,
        channels: int,
        input_quant: InputQuantizer,
        return_quant_tensor: bool,
        *,
        eps: float,
        momentum: float,
        gamma_bits: int,
        frac_bits: int,
        out_frac_bits: int,
    ) -> None:
        super().__init__(channels, input_quant, return_quant_tensor)
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
        if not 0.0 < momentum <= 1.0:
            raise ValueError(f"momentum must be in (0, 1], got {momentum!r}")
        self.eps, self.momentum = float(eps), float(momentum)
        self.gamma_bits, self.frac_bits, self.out_frac_bits = gamma_bits, frac_bits, out_frac_bits
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))
        self.register_buffer("num_batches_tracked", torch.zeros((), dtype=torch.long))
        self.sync_stats, self.process_group = True, None  # see training_stats

    def running_stats(self) -> BatchStats:
        var = param_array(self.running_var)
        return BatchStats(param_array(self.running_mean), var, var)

    def update_running_stats(self, stats: BatchStats) -> None:
        keep, m = 1.0 - self.momentum, self.momentum
        self.running_mean.copy_(torch.from_numpy(keep * param_array(self.running_mean) + m * stats.mean))
        self.running_var.copy_(torch.from_numpy(keep * param_array(self.running_var) + m * stats.var_unbiased))
        self.num_batches_tracked.add_(1)

    def bn_params(self, stats: BatchStats) -> dict[str, np.ndarray]:
        """Validated float64 gamma, beta, mean, var, eps (NaN/Inf and var < 0 refused by name)."""
        p = real_params(
            gamma=param_array(self.weight), beta=param_array(self.bias), mean=stats.mean, var=stats.var,
            eps=np.full(self.channels, self.eps),
        )  # fmt: skip
        check_bn_stats(p["var"], p["eps"])
        return p

    def rational(self, p: dict[str, np.ndarray], in_scale: float, out_scale: float) -> RationalBN:
        return RationalBN.from_float(
            p["gamma"], p["beta"], p["mean"], p["var"], p["eps"], in_scale, out_scale,
            self.gamma_bits, self.frac_bits, self.out_frac_bits,
        )  # fmt: skip

    def training_stats(self, ints: torch.Tensor, scale: float) -> BatchStats:
        """:func:`batch_stats` of channel-last integers, over all ranks under torch.distributed.

        In training with an initialized process group (and ``sync_stats``), the exact
        integer sums are all-reduced first: every replica normalizes with the global
        batch statistics and applies the identical running-statistics update, like
        ``SyncBatchNorm`` (exactly, since the sums are integers).
        """
        return batch_stats(ints, scale, sync=self.syncing(), group=self.process_group)

    def syncing(self) -> bool:
        """Whether this forward's batch statistics span the ranks (training, process group, ``sync_stats``)."""
        return self.training and self.sync_stats and distributed()

    def surrogate_bn(
        self,
        h: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor,
        running: tuple[torch.Tensor, torch.Tensor] | None,
        sync: bool = False,
    ) -> torch.Tensor:
        """Float BN of (N, C, ...) ``h``: batch statistics if ``running`` is None (training).

        ``sync`` (the forward's :meth:`syncing`, captured when it ran): the batch
        statistics span all ranks, as the integer forward's did, and so does their
        gradient (:func:`synced_batch_norm`).
        """
        if running is None and sync:
            return synced_batch_norm(h, w.to(h.dtype), b.to(h.dtype), self.eps, self.process_group)
        rm, rv = (None, None) if running is None else (r.to(h.dtype) for r in running)
        return F.batch_norm(h, rm, rv, w.to(h.dtype), b.to(h.dtype), running is None, 0.0, self.eps)

    def frozen_running(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Running statistics for an eval-mode surrogate (a copy: backward runs later), None in training."""
        return None if self.training else (self.running_mean.detach().clone(), self.running_var.detach().clone())

    def _config_metadata(self) -> dict[str, Any]:
        return {
            "eps": self.eps,
            "momentum": self.momentum,
            "gamma_bits": self.gamma_bits,
            "frac_bits": self.frac_bits,
            "out_frac_bits": self.out_frac_bits,
        }
