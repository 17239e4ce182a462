"""LayerNorm -> RMSNorm where the input has zero mean by construction (CRMSNorm).

For a row x with mean(x) = 0, ``var(x) = mean(x^2)``, so ``LayerNorm(x) =
gamma x / sqrt(mean(x^2) + eps) + beta = CRMSNorm(x)``: the mean subtraction and
its reduction can go.  :func:`ln_to_rms` swaps a LayerNorm for :class:`CRMSNorm`
(same gamma, beta, eps) only where it can prove the zero mean from the graph:

* a Linear whose weight is mean-centred along the output axis (every column
  sums to 0) and whose bias sums to 0: ``sum_o (W x + b)_o = 0`` for every x
  (:func:`center_linear` makes a producer so; since ``LN(y) = LN(y - mean(y))``,
  centring the producer of a LayerNorm does not change the LayerNorm's output);
* a sum or difference of zero-mean values (a residual stream whose every branch
  ends in a centred projection), a zero-mean value times a number, ``nn.Identity``;
* a module or model input the caller declares zero-mean (``assume_zero_mean``).

"Sums to 0" is checked as ``|sum| <= n u sum |.|`` (u the dtype's epsilon, n the
column length): the rounding that centring in floating point leaves behind, orders
of magnitude below the column sums of an uncentred matrix.  The swapped norm
therefore matches LayerNorm to float rounding, which the tests measure in ulp.
"""

from __future__ import annotations

import copy
import numbers
import operator
from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import fx, nn

from qnorm.passes._graph import (
    dataflow,
    describe,
    module_calls,
    replace_module,
    tensor_input,
)

_SUMS = (operator.add, operator.sub, torch.add, torch.sub)
_SCALINGS = (operator.mul, torch.mul, operator.truediv, torch.div)
_NEGATIONS = (operator.neg, torch.neg)


class CRMSNorm(nn.Module):
    """``gamma x / sqrt(mean(x^2) + eps) + beta`` over the last ``len(normalized_shape)`` axes.

    LayerNorm for zero-mean input, without the mean: RMSNorm plus LayerNorm's bias.
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(self.normalized_shape)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape)) if elementwise_affine and bias else None

    @classmethod
    def from_layer_norm(cls, ln: nn.LayerNorm) -> CRMSNorm:
        new = cls(ln.normalized_shape, ln.eps, ln.weight is not None, ln.bias is not None)
        for name in ("weight", "bias"):
            src = getattr(ln, name)
            if src is not None:  # the same tensor values, dtype and device
                setattr(new, name, nn.Parameter(src.detach().clone(), requires_grad=src.requires_grad))
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, affine={self.weight is not None}, bias={self.bias is not None}"
        )


def center_linear(linear: nn.Linear) -> nn.Linear:
    """A copy of ``linear`` whose outputs have zero mean over features for every input.

    ``W <- W - mean_o W``, ``b <- b - mean(b)`` in float64, rounded once.  Changes
    the Linear's output by a per-row constant, which a LayerNorm consuming it removes.
    """
    new = copy.deepcopy(linear)
    with torch.no_grad():
        w = linear.weight.detach().double()
        new.weight.copy_(w - w.mean(dim=0, keepdim=True))
        if linear.bias is not None:
            b = linear.bias.detach().double()
            new.bias.copy_(b - b.mean())
    return new


def centred_reason(name: str, linear: nn.Linear) -> str | None:
    """None if ``linear``'s output is zero-mean by construction, else why not."""
    w = linear.weight.detach().double()
    n, u = w.shape[0], torch.finfo(linear.weight.dtype).eps
    column_sum, column_abs = w.sum(dim=0).abs(), w.abs().sum(dim=0)
    if bool((column_sum > n * u * column_abs).any()):
        worst = float((column_sum / column_abs.clamp_min(torch.finfo(torch.float64).tiny)).max())
        return f"Linear {name!r} has weight columns that do not sum to 0 (worst |sum| / sum|w| = {worst:.3g})"
    if linear.bias is not None:
        b = linear.bias.detach().double()
        if float(b.sum().abs()) > n * u * float(b.abs().sum()):
            return f"Linear {name!r} has a bias that does not sum to 0 (sum = {float(b.sum()):.3g})"
    return None


def _zero_mean_reason(node: object, root: nn.Module, assumed: Collection[str]) -> str | None:
    """None if ``node``'s value is zero-mean over its last axis by construction, else why not."""
    if not isinstance(node, fx.Node):
        return None if node == 0 else f"the constant {node!r} is not zero-mean"
    if node.op in ("placeholder", "call_module") and node.target in assumed:
        return None
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        if isinstance(module, nn.Linear):
            return centred_reason(node.target, module)
        if isinstance(module, nn.Identity):
            return _zero_mean_reason(tensor_input(node, root), root, assumed)
    if node.op == "call_function" and not node.kwargs:
        if node.target in _SUMS:
            reasons = [_zero_mean_reason(a, root, assumed) for a in node.args]
            return next((r for r in reasons if r is not None), None)
        if node.target in _NEGATIONS:
            return _zero_mean_reason(node.args[0], root, assumed)
        if node.target in _SCALINGS and len(node.args) == 2:
            value, factor = node.args
            if node.target in (operator.mul, torch.mul) and isinstance(value, numbers.Real):
                value, factor = factor, value
            if isinstance(factor, numbers.Real):
                return _zero_mean_reason(value, root, assumed)
    return f"{describe(node, root)} is not known to produce a zero-mean value"


def ln_to_rms(
    model: nn.Module, names: Collection[str] | None = None, assume_zero_mean: Collection[str] = ()
) -> nn.Module:
    """Swap LayerNorms with provably zero-mean input for :class:`CRMSNorm` (module docstring).

    ``names``: the LayerNorms (qualified names) to swap; None means every LayerNorm
    in the dataflow graph.  Each must be proven zero-mean, else ValueError saying
    why.  ``assume_zero_mean``: module names or model input names whose outputs the
    caller guarantees to be zero-mean (a LayerNorm named there is swapped without
    proof).  Returns a deep copy; ``model`` is not changed.
    """
    graph = dataflow(model)
    nodes = {n.target: n for n in module_calls(graph, model, nn.LayerNorm)}
    wanted = list(nodes) if names is None else list(names)
    missing = [n for n in wanted if n not in nodes]
    if missing:
        raise ValueError(f"no LayerNorm called {missing} in the dataflow graph; found {sorted(nodes)}")
    for name in wanted:
        if name in assume_zero_mean:
            continue
        reason = _zero_mean_reason(tensor_input(nodes[name], model), model, assume_zero_mean)
        if reason is not None:
            raise ValueError(
                f"cannot replace LayerNorm {name!r} by RMSNorm: its input is not zero-mean by construction: {reason}"
            )
    out = copy.deepcopy(model)
    for name in wanted:
        replace_module(out, name, CRMSNorm.from_layer_norm(out.get_submodule(name)))
    return out
