"""The qnorm QAT norm layers as :func:`~qnorm.passes.convert` kinds.

``int_ln`` (:class:`~qnorm.nn.IntLayerNorm`), ``l1`` (:class:`~qnorm.nn.L1LayerNorm`)
and ``shift`` (:class:`~qnorm.nn.ShiftLayerNorm`) replace ``nn.LayerNorm``;
``int_rms`` (:class:`~qnorm.nn.IntRMSNorm`) replaces ``nn.RMSNorm`` and CRMSNorm.
Each layer mirrors its source: gamma and beta present or absent as there, the
source's dtype and device.  IntRMSNorm has no beta, so a CRMSNorm with a non-zero
beta is refused by ``convert``.  Options (``in_fmt``, ``out_fmt``, ``rounding``,
``mantissa_terms``, ``partial``, ...) pass through to the layer.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from qnorm.nn.norms import IntLayerNorm, IntRMSNorm, L1LayerNorm, ShiftLayerNorm
from qnorm.passes.registry import NormSpec, register_norm_kind


def _mirror(spec: NormSpec, with_bias: bool) -> dict[str, Any]:
    weight = getattr(spec.source, "weight", None)
    like = {"device": weight.device, "dtype": weight.dtype} if weight is not None else {}
    flags = {"elementwise_affine": weight is not None}
    if with_bias:
        flags["bias"] = getattr(spec.source, "bias", None) is not None
    return {**flags, **like}


def int_ln(spec: NormSpec, **options: Any) -> nn.Module:
    return IntLayerNorm(spec.channels, spec.eps, **_mirror(spec, True), **options)


def l1(spec: NormSpec, **options: Any) -> nn.Module:
    return L1LayerNorm(spec.channels, spec.eps, **_mirror(spec, True), **options)


def shift(spec: NormSpec, **options: Any) -> nn.Module:
    return ShiftLayerNorm(spec.channels, spec.eps, **_mirror(spec, True), **options)


def int_rms(spec: NormSpec, **options: Any) -> nn.Module:
    return IntRMSNorm(spec.channels, spec.eps, **_mirror(spec, False), **options)


register_norm_kind("int_ln", int_ln, centered=True)
register_norm_kind("l1", l1, centered=True)
register_norm_kind("shift", shift, centered=True)
register_norm_kind("int_rms", int_rms, centered=False)
