"""BatchNorm (eval) folded into the preceding Conv/Linear, before weight quantization.

Per output channel c, with ``a_c = gamma_c / sqrt(var_c + eps)``:

    W'[c] = W[c] * a_c,      b'_c = (b_c - mean_c) * a_c + beta_c

evaluated in float64 from the parameters' exact values and rounded once to the
layer's dtype (b = 0 without a bias; gamma = 1, beta = 0 without BN affine).  The
output channel is axis 0 of every Conv weight whatever ``groups`` is, so grouped
and depthwise convolutions need nothing special; gamma < 0 just flips a channel's
sign.  Exact in real arithmetic; in float the folded layer's output differs from
conv-then-BN by rounding (measured in the tests).

Pattern: a BatchNorm call whose one input is the output of a Conv1d/2d/3d or Linear
call that nothing else uses.  Any other BatchNorm visible in the dataflow graph is
refused with a ValueError naming it, because silently keeping a BN the caller asked
to fold is worse than stopping.  BatchNorms inside opaque layers (qnorm, Brevitas
modules, e.g. a spiking neuron's membrane BN) are part of those layers and are not
touched.  ``Linear -> BatchNorm1d`` assumes the BN sees the Linear's ``(B, C)``
output, the only layout in which BN's channel axis is the Linear's output axis.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from qnorm.passes._graph import (
    call_counts,
    check_single_call,
    dataflow,
    describe,
    module_calls,
    replace_module,
    tensor_input,
)

# The BatchNorm dimensionality each foldable layer's output has.
_BN_FOR = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3, nn.Linear: 1}
_BN_DIMS = {nn.BatchNorm1d: 1, nn.BatchNorm2d: 2, nn.BatchNorm3d: 3}


def bn_scale_shift(bn: _BatchNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a, mean, beta)`` in float64, ``a = gamma / sqrt(var + eps)``: eval BN is ``a (x - mean) + beta``."""
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError(
            "BatchNorm without running statistics (track_running_stats=False) has no inference form to fold"
        )
    var = bn.running_var.detach().double()
    if bool((var + bn.eps <= 0).any()):
        raise ValueError("BatchNorm running_var + eps must be positive to fold")
    gamma = bn.weight.detach().double() if bn.weight is not None else torch.ones_like(var)
    beta = bn.bias.detach().double() if bn.bias is not None else torch.zeros_like(var)
    return gamma / torch.sqrt(var + bn.eps), bn.running_mean.detach().double(), beta


def _bn_dims(layer: nn.Module | None) -> int | None:
    """The BatchNorm dimensionality after ``layer`` (subclasses such as Brevitas'
    QuantConv2d count: their float weight is folded before it is quantized)."""
    return next((d for t, d in _BN_FOR.items() if isinstance(layer, t)), None)


def fold_bn_into(layer: nn.Module, bn: _BatchNorm) -> nn.Module:
    """A new Conv/Linear equal (in real arithmetic) to ``bn(layer(x))`` in eval mode.

    The input modules are not changed.  The result always has a bias.
    """
    if _bn_dims(layer) is None:
        raise ValueError(f"cannot fold BatchNorm into {type(layer).__name__}; foldable: Conv1d/2d/3d, Linear")
    out_channels = layer.weight.shape[0]
    if bn.num_features != out_channels:
        raise ValueError(f"BatchNorm has {bn.num_features} channels, {type(layer).__name__} has {out_channels} outputs")
    a, mean, beta = bn_scale_shift(bn)
    w = layer.weight.detach()
    b = layer.bias.detach().double() if layer.bias is not None else torch.zeros_like(a)
    folded_w = w.double() * a.view(-1, *([1] * (w.dim() - 1)))
    folded_b = (b - mean) * a + beta
    new = copy.deepcopy(layer)
    with torch.no_grad():
        # In place: wrappers such as Brevitas' weight quantizers hold the Parameter itself.
        new.weight.copy_(folded_w)
        if new.bias is None:
            new.bias = nn.Parameter(folded_b.to(w.dtype), requires_grad=layer.weight.requires_grad)
        else:
            new.bias.copy_(folded_b)
    return new


def fold_bn(model: nn.Module) -> nn.Module:
    """Fold every visible BatchNorm into its producing Conv/Linear (see the module docstring).

    Returns a folded deep copy (the BNs become ``nn.Identity``); ``model`` is not
    changed.  The copy equals ``model`` in eval mode, in real arithmetic.
    """
    graph = dataflow(model)
    counts = call_counts(graph)
    pairs = []
    for bn_node in module_calls(graph, model, _BatchNorm):
        bn = model.get_submodule(bn_node.target)
        src = tensor_input(bn_node, model)
        layer = model.get_submodule(src.target) if src.op == "call_module" else None
        if _bn_dims(layer) is None:
            raise ValueError(
                f"BatchNorm {bn_node.target!r} follows {describe(src, model)}, not a Conv1d/2d/3d or Linear: "
                "it cannot be folded into a preceding layer"
            )
        if _BN_DIMS.get(type(bn), _bn_dims(layer)) != _bn_dims(layer):
            raise ValueError(
                f"{type(bn).__name__} {bn_node.target!r} does not match {type(layer).__name__} {src.target!r}"
            )
        others = [describe(u, model) for u in src.users if u is not bn_node]
        if others:
            raise ValueError(
                f"the output of {src.target!r} also feeds {', '.join(others)}; folding BatchNorm "
                f"{bn_node.target!r} into it would change what they see"
            )
        check_single_call(src.target, counts)
        pairs.append((src.target, bn_node.target))
    out = copy.deepcopy(model)
    for layer_name, bn_name in pairs:
        replace_module(out, layer_name, fold_bn_into(out.get_submodule(layer_name), out.get_submodule(bn_name)))
        replace_module(out, bn_name, nn.Identity())
    return out
