"""Swap float norms for qnorm QAT layers, copying gamma, beta, eps and running statistics.

* ``nn.LayerNorm`` -> the ``norm`` kind (a mean-subtracting kind: ``int_ln``, ``l1``,
  ``shift``).  Asking for an RMS kind while LayerNorms remain is refused: that
  would drop the mean subtraction; run :func:`~qnorm.passes.crms.ln_to_rms` first
  where the input is zero-mean by construction.
* ``nn.RMSNorm`` and :class:`~qnorm.passes.crms.CRMSNorm` -> the ``rms_norm`` kind
  (``int_rms``), or ``norm`` itself when that is an RMS kind.
* Only norms convert() can swap correctly are swapped; the others are refused by
  module name with the reason (:mod:`qnorm.passes.norm_layout`).  A LayerNorm /
  RMSNorm subclass that overrides forward is exported on the input the model gives
  it for ``example_input`` (a sample model input): a channels-first norm
  (permute the channel axis last, the stock forward, permute back) becomes the qnorm
  layer inside :class:`~qnorm.passes.PermutedNorm`; any other overridden forward,
  or one with no ``example_input``, is refused.  Functional ``F.layer_norm`` /
  ``F.rms_norm`` calls in custom modules are refused (there is no module to swap):
  found by running the model on ``example_input``, or without one in its torch.fx
  graph.  A model made only of library modules (torch.nn, Brevitas, qnorm) needs
  no ``example_input``.
* BatchNorm: with ``bn_act=True``, a BatchNorm whose only consumer is a registered
  quantized activation becomes one :class:`~qnorm.nn.BNQuantAct` with the
  activation's output format and rounding (the activation becomes ``nn.Identity``):
  that is the pair the multi-threshold fold needs.  Every other BatchNorm stays a
  float BatchNorm: its place at deployment is inside the preceding Conv/Linear
  (:func:`~qnorm.passes.bn_fold.fold_bn`), which costs nothing at inference.

Kinds and activations come from :mod:`qnorm.passes.registry`.  The result is a
converted deep copy; ``model`` is not changed.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from qnorm.nn.bnact import BNQuantAct
from qnorm.passes._graph import (
    call_counts,
    dataflow,
    module_calls,
    replace_module,
    replace_modules,
)
from qnorm.passes.crms import CRMSNorm
from qnorm.passes.flashnorm import rms_eps
from qnorm.passes.norm_layout import norm_axes
from qnorm.passes.permuted import PermutedNorm
from qnorm.passes.registry import (
    NormKind,
    NormSpec,
    norm_kind,
    quant_act_spec,
    quant_act_types,
)


def norm_spec(module: nn.Module) -> NormSpec | None:
    """The :class:`NormSpec` of a LayerNorm, RMSNorm or CRMSNorm; None for other modules."""
    if isinstance(module, nn.LayerNorm):
        eps = float(module.eps)
    elif isinstance(module, nn.RMSNorm):
        eps = rms_eps(module)
    elif isinstance(module, CRMSNorm):
        eps = module.eps
    else:
        return None
    if len(module.normalized_shape) != 1:
        raise ValueError(
            f"{type(module).__name__} over {tuple(module.normalized_shape)}: qnorm layers normalize one axis"
        )
    n = module.normalized_shape[0]
    weight, bias = module.weight, getattr(module, "bias", None)
    gamma = weight.detach().clone() if weight is not None else torch.ones(n)
    beta = bias.detach().clone() if bias is not None else torch.zeros(n)
    return NormSpec(module, n, eps, gamma, beta)


def build_norm(kind: NormKind, spec: NormSpec, options: Mapping[str, Any]) -> nn.Module:
    """``kind.ctor(spec, **options)`` with gamma and beta copied in and eps checked."""
    layer = kind.ctor(spec, **options)
    for name, value, neutral in (("weight", spec.gamma, 1.0), ("bias", spec.beta, 0.0)):
        target = getattr(layer, name, None)
        if target is None:
            if bool((value != neutral).any()):
                raise ValueError(f"{type(layer).__name__} has no {name} to hold the source's non-trivial {name}")
            continue
        if target.shape != value.shape:
            raise ValueError(
                f"{type(layer).__name__}.{name} has shape {tuple(target.shape)}, the source {tuple(value.shape)}"
            )
        with torch.no_grad():
            target.copy_(value)
    if not hasattr(layer, "eps"):
        raise ValueError(f"{type(layer).__name__} has no eps attribute; a registered norm layer must expose its eps")
    if float(layer.eps) != spec.eps:
        raise ValueError(f"{type(layer).__name__} was built with eps={layer.eps}, the source has eps={spec.eps}")
    return layer


def build_bn_act(bn: _BatchNorm, act: nn.Module, options: Mapping[str, Any]) -> BNQuantAct:
    """A BNQuantAct for ``act(bn(x))``: BN parameters, running statistics, eps and momentum copied."""
    if bn.running_mean is None or bn.running_var is None or bn.num_batches_tracked is None:
        raise ValueError("a BatchNorm without running statistics cannot become a BNQuantAct")
    if bn.momentum is None:
        raise ValueError("BatchNorm momentum=None (cumulative average) has no BNQuantAct equivalent")
    spec = quant_act_spec(act)
    layer = BNQuantAct(
        bn.num_features, spec.out_fmt, rounding=spec.rounding, eps=bn.eps, momentum=bn.momentum, **options
    )
    with torch.no_grad():
        if bn.weight is not None:
            layer.weight.copy_(bn.weight)
            layer.bias.copy_(bn.bias)
        layer.running_mean.copy_(bn.running_mean)
        layer.running_var.copy_(bn.running_var)
        layer.num_batches_tracked.copy_(bn.num_batches_tracked)
    return layer.train(bn.training)


def _bn_act_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """(BatchNorm, activation) names where the BN's only consumer is a quantized activation."""
    graph = dataflow(model, quant_act_types())
    counts = call_counts(graph)
    pairs = []
    for node in module_calls(graph, model, _BatchNorm):
        users = list(node.users)
        if len(users) != 1 or users[0].op != "call_module" or users[0].args != (node,) or users[0].kwargs:
            continue
        act = users[0].target
        if quant_act_spec(model.get_submodule(act)) is not None and counts[act] == 1:
            pairs.append((node.target, act))
    return pairs


