"""BatchNorm + uniform quantized activation, trained with the exact integer forward.

:class:`BNQuantAct` is the QAT form of :class:`~qnorm.ops.multithreshold.BNQuant`:
per channel (dim 1 of ``(B, C, *spatial)``),

    q = clamp(round((gamma (x - mu) / sqrt(var + eps) + beta) / s_out), q_lo, q_hi)

evaluated exactly in integers (the golden op's body on int64 tensors) with mu/var the
batch statistics of the quantized input in training (of the global batch under
torch.distributed) and the running statistics in eval.  Backward: float BN (batch statistics in training, as torch BN) followed by the
clipped identity, i.e. a straight-through estimator for the rounding that passes the
gradient where ``q_lo s_out <= BN(x) <= q_hi s_out`` and zeroes it where the
activation saturates.  Under torch.distributed the float BN's batch statistics
span the ranks too (:func:`~qnorm.nn.sync.synced_batch_norm`).

:meth:`BNQuantAct.fold` gives :class:`MultiThresholdAct`, the FINN-style
multi-threshold unit (:class:`~qnorm.ops.multithreshold.MultiThreshold`) with
identical outputs.
"""

from __future__ import annotations

from typing import Any

import torch

from qnorm.fixedpoint import DEFAULT_ROUND, Round
from qnorm.nn.base import IntInference, require_qformat, to_op_layout
from qnorm.nn.batchnorm import BatchStats, BNQATModule, rational_bn_constants
from qnorm.nn.quantizer import InputQuantizer
from qnorm.nn.surrogate import Output, clip_surrogate
from qnorm.ops.base import IntOp
from qnorm.ops.bnfold import FloatBN
from qnorm.ops.multithreshold import BNActConfig, BNQuant, MultiThreshold
from qnorm.qformat import QFormat

DEFAULT_OUT = QFormat(4, 0.25, signed=False)  # a 16-level quantized ReLU on [0, 3.75]


class BNQuantAct(BNQATModule):
    """BN + quantized activation with a bit-exact integer forward (see the module docstring).

    ``out_fmt``: the activation format (its word range is the level range, e.g. 4-bit
    unsigned = a quantized ReLU with 16 levels).  ``in_fmt``: a fixed input format, or
    None to calibrate an ``in_bits`` (un)signed per-tensor scale in training
    (:class:`~qnorm.nn.quantizer.InputQuantizer`; a power of two with ``pow2``).  ``rounding``: the tie rule of the
    activation (half up by default).  Output: float ``level * s_out``, or an
    IntQuantTensor with ``return_quant_tensor=True``.
    """

    channel_dim = 1
    min_ndim = 2

    def __init__(
        self,
        channels: int,
        out_fmt: QFormat = DEFAULT_OUT,
        *,
        in_fmt: QFormat | None = None,
        in_bits: int = 8,
        in_signed: bool = True,
        rounding: Round | str = DEFAULT_ROUND,
        eps: float = 1e-5,
        momentum: float = 0.1,
        pow2: bool = False,
        gamma_bits: int = 16,
        frac_bits: int = 8,
        out_frac_bits: int = 8,
        return_quant_tensor: bool = False,
    ) -> None:
        require_qformat(out_fmt)
        quant = InputQuantizer(in_fmt, bits=in_bits, signed=in_signed, momentum=momentum, pow2=pow2)
        super().__init__(
            channels, quant, return_quant_tensor, eps=eps, momentum=momentum,
            gamma_bits=gamma_bits, frac_bits=frac_bits, out_frac_bits=out_frac_bits,
        )  # fmt: skip
        self.out_fmt = out_fmt
        self.rounding = Round.parse(rounding)

    def golden(self, in_fmt: QFormat | None = None, stats: BatchStats | None = None) -> BNQuant:
        """The golden op for the current gamma/beta and ``stats`` (default: running statistics).

        Same constants as ``BNQuant.from_float`` (the fast derivation is tested equal).
        """
        fmt = self.input_format(in_fmt)
        p = self.bn_params(stats if stats is not None else self.running_stats())
        bn = self.rational(p, fmt.scale, self.out_fmt.scale)
        return BNQuant.from_rational(BNActConfig(fmt, self.out_fmt, self.rounding), bn, FloatBN(**p))

    def forward(self, x: torch.Tensor | Any) -> Output:
        q = self.quantize_input(x)
        stats = None
        if self.training:
            stats = self.training_stats(to_op_layout(q.ints, self.channel_dim), q.fmt.scale)
            self.update_running_stats(stats)
        op = self.golden(q.fmt, stats)
        running, sync = self.frozen_running(), self.syncing()
        lo, hi = self.out_fmt.real_range

        def surrogate(xd: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return clip_surrogate(self.surrogate_bn(xd, w, b, running, sync), lo, hi)

        return self.finish(q, self.run_golden(op, q.ints), self.out_fmt, surrogate, (self.weight, self.bias))

    def fold(self) -> MultiThresholdAct:
        """The equivalent multi-threshold unit for the eval-mode (running statistics) op."""
        return MultiThresholdAct(self.golden().fold(), self.channels, self.return_quant_tensor)

    def _constants(self, op: IntOp) -> dict[str, Any]:
        return {**rational_bn_constants(op.bn), "rounding": op.cfg.mode}

    def _config_metadata(self) -> dict[str, Any]:
        return {**super()._config_metadata(), "rounding": self.rounding.value}

    def extra_repr(self) -> str:
        return f"{self.channels}, out_fmt={self.out_fmt}, rounding={self.rounding.value}"


class MultiThresholdAct(IntInference):
    """Folded BN + quantized activation: ``q = q_lo + #{j : x crosses t_j}`` per channel.

    Inference only; input ``(B, C, *spatial)`` float (quantized with the fixed input
    format the thresholds were derived for) or an IntQuantTensor of that format.
    """

    channel_dim = 1
    min_ndim = 2
    op: MultiThreshold

    @property
    def thresholds(self) -> torch.Tensor:
        """Integer thresholds, shape ``(C, levels - 1)``."""
        return torch.from_numpy(self.op.thresholds)

    def _constants(self, op: IntOp) -> dict[str, Any]:
        return {"thresholds": op.thresholds, "negative": op.negative, "rounding": op.cfg.mode}
