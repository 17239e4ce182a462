"""torch.distributed helpers of the QAT layers: exact all-reduces and synchronized BN moments.

With a process group initialized, a training forward reduces what it learns from the
batch over the ranks (the calibrating quantizer's max |x|, the BN layers' integer sums
and their float surrogate's moments), so every replica sees the global batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def distributed() -> bool:
    """True when torch.distributed is initialized (the statistics are then synchronized in training)."""
    return dist.is_available() and dist.is_initialized()


def all_reduce_max(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The element-wise max of ``t`` over the ranks of ``group`` (a reduced copy; exact)."""
    out = t.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


class _AllReduceSum(torch.autograd.Function):
    """Differentiable sum over ranks: the gradient of a sum is the sum of the gradients."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = t.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=ctx.group)
        return out, None


def synced_moments(h: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel ``(centered, mean, biased var, count)`` of (N, C, ...) ``h`` over all ranks.

    Two all-reduces, differentiable like ``SyncBatchNorm``: the sum (with the element
    count) for the mean, then the sum of squared deviations; two passes instead of
    E[x^2] - E[x]^2 avoid cancellation, and all-reduce results are bitwise equal on
    every rank.  Shared by :func:`synced_batch_norm` and
    :class:`qnorm.train.distributed.GlooSyncBatchNorm`.
    """
    c = h.shape[1]
    dims = [0, *range(2, h.dim())]
    shape = [1, c] + [1] * (h.dim() - 2)
    total = _AllReduceSum.apply(torch.cat([h.sum(dims), h.new_tensor([h.numel() // c])]), group)
    count = total[c]
    mean = total[:c] / count
    centered = h - mean.view(shape)
    var = _AllReduceSum.apply((centered * centered).sum(dims), group) / count
    return centered, mean, var, count


def synced_batch_norm(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float, group: Any = None) -> torch.Tensor:
    """Float BN of (N, C, ...) ``h`` with the biased statistics of the batch over all ranks.

    The surrogate of a synchronized BN layer (the float twin of ``batch_stats(sync=True)``):
    with DDP's gradient averaging the gradients are those of one process on the
    concatenated batch (up to float summation order).
    """
    centered, _, var, _ = synced_moments(h, group)
    shape = [1, h.shape[1]] + [1] * (h.dim() - 2)
    return centered * torch.rsqrt(var + eps).view(shape) * w.view(shape) + b.view(shape)
