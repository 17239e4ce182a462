"""The input side of the QAT layers: float or Brevitas IntQuantTensor in, integers out.

:class:`InputQuantizer` quantizes a float tensor with a fixed
:class:`~qnorm.qformat.QFormat` or a calibrated per-tensor scale, or takes a Brevitas
``IntQuantTensor``'s own integers, into a :class:`QuantizedInput`: int64 integers,
their format, the dequantized value and the straight-through mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from qnorm.extras import install_hint
from qnorm.nn import jitchain
from qnorm.nn.sync import all_reduce_max, distributed
from qnorm.qformat import QFormat

COMPUTE_DTYPE = torch.int64
# Float dtypes whose CPU tensors the quantizer hands to numpy (its own dtype of each).
NUMPY_FLOATS = {torch.float32: np.float32, torch.float64: np.float64}


def power_of_two_ceil(scale: float) -> float:
    """The smallest power of two >= ``scale`` (> 0), exactly (``frexp``/``ldexp``, no log)."""
    mantissa, exponent = math.frexp(scale)
    return scale if mantissa == 0.5 else math.ldexp(1.0, exponent)


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
    finite_extremes(x, name)


def finite_extremes(x: torch.Tensor, name: str = "input") -> tuple[float, float] | None:
    """:func:`check_finite_float`, returning the extremes it checked (None for an empty tensor).

    ``aminmax`` propagates NaN, and every value lies between the extremes, so they are
    finite exactly when all values are: one fused reduction, several times cheaper on
    the CPU than ``isfinite(x).all()`` (which materializes a mask first), and the
    calibration's max |x| is ``max(-lo, hi)`` of the same two values.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a float torch.Tensor or a Brevitas IntQuantTensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor (or a Brevitas IntQuantTensor), got dtype {x.dtype}")
    if x.numel() == 0:
        return None
    lo_t, hi_t = torch.aminmax(x.detach())
    lo, hi = float(lo_t), float(hi_t)  # exact: every float dtype widens to a Python float
    if -math.inf < lo and hi < math.inf:  # False for NaN too: the failure is named below
        return lo, hi
    if torch.isnan(x).any():
        raise ValueError(f"{name} contains NaN; NaN has no fixed-point value")
    raise ValueError(f"{name} contains Inf; Inf has no fixed-point value")


def quantize_float(x: torch.Tensor, fmt: QFormat, peak: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`QFormat.quantize` (round half up, saturate) of a torch tensor, and the STE mask.

    The spec's own quantizer on the float64 tensor (torch operations on the input's
    device, the same float64 steps as on numpy, so the same integers), and
    :meth:`QFormat.in_range`: True where ``x / scale`` was not clipped.  A float32 or
    float64 tensor on the CPU runs on its numpy view: on a few thousand values each
    numpy step costs a few microseconds where a torch call (a comparison, a dtype
    conversion) costs tens.  ``peak``: max |x|, when the caller has already found
    every value finite (:func:`finite_extremes`); then the spec's per-element
    finiteness count is skipped.
    """
    # t = x / scale is monotone in |x|, so every |t| <= peak / scale (the same IEEE division)
    finite = peak is not None and math.isfinite(peak / fmt.scale)
    if x.device.type == "cpu" and x.dtype in NUMPY_FLOATS:
        ints, inside = fmt.quantize_with_mask(x.detach().numpy(), finite=finite)
        return torch.from_numpy(ints), torch.from_numpy(inside)
    return fmt.quantize_with_mask(x.detach().to(torch.float64), finite=finite)


def exact_float(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values.to(dtype)`` for integers or booleans: on the CPU numpy's conversion, the
    same IEEE round-to-nearest at a fraction of a torch call's cost on a QAT batch."""
    if values.device.type == "cpu" and dtype in NUMPY_FLOATS:
        return torch.from_numpy(values.numpy().astype(NUMPY_FLOATS[dtype]))
    return values.to(dtype)


