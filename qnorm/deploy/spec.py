"""Model specs: the JSON a model is rebuilt from, told by the layer that defines the model.

A model family above this layer (the digits models of :mod:`qnorm.train.models`)
registers a describer, a function returning a model's spec (JSON-ready, enough to
rebuild it) or None for a model it does not define.  Whoever deploys a model, like
the compiler's cache keys (:func:`compilers.tvm.graph.model_key`), asks
:func:`model_spec` without importing that family: a model object exists only once its
family's module is imported, and importing it registered the describer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

Describer = Callable[[nn.Module], dict[str, Any] | None]

_DESCRIBERS: list[Describer] = []


def register_spec(describe: Describer) -> None:
    """Ask ``describe`` for the specs of models from now on (registering it again changes nothing)."""
    if describe not in _DESCRIBERS:
        _DESCRIBERS.append(describe)


def model_spec(model: nn.Module) -> dict[str, Any] | None:
    """The spec of ``model`` from the first describer that knows it, None when none does."""
    for describe in _DESCRIBERS:
        spec = describe(model)
        if spec is not None:
            return spec
    return None
