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

from qnorm.nn.bnact import BNQuantAct
from qnorm.nn.spiking import MPBNLIF
from qnorm.passes._graph import replace_modules


def fold_thresholds(model: nn.Module) -> nn.Module:
    """A deep copy with every MPBNLIF and BNQuantAct replaced by its ``fold()``.

    The folded modules are inference-only integer modules; each layer's input
    format must be known (fixed, or calibrated in training), else its ``fold``
    raises.  ``model`` is not changed.
    """

    def fold(m: nn.Module) -> nn.Module | None:
        return m.fold() if isinstance(m, (MPBNLIF, BNQuantAct)) else None

    return replace_modules(copy.deepcopy(model), fold)