def convert(
    model: nn.Module,
    norm: str = "int_ln",
    *,
    rms_norm: str = "int_rms",
    bn_act: bool = False,
    norm_options: Mapping[str, Any] | None = None,
    bn_act_options: Mapping[str, Any] | None = None,
    example_input: Any | None = None,
) -> nn.Module:
    """A deep copy of ``model`` with its norms swapped for qnorm layers (module docstring).

    ``norm_options`` go to every norm kind's constructor, ``bn_act_options`` (e.g.
    ``in_fmt``) to every :class:`~qnorm.nn.BNQuantAct`.  ``example_input``: a sample
    input of ``model`` (a tensor, or a tuple of positional arguments), run once in
    eval mode to see its norms; needed for norms that override forward, and for
    custom modules torch.fx cannot trace.
    """
    chosen = norm_kind(norm)
    norm_options, bn_act_options = dict(norm_options or {}), dict(bn_act_options or {})
    out = copy.deepcopy(model)
    axes = norm_axes(out, example_input)
    if bn_act:
        for bn_name, act_name in _bn_act_pairs(out):
            replace_module(
                out, bn_name, build_bn_act(out.get_submodule(bn_name), out.get_submodule(act_name), bn_act_options)
            )
            replace_module(out, act_name, nn.Identity())

    def swap(module: nn.Module) -> nn.Module | None:
        spec = norm_spec(module)
        if spec is None:
            return None
        if isinstance(module, nn.LayerNorm):
            if not chosen.centered:
                raise ValueError(
                    f"norm kind {norm!r} does not subtract the mean, but the model has a LayerNorm; "
                    "pick a LayerNorm kind, or first swap zero-mean LayerNorms with qnorm.passes.ln_to_rms"
                )
            kind = chosen
        else:
            kind = chosen if not chosen.centered else norm_kind(rms_norm)
            if kind.centered:
                raise ValueError(f"rms_norm kind {rms_norm!r} subtracts the mean; an RMSNorm needs an RMS kind")
        layer = build_norm(kind, spec, norm_options)
        axis = axes.get(id(module))
        if axis is not None:
            layer = PermutedNorm(layer, axis.dim, axis.ndim)
        return layer.train(module.training)

    return replace_modules(out, swap)
