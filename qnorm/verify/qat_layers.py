"""The ``qat`` column of ``qnorm verify``: the PyTorch QAT path of a golden op.

The :mod:`qnorm.nn` layer of the op's family, built from the op's float
parameters and options in eval mode: for a norm or a neuron, the layer of the
registered kind that runs the op (:func:`qnorm.nn.kinds.for_golden`: IntLayerNorm,
L1LayerNorm, ShiftLayerNorm, IntRMSNorm, MPBNLIF and its fold FoldedMPBNLIF), and
BNQuantAct and its fold MultiThresholdAct for BN + quantized activation,
IntGELU / IntSiLU (:mod:`qnorm.nn.activation`) for the activations and IntSoftmax
for softmax.  Its ``golden()`` must equal the op's integer config and constants (else FAIL: the
layer's derivation drifted), and its float32 forward on the dequantized input
must be exactly an integer times the output scale; those integers are compared.  Where the layer cannot hold the op (a β on
RMSNorm, per-neuron parameters, ...) the op's own ``_forward`` runs on torch
int64 tensors, which is what every layer computes.

Imports torch and qnorm.nn (seconds): :mod:`.backends` registers the column and
loads this module only when a case is prepared.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from qnorm import nn as qnn
from qnorm.nn.kinds import NEURON, Kind, for_golden
from qnorm.ops import IntRMSNorm, ShiftLayerNorm
from qnorm.ops._normcore import NormOp
from qnorm.ops.activation import IntActivation, IntGELU, IntSiLU
from qnorm.ops.base import IntOp
from qnorm.ops.multithreshold import BNQuant, MultiThreshold
from qnorm.ops.softmax import IntSoftmax
from qnorm.ops.spiking import FoldedLIFNeuron, MPBNNeuron
from qnorm.verify.registry import BackendError, Runner

LAYER_DTYPE = torch.float32  # the QAT layers' parameter dtype, so the dtype they are fed in training


class _NoLayer(Exception):
    """The qnorm.nn layer of the family cannot hold this op (the QAT path is then the op body)."""


def _layer_output_ints(y: torch.Tensor, scale: float) -> np.ndarray:
    """The integers a QAT output stands for; it must be exactly ``ints * scale``."""
    ints = torch.round(y / scale)
    if not torch.equal(ints * scale, y):
        bad = torch.nonzero(ints * scale != y)[0].tolist()
        raise BackendError(f"layer output {float(y[tuple(bad)])!r} at {bad} is not an integer multiple of {scale!r}")
    return ints.to(torch.int64).numpy()


def _integer_fields(op: IntOp) -> dict[str, Any]:
    """What defines an op's integer behaviour: the config and integer constants golden() must match."""
    if isinstance(op, (NormOp, IntSoftmax)):
        return {"config": op.config}
    if isinstance(op, IntActivation):
        return {"cfg": op.cfg, **op.tables}
    if isinstance(op, (BNQuant, MultiThreshold)):
        bn, fields = op.bn, {"cfg": op.cfg}
    else:
        bn, fields = op.params.bn, {"cfg": op.cfg, "v_th_q": op.params.v_th_q, "reset_sub": op.params.reset_sub}
    for name in ("gamma_m", "gamma_shift", "mean_q", "std_q", "frac_bits", "beta_q", "out_frac_bits"):
        fields[name] = getattr(bn, name)
    if isinstance(op, MultiThreshold):
        fields.update(thresholds=op.thresholds, negative=op.negative)
    return fields


def _first_difference(a: IntOp, b: IntOp) -> str | None:
    fa, fb = _integer_fields(a), _integer_fields(b)
    for name, va in fa.items():
        vb = fb[name]
        same = np.array_equal(va, vb) if isinstance(va, np.ndarray) else va == vb
        if not same:
            return name
    return None


def _uniform(values: np.ndarray, what: str) -> float:
    flat = np.unique(np.asarray(values, dtype=np.float64))
    if flat.size != 1:
        raise _NoLayer(f"per-channel {what} (the layer has one)")
    return float(flat[0])


def _per_channel(shape: tuple[int, ...]) -> int:
    if len(shape) != 1:
        raise _NoLayer(f"parameter shape {shape} (the layer is per channel)")
    return shape[0]


def _norm_layer(kind: Kind, op: NormOp) -> torch.nn.Module:
    """The norm layer of ``kind`` with the op's γ, β, ε, formats and options."""
    cfg, p = op.config, op.params
    options: dict[str, Any] = {"partial": cfg.partial} if isinstance(op, IntRMSNorm) else {}
    if isinstance(op, IntRMSNorm):
        if np.any(p.beta != 0):
            raise _NoLayer("the op has a nonzero β, the layer has none")
    else:
        options["bias"] = True
    if isinstance(op, ShiftLayerNorm):
        options["mantissa_terms"] = cfg.mantissa_terms
    layer = kind.build(cfg.n, eps=p.eps, out_fmt=op.out_fmt, in_fmt=op.in_fmt, rounding=cfg.rounding, **options)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(p.gamma))
        if layer.bias is not None:
            layer.bias.copy_(torch.from_numpy(p.beta))
    return layer.eval()


def _bn_layer(op: BNQuant | MultiThreshold) -> torch.nn.Module:
    """BNQuantAct holding the op's float BN parameters (eval mode: running statistics)."""
    ref, bn = op.reference, op.bn
    layer = qnn.BNQuantAct(
        _per_channel(bn.shape), op.out_fmt, in_fmt=op.in_fmt, rounding=op.cfg.mode, eps=_uniform(ref.eps, "eps"),
        frac_bits=bn.frac_bits, out_frac_bits=bn.out_frac_bits,
    )  # fmt: skip
    _load_bn_state(layer, ref)
    return layer.eval()


