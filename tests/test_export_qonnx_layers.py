"""QONNX export, layer by layer: each qnorm layer's nodes, run by qonnx's executor, give the
layer's outputs bit for bit (BN + quantized activation on every int8 input with gamma < 0
and gamma = 0 channels, MPBN LIF neurons of several dynamics, the four norms), and the
``qnorm.custom_op`` attributes rebuild the golden op exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("qonnx", reason="QONNX export needs the qonnx extra (pip install -e '.[qonnx]')")

from onnx import numpy_helper
from qonnx.core.modelwrapper import ModelWrapper
from qonnx.core.onnx_exec import execute_onnx
from qonnx.custom_op.general.multithreshold import multithreshold
from qonnx.custom_op.registry import getCustomOp

from qnorm import ops
from qnorm.export.attributes import norm_attributes
from qnorm.export.graph import LayerGraph
from qnorm.export.layers import DOMAIN
from qnorm.export.qonnx import export_qonnx
from qnorm.nn import (
    MPBNLIF,
    BNQuantAct,
    IntLayerNorm,
    IntRMSNorm,
    L1LayerNorm,
    ShiftLayerNorm,
)
from qnorm.qformat import QFormat

IN = QFormat(8, 2.0**-4)
GAMMA = [1.3, -0.7, 0.0, -2.1, 0.45, -0.05]  # gamma < 0 and gamma = 0 channels
BETA = [0.2, -0.4, 1.1, 0.0, -0.3, 0.6]


def run(proto, x: torch.Tensor) -> np.ndarray:
    model = ModelWrapper(proto)
    return execute_onnx(model, {model.graph.input[0].name: x.numpy()})[model.graph.output[0].name]


def eager(module: nn.Module, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return module(x).numpy()


def set_bn(layer: nn.Module, mean: list[float], var: list[float]) -> None:
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(GAMMA[: layer.channels]))
        layer.bias.copy_(torch.tensor(BETA[: layer.channels]))
        layer.running_mean.copy_(torch.tensor(mean))
        layer.running_var.copy_(torch.tensor(var))


def bn_act_inputs(channels: int) -> torch.Tensor:
    """Every int8 input on its grid, every tie between grid points, and values beyond the range."""
    grid = torch.arange(-128, 128, dtype=torch.float32) * IN.scale
    ties = (torch.arange(-130, 130, dtype=torch.float32) + 0.5) * IN.scale
    values = torch.cat([grid, ties, torch.tensor([-1e3, -9.0, 9.0, 1e3])])
    return values[:, None].expand(-1, channels).contiguous()


@pytest.mark.parametrize(
    "out_fmt, rounding",
    [(QFormat(4, 0.25, signed=False), "half_up"), (QFormat(8, 2.0**-4), "half_even"), (QFormat(3, 0.5), "floor")],
    ids=["uint4-half_up", "int8-half_even", "int3-floor"],
)
def test_bn_quant_act_is_multithreshold_exact_on_every_int8_input(out_fmt, rounding):
    layer = BNQuantAct(6, out_fmt, in_fmt=IN, rounding=rounding)
    set_bn(layer, [0.5, -1.0, 0.0, 2.0, -0.25, 0.1], [1.0, 0.3, 2.0, 4.5, 0.8, 1.7])
    layer.eval()
    x = bn_act_inputs(6)
    proto = export_qonnx(nn.Sequential(layer), x)
    assert np.array_equal(run(proto, x), eager(layer, x))
    assert [n.op_type for n in proto.graph.node] == ["Quantize", "Mul", "MultiThreshold", "Mul"]


def test_negative_channels_are_negated_with_negated_thresholds():
    """x <= t on gamma < 0 channels is -x >= -t: qonnx's own multithreshold on the exported
    sign and thresholds counts what the golden op counts; the thresholds fed as they are do not."""
    layer = BNQuantAct(6, QFormat(4, 0.25, signed=False), in_fmt=IN)
    set_bn(layer, [0.0] * 6, [1.0] * 6)
    layer.eval()
    golden = layer.fold().golden()
    proto = export_qonnx(layer, bn_act_inputs(6)[:8])
    consts = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    sign, thresholds = consts["model/multithreshold_sign"], consts["model/multithreshold_thresholds"]
    assert np.array_equal(sign.ravel(), np.where(golden.negative, -1.0, 1.0))
    ints = np.repeat(np.arange(-128, 128)[:, None], 6, axis=1)
    want = golden.forward(ints)
    assert np.array_equal(multithreshold(ints * sign, thresholds), want)
    assert not np.array_equal(multithreshold(ints, golden.thresholds), want)


@pytest.mark.parametrize(
    "dynamics",
    [
        {"leak": 0.5, "reset": "hard", "comparator": ">=", "saturate": True},
        # the leak product passes 2^24: the leak runs in float64
        {"leak": 0.9, "reset": "soft", "comparator": ">", "saturate": True, "u_rest": 3},
        {"leak": 0.75, "reset": "hard", "comparator": ">", "saturate": False, "membrane_bits": 12},
    ],
    ids=["hard-leak0.5", "soft-leak0.9-rest3", "hard-unsaturated"],
)
def test_mpbn_lif_unrolled_gives_the_layers_spike_trains(dynamics):
    layer = MPBNLIF(4, v_th=0.5, in_fmt=QFormat(8, 2.0**-3), **dynamics)
    set_bn(layer, [0.5, -1.0, 0.0, 2.0], [1.0, 0.3, 2.0, 4.5])
    layer.eval()
    torch.manual_seed(0)
    x = torch.randn(8, 32, 4, 3) * 6  # (T, N, C, W)
    proto = export_qonnx(layer, x)
    want = eager(layer, x)
    assert np.array_equal(run(proto, x), want)
    assert 0 < want.mean() < 1  # neither silent nor saturated: the comparison means something
    assert sum(n.op_type == "MultiThreshold" for n in proto.graph.node) == 8


def test_four_norms_are_qnorm_custom_op_nodes_equal_to_the_layers():
    out = QFormat.power_of_two(8, -5)  # the norms' default output format: the next layer's input
    model = nn.Sequential(
        IntLayerNorm(16, in_fmt=QFormat(8, 0.03)),  # not a float32 value: the attribute keeps float64
        L1LayerNorm(16, in_fmt=out),
        ShiftLayerNorm(16, in_fmt=out, mantissa_terms=1),
        IntRMSNorm(16, in_fmt=out, partial=0.3),
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for norm in model:
            norm.weight.uniform_(-2, 2)
            if norm.bias is not None:
                norm.bias.uniform_(-1, 1)
    x = torch.cat([torch.randn(64, 16) * 2, (torch.randint(-140, 140, (8, 16)) + 0.5) * 0.03])
    proto = export_qonnx(model, x)
    assert np.array_equal(run(proto, x), eager(model, x))
    custom = [n.op_type for n in proto.graph.node if n.domain == DOMAIN]
    assert custom == ["Quantize", "IntLayerNorm", "Quantize", "L1LayerNorm", "Quantize", "ShiftLayerNorm",
                      "Quantize", "IntRMSNorm"]  # fmt: skip


@pytest.mark.parametrize("op_cls", ops.NORMS, ids=lambda c: c.__name__)
def test_node_attributes_rebuild_the_golden_op(op_cls):
    """Through protobuf and qonnx's attribute decoding: the same config, the same integers."""
    rng = np.random.default_rng(3)
    options = {ops.IntRMSNorm: {"partial": 0.3}, ops.ShiftLayerNorm: {"mantissa_terms": 1}}.get(op_cls, {})
    op = op_cls.from_float(rng.normal(size=12), rng.normal(size=12), 1e-3, QFormat(6, 0.07), **options)
    g = LayerGraph("layer")
    g.node(op_cls.__name__, ["x"], "normalize", (5, 12), domain=DOMAIN, **norm_attributes(op))
    node = getCustomOp(g.nodes[0])
    rebuilt = node.golden()
    assert rebuilt.config == op.config
    x = rng.integers(-32, 32, size=(40, 12))
    assert np.array_equal(rebuilt.forward(x), op.forward(x))
    assert node.verify_node() == [f"{op_cls.__name__}: attributes valid"]
    attrs = g.nodes[0].attribute
    del attrs[[a.name for a in attrs].index("n")]
    assert node.verify_node() == [f"{op_cls.__name__}: missing attributes ['n']"]
