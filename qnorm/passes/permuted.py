"""A last-axis norm applied to another axis: the converted form of a channels-first norm.

ConvNeXt-style ``LayerNorm2d`` modules normalize the channel axis of an NCHW tensor
by permuting it last, calling the stock LayerNorm and permuting back.  The qnorm
layers normalize the last axis only, so :func:`~qnorm.passes.convert` puts the
converted layer inside :class:`PermutedNorm`, which moves ``dim`` last and back.
A row norm treats every other axis alike, so only which axis goes last matters, not
the order of the others; the input calibration (max |x| over the whole tensor) does
not depend on the layout either.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class PermutedNorm(nn.Module):
    """``norm`` over axis ``dim`` of ``ndim``-D inputs (float tensors or Brevitas IntQuantTensors).

    The rank is fixed: ``dim`` was found on an input of that rank, and the source
    module's own permutes admit no other.
    """

    def __init__(self, norm: nn.Module, dim: int, ndim: int) -> None:
        super().__init__()
        if not 0 <= dim < ndim:
            raise ValueError(f"dim must be an axis of a {ndim}-D input, got {dim}")
        self.norm = norm
        self.dim, self.ndim = dim, ndim
        self._to_last = tuple(d for d in range(ndim) if d != dim) + (dim,)
        self._back = tuple(self._to_last.index(d) for d in range(ndim))  # the inverse permutation

    def forward(self, x: Any) -> Any:
        if x.dim() != self.ndim:
            raise ValueError(
                f"{type(self).__name__} normalizes axis {self.dim} of {self.ndim}-D inputs, got shape {tuple(x.shape)}"
            )
        return self.norm(x.permute(*self._to_last)).permute(*self._back)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, ndim={self.ndim}"