def exact_scaled(ints: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``ints.to(dtype) * scale`` as torch forms it (the scale in ``dtype``, one IEEE
    multiply); on the CPU in numpy, in place, at a fraction of two torch calls' cost."""
    if ints.device.type == "cpu" and dtype in NUMPY_FLOATS:
        out = ints.numpy().astype(NUMPY_FLOATS[dtype])
        out *= NUMPY_FLOATS[dtype](scale)
        return torch.from_numpy(out)
    return ints.to(dtype) * scale


def quantized_input(x: torch.Tensor, fmt: QFormat, peak: float | None) -> QuantizedInput:
    """Float ``x`` (every value finite, max |x| = ``peak``; None when empty) quantized to
    ``fmt``: :func:`quantize_float`'s integers and mask, and ``ints · scale`` in ``x``'s dtype.

    A CPU float32/float64 tensor whose every ``x / scale`` is finite takes one compiled
    pass where the ``fast`` extra is installed (:func:`qnorm.nn.jitchain.quantize`, the
    same steps per element: tested equal); otherwise quantize_float, which also names
    an ``x / scale`` that overflows.
    """
    if x.device.type == "cpu" and x.dtype in NUMPY_FLOATS and peak is not None and math.isfinite(peak / fmt.scale):
        fused = jitchain.quantize(x.detach().numpy(), fmt.scale, fmt.lo, fmt.hi)
        if fused is not None:
            ints, dequant, mask = (torch.from_numpy(a) for a in fused)
            return QuantizedInput(ints, fmt, x, dequant, mask)
    ints, inside = quantize_float(x, fmt, peak)
    return QuantizedInput(ints, fmt, x, exact_scaled(ints, x.dtype, fmt.scale), exact_float(inside, x.dtype))


def int_quant_tensor_type() -> type:
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
    if not isinstance(qt, int_quant_tensor_type()):
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

    **The format follows the range with a dead band.**  The format is made from
    ``format_max_abs``, which takes the running range's value only when that moves
    more than ``tolerance`` (relative, default 1/32) away from it; within the band
    the scale, and so the golden op, stay as they are.  A layer re-derives its
    golden op exactly in every forward whose format or parameters changed, and the
    format's part of that (the range analysis of the new ε in input units) is its
    largest cost: with momentum 0.1 the running range moves ~0.4 % per step, so
    following it every step re-derives every step, while the band re-derives the
    format every ~25 steps (digits transformer).  The format's range is then at most
    ``tolerance`` off the running one: up to 3 % of the integer range unused, or
    values up to 3 % beyond it saturated.  ``tolerance = 0`` follows every step.
    A state dict saved before the band existed (version 1) has no
    ``format_max_abs``: it is the running range, the format that state used.

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
    format_max_abs: torch.Tensor
    max_jump: float = 2.0**10
    _version = 2  # 2: format_max_abs (the dead band); a version-1 state's format is its running range

    def __init__(
        self,
        fmt: QFormat | None = None,
        *,
        bits: int = 8,
        signed: bool = True,
        momentum: float = 0.1,
        pow2: bool = False,
        tolerance: float = 1 / 32,
    ) -> None:
        super().__init__()
        if fmt is not None and not isinstance(fmt, QFormat):
            raise ValueError(f"fmt must be a QFormat or None, got {type(fmt).__name__}")
        if not 0.0 < momentum <= 1.0:
            raise ValueError(f"momentum must be in (0, 1], got {momentum!r}")
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0.0 <= tolerance < 1.0:
            raise ValueError(f"tolerance must be a number in [0, 1), got {tolerance!r}")
        self.fixed = fmt
        self.bits, self.signed = (fmt.bits, fmt.signed) if fmt is not None else (bits, signed)
        self.hi = QFormat(self.bits, 1.0, self.signed).hi  # also validates bits
        self.momentum = momentum
        self.pow2 = bool(pow2)
        self.tolerance = float(tolerance)
        self.register_buffer("running_max_abs", torch.zeros((), dtype=torch.float64))
        self.register_buffer("format_max_abs", torch.zeros((), dtype=torch.float64))
        self._qt_fmt: QFormat | None = None
        self.sync_stats, self.process_group = True, None  # see the class docstring

    @property
    def fmt(self) -> QFormat | None:
        """The current input format: fixed, else the last IntQuantTensor's, else calibrated."""
        if self.fixed is not None:
            return self.fixed
        if self._qt_fmt is not None:
            return self._qt_fmt
        peak = float(self.format_max_abs)
        if peak <= 0:
            return None
        key = (peak, self.bits, self.signed, self.pow2)
        made = self.__dict__.get("_made_fmt")
        if made is not None and made[0] == key:  # the dead band holds a range for many steps
            return made[1]
        scale = peak / self.hi
        fmt = QFormat(self.bits, power_of_two_ceil(scale) if self.pow2 else scale, self.signed)
        self.__dict__["_made_fmt"] = (key, fmt)  # past Module.__setattr__: no parameter or buffer
        return fmt

    # Host logic (Python floats from the batch's extremes, the calibration, the format, numba):
    # one opaque call under torch.compile.  Traced, Dynamo specialized on each batch's max |x|
    # (a recompile per batch, up to its limit), and a layer calibrating under torch.compile
    # found no format after its first batch's calibration.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor | Any) -> QuantizedInput:
        if is_quant_tensor(x):
            q = from_quant_tensor(x)
            if self.fixed is not None and q.fmt != self.fixed:
                raise ValueError(
                    f"IntQuantTensor format {q.fmt} differs from this layer's fixed input format {self.fixed}"
                )
            self._qt_fmt = q.fmt if self.fixed is None else None
            return q
        extremes = finite_extremes(x)
        peak = None if extremes is None else max(-extremes[0], extremes[1])
        if self._qt_fmt is not None:
            self._qt_fmt = None
        if self.training and self.fixed is None:
            self._calibrate_on(x, 0.0 if peak is None else peak)
        fmt = self.fmt
        if fmt is None:
            raise ValueError(
                "the input quantizer is not calibrated: run training batches with non-zero input "
                "first, or give the layer a fixed in_fmt"
            )
        return quantized_input(x, fmt, peak)

    def set_range(self, max_abs: float) -> None:
        """Set the calibrated range: the running max |x| and the format's, both ``max_abs``
        (a write to ``running_max_abs`` alone moves the format only once the next training
        batch takes the running range out of the dead band)."""
        if not (isinstance(max_abs, (int, float)) and math.isfinite(max_abs) and max_abs >= 0):
            raise ValueError(f"max_abs must be a finite number >= 0, got {max_abs!r}")
        self.running_max_abs.fill_(max_abs)
        self.format_max_abs.fill_(max_abs)

    def _calibrate_on(self, x: torch.Tensor, peak: float) -> None:
        """Update the calibration with the batch max |x| (``peak``, from the finiteness
        check's extremes), the max over all ranks under torch.distributed."""
        sync = self.sync_stats and distributed()
        if not (x.numel() or sync):
            return
        if sync:  # every rank joins the reduction (an empty shard with 0), so none waits forever
            peak = float(all_reduce_max(x.new_tensor(peak, dtype=torch.float64), self.process_group))
        self._calibrate(peak)

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
        held = float(self.format_max_abs)
        if held == 0.0 or abs(new - held) > self.tolerance * held:
            self.format_max_abs.fill_(new)

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any], *args: Any
    ) -> None:
        """A version-1 state (no dead band) made its format from the running range: so does its copy."""
        running, held = prefix + "running_max_abs", prefix + "format_max_abs"
        if local_metadata.get("version", 1) < 2 and running in state_dict and held not in state_dict:
            state_dict[held] = state_dict[running].clone()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)

    def extra_repr(self) -> str:
        if self.fixed is not None:
            return f"fmt={self.fixed}"
        pow2 = ", power-of-two scale" if self.pow2 else ""
        band = f", tolerance={self.tolerance:g}"
        return f"bits={self.bits}, signed={self.signed}, calibrated (momentum={self.momentum}{band}{pow2})"
