"""What :func:`qnorm.passes.convert` converts to, registered by name.

* **Norm kinds**: the norm kinds of :mod:`qnorm.nn.kinds` (one registry for models and
  conversions) that say whether they subtract the mean: ``centered`` kinds replace
  ``nn.LayerNorm``; the others replace ``nn.RMSNorm`` and
  :class:`~qnorm.passes.crms.CRMSNorm`.  A kind's layer is built like its source
  (:func:`layer_ctor`): channel count and resolved eps, gamma and beta present or
  absent as there, the source's dtype and device, plus the conversion's options.
  ``register_norm_kind("mine", ctor, centered=True)`` adds a kind with a constructor
  of its own: ``ctor(spec, **options)`` receives a :class:`NormSpec` (the source
  module, channel count and resolved eps).  Either way the layer has ``weight``,
  ``bias`` (each a (C,) parameter or None) and ``eps``; ``convert`` copies gamma and
  beta into it and checks eps.
* **Quantized activations**: ``register_quant_act(cls, spec_of)`` where
  ``spec_of(module)`` gives its output format and rounding; a BatchNorm whose only
  consumer is such a module becomes one :class:`~qnorm.nn.BNQuantAct`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qnorm.fixedpoint import Round
from qnorm.nn import kinds
from qnorm.nn.kinds import NORM, Kind
from qnorm.qformat import QFormat


@dataclass(frozen=True, eq=False)
class NormSpec:
    """A float norm to convert: the module, its channel count, eps, gamma and beta (C,)."""

    source: nn.Module
    channels: int
    eps: float
    gamma: torch.Tensor
    beta: torch.Tensor


NormCtor = Callable[..., nn.Module]


@dataclass(frozen=True)
class NormKind:
    ctor: NormCtor
    centered: bool


@dataclass(frozen=True)
class QuantActSpec:
    """A quantized activation's output grid and tie rule."""

    out_fmt: QFormat
    rounding: Round


_QUANT_ACTS: dict[type, Callable[[nn.Module], QuantActSpec]] = {}


def register_norm_kind(kind: str, ctor: NormCtor, *, centered: bool, replace: bool = False) -> None:
    """Make ``convert(model, norm=kind)`` build layers with ``ctor(spec, **options)``.

    Registering the very same entry again is allowed (re-imports are harmless);
    silently swapping a different one in is not, unless ``replace``.
    """
    kinds.register(Kind(kind, NORM, convert=ctor, centered=bool(centered)), replace=replace)


def norm_kind(kind: str) -> NormKind:
    """The constructor and centering of a conversion target."""
    found = kinds.get(kind, NORM)
    if found.centered is None:
        raise ValueError(
            f"norm kind {kind!r} cannot be a conversion target: it was registered without saying whether it "
            f"subtracts the mean; conversion targets: {', '.join(norm_kinds())}"
        )
    return NormKind(found.convert or layer_ctor(found), found.centered)


def norm_kinds() -> list[str]:
    """The norm kinds ``convert`` can build, sorted."""
    return sorted(k.name for k in kinds.kinds(NORM) if k.centered is not None)


def layer_ctor(kind: Kind) -> NormCtor:
    """``ctor(spec, **options)`` building ``kind``'s layer like the source (module docstring)."""
    return functools.partial(_mirrored_layer, kind)


def _mirrored_layer(kind: Kind, spec: NormSpec, **options: Any) -> nn.Module:
    weight = getattr(spec.source, "weight", None)
    like = {"device": weight.device, "dtype": weight.dtype} if weight is not None else {}
    flags = {"elementwise_affine": weight is not None}
    if kind.centered:  # RMSNorm-like layers have no beta (a CRMSNorm's nonzero one is refused by convert)
        flags["bias"] = getattr(spec.source, "bias", None) is not None
    return kind.build(spec.channels, eps=spec.eps, **flags, **like, **options)


def register_quant_act(cls: type, spec_of: Callable[[nn.Module], QuantActSpec], *, replace: bool = False) -> None:
    """Declare modules of type ``cls`` (and subclasses) quantized activations."""
    known = _QUANT_ACTS.get(cls)
    if known is not None and known is not spec_of and not replace:
        raise ValueError(f"quantized activation {cls.__name__} is already registered")
    _QUANT_ACTS[cls] = spec_of


def quant_act_types() -> tuple[type, ...]:
    return tuple(_QUANT_ACTS)


def quant_act_spec(module: nn.Module) -> QuantActSpec | None:
    """The spec of a registered quantized activation, None for any other module."""
    for cls in type(module).__mro__:
        if cls in _QUANT_ACTS:
            return _QUANT_ACTS[cls](module)
    return None
