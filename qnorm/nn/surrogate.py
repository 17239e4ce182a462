"""The output side of the QAT layers: exact forward, surrogate backward, float or IntQuantTensor out.

:func:`exact_forward` returns ``ints * out_scale`` exactly, with the gradient of the
layer's differentiable float surrogate at the dequantized input; :func:`to_output`
wraps the result as an ``IntQuantTensor`` when a layer returns quant tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from qnorm.nn.quantizer import QuantizedInput, exact_scaled, int_quant_tensor_type
from qnorm.qformat import QFormat

Output = torch.Tensor | Any  # Any: a brevitas IntQuantTensor (brevitas is optional)
Surrogate = Callable[..., torch.Tensor]


def clip_surrogate(y: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """The surrogate's output clip: the gradient of ``y.clamp(lo, hi)``, which passes where
    ``lo <= y <= hi`` (the bounds in ``y``'s dtype) and is zero where the output saturates.

    Formed as ``hardtanh`` with bounds one step of ``y``'s dtype outside ``lo`` and ``hi``:
    its gradient passes where ``lo' < y < hi'``, the same elements, and its backward is one
    kernel where clamp's is four (two comparisons, an and, a select: ~60 µs of a QAT
    norm's forward and backward on 512 rows of 32).  Its values are clamped to that wider
    range, so a caller keeps only its gradient (every surrogate here has its value
    replaced by the exact output); its backward reads only its input.  A bound whose next
    step is infinite in ``y``'s dtype (a float16 range at its largest value) keeps clamp,
    and so does a graph ``torch.compile`` traces (its compiler fuses clamp's backward, and
    the bounds' cache is not traced).
    """
    if torch.compiler.is_compiling():
        return y.clamp(lo, hi)
    below, above = _outside(float(lo), float(hi), y.dtype)
    if not (math.isfinite(below) and math.isfinite(above)):
        return y.clamp(lo, hi)
    return F.hardtanh(y, below, above)


@functools.lru_cache(maxsize=64)
def _outside(lo: float, hi: float, dtype: torch.dtype) -> tuple[float, float]:
    """The values of ``dtype`` next below ``lo`` and next above ``hi`` (each first rounded to
    ``dtype``, as a clamp bound is), exactly representable in it."""
    bounds = torch.tensor([lo, hi], dtype=dtype)
    outward = torch.tensor([-math.inf, math.inf], dtype=dtype)
    below, above = torch.nextafter(bounds, outward).tolist()
    return below, above


class _ExactSurrogate(torch.autograd.Function):
    """Forward: ``ints * scale`` (exact).  Backward: VJP of ``surrogate`` at the dequantized input."""

    @staticmethod
    def forward(ctx: Any, ints: torch.Tensor, out_scale: float, surrogate: Surrogate, dequant: torch.Tensor,
                pass_mask: torch.Tensor | None, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # fmt: skip
        ctx.surrogate = surrogate
        ctx.has_mask = pass_mask is not None
        ctx.save_for_backward(dequant, *((pass_mask,) if ctx.has_mask else ()), *params)
        return ints.to(x.dtype) * out_scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        dequant, mask = saved[0], saved[1] if ctx.has_mask else None
        params = saved[1 + ctx.has_mask:]
        needs = ctx.needs_input_grad[5:]  # x, *params
        with torch.enable_grad():
            leaves = [dequant.detach().requires_grad_(needs[0])]
            leaves += [p.detach().requires_grad_(n) for p, n in zip(params, needs[1:], strict=True)]
            y = ctx.surrogate(*leaves)
            wanted = [t for t in leaves if t.requires_grad]
            found = iter(torch.autograd.grad(y, wanted, grad, allow_unused=True) if wanted else ())
        grads = [next(found) if t.requires_grad else None for t in leaves]
        if grads[0] is not None and mask is not None:
            grads[0] = grads[0] * mask
        return (None, None, None, None, None, *grads)


def exact_forward(
    ints: torch.Tensor, out_scale: float, surrogate: Surrogate, q: QuantizedInput, params: Sequence[torch.Tensor]
) -> torch.Tensor:
    """``ints.to(dtype) * out_scale`` with the gradient of ``surrogate(dequant, *params)``.

    ``surrogate`` must be differentiable in all its arguments and side-effect free (it
    runs again in backward); it receives the detached dequantized input and detached
    copies of ``params`` and should cast parameters to the input's dtype itself.
    """
    return _ExactSurrogate.apply(ints, float(out_scale), surrogate, q.dequant, q.pass_mask, q.value, *params)


def _with_value(t: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``t`` (a fresh result of a differentiable op) with its values replaced by
    ``value``'s, its gradient path kept.

    The copy runs outside autograd, so the graph still differentiates the op that
    made ``t``; that op's backward must not read its own output (a product, a clone,
    a clamp: they read their inputs), which the callers below guarantee.  One copy
    and no Python autograd node: this is what keeps the backward in C++."""
    with torch.no_grad():
        t.copy_(value)
    return t


def exact_forward_in_graph(
    ints: torch.Tensor,
    out_scale: float,
    surrogate: Surrogate,
    q: QuantizedInput,
    params: Sequence[torch.Tensor],
    *,
    fresh: bool = False,
) -> torch.Tensor:
    """:func:`exact_forward`'s value and gradients, the surrogate evaluated in the forward.

    The surrogate runs once, in the forward's own autograd graph, at the dequantized
    input, passed through the quantizer's straight-through estimator: ``x · mask``
    (``x`` itself without a mask) with the dequantized values written in, so the
    gradient to ``x`` is ``grad · mask``.  Its output is cloned and the exact
    ``ints * out_scale`` written into the clone: its gradient flows on unchanged.
    The gradients are those of :func:`exact_forward` (the same surrogate at the same
    point), without a second autograd pass inside the backward; the surrogate must
    not change state, as there.  Without a gradient to compute (no_grad, or nothing
    requiring one) only the exact value is formed.  ``fresh``: the surrogate's output is
    a tensor of its own whose backward does not read it (it ends in
    :func:`clip_surrogate`, which saves only its input), so the exact values are written
    into it and the clone (a copy and an autograd node per call) is skipped.
    """
    return surrogate_in_graph(exact_scaled(ints, q.value.dtype, float(out_scale)), surrogate, q, params, fresh=fresh)


def surrogate_in_graph(
    exact: torch.Tensor,
    surrogate: Surrogate,
    q: QuantizedInput,
    params: Sequence[torch.Tensor],
    *,
    fresh: bool = False,
) -> torch.Tensor:
    """:func:`exact_forward_in_graph` for an exact output already formed (``ints * out_scale``
    in the input's dtype)."""
    value = q.value
    if not torch.is_grad_enabled() or not (value.requires_grad or any(p.requires_grad for p in params)):
        return exact
    xd = q.dequant
    if value.requires_grad:
        xd = _with_value(value * q.pass_mask if q.pass_mask is not None else value.clone(), xd)
    y = surrogate(xd, *params)
    return _with_value(y if fresh else y.clone(), exact)


def to_output(y: torch.Tensor, fmt: QFormat, quant_tensor: bool, training: bool) -> Output:
    """Float ``y``, or an IntQuantTensor of it (per-tensor scale, zero point 0)."""
    if not quant_tensor:
        return y
    int_quant_tensor = int_quant_tensor_type()
    return int_quant_tensor(
        value=y,
        scale=torch.tensor(fmt.scale, dtype=y.dtype, device=y.device),
        zero_point=torch.zeros((), dtype=y.dtype, device=y.device),
        bit_width=torch.tensor(float(fmt.bits), dtype=y.dtype, device=y.device),
        signed=fmt.signed,
        training=training,
    )
