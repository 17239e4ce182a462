"""Freeze a trained qnorm model into an exportable inference graph with identical outputs.

``torch.export`` cannot trace an eval-mode qnorm model as it is: Brevitas' quant
tensors make data-dependent checks, and a qnorm layer re-derives its golden op
with numpy in every forward.  :func:`freeze` returns an eval-mode copy in which,
module for module,

* a Brevitas activation quantizer (``QuantIdentity``, a layer's ``input_quant``) is
  a :class:`FakeQuant`: ``clamp(round(x / s), lo, hi) * s`` with Brevitas' scale and
  integer range, and Brevitas' own steps (``torch.round``: ties to even);
* ``QuantLinear`` / ``QuantConv2d`` is the same ``F.linear`` / ``F.conv2d`` on the
  fake-quantized weight and bias that Brevitas computes for the eval-mode layer;
* a qnorm integer layer is an :class:`IntOpCall`: one ``qnorm::int_op`` custom op
  whose eager implementation *is* the layer (BN-based layers folded first:
  ``MPBNLIF.fold()``, ``BNQuantAct.fold()``, identical outputs by construction).
  An exporter sees one opaque node per layer; ``compilers.tvm.graph`` maps it to
  the layer's golden-op kernel.

Nothing is re-derived: every number in the frozen model is one the QAT model
computes with.  Whether the result can be compiled *exactly* is a separate
question, answered by :mod:`qnorm.deploy.exactness`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qnorm.errors import DeployError
from qnorm.nn.base import IntModule
from qnorm.nn.batchnorm import BNQATModule
from qnorm.nn.quantizer import is_quant_tensor
from qnorm.ops.base import IntOp

# The layers behind the custom op's string argument (an op schema cannot carry a
# module).  Held for the life of the process: an exported program names its layers
# by key only, and must stay runnable and compilable after the frozen model is gone
# (the layers are small: parameters and a golden op each).
_LAYERS: dict[str, IntModule] = {}


@torch.library.custom_op("qnorm::int_op", mutates_args=())
def int_op(x: torch.Tensor, key: str) -> torch.Tensor:
    """The qnorm layer registered under ``key``, applied to ``x`` (eval mode, no autograd)."""
    with torch.no_grad():
        return registered_layer(key)(x)


@int_op.register_fake
def _int_op_shape(x: torch.Tensor, key: str) -> torch.Tensor:
    return torch.empty_like(x)  # every qnorm layer maps its input shape to itself


def registered_layer(key: str) -> IntModule:
    """The layer an ``int_op`` node names (registered by :class:`IntOpCall` in this process)."""
    try:
        return _LAYERS[key]
    except KeyError:
        raise KeyError(f"no qnorm layer {key!r} in this process: int_op nodes come from qnorm.deploy.freeze") from None


@dataclass(frozen=True)
class IntOpInfo:
    """What a compiler needs about one ``int_op`` node: the layer's golden op and layout."""

    name: str  # the layer's qualified name in the model
    layer: str  # its class name
    op: IntOp
    channel_dim: int  # the layer's channel axis; the golden op wants it last


def int_op_info(key: str) -> IntOpInfo:
    layer = registered_layer(key)
    return IntOpInfo(key.rsplit("@", 1)[0], type(layer).__name__, layer.golden(), layer.channel_dim)


class IntOpCall(nn.Module):
    """One qnorm integer layer as a single ``qnorm::int_op`` node (see the module docstring)."""

    def __init__(self, layer: IntModule, name: str) -> None:
        super().__init__()
        self.key = f"{name}@{id(layer):x}"
        # Not a submodule: the export must not lift the layer's float parameters,
        # which the integer op does not use.
        _LAYERS[self.key] = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.qnorm.int_op(x, self.key)

    def extra_repr(self) -> str:
        return f"{type(_LAYERS[self.key]).__name__}, key={self.key!r}"


class FakeQuant(nn.Module):
    """``clamp(round(x / scale), lo, hi) * scale``: a Brevitas integer quantizer in eval, frozen."""

    def __init__(self, scale: float, lo: int, hi: int) -> None:
        super().__init__()
        self.scale, self.lo, self.hi = float(scale), int(lo), int(hi)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(torch.round(x / self.scale), self.lo, self.hi) * self.scale

    def extra_repr(self) -> str:
        return f"scale={self.scale!r}, lo={self.lo}, hi={self.hi}"


class FrozenLinear(nn.Module):
    """``F.linear`` on Brevitas' fake-quantized weight and bias, after its input quantizer."""

    def __init__(
        self, input_quant: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, output_quant: nn.Module
    ) -> None:
        super().__init__()
        self.input_quant, self.output_quant = input_quant, output_quant
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_quant(F.linear(self.input_quant(x), self.weight, self.bias))


