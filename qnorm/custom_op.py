"""The ``qnorm.custom_op`` QONNX domain: executors of the nodes qnorm's QONNX export writes.

qonnx finds a custom node's executor by importing the node's domain as a Python
module (``qonnx.custom_op.registry``), so the domain ``qnorm.custom_op`` is this
module and ``qonnx.core.onnx_exec.execute_onnx`` runs its nodes with these classes:

* ``Quantize``: ``QFormat(bits, scale, signed).quantize(x, rounding)``, the QAT
  layers' input quantizer (half up, ties toward +inf, saturating), integers out in
  the input's float tensor type.
* ``IntLayerNorm``, ``L1LayerNorm``, ``ShiftLayerNorm``, ``IntRMSNorm``: the golden
  op rebuilt from the node's attributes (its integer config,
  :mod:`qnorm.export.attributes`), then ``op.forward`` on the integer input.  So a
  node means exactly the golden integers.

Importing this module needs qonnx (the ``qonnx`` extra).
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np
import onnx
from onnx import helper
from qonnx.core.datatype import DataType
from qonnx.custom_op.base import CustomOp

from qnorm import ops
from qnorm.export.attributes import (
    datatype_name,
    fmt_attribute_types,
    fmt_from_attributes,
    norm_attribute_types,
    norm_from_attributes,
)
from qnorm.fixedpoint import DEFAULT_ROUND
from qnorm.ops._normcore import NormOp
from qnorm.qformat import QFormat


def _integers(x: np.ndarray, node: onnx.NodeProto) -> np.ndarray:
    """The input as int64, refused unless every value is an integer."""
    ints = x.astype(np.int64)
    if not np.array_equal(ints, x):
        raise ValueError(f"{node.op_type} node {node.name!r}: input {node.input[0]!r} holds non-integer values")
    return ints


class _QnormOp(CustomOp):
    """Shape-preserving single-input nodes; subclasses compute and type the output."""

    def make_shape_compatible_op(self, model: Any) -> onnx.NodeProto:
        node = self.onnx_node
        return helper.make_node("Identity", [node.input[0]], [node.output[0]])

    def infer_node_datatype(self, model: Any) -> None:
        model.set_tensor_datatype(self.onnx_node.output[0], DataType[datatype_name(self.out_fmt())])

    @abc.abstractmethod
    def out_fmt(self) -> QFormat:
        """The integer format of the output (decoded from the attributes)."""

    def attribute_values(self) -> dict[str, Any]:
        return {name: self.get_nodeattr(name) for name in self.get_nodeattr_types()}

    def verify_node(self) -> list[str]:
        """qonnx's node check: every required attribute is there and they decode into a valid op."""
        op_type, present = self.onnx_node.op_type, {a.name for a in self.onnx_node.attribute}
        missing = sorted(name for name, (_, required, *_) in self.get_nodeattr_types().items()
                         if required and name not in present)  # fmt: skip
        if missing:
            return [f"{op_type}: missing attributes {missing}"]
        try:
            self.out_fmt()
        except ValueError as err:
            return [f"{op_type}: invalid attributes: {err}"]
        return [f"{op_type}: attributes valid"]


class Quantize(_QnormOp):
    """``QFormat.quantize``: round ``x / scale`` (half up by default) and saturate to the word."""

    def get_nodeattr_types(self) -> dict[str, tuple[str, bool, Any]]:
        return {**fmt_attribute_types(""), "rounding": ("s", False, DEFAULT_ROUND.value)}

    def out_fmt(self) -> QFormat:
        return fmt_from_attributes("", self.attribute_values())

    def execute_node(self, context: dict[str, np.ndarray], graph: Any) -> None:
        node = self.onnx_node
        x = context[node.input[0]]
        context[node.output[0]] = self.out_fmt().quantize(x, self.get_nodeattr("rounding")).astype(x.dtype)


class _Norm(_QnormOp):
    """A golden norm op on the integers of its input (last axis normalized)."""

    op_cls: type[NormOp]

    def get_nodeattr_types(self) -> dict[str, tuple[str, bool, Any]]:
        return norm_attribute_types(self.op_cls)

    def golden(self) -> NormOp:
        return norm_from_attributes(self.op_cls, self.attribute_values())

    def out_fmt(self) -> QFormat:
        return self.golden().out_fmt

    def execute_node(self, context: dict[str, np.ndarray], graph: Any) -> None:
        node = self.onnx_node
        x = context[node.input[0]]
        context[node.output[0]] = self.golden().forward(_integers(x, node)).astype(x.dtype)


class IntLayerNorm(_Norm):
    op_cls = ops.IntLayerNorm


class L1LayerNorm(_Norm):
    op_cls = ops.L1LayerNorm


class ShiftLayerNorm(_Norm):
    op_cls = ops.ShiftLayerNorm


class IntRMSNorm(_Norm):
    op_cls = ops.IntRMSNorm


__all__ = ["IntLayerNorm", "IntRMSNorm", "L1LayerNorm", "Quantize", "ShiftLayerNorm"]
