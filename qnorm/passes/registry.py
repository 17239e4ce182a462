"""What :func:`qnorm.passes.convert` converts to, registered by name.

* **Norm kinds**: ``register_norm_kind("int_ln", ctor, centered=True)``.  ``ctor(spec,
  **options)`` receives a :class:`NormSpec` (the source module, channel count and
  resolved eps) and returns a layer with ``weight``, ``bias`` (each a (C,) parameter
  or None) and ``eps``; ``convert`` copies gamma and beta into it and checks eps.
  ``centered`` kinds subtract the mean and replace ``nn.LayerNorm``; the others
  replace ``nn.RMSNorm`` and :class:`~qnorm.passes.crms.CRMSNorm`.
* **Quantized activations**: ``register_quant_act(cls, spec_of)`` where
  ``spec_of(module)`` gives its output format and rounding; a BatchNorm whose only
  consumer is such a module becomes one :class:`~qnorm.nn.BNQuantAct`.

This module imports nothing from :mod:`qnorm.nn`, so layer modules can register
from their own import.  The qnorm QAT norms are registered by
:mod:`qnorm.passes.qat_kinds` (imported with :mod:`qnorm.passes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from qnorm.fixedpoint import Round
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


_NORM_KINDS: dict[str, NormKind] = {}
_QUANT_ACTS: dict[type, Callable[[nn.Module], QuantActSpec]] = {}


def register_norm_kind(kind: str, ctor: NormCtor, *, centered: bool, replace: bool = False) -> None:
    """Make ``convert(model, norm=kind)`` build layers with ``ctor(spec, **options)``.

    Registering the very same entry again is allowed (re-imports are harmless);
    silently swapping a different one in is not, unless ``replace``.
    """
    entry = NormKind(ctor, bool(centered))
    known = _NORM_KINDS.get(kind)
    if known is not None and known != entry and not replace:
        raise ValueError(f"norm kind {kind!r} is already registered to {known}")
    _NORM_KINDS[kind] = entry


def norm_kind(kind: str) -> NormKind:
    if kind not in _NORM_KINDS:
        raise ValueError(f"unknown norm kind {kind!r}; registered: {', '.join(norm_kinds()) or 'none'}")
    return _NORM_KINDS[kind]


def norm_kinds() -> list[str]:
    return sorted(_NORM_KINDS)


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
