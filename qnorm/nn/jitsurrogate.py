"""The L1 and RMS norms' surrogate gradients as compiled loops (numba, where installed).

:class:`~qnorm.nn.norms.L1LayerNorm` trains with the gradient of the true L1 norm
``y = γ (x − μ) / (c·MAD + ε) + β`` (``MAD = mean |x − μ|``, ``c = sqrt(π/2)``), and
:class:`~qnorm.nn.norms.IntRMSNorm` with that of ``y = γ x / sqrt(ms + ε)`` (``ms`` the
mean square of the row's first k elements, k = N unless partial), each clipped where
``y`` leaves the output range.  Written in torch these are a dozen and half a dozen
operations forward (torch's CPU ``rms_norm`` is composite) and as many autograd nodes
backward: on a QAT batch (512 rows of 32) ~200 µs (L1) more than ``F.layer_norm``'s
surrogate, per layer and step.  Here the forward keeps one center and one factor per
row (a compiled loop over the rows), and the backward's loop forms the normalized row
``u``, the clip mask and the vector-Jacobian product from them (``g' = g · [lo <= y <= hi]``,
``mask`` the input quantizer's straight-through mask), two passes per row:

    L1:   u = (x − μ) / D,  D = c·MAD + ε,
          ∂β = Σ_rows g',  ∂γ = Σ_rows g'·u,  ∂x = (t − mean(t)) · mask,
          t = (g'·γ − (c/N)·Σ(g'·γ·u)·sign(u)) / D        (sign(0) = 0, as torch's abs)
    RMS:  u = x·r,  r = (ms + ε)^(−1/2),
          ∂γ = Σ_rows g'·u,  ∂x_j = r·(g'_j·γ_j − [j < k]·u_j·Σ(g'·γ·u)/k) · mask

Sums are in float64, so the results are the torch graphs' gradients up to float
rounding, not bit for bit (``tests/test_nn_jitsurrogate.py`` holds them to the float64
VJP by autograd); ``y`` is evaluated in float64 for the clip (a y within an ulp or two
of a bound may be clipped where the torch graph keeps it, or the reverse, as between any
two float evaluations of it; the loops' products may be reassociated).  ``mean(t)`` is formed
from the first pass's sums, ``(Σ g'·γ − (c/N)·Σ(g'·γ·u)·Σ sign(u)) / (N·D)``, so the
second pass writes ∂x directly.  Nothing of size rows × N is kept between forward and
backward but the dequantized input itself (u in float64 would be twice its size, and
inside a training step the backward reading it back from memory cost more than
forming it again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from qnorm.nn.jitchain import _reassociating_kernel, available
from qnorm.nn.quantizer import NUMPY_FLOATS, QuantizedInput

SQRT_HALF_PI = math.sqrt(math.pi / 2)  # c: c · MAD = σ for Gaussian rows
L1, RMS = 0, 1  # the forward loop's statistic


class _Form(Protocol):
    """One surrogate's two loops: the per-row statistics, and the VJP."""

    def forward(self, rows: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
        """The center and the factor of each row (float64): u = (x − center)·factor."""

    def backward(self, g: np.ndarray, rows: np.ndarray, center: np.ndarray, factor: np.ndarray, clip: _Clip,
                 mask: np.ndarray, masked: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        """∂x, ∂γ, ∂β in ``g``'s dtype."""


@dataclass(frozen=True)
class _Clip:
    """What decides which outputs the surrogate clips: y = γu + β against [lo, hi]."""

    gamma: np.ndarray
    beta: np.ndarray
    lo: float
    hi: float


@dataclass(frozen=True)
class _L1Form:
    def forward(self, rows: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
        return _reassociating_kernel(_row_factors)(rows, eps, L1, rows.shape[1])

    def backward(self, g: np.ndarray, rows: np.ndarray, center: np.ndarray, factor: np.ndarray, clip: _Clip,
                 mask: np.ndarray, masked: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        loop = _reassociating_kernel(_l1_backward)
        return loop(g, rows, center, factor, clip.gamma, clip.beta, clip.lo, clip.hi, mask, masked)


@dataclass(frozen=True)
class _RMSForm:
    prefix: int  # k: the mean square's elements (the first k of each row)

    def forward(self, rows: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
        return _reassociating_kernel(_row_factors)(rows, eps, RMS, self.prefix)

    def backward(self, g: np.ndarray, rows: np.ndarray, center: np.ndarray, factor: np.ndarray, clip: _Clip,
                 mask: np.ndarray, masked: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        loop = _reassociating_kernel(_rms_backward)
        return loop(g, rows, factor, clip.gamma, clip.beta, clip.lo, clip.hi, mask, masked, self.prefix)


def l1_surrogate_in_graph(exact: torch.Tensor, q: QuantizedInput, weight: torch.Tensor | None,
                          bias: torch.Tensor | None, eps: float, lo: float, hi: float) -> torch.Tensor | None:  # fmt: skip
    """``exact`` with the clipped L1 surrogate's gradient at ``q.dequant`` (the layer's
    :func:`~qnorm.nn.surrogate.surrogate_in_graph` for L1LayerNorm), or None where the
    loops do not apply (:func:`_compiled_in_graph`)."""
    return _compiled_in_graph(_L1Form(), exact, q, weight, bias, eps, lo, hi)


def rms_surrogate_in_graph(exact: torch.Tensor, q: QuantizedInput, weight: torch.Tensor | None, prefix: int,
                           eps: float, lo: float, hi: float) -> torch.Tensor | None:  # fmt: skip
    """``exact`` with the clipped (partial) RMS surrogate's gradient at ``q.dequant``, the
    mean square over each row's first ``prefix`` elements, or None where the loops do not
    apply (:func:`_compiled_in_graph`)."""
    return _compiled_in_graph(_RMSForm(prefix), exact, q, weight, None, eps, lo, hi)


# Host code that calls numba: one opaque call under torch.compile (Dynamo cannot trace the loops).
@torch.compiler.disable
def _compiled_in_graph(form: _Form, exact: torch.Tensor, q: QuantizedInput, weight: torch.Tensor | None,
                       bias: torch.Tensor | None, eps: float, lo: float, hi: float) -> torch.Tensor | None:  # fmt: skip
    """``form``'s gradient on ``exact``, or None where the loops do not apply: numba
    missing, a tensor off the CPU or of another float dtype than float32/float64,
    parameters in another dtype than the input."""
    value = q.value
    if not available() or value.device.type != "cpu" or value.dtype not in NUMPY_FLOATS:
        return None
    params = [p for p in (weight, bias) if p is not None]
    if any(p.device.type != "cpu" or p.dtype != value.dtype for p in params):
        return None
    w = weight if weight is not None else torch.ones(value.shape[-1], dtype=value.dtype)
    return _CompiledSurrogate.apply(form, exact, q.dequant, q.pass_mask, float(eps), float(lo), float(hi), value, w,
                                    bias)  # fmt: skip


class _CompiledSurrogate(torch.autograd.Function):
    """Forward: ``exact`` as it is.  Backward: the clipped surrogate's VJP (module docstring)."""

    @staticmethod
    def forward(ctx: Any, form: _Form, exact: torch.Tensor, dequant: torch.Tensor, mask: torch.Tensor | None,
                eps: float, lo: float, hi: float, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        # the backward forms u from these values again; an IntQuantTensor's are the caller's
        # tensor, so it is saved as torch saves a graph's tensors: changed in place, the
        # backward raises instead of reading other values
        held = dequant.detach().contiguous()
        ctx.save_for_backward(held)
        rows = held.numpy().reshape(-1, dequant.shape[-1])
        center, factor = form.forward(rows, eps)
        # γ and β as the forward saw them (the torch graph saves them too)
        gamma = weight.detach().numpy().copy()
        beta = np.zeros(rows.shape[1], dtype=rows.dtype) if bias is None else bias.detach().numpy().copy()
        # no mask (IntQuantTensor input): a 1×1 stand-in the backward does not read
        stand_in = np.ones((1, 1), dtype=rows.dtype)
        ctx.saved = (center, factor, _Clip(gamma, beta, lo, hi),
                     stand_in if mask is None else mask.contiguous().numpy().reshape(rows.shape))  # fmt: skip
        ctx.form, ctx.masked, ctx.shape = form, mask is not None, x.shape
        return exact

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (held,) = ctx.saved_tensors  # torch checks here that it was not changed in place
        center, factor, clip, mask = ctx.saved
        rows = held.numpy().reshape(-1, held.shape[-1])
        g = grad.contiguous().numpy().reshape(rows.shape)
        gx, gw, gb = ctx.form.backward(g, rows, center, factor, clip, mask, ctx.masked)
        needs = ctx.needs_input_grad  # form, exact, dequant, mask, eps, lo, hi, x, weight, bias
        dx = torch.from_numpy(gx).view(ctx.shape) if needs[7] else None
        dw = torch.from_numpy(gw) if needs[8] else None
        db = torch.from_numpy(gb) if needs[9] else None
        return None, None, None, None, None, None, None, dx, dw, db


def _l1_backward(g, x, center, inv_d, gamma, beta, lo, hi, mask, masked):  # noqa: ANN001
    """The VJP of the module docstring, row by row, in float64; returns ∂x, ∂γ (summed over
    the rows) and ∂β in the gradient's dtype.  The first pass forms u and g' (kept for the
    row only) and every sum; the second writes ∂x."""
    rows, n = g.shape
    k_scale = SQRT_HALF_PI / n
    gw = np.zeros(n, dtype=np.float64)
    gb = np.zeros(n, dtype=np.float64)
    gx = np.empty_like(g)
    u = np.empty(n, dtype=np.float64)
    gy = np.empty(n, dtype=np.float64)
    for i in range(rows):
        dot = 0.0  # Σ g'·γ·u
        weighted = 0.0  # Σ g'·γ
        signs = 0.0  # Σ sign(u)
        for j in range(n):
            uu = (x[i, j] - center[i]) * inv_d[i]
            y = np.float64(gamma[j]) * uu + beta[j]
            kept = np.float64(g[i, j]) if (y >= lo and y <= hi) else 0.0
            u[j], gy[j] = uu, kept
            gb[j] += kept
            gw[j] += kept * uu
            dot += kept * gamma[j] * uu
            weighted += kept * gamma[j]
            signs += 1.0 if uu > 0 else (-1.0 if uu < 0 else 0.0)
        k = dot * k_scale
        mean = (weighted - k * signs) * inv_d[i] / n
        for j in range(n):
            sign = 1.0 if u[j] > 0 else (-1.0 if u[j] < 0 else 0.0)
            t = (gy[j] * gamma[j] - k * sign) * inv_d[i]
            gx[i, j] = (t - mean) * (mask[i, j] if masked else 1.0)
    return gx, gw.astype(g.dtype), gb.astype(g.dtype)


def _rms_backward(g, x, r, gamma, beta, lo, hi, mask, masked, prefix):  # noqa: ANN001
    """The RMS VJP of the module docstring, row by row, in float64; returns ∂x, ∂γ (summed
    over the rows) and a zero ∂β (RMSNorm has none) in the gradient's dtype.  ``beta``:
    zeros, the clip's y = γu."""
    rows, n = g.shape
    gw = np.zeros(n, dtype=np.float64)
    gx = np.empty_like(g)
    u = np.empty(n, dtype=np.float64)
    gy = np.empty(n, dtype=np.float64)
    for i in range(rows):
        dot = 0.0
        for j in range(n):
            uu = np.float64(x[i, j]) * r[i]
            y = np.float64(gamma[j]) * uu + beta[j]
            kept = np.float64(g[i, j]) if (y >= lo and y <= hi) else 0.0
            u[j], gy[j] = uu, kept
            gw[j] += kept * uu
            dot += kept * gamma[j] * uu
        k = dot / prefix
        for j in range(n):
            t = gy[j] * gamma[j] - (k * u[j] if j < prefix else 0.0)
            gx[i, j] = r[i] * t * (mask[i, j] if masked else 1.0)
    return gx, gw.astype(g.dtype), np.zeros(n, dtype=g.dtype)


def _row_factors(x, eps, statistic, prefix):  # noqa: ANN001
    """Per row a center and a factor (float64), u = (x − center)·factor.  ``statistic`` L1:
    the mean and 1/D, D = c·MAD + ε; RMS: 0 and (ms + ε)^(−1/2), the mean square over the
    first ``prefix`` elements."""
    rows, n = x.shape
    center = np.zeros(rows, dtype=np.float64)
    factor = np.empty(rows, dtype=np.float64)
    for i in range(rows):
        if statistic == L1:
            total = 0.0
            for j in range(n):
                total += x[i, j]
            center[i] = total / n
            spread = 0.0
            for j in range(n):
                spread += abs(x[i, j] - center[i])
            factor[i] = 1.0 / (SQRT_HALF_PI * (spread / n) + eps)
        else:
            squares = 0.0
            for j in range(prefix):
                v = np.float64(x[i, j])
                squares += v * v
            factor[i] = 1.0 / math.sqrt(squares / prefix + eps)
    return center, factor
