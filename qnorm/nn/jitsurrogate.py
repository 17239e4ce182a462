"""The L1 LayerNorm's surrogate gradient as compiled loops (numba, where installed).

:class:`~qnorm.nn.norms.L1LayerNorm` trains with the gradient of the true L1 norm
``y = γ (x − μ) / (c·MAD + ε) + β`` (``MAD = mean |x − μ|``, ``c = sqrt(π/2)``), clipped
where ``y`` leaves the output range.  Written in torch that is a dozen operations
forward and as many autograd nodes backward: on a QAT batch (512 rows of 32) ~200 µs
more than ``F.layer_norm``'s surrogate, per layer and step.  Here one compiled loop
forms what the backward needs (``u = (x − μ) / D``, ``1 / D`` per row, the clip mask)
and one forms the vector-Jacobian product:

    g' = g · [lo <= y <= hi],   ∂β = Σ_rows g',   ∂γ = Σ_rows g'·u,
    ∂x = (t − mean(t)) · mask,  t = (g'·γ − (c/N)·Σ(g'·γ·u)·sign(u)) / D

(``sign(0) = 0``, as torch's ``abs`` differentiates; ``mask`` the input quantizer's
straight-through mask).  Sums are in float64, so the result is the torch graph's
gradient up to float rounding, not bit for bit (``tests/test_nn_jitsurrogate.py``
holds the two together); ``y`` is evaluated in float64 for the clip.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from qnorm.nn.jitchain import _kernel, available
from qnorm.nn.quantizer import NUMPY_FLOATS, QuantizedInput

SQRT_HALF_PI = math.sqrt(math.pi / 2)  # c: c · MAD = σ for Gaussian rows


# Host code that calls numba: one opaque call under torch.compile (Dynamo cannot trace the loops).
@torch.compiler.disable
def l1_surrogate_in_graph(
    exact: torch.Tensor,
    q: QuantizedInput,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    lo: float,
    hi: float,
) -> torch.Tensor | None:
    """``exact`` with the clipped L1 surrogate's gradient at ``q.dequant`` (the layer's
    :func:`~qnorm.nn.surrogate.surrogate_in_graph` for L1LayerNorm), or None where the
    loops do not apply: numba missing, a tensor off the CPU or of another float dtype
    than float32/float64, parameters in another dtype than the input."""
    value = q.value
    if not available() or value.device.type != "cpu" or value.dtype not in NUMPY_FLOATS:
        return None
    params = [p for p in (weight, bias) if p is not None]
    if any(p.device.type != "cpu" or p.dtype != value.dtype for p in params):
        return None
    n = value.shape[-1]
    w = weight if weight is not None else torch.ones(n, dtype=value.dtype)
    b = bias if bias is not None else torch.zeros(n, dtype=value.dtype)
    return _L1Surrogate.apply(exact, q.dequant, q.pass_mask, float(eps), float(lo), float(hi), value, w, b)


class _L1Surrogate(torch.autograd.Function):
    """Forward: ``exact`` as it is.  Backward: the clipped L1 norm's VJP (module docstring)."""

    @staticmethod
    def forward(ctx: Any, exact: torch.Tensor, dequant: torch.Tensor, mask: torch.Tensor | None, eps: float, lo: float,
                hi: float, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # fmt: skip
        rows = dequant.detach().contiguous().numpy().reshape(-1, dequant.shape[-1])
        gamma = weight.detach().numpy().copy()  # γ as the forward saw it (the torch graph saves it too)
        u, inv_d, keep = _kernel(_l1_forward)(rows, gamma, bias.detach().numpy(), eps, lo, hi)
        # no mask (IntQuantTensor input): a 1×1 stand-in the backward does not read
        stand_in = np.ones((1, 1), dtype=rows.dtype)
        ctx.saved = (u, inv_d, keep, gamma, stand_in if mask is None else mask.contiguous().numpy().reshape(rows.shape))
        ctx.masked = mask is not None
        ctx.shape = x.shape
        return exact

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        u, inv_d, keep, gamma, mask = ctx.saved
        gx, gw, gb = _kernel(_l1_backward)(grad.contiguous().numpy().reshape(u.shape), u, inv_d, keep, gamma, mask,
                                           ctx.masked)  # fmt: skip
        needs = ctx.needs_input_grad
        dx = torch.from_numpy(gx).view(ctx.shape) if needs[6] else None
        dw = torch.from_numpy(gw) if needs[7] else None
        db = torch.from_numpy(gb) if needs[8] else None
        return None, None, None, None, None, None, dx, dw, db


def _l1_forward(x, gamma, beta, eps, lo, hi):  # noqa: ANN001
    """Per row: μ, D = c·MAD + ε, u = (x − μ) / D (float64), and whether y = γu + β lies in
    [lo, hi]; returns u, 1/D per row and that mask."""
    rows, n = x.shape
    c = SQRT_HALF_PI
    u = np.empty((rows, n), dtype=np.float64)
    inv_d = np.empty(rows, dtype=np.float64)
    keep = np.empty((rows, n), dtype=np.uint8)
    for i in range(rows):
        total = 0.0
        for j in range(n):
            total += x[i, j]
        mean = total / n
        spread = 0.0
        for j in range(n):
            spread += abs(x[i, j] - mean)
        d = c * (spread / n) + eps
        inv_d[i] = 1.0 / d
        for j in range(n):
            uu = (x[i, j] - mean) / d
            u[i, j] = uu
            y = np.float64(gamma[j]) * uu + beta[j]
            keep[i, j] = 1 if (y >= lo and y <= hi) else 0
    return u, inv_d, keep


def _l1_backward(g, u, inv_d, keep, gamma, mask, masked):  # noqa: ANN001
    """The VJP of the module docstring, row by row, in float64; returns ∂x, ∂γ (summed over
    the rows) and ∂β in the gradient's dtype."""
    rows, n = g.shape
    k_scale = SQRT_HALF_PI / n
    gw = np.zeros(n, dtype=np.float64)
    gb = np.zeros(n, dtype=np.float64)
    gx = np.empty_like(g)
    t = np.empty(n, dtype=np.float64)
    for i in range(rows):
        dot = 0.0
        for j in range(n):
            gy = np.float64(g[i, j]) if keep[i, j] else 0.0
            gb[j] += gy
            gw[j] += gy * u[i, j]
            dot += gy * gamma[j] * u[i, j]
        k = dot * k_scale
        mean = 0.0
        for j in range(n):
            gy = np.float64(g[i, j]) if keep[i, j] else 0.0
            sign = 1.0 if u[i, j] > 0 else (-1.0 if u[i, j] < 0 else 0.0)
            t[j] = (gy * gamma[j] - k * sign) * inv_d[i]
            mean += t[j]
        mean /= n
        for j in range(n):
            gx[i, j] = (t[j] - mean) * (mask[i, j] if masked else 1.0)
    return gx, gw.astype(g.dtype), gb.astype(g.dtype)
