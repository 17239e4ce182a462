"""QAT layers: float parameters, bit-exact integer forward, surrogate backward.

Every layer's forward returns exactly ``golden_op.forward(x_int) * out_scale`` (its
golden op's own integer body, run on torch int64 tensors); its backward is the
gradient of a documented float surrogate.  ``layer.golden()`` returns the golden op
for the current parameters, ``layer.qnorm_metadata()`` a JSON-ready description, and
the BN-based layers' ``fold()`` the equivalent folded integer module.
Shared machinery (input quantizer, autograd Function, output wrapper): :mod:`qnorm.nn._qat`.
"""

from qnorm.nn._qat import BNQATModule, InputQuantizer, IntInference, IntModule, QATModule, QuantizedInput
from qnorm.nn.bnact import BNQuantAct, MultiThresholdAct
from qnorm.nn.norms import IntLayerNorm, IntRMSNorm, L1LayerNorm, ShiftLayerNorm, register_training_kinds
from qnorm.nn.spiking import MPBNLIF, FoldedMPBNLIF

__all__ = [
    "MPBNLIF",
    "BNQATModule",
    "BNQuantAct",
    "FoldedMPBNLIF",
    "InputQuantizer",
    "IntInference",
    "IntLayerNorm",
    "IntModule",
    "IntRMSNorm",
    "L1LayerNorm",
    "MultiThresholdAct",
    "QATModule",
    "QuantizedInput",
    "ShiftLayerNorm",
    "register_training_kinds",
]
