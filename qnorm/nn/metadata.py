"""Module metadata: what the ``qnorm_metadata()`` hooks of a model's modules publish.

A module with a ``qnorm_metadata()`` method (every qnorm layer, and any module that
wants its settings recorded) returns a JSON-ready description of itself: formats,
integer constants, folded thresholds.  Checkpoints record these descriptions and
compare them on load; the compiler's cache keys hash them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


def metadata_hooks(model: nn.Module) -> dict[str, Callable[[], Any]]:
    """{qualified name: module.qnorm_metadata} for every module that has the hook ("" is the root)."""
    hooks = {}
    for name, module in model.named_modules():
        hook = getattr(module, "qnorm_metadata", None)
        if callable(hook):
            hooks[name] = hook
    return hooks


def collect_module_metadata(model: nn.Module) -> dict[str, Any]:
    """{qualified name: module.qnorm_metadata()} for every module that has the hook."""
    return {name: hook() for name, hook in metadata_hooks(model).items()}
