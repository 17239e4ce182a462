"""QAT layers: float parameters, bit-exact integer forward, surrogate backward.

Every layer's forward returns exactly ``golden_op.forward(x_int) * out_scale`` (its
golden op's own integer body, run on torch int64 tensors); its backward is the
gradient of a documented float surrogate.  ``layer.golden()`` returns the golden op
for the current parameters, ``layer.qnorm_metadata()`` a JSON-ready description, and
the BN-based layers' ``fold()`` the equivalent folded integer module.
:class:`IntSoftmax` (:mod:`qnorm.nn.softmax`) is the integer softmax of attention.
Shared machinery (the recipe every layer follows, and the modules of its steps): :mod:`qnorm.nn._qat`.
The norm and neuron kinds models and conversions choose layers by: :mod:`qnorm.nn.kinds`.
"""

from qnorm.nn.activation import IntGELU, IntSiLU
from qnorm.nn.base import IntInference, IntModule, QATModule
from qnorm.nn.batchnorm import BNQATModule
from qnorm.nn.bnact import BNQuantAct, MultiThresholdAct
from qnorm.nn.kinds import register_training_kinds
from qnorm.nn.norms import IntLayerNorm, IntNorm, IntRMSNorm, L1LayerNorm, ShiftLayerNorm
from qnorm.nn.quantizer import InputQuantizer, QuantizedInput
from qnorm.nn.softmax import IntSoftmax
from qnorm.nn.spiking import MPBNLIF, FoldedMPBNLIF

__all__ = [
    "MPBNLIF",
    "BNQATModule",
    "BNQuantAct",
    "FoldedMPBNLIF",
    "InputQuantizer",
    "IntGELU",
    "IntInference",
    "IntLayerNorm",
    "IntModule",
    "IntNorm",
    "IntRMSNorm",
    "IntSiLU",
    "IntSoftmax",
    "L1LayerNorm",
    "MultiThresholdAct",
    "QATModule",
    "QuantizedInput",
    "ShiftLayerNorm",
    "register_training_kinds",
]
