"""The module bases of the QAT layers and what deriving and describing a golden op needs.

:class:`IntModule` (layout, shape check, the golden op's body on int64 tensors,
``qnorm_metadata``), :class:`QATModule` (a trainable layer: exact forward,
surrogate backward) and :class:`IntInference` (a frozen golden op: what ``fold()``
returns); the helpers turning parameters into the golden op's float64 inputs and
its constants into JSON.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from qnorm.fixedpoint import Round
from qnorm.nn.quantizer import COMPUTE_DTYPE, InputQuantizer, QuantizedInput
from qnorm.nn.surrogate import Output, Surrogate, exact_forward, to_output
from qnorm.ops.base import IntOp
from qnorm.qformat import QFormat


def param_array(p: torch.Tensor) -> np.ndarray:
    """A parameter or buffer as a float64 numpy array of its own (exact: float32 -> float64
    widens); a CPU float32/float64 tensor through its numpy view (one torch call fewer)."""
    t = p.detach()
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64):
        return t.numpy().astype(np.float64)
    return t.to("cpu", torch.float64).numpy()


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


def require_qformat(out_fmt: object) -> None:
    """Refuse an output format that is not a :class:`QFormat` (a float scale or bit width
    passed by mistake would otherwise fail later, far from the call)."""
    if not isinstance(out_fmt, QFormat):
        raise ValueError(f"out_fmt must be a QFormat, got {type(out_fmt).__name__}")


def to_op_layout(t: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """Golden ops take their parameter axis last: move the layer's channel axis there."""
    return t.movedim(channel_dim, -1)


def from_op_layout(t: torch.Tensor, channel_dim: int) -> torch.Tensor:
    return t.movedim(-1, channel_dim)


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
    """A trainable layer: exact integer forward, surrogate backward (the recipe in :mod:`qnorm.nn._qat`).

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
