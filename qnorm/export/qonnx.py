"""Export a trained qnorm model to QONNX, node for node what the QAT model computes.

* **Brevitas layers** (``QuantIdentity``, ``QuantLinear``, ``QuantConv2d``, their
  weight, bias and activation quantizers): QONNX ``Quant`` nodes before
  ``MatMul`` / ``Gemm`` / ``Conv``, written by Brevitas' own QONNX export
  (``brevitas.export.export_qonnx``, torch.export based).
* **qnorm norms** (IntLayerNorm, L1LayerNorm, ShiftLayerNorm, IntRMSNorm):
  ``Quantize`` -> one ``qnorm.custom_op`` node carrying the golden op's integer
  config -> ``Mul`` by the output scale (:mod:`qnorm.export.layers`).
* **BN + quantized activation** (``BNQuantAct``, folded first): ``Quantize`` ->
  QONNX ``MultiThreshold`` -> ``Mul``; gamma < 0 channels are negated before it
  (:func:`qnorm.export.layers.multithreshold`).
* **MPBN LIF neurons** (``MPBNLIF``, folded to integer thresholds first): the time
  loop unrolled, each step's firing one ``MultiThreshold`` (:mod:`qnorm.export.lif`).

How: every qnorm layer of a copy of the model is swapped for a placeholder that
exports as one opaque ``qnorm.export::Layer`` node; Brevitas exports the rest; each
placeholder node is then replaced by the layer's nodes.  The nodes of the
``qnorm.custom_op`` domain run with :mod:`qnorm.custom_op`, which qonnx finds by the
domain name.  Shapes are static (the example input's, batch included).
"""

from __future__ import annotations

import copy
import json
import logging
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import onnx
import torch
from onnx import helper
from torch import nn

from qnorm.export.graph import LayerGraph
from qnorm.export.layers import DOMAIN, QONNX_DOMAIN, lower_multithreshold, lower_norm
from qnorm.export.lif import lower_lif
from qnorm.nn import BNQATModule, FoldedMPBNLIF, IntModule, IntNorm, MultiThresholdAct

PLACEHOLDER_DOMAIN = "qnorm.export"
# The opset version written for a custom domain the graph does not import yet: every
# qnorm.custom_op node, the placeholder and qonnx's MultiThreshold are version 1.
CUSTOM_OPSET = 1

Lowering = Callable[[Any, LayerGraph, str, str, tuple[int, ...]], None]
_LOWERINGS: tuple[tuple[tuple[type, ...], Lowering], ...] = (
    ((IntNorm,), lower_norm),
    ((MultiThresholdAct,), lower_multithreshold),
    ((FoldedMPBNLIF,), lower_lif),
)


