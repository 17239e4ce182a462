"""The ONNX nodes that replace one exported qnorm layer, with unique names and shapes.

Every tensor between nodes is float32 (what QONNX graphs and their executors use),
holding integers wherever the golden op has integers.  float32 holds every integer
of magnitude <= 2^24 exactly, and a sum, difference or product whose exact result is
such an integer is computed exactly, in any runtime.  The lowering refuses widths
past that (:func:`check_width`) instead of exporting a graph that could round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qnorm.qformat import QFormat

MAX_EXACT_BITS = 24  # float32 integers: |v| <= 2^24


def check_width(where: str, what: str, bits: int) -> None:
    """Refuse an integer word wider than float32 tensors hold exactly."""
    if bits > MAX_EXACT_BITS:
        raise ValueError(
            f"{where}: {what} is {bits} bits wide; QONNX tensors are float32, exact for integers of at "
            f"most {MAX_EXACT_BITS} bits"
        )


def float32_scale(where: str, fmt: QFormat) -> np.ndarray:
    """The format's scale as a float32 constant, refused unless float32 holds it exactly.

    The QAT layers multiply their integers by the scale in float32; a scale that float32
    rounds would give a runtime-dependent last bit.
    """
    value = np.float32(fmt.scale)
    if float(value) != fmt.scale:
        raise ValueError(
            f"{where}: output scale {fmt.scale!r} is not a float32 value; the exported graph computes in float32"
        )
    return np.asarray(value)


class LayerGraph:
    """Nodes, initializers and value infos of one layer's expansion.

    Names are ``<prefix>/<local>``, the prefix being the layer's qualified name in the
    model, so they are unique in the graph and say where a node comes from.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix or "model"
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self._consts: dict[str, np.ndarray] = {}

    def name(self, local: str) -> str:
        return f"{self.prefix}/{local}"

    def const(self, local: str, value: np.ndarray) -> str:
        """An initializer holding ``value`` (dtype kept); its name.  Asking again for the
        same name with the same value reuses it (per-step code asks once per step)."""
        name, value = self.name(local), np.asarray(value)
        known = self._consts.get(name)
        if known is not None:
            if known.dtype != value.dtype or not np.array_equal(known, value):
                raise ValueError(f"constant {name} defined twice with different values")
            return name
        self._consts[name] = value
        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def node(
        self,
        op_type: str,
        inputs: Sequence[str],
        local: str,
        shape: Sequence[int],
        *,
        domain: str = "",
        output: str | None = None,
        elem_type: int = TensorProto.FLOAT,
        **attrs: Any,
    ) -> str:
        """Append one single-output node; its output name.

        ``output`` names an existing tensor (the layer's output, whose value info the
        exporter already wrote); otherwise the output is new and gets a value info of
        ``shape`` and ``elem_type``.  numpy array attributes become TENSOR attributes.
        """
        out = output if output is not None else self.name(local)
        converted = {k: numpy_helper.from_array(v) if isinstance(v, np.ndarray) else v for k, v in attrs.items()}
        node = helper.make_node(op_type, list(inputs), [out], name=self.name(local), domain=domain, **converted)
        self.nodes.append(node)
        if output is None:
            self.value_info.append(helper.make_tensor_value_info(out, elem_type, list(shape)))
        return out