class FrozenConv2d(nn.Module):
    """``F.conv2d`` on Brevitas' fake-quantized weight and bias, after its input quantizer."""

    def __init__(
        self, conv: nn.Conv2d, input_quant: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None,
        output_quant: nn.Module,
    ) -> None:  # fmt: skip
        super().__init__()
        self.input_quant, self.output_quant = input_quant, output_quant
        self.stride, self.padding, self.dilation, self.groups = conv.stride, conv.padding, conv.dilation, conv.groups
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.conv2d(self.input_quant(x), self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        return self.output_quant(y)


# --------------------------------------------------------------------------- freezing


def integer_ops(model: nn.Module) -> dict[str, IntOp]:
    """The golden op of every qnorm integer layer of ``model``, by qualified name, in
    model order, as the frozen model runs them (BN-based layers folded): what a
    per-layer back end (an HLS project per layer) compiles."""
    calls = [m for m in freeze(model).modules() if isinstance(m, IntOpCall)]
    infos = [int_op_info(call.key) for call in calls]
    return {info.name: info.op for info in infos}


def freeze(model: nn.Module) -> nn.Module:
    """An eval-mode copy of ``model`` that ``torch.export`` can trace, with the same outputs.

    ``model`` is not changed.  Raises ValueError naming the module for what has no
    frozen form: a Brevitas layer other than QuantIdentity / QuantLinear /
    QuantConv2d, a quantizer with a zero point, a layer that returns quant tensors,
    a qnorm layer whose input format is not calibrated yet.
    """
    frozen = copy.deepcopy(model).eval()
    root = _frozen_form("", frozen)
    if root is not None:
        return root
    replaced: dict[int, nn.Module | None] = {}  # by identity: a shared module stays shared
    inside: list[str] = []  # names of replaced modules, whose insides are gone
    for name, module in list(frozen.named_modules(remove_duplicate=False))[1:]:
        if any(name.startswith(f"{done}.") for done in inside):
            continue
        if id(module) not in replaced:
            replaced[id(module)] = _frozen_form(name, module)
        new = replaced[id(module)]
        if new is not None:
            frozen.set_submodule(name, new)
            inside.append(name)
    return frozen


def _frozen_form(name: str, module: nn.Module) -> nn.Module | None:
    """The frozen replacement of one module, or None to keep it (and look inside)."""
    where = name or "the model"
    if isinstance(module, IntModule):
        if module.return_quant_tensor:
            raise DeployError(f"{where} ({type(module).__name__}) returns quant tensors; deployment needs float outputs")
        layer = module.fold() if isinstance(module, BNQATModule) else module
        try:
            layer.golden()
        except ValueError as err:
            raise DeployError(f"{where} ({type(module).__name__}): {err}") from err
        return IntOpCall(layer.eval(), name)
    if not type(module).__module__.startswith("brevitas."):
        return None
    import brevitas.nn as qnn

    if getattr(module, "return_quant_tensor", False):
        raise DeployError(f"{where} ({type(module).__name__}) returns quant tensors; deployment needs float outputs")
    if isinstance(module, qnn.QuantIdentity):
        return _fake_quant(module.act_quant, where)
    if isinstance(module, qnn.QuantLinear):
        return FrozenLinear(*_frozen_layer(module, where))
    if isinstance(module, qnn.QuantConv2d):
        if module.padding_mode != "zeros" or module.is_same_padded_strided:
            raise DeployError(
                f"{where}: QuantConv2d with padding_mode={module.padding_mode!r} / same-padded stride is not supported"
            )
        input_quant, weight, bias, output_quant = _frozen_layer(module, where)
        return FrozenConv2d(module, input_quant, weight, bias, output_quant)
    raise DeployError(
        f"{where}: Brevitas {type(module).__name__} has no frozen form; qnorm.deploy takes QuantIdentity, "
        "QuantLinear and QuantConv2d (a quantized activation: nn.ReLU then QuantIdentity)"
    )


@torch.no_grad()
def _frozen_layer(layer: Any, where: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor | None, nn.Module]:
    """(input quantizer, weight, bias, output quantizer) of a Brevitas weight layer in eval."""
    input_quant = _fake_quant(layer.input_quant, f"{where}.input_quant")
    output_quant = _fake_quant(layer.output_quant, f"{where}.output_quant")
    weight = layer.quant_weight()
    bias = None
    if layer.bias is not None:
        # The bias quantizer needs the input's quant tensor (Int32Bias: scale s_x * s_w);
        # in eval its scale does not depend on the values, so any input gives it.
        quant_input = layer.input_quant(torch.zeros(1, dtype=layer.weight.dtype))
        bias = _value(layer.bias_quant(layer.bias, quant_input, weight)).detach().clone()
    return input_quant, _value(weight).detach().clone(), bias, output_quant


def _value(t: Any) -> torch.Tensor:
    return t.value if is_quant_tensor(t) else t


@torch.no_grad()
def _fake_quant(proxy: Any, where: str) -> nn.Module:
    """A Brevitas activation quant proxy in eval as a FakeQuant (nn.Identity when disabled)."""
    if not proxy.is_quant_enabled:
        return nn.Identity()
    fused = getattr(proxy, "fused_activation_quant_proxy", None)
    if fused is not None and not isinstance(fused.activation_impl, nn.Identity):
        raise DeployError(f"{where}: a quantizer with a fused {type(fused.activation_impl).__name__} has no frozen form")
    qt = proxy(torch.zeros(1))
    if bool((qt.zero_point != 0).any()):
        raise DeployError(f"{where}: quantizer has a non-zero zero point; deployment needs symmetric quantizers")
    if qt.scale.numel() != 1:
        raise DeployError(f"{where}: per-channel activation scales are not supported")
    bits, signed, narrow = int(qt.bit_width), bool(qt.signed), bool(proxy.is_narrow_range)
    lo = -(1 << (bits - 1)) + narrow if signed else 0
    hi = (1 << (bits - 1)) - 1 if signed else (1 << bits) - 1 - narrow
    return FakeQuant(float(qt.scale), lo, hi)
