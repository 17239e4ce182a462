"""FlashNorm: the RMSNorm gain folded into the next Linear(s), 1/rms applied after the matmul.

**Float pass** (:func:`flashnorm`): ``RMSNorm(gamma) -> Linear(W)`` becomes a weightless
``RMSNorm -> Linear(W diag(gamma))``, for every Linear that consumes the norm's
output (an LLM block's q/k/v projections share one norm).  ``W'[o, i] = W[o, i]
gamma_i`` is one product of two floats of the layer's dtype, exact in float64 and
rounded once, i.e. the correctly rounded ``W * gamma``.

**Integer form**: the golden op :class:`~qnorm.ops.flashnorm.IntFlashNorm` (in
:mod:`qnorm.ops.flashnorm`, re-exported here with ``rms_eps``) and the inference
module :class:`IntFlashNormLinear` that runs it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from qnorm.nn.base import IntInference
from qnorm.ops.base import IntOp
from qnorm.ops.flashnorm import INV_FRAC, MANT_BITS, IntFlashNorm, gain_folded, rms_eps
from qnorm.passes._graph import (
    call_counts,
    check_single_call,
    dataflow,
    describe,
    module_calls,
    replace_module,
    tensor_input,
)
from qnorm.qformat import QFormat

__all__ = ["IntFlashNorm", "IntFlashNormLinear", "flashnorm", "fold_gain", "rms_eps"]


# --------------------------------------------------------------------------- float pass


def fold_gain(linear: nn.Linear, gamma: torch.Tensor) -> nn.Linear:
    """A copy of ``linear`` with weight ``W diag(gamma)`` (correctly rounded products)."""
    if gamma.shape != (linear.in_features,):
        raise ValueError(f"gain has shape {tuple(gamma.shape)}, the Linear takes {linear.in_features} inputs")
    new = copy.deepcopy(linear)
    with torch.no_grad():
        new.weight.copy_(gain_folded(linear.weight, gamma))
    return new


def flashnorm(model: nn.Module) -> nn.Module:
    """Fold every visible RMSNorm gain into the Linear(s) consuming it (module docstring).

    Returns a deep copy; ``model`` is not changed.  Every RMSNorm with a gain must
    feed only Linear layers (each called once), else ValueError; RMSNorms without a
    gain have nothing to fold and stay.  Exact in real arithmetic; the float
    deviation is measured in the tests.
    """
    graph = dataflow(model)
    counts = call_counts(graph)
    plan = []
    for node in module_calls(graph, model, nn.RMSNorm):
        norm = model.get_submodule(node.target)
        if norm.weight is None:
            continue
        if len(norm.normalized_shape) != 1:
            raise ValueError(
                f"RMSNorm {node.target!r} normalizes {tuple(norm.normalized_shape)}; FlashNorm folds a 1-D gain"
            )
        users = list(node.users)
        if not users:
            raise ValueError(
                f"the output of RMSNorm {node.target!r} is unused: there is no Linear to fold its gain into"
            )
        for user in users:
            layer = model.get_submodule(user.target) if user.op == "call_module" else None
            if not isinstance(layer, nn.Linear) or tensor_input(user, model) is not node:
                raise ValueError(
                    f"RMSNorm {node.target!r} feeds {describe(user, model)}, not a Linear taking it as input: "
                    "its gain can only be folded when every consumer is a Linear"
                )
            check_single_call(user.target, counts)
        plan.append((node.target, [u.target for u in users]))
    out = copy.deepcopy(model)
    for norm_name, linear_names in plan:
        norm = out.get_submodule(norm_name)
        for name in linear_names:
            replace_module(out, name, fold_gain(out.get_submodule(name), norm.weight))
        replace_module(out, norm_name, nn.RMSNorm(norm.normalized_shape, eps=norm.eps, elementwise_affine=False))
    return out


# --------------------------------------------------------------------------- integer form


class IntFlashNormLinear(IntInference):
    """:class:`IntFlashNorm` as an inference module: ``(..., N)`` in, ``(..., O)`` out.

    Float input is quantized with the op's fixed input format (round half up); the
    output is ``y_int * s_out`` in the input's dtype (or an IntQuantTensor).
    """

    channel_dim = -1
    min_ndim = 1
    op: IntFlashNorm

    @classmethod
    def from_modules(
        cls,
        norm: nn.RMSNorm,
        linear: nn.Linear,
        in_fmt: QFormat,
        out_fmt: QFormat,
        return_quant_tensor: bool = False,
        **kw: Any,
    ) -> IntFlashNormLinear:
        op = IntFlashNorm.from_modules(norm, linear, in_fmt, out_fmt, **kw)
        return cls(op, op.n, return_quant_tensor)

    def _constants(self, op: IntOp) -> dict[str, Any]:
        return {"weight": op.weight, "mult": op.mult, "shift": op.shift, "bias": op.bias, "eps": op.eps,
                "mant_bits": MANT_BITS, "inv_frac_bits": INV_FRAC}  # fmt: skip
