"""Conversion and folding passes on torch models.

Every pass returns a new module (a converted deep copy) and leaves its input
untouched.  Graph passes find their patterns with ``torch.fx`` (or the chain of
an ``nn.Sequential``) and edit the copy of the original module, so a model keeps
its class.

* :func:`fold_bn` — BatchNorm into the preceding Conv/Linear, before weight quantization.
* :func:`flashnorm` — RMSNorm gain into the following Linear(s); :class:`IntFlashNorm` (the
  golden op, :mod:`qnorm.ops.flashnorm`) / :class:`IntFlashNormLinear` apply 1/rms after the
  integer matmul.
* :func:`ln_to_rms` — LayerNorm -> :class:`CRMSNorm` where the input is zero-mean by construction.
* :func:`fold_powernorm` — :class:`PowerNorm` -> per-channel :class:`ChannelAffine` at inference.
* :func:`convert` — float norms -> qnorm QAT layers (kinds of :mod:`qnorm.nn.kinds`, see
  :mod:`qnorm.passes.registry`);
  channels-first norms inside :class:`PermutedNorm`, norms it cannot swap refused.
* :func:`fold_thresholds` — MPBNLIF / BNQuantAct -> their integer-threshold folds.
"""

from qnorm.ops.wquant import quantize_per_channel
from qnorm.passes.bn_fold import fold_bn, fold_bn_into
from qnorm.passes.convert import convert
from qnorm.passes.crms import CRMSNorm, center_linear, ln_to_rms
from qnorm.passes.flashnorm import (
    IntFlashNorm,
    IntFlashNormLinear,
    flashnorm,
    fold_gain,
)
from qnorm.passes.permuted import PermutedNorm
from qnorm.passes.powernorm import ChannelAffine, PowerNorm, fold_powernorm
from qnorm.passes.registry import (
    NormSpec,
    QuantActSpec,
    norm_kinds,
    register_norm_kind,
    register_quant_act,
)
from qnorm.passes.thresholds import fold_thresholds

__all__ = [
    "CRMSNorm",
    "ChannelAffine",
    "IntFlashNorm",
    "IntFlashNormLinear",
    "NormSpec",
    "PermutedNorm",
    "PowerNorm",
    "QuantActSpec",
    "center_linear",
    "convert",
    "flashnorm",
    "fold_bn",
    "fold_bn_into",
    "fold_gain",
    "fold_powernorm",
    "fold_thresholds",
    "ln_to_rms",
    "norm_kinds",
    "quantize_per_channel",
    "register_norm_kind",
    "register_quant_act",
]