def _lif_layer(kind: Kind, op: MPBNNeuron | FoldedLIFNeuron) -> torch.nn.Module:
    """The neuron layer of ``kind`` (MPBNLIF) holding the op's float parameters and dynamics (eval mode)."""
    ref, bn, cfg = op.reference, op.params.bn, op.cfg
    layer = kind.build(
        _per_channel(bn.shape), v_th=_uniform(ref.v_th, "v_th"), leak=cfg.leak, reset=cfg.reset,
        comparator=cfg.comparator, u_rest=cfg.u_rest, membrane_bits=cfg.membrane_bits, saturate=cfg.saturate,
        max_steps=cfg.max_steps, in_fmt=cfg.in_fmt, eps=_uniform(ref.bn.eps, "eps"), frac_bits=bn.frac_bits,
        out_frac_bits=bn.out_frac_bits,
    )  # fmt: skip
    _load_bn_state(layer, ref.bn)
    return layer.eval()


def _load_bn_state(layer: torch.nn.Module, ref: Any) -> None:
    """Float BN parameters into the layer's float32 parameters and buffers."""
    with torch.no_grad():
        for dst, src in ((layer.weight, ref.gamma), (layer.bias, ref.beta)):
            dst.copy_(torch.from_numpy(src))
        layer.running_mean.copy_(torch.from_numpy(ref.mean))
        layer.running_var.copy_(torch.from_numpy(ref.var))


def _softmax_layer(op: IntSoftmax) -> torch.nn.Module:
    """qnorm.nn.IntSoftmax with the op's formats and masks (eval mode)."""
    cfg = op.config
    return qnn.IntSoftmax(
        cfg.n, cfg.out_fmt, cfg.in_fmt, causal=cfg.causal, causal_offset=cfg.causal_offset,
        query_len=cfg.query_len, padding=cfg.padding, rounding=cfg.rounding,
    ).eval()  # fmt: skip


# Layers that are no norm or neuron kind: BN + quantized activation (convert makes it
# from a BatchNorm) and the softmax.
_BN_LAYERS: dict[type, tuple[str, Callable[[Any], torch.nn.Module]]] = {
    BNQuant: ("qnorm.nn.BNQuantAct", _bn_layer),
    MultiThreshold: ("qnorm.nn.BNQuantAct(...).fold() = MultiThresholdAct", lambda op: _bn_layer(op).fold()),
    IntSoftmax: ("qnorm.nn.IntSoftmax", _softmax_layer),
}
# Folded golden ops -> the golden op whose kind's layer folds into them.
_UNFOLDED: dict[type, type] = {FoldedLIFNeuron: MPBNNeuron}


_ACTIVATION_LAYERS: dict[type, type[torch.nn.Module]] = {IntGELU: qnn.IntGELU, IntSiLU: qnn.IntSiLU}


def _activation_layer(op: IntActivation) -> torch.nn.Module:
    """The activation layer of the op's class with its formats and rounding (eval mode)."""
    layer = _ACTIVATION_LAYERS[type(op)]
    return layer(in_fmt=op.in_fmt, out_fmt=op.out_fmt, rounding=op.cfg.rounding, algorithm=op.cfg.algorithm).eval()


def _layer_for(op: IntOp) -> tuple[str, Callable[[Any], torch.nn.Module]] | None:
    """(layer description, module factory) of the op's family; None where no qnorm.nn layer runs it."""
    if type(op) in _ACTIVATION_LAYERS:
        return f"qnorm.nn.activation.{_ACTIVATION_LAYERS[type(op)].__name__}", _activation_layer
    if type(op) in _BN_LAYERS:
        return _BN_LAYERS[type(op)]
    unfolded = _UNFOLDED.get(type(op), type(op))
    kind = for_golden(unfolded)
    if kind is None or kind.layer is None:
        return None
    build = functools.partial(_lif_layer if kind.role == NEURON else _norm_layer, kind)
    desc = f"qnorm.nn.{kind.layer.__name__}"
    if unfolded is type(op):
        return desc, build
    return f"{desc}(...).fold()", lambda o: build(o).fold()


def _op_body_runner(op: IntOp, why: str) -> Runner:
    """The golden op's own ``_forward`` on torch int64: what every QAT layer computes."""
    return Runner(
        lambda x: op._forward(torch.from_numpy(op.in_fmt.check(x)), None).numpy(),
        f"golden op body on torch int64 ({why})",
    )


def prepare(op: IntOp) -> Runner:
    """The ``qat`` column's runner for ``op``: its qnorm.nn layer in eval mode, or the op body."""
    found = _layer_for(op)
    if found is None:
        return _op_body_runner(op, "no qnorm.nn layer for this family")
    desc, factory = found
    try:
        module = factory(op)
    except _NoLayer as why:
        return _op_body_runner(op, f"{desc} cannot hold this op: {why}")
    diff = _first_difference(module.golden(), op)
    if diff is not None:
        raise BackendError(f"{desc}.golden() differs from the case's op in {diff!r}")

    def run(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            y = module(torch.from_numpy(op.in_fmt.dequantize(x)).to(LAYER_DTYPE))
        return _layer_output_ints(y, op.out_fmt.scale)

    return Runner(run, f"{desc}, eval mode, float32 input")
