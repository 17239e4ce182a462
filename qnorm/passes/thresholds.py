"""Fold every BN-before-threshold layer into its integer-threshold form.

The layers own their folds: :meth:`qnorm.nn.MPBNLIF.fold` gives the neuron with a
per-channel integer firing threshold, :meth:`qnorm.nn.BNQuantAct.fold` the
multi-threshold activation.  Each fold is exact for the eval-mode layer (running
statistics, the input format fixed at fold time), so the folded model's outputs
equal the eval-mode model's outputs bit for bit.
"""

from __future__ import annotations

import copy

from torch import nn

from qnorm.nn.batchnorm import BNQATModule
from qnorm.passes._graph import replace_modules


def fold_thresholds(model: nn.Module) -> nn.Module:
    """A deep copy with every BN-based layer (:class:`~qnorm.nn.BNQATModule`: MPBNLIF,
    BNQuantAct) replaced by its ``fold()``.

    The folded modules are inference-only integer modules; each layer's input
    format must be known (fixed, or calibrated in training), else its ``fold``
    raises.  ``model`` is not changed.
    """

    def fold(m: nn.Module) -> nn.Module | None:
        return m.fold() if isinstance(m, BNQATModule) else None

    return replace_modules(copy.deepcopy(model), fold)