class _Placeholder(nn.Module):
    """One qnorm layer during the export: runs the layer, exports as one opaque node."""

    def __init__(self, name: str, layer: IntModule, index: int) -> None:
        super().__init__()
        self.name, self.index = name, index
        # A plain attribute, not a submodule: the export must not lift the layer's float
        # parameters, which the nodes that replace the placeholder do not use.
        object.__setattr__(self, "layer", layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.onnx.is_in_onnx_export():
            return torch.onnx.ops.symbolic(f"{PLACEHOLDER_DOMAIN}::Layer", (x,), {"index": self.index},
                                           dtype=x.dtype, shape=x.shape, version=CUSTOM_OPSET)  # fmt: skip
        return self.layer(x)


def _exported_layer(name: str, module: IntModule) -> IntModule:
    """The layer whose nodes are written: BN layers folded; refusals name the module."""
    where = name or "the model"
    if module.return_quant_tensor:
        raise ValueError(f"{where} ({type(module).__name__}) returns quant tensors; the export needs float outputs")
    try:
        layer = module.fold() if isinstance(module, BNQATModule) else module.eval()
        layer.golden()
    except ValueError as err:  # e.g. an input quantizer never calibrated
        raise ValueError(f"{where} ({type(module).__name__}): {err}") from err
    if not any(isinstance(layer, kinds) for kinds, _ in _LOWERINGS):
        raise ValueError(f"{where}: {type(module).__name__} has no QONNX form")
    return layer


def _with_placeholders(model: nn.Module) -> tuple[nn.Module, list[_Placeholder]]:
    """An eval-mode copy of ``model`` with every qnorm layer a placeholder (``model`` unchanged)."""
    copied = copy.deepcopy(model).eval()
    placeholders: list[_Placeholder] = []

    def swap(name: str, module: IntModule) -> _Placeholder:
        placeholders.append(_Placeholder(name, _exported_layer(name, module), len(placeholders)))
        return placeholders[-1]

    if isinstance(copied, IntModule):
        return swap("", copied), placeholders
    by_id: dict[int, _Placeholder] = {}  # a layer shared by two names stays one layer
    for name, module in list(copied.named_modules(remove_duplicate=False))[1:]:
        if isinstance(module, IntModule):  # qnorm layers hold no qnorm layers: no nesting to skip
            if id(module) not in by_id:
                by_id[id(module)] = swap(name, module)
            copied.set_submodule(name, by_id[id(module)])
    return copied, placeholders


@contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence the ONNX exporter's progress lines and notices (e.g. missing torchvision)."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _brevitas_export(model: nn.Module, example: torch.Tensor) -> onnx.ModelProto:
    with torch.no_grad(), _quiet_exporter():
        # Imported here, quietly: brevitas.export warns about optional kernels it lacks.
        from brevitas.export import export_qonnx

        return export_qonnx(model, example, dynamo=True, optimize=True, verbose=False)


def _static_shape(graph: onnx.GraphProto, name: str) -> tuple[int, ...]:
    for info in (*graph.value_info, *graph.input):
        if info.name == name:
            dims = info.type.tensor_type.shape.dim
            if all(d.HasField("dim_value") for d in dims):
                return tuple(d.dim_value for d in dims)
            break
    raise ValueError(f"the exported graph has no static shape for {name!r}")


def _lower(placeholder: _Placeholder, graph: onnx.GraphProto, node: onnx.NodeProto) -> LayerGraph:
    g = LayerGraph(placeholder.name)
    lowering = next(lower for kinds, lower in _LOWERINGS if isinstance(placeholder.layer, kinds))
    lowering(placeholder.layer, g, node.input[0], node.output[0], _static_shape(graph, node.input[0]))
    return g


def _expand(proto: onnx.ModelProto, placeholders: list[_Placeholder]) -> None:
    """Replace every placeholder node by its layer's nodes, in place (topological order kept)."""
    graph = proto.graph
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.domain != PLACEHOLDER_DOMAIN:
            nodes.append(node)
            continue
        index = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "index")
        g = _lower(placeholders[index], graph, node)
        nodes.extend(g.nodes)
        graph.initializer.extend(g.initializers)
        graph.value_info.extend(g.value_info)
    del graph.node[:]
    graph.node.extend(nodes)
    domains = {n.domain for n in nodes}
    opsets = [o for o in proto.opset_import if o.domain != PLACEHOLDER_DOMAIN]
    opsets += [helper.make_opsetid(d, CUSTOM_OPSET) for d in (DOMAIN, QONNX_DOMAIN)
               if d in domains and all(o.domain != d for o in opsets)]  # fmt: skip
    del proto.opset_import[:]
    proto.opset_import.extend(opsets)


def export_qonnx(model: nn.Module, example: torch.Tensor, path: str | Path | None = None) -> onnx.ModelProto:
    """The QONNX model of ``model`` (eval mode) for inputs shaped like ``example``; saved to ``path`` if given.

    ``model`` is not changed.  Raises ValueError naming the module for a layer without
    a QONNX form, an uncalibrated qnorm layer, a layer returning quant tensors, or an
    integer width float32 tensors cannot hold exactly.
    """
    if not isinstance(example, torch.Tensor) or example.dtype != torch.float32:
        raise ValueError(f"the example input must be a float32 tensor, got {getattr(example, 'dtype', type(example))}")
    copied, placeholders = _with_placeholders(model)
    proto = _brevitas_export(copied, example)
    _expand(proto, placeholders)
    onnx.checker.check_model(proto)
    if path is not None:
        onnx.save(proto, str(path))
    return proto


def export_checkpoint(
    checkpoint: str | Path, out: str | Path, batch: int = 1
) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Export a checkpoint written by ``qnorm train`` for a batch of ``batch`` inputs; the model and meta.json.

    The file records where it comes from (metadata ``qnorm.model``, ``qnorm.weights_sha256``).
    """
    from qnorm.train.checkpoint import load_checkpoint

    if batch < 1:
        raise ValueError(f"--batch must be positive, got {batch}")
    model, meta = load_checkpoint(checkpoint)
    proto = export_qonnx(model, model.example_input(batch))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    for key, value in (("qnorm.model", json.dumps(meta["model"])), ("qnorm.weights_sha256", meta["weights"]["sha256"])):
        proto.metadata_props.append(onnx.StringStringEntryProto(key=key, value=value))
    onnx.save(proto, str(out))
    return proto, meta


def describe(proto: onnx.ModelProto) -> str:
    """One line: the input shape and the node count per (domain::)op type."""
    shape = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    kinds = Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in proto.graph.node)
    counts = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
    return f"input {shape}, {len(proto.graph.node)} nodes: {counts}"
