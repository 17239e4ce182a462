"""Golden integer ops: each defines its op exactly (config, integer forward, ranges).

Normalizations over the last axis: IntLayerNorm (L2, exact rsqrt), L1LayerNorm
(mean absolute deviation, one reciprocal), ShiftLayerNorm (powers of two only),
IntRMSNorm (and partial RMSNorm).  The BN-folding ops (spiking neurons with
integer thresholds, multi-threshold activations) and FlashNorm (an RMSNorm fused
with the next Linear, :mod:`qnorm.ops.flashnorm`) and the elementwise GELU and SiLU
(:mod:`qnorm.ops.activation`) live in their own modules.
"""

from qnorm.ops.l1norm import L1LayerNorm, L1NormConfig
from qnorm.ops.layernorm import IntLayerNorm, LayerNormConfig
from qnorm.ops.rmsnorm import IntRMSNorm, RMSNormConfig
from qnorm.ops.shiftnorm import ShiftLayerNorm, ShiftNormConfig

NORMS = (IntLayerNorm, L1LayerNorm, ShiftLayerNorm, IntRMSNorm)

__all__ = [
    "NORMS",
    "IntLayerNorm",
    "IntRMSNorm",
    "L1LayerNorm",
    "L1NormConfig",
    "LayerNormConfig",
    "RMSNormConfig",
    "ShiftLayerNorm",
    "ShiftNormConfig",
]
