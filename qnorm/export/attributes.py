"""The attributes of a ``qnorm.custom_op`` node: a golden op's integer config, exactly.

Every field of a norm op's config dataclass becomes one ONNX attribute of the same
name, so the node rebuilds the very op the QAT layer ran:

* ``int`` -> INT, ``tuple[int, ...]`` -> INTS, ``Round`` -> STRING (its value);
* ``float`` -> TENSOR, a float64 scalar (ONNX FLOAT attributes are float32 and would
  round e.g. RMSNorm's ``partial`` or a calibrated scale);
* a ``QFormat`` field ``in_fmt`` / ``out_fmt`` -> ``in_bits``, ``in_scale`` (float64),
  ``in_signed`` / ``out_...`` (the ``Quantize`` node's own format: ``bits``, ``scale``,
  ``signed``).

Norm nodes also carry the float γ, β, ε the integers were quantized from
(``reference_gamma``, ``reference_beta``, ``reference_eps``, float64 tensors): the
op's float reference uses them, its integer forward never does.

Encoding gives plain values and numpy arrays (the graph builder makes them ONNX
attributes); decoding takes already decoded values (qonnx's ``get_nodeattr`` gives
numpy arrays, lists, ints and strings), so this module imports neither onnx nor qonnx.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import Field, fields
from typing import Any

import numpy as np

from qnorm.fixedpoint import Round
from qnorm.ops._normcore import FloatParams, NormOp
from qnorm.qformat import QFormat

# Config field annotation -> qonnx attribute dtype ("fmt": three attributes).
_KINDS = {"int": "i", "tuple[int, ...]": "ints", "Round": "s", "float": "t", "QFormat": "fmt"}
_DEFAULTS: dict[str, Any] = {"i": 0, "ints": [], "s": "", "t": np.zeros((), dtype=np.float64)}
REFERENCE = ("reference_gamma", "reference_beta", "reference_eps")


def _kind(config_cls: type, field: Field) -> str:
    kind = _KINDS.get(field.type if isinstance(field.type, str) else getattr(field.type, "__name__", ""))
    if kind is None:
        where = f"{config_cls.__name__}.{field.name}"
        raise ValueError(f"{where}: field type {field.type!r} has no ONNX attribute encoding")
    return kind


def _prefix(field_name: str) -> str:
    """``in_fmt`` -> ``in_``: the attribute names' prefix."""
    return field_name.removesuffix("fmt")


def float64(value: Any) -> np.ndarray:
    """A float (or float array) as the float64 array a TENSOR attribute stores."""
    return np.asarray(value, dtype=np.float64)


def datatype_name(fmt: QFormat) -> str:
    """QONNX's name of the integer type of a format's words (``INT8``, ``UINT4``)."""
    return f"{'INT' if fmt.signed else 'UINT'}{fmt.bits}"


def fmt_attributes(prefix: str, fmt: QFormat) -> dict[str, Any]:
    """``<prefix>bits``, ``<prefix>scale`` (float64), ``<prefix>signed`` of a format."""
    return {f"{prefix}bits": fmt.bits, f"{prefix}scale": float64(fmt.scale), f"{prefix}signed": int(fmt.signed)}


def fmt_attribute_types(prefix: str) -> dict[str, tuple[str, bool, Any]]:
    """qonnx's ``get_nodeattr_types`` entries of :func:`fmt_attributes`."""
    return {f"{prefix}bits": ("i", True, 0), f"{prefix}scale": ("t", True, _DEFAULTS["t"]),
            f"{prefix}signed": ("i", True, 0)}  # fmt: skip


def fmt_from_attributes(prefix: str, values: Mapping[str, Any]) -> QFormat:
    return QFormat(int(values[f"{prefix}bits"]), float(values[f"{prefix}scale"]), bool(values[f"{prefix}signed"]))


def norm_attributes(op: NormOp) -> dict[str, Any]:
    """The node attributes of a norm op: its config fields and its float reference parameters."""
    cfg = op.config
    out: dict[str, Any] = {}
    for field in fields(cfg):
        kind, value = _kind(type(cfg), field), getattr(cfg, field.name)
        if kind == "fmt":
            out.update(fmt_attributes(_prefix(field.name), value))
        elif kind == "ints":
            out[field.name] = [int(v) for v in value]
        elif kind == "s":
            out[field.name] = Round.parse(value).value
        elif kind == "t":
            out[field.name] = float64(value)
        else:
            out[field.name] = int(value)
    p = op.params
    out.update(zip(REFERENCE, (float64(p.gamma), float64(p.beta), float64(p.eps)), strict=True))
    return out


def norm_attribute_types(op_cls: type[NormOp]) -> dict[str, tuple[str, bool, Any]]:
    """qonnx's ``get_nodeattr_types`` of a norm node: every attribute is required."""
    types: dict[str, tuple[str, bool, Any]] = {}
    for field in fields(op_cls.config_cls):
        kind = _kind(op_cls.config_cls, field)
        if kind == "fmt":
            types.update(fmt_attribute_types(_prefix(field.name)))
        else:
            types[field.name] = (kind, True, _DEFAULTS[kind])
    types.update((name, ("t", True, _DEFAULTS["t"])) for name in REFERENCE)
    return types


def norm_from_attributes(op_cls: type[NormOp], values: Mapping[str, Any]) -> NormOp:
    """Rebuild the golden op from decoded node attributes (the inverse of :func:`norm_attributes`)."""
    cfg_cls = op_cls.config_cls
    config: dict[str, Any] = {}
    for field in fields(cfg_cls):
        kind = _kind(cfg_cls, field)
        if kind == "fmt":
            config[field.name] = fmt_from_attributes(_prefix(field.name), values)
        elif kind == "ints":
            config[field.name] = tuple(int(v) for v in values[field.name])
        elif kind == "s":
            config[field.name] = str(values[field.name])
        elif kind == "t":
            config[field.name] = float(values[field.name])
        else:
            config[field.name] = int(values[field.name])
    gamma, beta, eps = (values[name] for name in REFERENCE)
    return op_cls(cfg_cls(**config), FloatParams.checked(gamma, beta, float(eps)))
