"""PowerNorm (quadratic-mean normalization) and its inference fold to a per-channel scale.

PowerNorm (Shen et al., 2020) normalizes each channel by its quadratic mean
``psi^2 = mean(x^2)`` instead of mean and variance.  :class:`PowerNorm` is the
minimal form: in training it divides by the batch's ``sqrt(psi^2 + eps)`` (over
every axis but the channel axis, like BatchNorm without the mean) and tracks
``running_phi`` by exponential moving average; at inference it is the fixed
per-channel affine map

    y = x * s + beta,    s = gamma / sqrt(running_phi + eps)

with ``s`` computed in float64 and rounded once (:meth:`PowerNorm.inference_affine`).
:func:`fold_powernorm` replaces each PowerNorm by :class:`ChannelAffine` holding
``(s, beta)``: the same arithmetic on the same constants, so the folded model equals
the eval-mode model bit for bit.  (The paper's approximate backward and warm-up are
not reproduced: only the inference form matters to the fold.)
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from qnorm.passes._graph import replace_modules


def channel_affine(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """``x * scale + shift`` with the (C,) vectors along ``channel_dim``."""
    shape = [1] * x.dim()
    shape[channel_dim] = -1
    return x * scale.to(x.dtype).view(shape) + shift.to(x.dtype).view(shape)


def _check_channels(x: torch.Tensor, channel_dim: int, channels: int, who: str) -> None:
    if x.dim() < 2 or not -x.dim() <= channel_dim < x.dim() or x.shape[channel_dim] != channels:
        raise ValueError(f"{who} expects {channels} channels on dim {channel_dim}, got input shape {tuple(x.shape)}")


class PowerNorm(nn.Module):
    """Quadratic-mean normalization per channel (see the module docstring).

    ``channel_dim``: 1 for ``(B, C, *spatial)`` (conv), -1 for ``(B, T, C)`` (tokens).
    """

    running_phi: torch.Tensor

    def __init__(
        self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True, channel_dim: int = 1
    ) -> None:
        super().__init__()
        if not (math.isfinite(eps) and eps >= 0) or not 0 < momentum <= 1:
            raise ValueError(f"need eps >= 0 and momentum in (0, 1], got eps={eps!r}, momentum={momentum!r}")
        self.num_features, self.eps, self.momentum, self.channel_dim = (
            num_features,
            float(eps),
            float(momentum),
            channel_dim,
        )
        self.weight = nn.Parameter(torch.ones(num_features)) if affine else None
        self.bias = nn.Parameter(torch.zeros(num_features)) if affine else None
        self.register_buffer("running_phi", torch.ones(num_features))

    def inference_affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gamma / sqrt(running_phi + eps), beta)``: float64 arithmetic, one rounding."""
        phi = self.running_phi.detach().double()
        if bool((phi + self.eps <= 0).any()):
            raise ValueError("PowerNorm running_phi + eps must be positive")
        gamma = self.weight.detach().double() if self.weight is not None else torch.ones_like(phi)
        beta = self.bias.detach() if self.bias is not None else torch.zeros_like(self.running_phi)
        return (gamma / torch.sqrt(phi + self.eps)).to(self.running_phi.dtype), beta.clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_channels(x, self.channel_dim, self.num_features, "PowerNorm")
        if not self.training:
            return channel_affine(x, *self.inference_affine(), self.channel_dim)
        dim = self.channel_dim % x.dim()
        phi = x.pow(2).mean(dim=[d for d in range(x.dim()) if d != dim])
        with torch.no_grad():
            self.running_phi.mul_(1 - self.momentum).add_(self.momentum * phi.detach().to(self.running_phi.dtype))
        zeros = torch.zeros_like(phi)
        y = channel_affine(x, torch.rsqrt(phi + self.eps), zeros, dim)
        if self.weight is None:
            return y
        return channel_affine(y, self.weight, self.bias, dim)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, channel_dim={self.channel_dim}"


class ChannelAffine(nn.Module):
    """``x * scale + shift`` per channel: an inference-time norm folded to constants."""

    scale: torch.Tensor
    shift: torch.Tensor

    def __init__(self, scale: torch.Tensor, shift: torch.Tensor, channel_dim: int = 1) -> None:
        super().__init__()
        if scale.dim() != 1 or scale.shape != shift.shape:
            raise ValueError(
                f"scale and shift must be equal (C,) vectors, got {tuple(scale.shape)} and {tuple(shift.shape)}"
            )
        self.channel_dim = channel_dim
        self.register_buffer("scale", scale.detach().clone())
        self.register_buffer("shift", shift.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_channels(x, self.channel_dim, self.scale.numel(), "ChannelAffine")
        return channel_affine(x, self.scale, self.shift, self.channel_dim)

    def extra_repr(self) -> str:
        return f"{self.scale.numel()}, channel_dim={self.channel_dim}"


def fold_powernorm(model: nn.Module) -> nn.Module:
    """A deep copy with every :class:`PowerNorm` replaced by its :class:`ChannelAffine`.

    Bit-identical to ``model`` in eval mode (the same constants, the same ops).
    """

    def fold(m: nn.Module) -> nn.Module | None:
        return ChannelAffine(*m.inference_affine(), m.channel_dim) if isinstance(m, PowerNorm) else None

    return replace_modules(copy.deepcopy(model), fold)
