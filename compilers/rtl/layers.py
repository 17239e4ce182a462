"""A trained model's qnorm layers as RTL units: what ``qnorm compile --target fpga-rtl`` deploys.

:func:`model_layers` freezes the model (:func:`qnorm.deploy.freeze`: BN-based
layers folded, as every compiled target runs them) and lists its qnorm layers;
:func:`rtl_layers` then holds each golden op to the ``fpga-rtl`` target's widths
(:func:`qnorm.analysis.check_target`) and builds its RTL unit
(:func:`~compilers.rtl.rtl_unit`).  A layer that has no RTL unit refuses the model
before any unit is built, every such layer named with its class in one error:
qnorm layers of an op family without a unit and the
float norm and neuron layers of :mod:`qnorm.nn.kinds` (``nn.LayerNorm``, ...), which
would leave the datapath in float.  With ``skip_unsupported`` they are listed
instead and left out.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from compilers.rtl.unit import RtlUnit, has_rtl_unit, rtl_unit
from qnorm.analysis import check_target
from qnorm.deploy import freeze
from qnorm.deploy.freeze import IntOpCall, int_op_info, registered_layer
from qnorm.errors import DeployError
from qnorm.nn import kinds
from qnorm.nn.base import IntModule
from qnorm.ops.base import IntOp
from qnorm.targets import Target

SKIP_FLAG = "--skip-unsupported"


@dataclass(frozen=True)
class ModelLayer:
    """One qnorm layer of a model, as the frozen model runs it.  ``layer_class``: the
    model's module class; ``metadata``: the frozen layer's ``qnorm_metadata()`` (formats,
    integer constants, definition version); ``code_range``: the input codes it was
    calibrated on."""

    name: str
    layer_class: str
    op: IntOp
    metadata: dict[str, Any]
    code_range: tuple[int, int]


@dataclass(frozen=True)
class RtlLayer(ModelLayer):
    """A qnorm layer and its RTL unit."""

    unit: RtlUnit


@dataclass(frozen=True)
class Unsupported:
    """A layer with no RTL unit, and why."""

    name: str
    layer_class: str
    reason: str

    def describe(self) -> str:
        return f"{self.name} ({self.layer_class}: {self.reason})"


def calibrated_codes(module: nn.Module, op: IntOp) -> tuple[int, int]:
    """The input codes a layer's calibration saw: ±ceil(max |x| / scale) within the
    format; the whole format for a layer without a calibrated range."""
    fmt = op.in_fmt
    peak = getattr(getattr(module, "input_quant", None), "running_max_abs", None)
    if peak is None or float(peak) <= 0:
        return fmt.lo, fmt.hi
    codes = math.ceil(float(peak) / fmt.scale)
    return max(fmt.lo, -codes), min(fmt.hi, codes)


def _float_layers(model: nn.Module) -> list[Unsupported]:
    """The float norm and neuron layers of the registered kinds, by module name."""
    classes = tuple(
        k.layer for role in kinds.ROLES for k in kinds.kinds(role) if not k.integer and isinstance(k.layer, type)
    )
    return [
        Unsupported(name, type(module).__name__, "a float layer")
        for name, module in model.named_modules()
        if isinstance(module, classes) and not isinstance(module, IntModule)
    ]


def model_layers(model: nn.Module, skip_unsupported: bool = False) -> tuple[list[ModelLayer], list[Unsupported]]:
    """The model's qnorm layers that have an RTL unit, in model order, and the layers left
    out (``skip_unsupported``); without it, :class:`~qnorm.errors.DeployError` naming
    every layer that has no unit."""
    layers: list[ModelLayer] = []
    unsupported = _float_layers(model)
    for call in (m for m in freeze(model).modules() if isinstance(m, IntOpCall)):
        info = int_op_info(call.key)
        module = model.get_submodule(info.name)
        if not has_rtl_unit(info.op):
            unsupported.append(Unsupported(info.name, type(module).__name__, f"no RTL unit for {type(info.op).__name__}"))
            continue
        meta = registered_layer(call.key).qnorm_metadata()
        layers.append(ModelLayer(info.name, type(module).__name__, info.op, meta, calibrated_codes(module, info.op)))
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    unsupported.sort(key=lambda u: order[u.name])  # float and integer layers, in model order
    if unsupported and not skip_unsupported:
        raise DeployError(
            f"{len(unsupported)} layer(s) have no RTL unit: {'; '.join(u.describe() for u in unsupported)} "
            f"(pass {SKIP_FLAG} to leave them out of the RTL and run them elsewhere)"
        )
    if not layers:
        raise DeployError("the model has no qnorm layer with an RTL unit to put on the FPGA")
    return layers, unsupported


def rtl_layers(model: nn.Module, target: Target, skip_unsupported: bool = False) -> tuple[list[RtlLayer], list[Unsupported]]:
    """:func:`model_layers`, each held to the target's widths
    (:class:`~qnorm.analysis.TargetLimitError` otherwise) and with its unit built."""
    layers, unsupported = model_layers(model, skip_unsupported)
    for layer in layers:
        check_target(layer.op, target)
    fields = [f.name for f in dataclasses.fields(ModelLayer)]
    built = [RtlLayer(**{f: getattr(layer, f) for f in fields}, unit=rtl_unit(layer.op)) for layer in layers]
    return built, unsupported
