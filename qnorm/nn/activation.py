"""Integer GELU and SiLU layers for QAT: bit-exact integer forward, float-derivative backward.

:class:`IntGELU` and :class:`IntSiLU` are the trainable forms of the golden ops of
the same names in :mod:`qnorm.ops.activation`, drop-in replacements for
``nn.GELU()`` / ``nn.SiLU()`` on any input shape (they are elementwise).

**Forward** (the recipe of :mod:`qnorm.nn._qat`): the input is quantized (a fixed
``in_fmt``, a per-tensor scale calibrated in training, or a Brevitas
``IntQuantTensor``'s own integers), the golden op of that input format runs its
own integer body on int64 tensors (its table gather, or its segment quadratic),
and the output is ``golden_ints * out_fmt.scale`` in the input's float dtype,
exactly.  The op has no trainable parameter, so it is built once per input format.

**Backward**: a straight-through estimator of the float activation: the gradient
is the derivative of ``F.gelu`` (erf form) / ``F.silu`` at the dequantized input,
zero where the float output lies outside the output format (saturation), and the
input quantizer passes it only where it did not clip.  The rounding to the output
grid and the table / segment approximation are ignored by the gradient.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from qnorm import fixedpoint as fp
from qnorm.fixedpoint import DEFAULT_ROUND, Round
from qnorm.nn.base import QATModule, require_qformat
from qnorm.nn.quantizer import InputQuantizer, QuantizedInput
from qnorm.nn.surrogate import Output, Surrogate, clip_surrogate
from qnorm.ops import activation as ops
from qnorm.qformat import QFormat

DEFAULT_OUT = QFormat.power_of_two(8, -4)  # int8 over [-8, 8): GELU/SiLU of normalized inputs


# Under torch.compile the op is looked up, not traced: Dynamo would trace past the
# ops layer's cache into the derivation (and warn that it skips the cache).
@torch.compiler.disable
def _op(
    op_cls: type[ops.IntActivation], in_fmt: QFormat, out_fmt: QFormat, rounding: Round, algorithm: str | None
) -> ops.IntActivation:
    return op_cls.of(in_fmt, out_fmt, rounding, algorithm)


class IntActivation(QATModule):
    """What the activation layers share; a subclass names its golden op and float op."""

    channel_dim = -1  # elementwise: no channel axis; the golden op takes any shape
    min_ndim = 0
    op_cls: ClassVar[type[ops.IntActivation]]

    def __init__(
        self,
        *,
        out_fmt: QFormat = DEFAULT_OUT,
        in_fmt: QFormat | None = None,
        in_bits: int = 8,
        momentum: float = 0.1,
        pow2: bool = False,
        rounding: Round | str = DEFAULT_ROUND,
        algorithm: str | None = None,
        return_quant_tensor: bool = False,
    ) -> None:
        require_qformat(out_fmt)
        quant = InputQuantizer(in_fmt, bits=in_bits, momentum=momentum, pow2=pow2)
        super().__init__(1, quant, return_quant_tensor)  # channels: unused by an elementwise layer
        self.out_fmt = out_fmt
        self.rounding = Round.parse(rounding)
        self.algorithm = algorithm
        if in_fmt is not None:  # a fixed format is proven (and its op built) now, not at the first forward
            self.golden()

    def golden(self, in_fmt: QFormat | None = None) -> ops.IntActivation:
        """The golden op for the input format (default: the quantizer's current one)."""
        return _op(self.op_cls, self.input_format(in_fmt), self.out_fmt, self.rounding, self.algorithm)

    def quantize_input(self, x: torch.Tensor | Any) -> QuantizedInput:
        return self.input_quant(x)  # any shape: there is no channel axis to check

    def forward(self, x: torch.Tensor | Any) -> Output:
        """``golden(fmt).forward(x_int) * out_fmt.scale`` exactly; the float derivative backward.

        The body runs inside :func:`qnorm.fixedpoint.proven_ranges`: the op's range
        analysis covered every code of ``q.fmt`` and the quantizer saturates into it.
        """
        q = self.quantize_input(x)
        op = self.golden(q.fmt)
        with fp.proven_ranges():
            ints = op._forward(q.ints, None)  # elementwise: no axis to move
        return self.finish(q, ints, op.out_fmt, self._surrogate(), ())

    def float_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The unquantized float activation."""
        return self._float_op(x)

    def _surrogate(self) -> Surrogate:
        lo, hi = self.out_fmt.real_range
        return lambda xd: clip_surrogate(self._float_op(xd), lo, hi)

    @abc.abstractmethod
    def _float_op(self, x: torch.Tensor) -> torch.Tensor:
        """The float activation (the surrogate before the output clip)."""

    def _constants(self, op: ops.IntActivation) -> dict[str, Any]:
        consts: dict[str, Any] = {"algorithm": op.algorithm, "rounding": op.cfg.rounding, **op.tables}
        if op.segments is not None:
            consts.update(segment_bits=op.segments.bits, frac_bits=ops.FRAC_BITS)
        return consts

    def _config_metadata(self) -> dict[str, Any]:
        return {"rounding": self.rounding.value, "algorithm": self.algorithm}

    def extra_repr(self) -> str:
        return f"out_fmt={self.out_fmt}, rounding={self.rounding.value}"


class IntGELU(IntActivation):
    """Integer GELU (exact erf form); surrogate ``F.gelu``."""

    op_cls = ops.IntGELU

    def _float_op(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)


class IntSiLU(IntActivation):
    """Integer SiLU; surrogate ``F.silu``."""

    op_cls = ops.IntSiLU

    def _float_op(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)
