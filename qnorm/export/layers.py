"""qnorm norm layers and folded BN + quantized activations as QONNX nodes.

Each layer becomes: ``Quantize`` (the layer's input quantizer: ``QFormat.quantize``,
half up, saturating; a ``qnorm.custom_op`` node, because QONNX's ``Quant`` has no
half-up-toward-+inf rounding) -> the integer op -> ``Mul`` by the output scale.

* A norm's integer op is one ``qnorm.custom_op`` node named like the golden op
  (``IntLayerNorm``, ``L1LayerNorm``, ``ShiftLayerNorm``, ``IntRMSNorm``) whose
  attributes are the op's integer config (:mod:`qnorm.export.attributes`).
* A folded BN + quantized activation is QONNX's ``MultiThreshold`` (see
  :func:`multithreshold`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from qnorm.export.attributes import datatype_name, fmt_attributes, norm_attributes
from qnorm.export.graph import LayerGraph, check_width, float32_scale
from qnorm.fixedpoint import DEFAULT_ROUND
from qnorm.nn.bnact import MultiThresholdAct
from qnorm.nn.norms import IntNorm
from qnorm.qformat import QFormat

DOMAIN = "qnorm.custom_op"
QONNX_DOMAIN = "qonnx.custom_op.general"
_SPATIAL = "DHW"  # layout letters of up to three spatial axes after N, C


def quantize(g: LayerGraph, x: str, fmt: QFormat, shape: Sequence[int]) -> str:
    """The integers of ``x`` in ``fmt`` (float32 tensor), as the QAT layer's input quantizer makes them."""
    check_width(g.prefix, "the input format", fmt.bits)
    return g.node("Quantize", [x], "quantize", shape, domain=DOMAIN, rounding=DEFAULT_ROUND.value,
                  **fmt_attributes("", fmt))  # fmt: skip


def dequantize(g: LayerGraph, ints: str, fmt: QFormat, y: str) -> None:
    """``y = ints * scale``: the QAT layer's float output."""
    check_width(g.prefix, "the output format", fmt.bits)
    g.node("Mul", [ints, g.const("out_scale", float32_scale(g.prefix, fmt))], "dequantize", (), output=y)


def data_layout(rank: int) -> str:
    """QONNX's layout string of a (N, C, *spatial) tensor: where MultiThreshold finds the channels."""
    if not 2 <= rank <= 2 + len(_SPATIAL):
        raise ValueError(f"MultiThreshold inputs are (N, C, *spatial) with up to 3 spatial axes, got rank {rank}")
    return "NC" + _SPATIAL[len(_SPATIAL) - (rank - 2):]


def multithreshold(
    g: LayerGraph,
    x: str,
    shape: Sequence[int],
    thresholds: np.ndarray,
    negative: np.ndarray,
    local: str,
    **attrs: Any,
) -> str:
    """QONNX ``MultiThreshold`` on integer ``x`` (N, C, ...) meaning the golden count exactly.

    The golden op counts ``x >= t`` per channel, and ``x <= t`` on the ``negative``
    (gamma < 0) channels; MultiThreshold only counts ``>=``.  For integers
    ``x <= t  <=>  -x >= -t`` exactly (no strict/non-strict change, so nothing moves
    on the grid), so the negative channels' input is multiplied by -1 (a per-channel
    +-1 ``Mul``) and their thresholds negated.  The negated input needs one bit more
    than x (int8 -128 becomes 128): float32 holds it, and qonnx's datatype inference
    types a ``Mul`` output as a 32-bit integer.  gamma = 0 channels need nothing: their
    thresholds sit at the ends of the input range (always / never crossed).
    """
    if negative.any():
        sign = np.where(negative, -1.0, 1.0).astype(np.float32).reshape((-1,) + (1,) * (len(shape) - 2))
        x = g.node("Mul", [x, g.const(f"{local}_sign", sign)], f"{local}_negate", shape)
        thresholds = np.where(negative[:, None], -thresholds, thresholds)
    t = g.const(f"{local}_thresholds", thresholds.astype(np.float32))
    layout = data_layout(len(shape))
    return g.node("MultiThreshold", [x, t], local, shape, domain=QONNX_DOMAIN, data_layout=layout, **attrs)


def lower_norm(layer: IntNorm, g: LayerGraph, x: str, y: str, shape: Sequence[int]) -> None:
    """Quantize -> ``qnorm.custom_op::<golden op>`` -> Mul(out scale)."""
    op = layer.golden()
    ints = quantize(g, x, op.in_fmt, shape)
    ints = g.node(type(op).__name__, [ints], "normalize", shape, domain=DOMAIN, **norm_attributes(op))
    dequantize(g, ints, op.out_fmt, y)


def lower_multithreshold(layer: MultiThresholdAct, g: LayerGraph, x: str, y: str, shape: Sequence[int]) -> None:
    """Quantize -> (sign) -> MultiThreshold (level = q_lo + count) -> Mul(out scale), channels on axis 1."""
    op = layer.golden()
    if op.bn.shape != (layer.channels,):
        raise ValueError(f"{g.prefix}: per-neuron thresholds {op.bn.shape} have no MultiThreshold form; "
                         "per-channel ones do")  # fmt: skip
    ints = quantize(g, x, op.in_fmt, shape)
    levels = multithreshold(
        g, ints, shape, op.thresholds, op.negative, "multithreshold",
        out_dtype=datatype_name(op.out_fmt), out_scale=1.0, out_bias=float(op.out_fmt.lo),
    )  # fmt: skip
    dequantize(g, levels, op.out_fmt, y)
