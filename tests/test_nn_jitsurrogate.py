"""The L1 norm's compiled surrogate gradient against the torch graph it replaces."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qnorm.nn as qnn
from qnorm.nn import jitchain
from qnorm.nn.jitsurrogate import l1_surrogate_in_graph
from qnorm.nn.norms import IntNorm, surrogate_eps
from qnorm.nn.quantizer import QuantizedInput
from qnorm.qformat import QFormat

pytestmark = pytest.mark.skipif(not jitchain.available(), reason="the compiled loops need the fast extra (numba)")

TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-9}  # of the largest gradient element (sums in another order)


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    rows, n = draw(st.integers(1, 24)), draw(st.integers(1, 48))
    affine, bias = draw(st.booleans()), draw(st.booleans())
    out_fmt = QFormat(8, draw(st.sampled_from([2.0**-5, 2.0**-3, 0.01])))  # narrow ranges clip some outputs
    eps = draw(st.sampled_from([0.0, 1e-5, 0.1]))
    seed = draw(st.integers(0, 2**31 - 1))
    constant_rows = draw(st.lists(st.integers(0, rows - 1), max_size=3))
    masked = draw(st.booleans())
    return dtype, rows, n, affine, bias, out_fmt, eps, seed, constant_rows, masked


def peak(t: torch.Tensor) -> float:
    """max |t|, 0 for an empty tensor."""
    return float(t.abs().max()) if t.numel() else 0.0


def reference(q: QuantizedInput, layer: qnn.L1LayerNorm, eps: float, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The clipped L1 surrogate's VJP by autograd in float64 (the float op of the layer,
    clamped to the output range, the input mask applied): ∂x, then ∂γ, ∂β where present."""
    fmt = layer.out_fmt
    xd = q.dequant.to(torch.float64, copy=True).requires_grad_()
    params = [p.detach().to(torch.float64, copy=True).requires_grad_() for p in (layer.weight, layer.bias) if p is not None]
    w = params[0] if layer.weight is not None else None
    b = params[-1] if layer.bias is not None else None
    y = layer._float_op(xd, w, b, eps).clamp(fmt.lo * fmt.scale, fmt.hi * fmt.scale)
    found = torch.autograd.grad(y, [xd, *params], grad.double())
    dx = found[0] * q.pass_mask.double() if q.pass_mask is not None else found[0]
    return (dx, *found[1:])


@given(cases())
@settings(max_examples=120, deadline=None)
def test_the_compiled_l1_gradient_is_the_float64_vjp(case):
    """∂x, ∂γ, ∂β from the compiled loops are the clipped L1 surrogate's VJP evaluated in
    float64, rounded once to the layer's dtype: clipped outputs, constant rows (a zero
    deviation, D = ε), the input mask, layers without γ or β, ε = 0 (the surrogate's one
    unit) and both float dtypes.  (The torch float32 graph it replaces is further off on
    nearly constant rows, where its deviations are rounding noise.)"""
    dtype, rows, n, affine, bias, out_fmt, eps, seed, constant_rows, masked = case
    gen = torch.Generator().manual_seed(seed)
    layer = qnn.L1LayerNorm(n, eps, affine, bias, in_fmt=QFormat(8, 0.02), out_fmt=out_fmt, dtype=dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.5, 0.8, generator=gen)
    x = (torch.randn(rows, n, generator=gen, dtype=dtype) * 1.5).requires_grad_()
    with torch.no_grad():
        for r in constant_rows:
            x[r] = 0.3
    q = layer.quantize_input(x)
    if not masked:
        q = QuantizedInput(q.ints, q.fmt, q.value, q.dequant, None)
    exact, config = layer._golden_values(q)
    params = [p for p in (layer.weight, layer.bias) if p is not None]
    lo, hi = out_fmt.lo * out_fmt.scale, out_fmt.hi * out_fmt.scale
    eps_used = surrogate_eps(config, layer.eps)
    y = l1_surrogate_in_graph(exact, q, layer.weight, layer.bias, eps_used, lo, hi)
    assert torch.equal(y, exact)
    grad = torch.randn(rows, n, generator=gen, dtype=dtype)
    got = torch.autograd.grad(y, [x, *params], grad)
    want = reference(q, layer, eps_used, grad)
    # |x − μ| has a kink at 0: where an element lies within rounding of its row's mean, the
    # two sums of μ (in another order) may pick different sides of it, so ∂x of that row is
    # compared in test_an_element_on_its_rows_mean_differentiates_as_torch instead
    dev = q.dequant.double() - q.dequant.double().mean(dim=-1, keepdim=True)
    smooth = (dev.abs() > 1e-9 * (1.0 + float(q.dequant.abs().max()))).all(dim=-1) | (dev == 0).all(dim=-1)
    got = (got[0][smooth], *got[1:])
    want = (want[0][smooth], *want[1:])
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        # relative to the largest element, or to the output gradient's where every element is
        # rounding noise of a true 0 (∂γ on constant rows: u = 0 exactly here, ±1e-13 there)
        scale = max(peak(w), peak(grad))
        assert peak(g.double() - w) <= TOLERANCE[dtype] * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_element_on_its_rows_mean_differentiates_as_torch(dtype):
    """sign(0) = 0 at the kink of |x − μ|, as torch's ``abs`` differentiates: rows whose
    mean is one of their elements exactly (in any order of summation)."""
    layer = qnn.L1LayerNorm(5, in_fmt=QFormat(8, 0.25), dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.0, 0.5, 2.0, -1.0, 1.5]))
        layer.bias.copy_(torch.tensor([0.0, 0.25, -0.5, 0.0, 0.125]))
    x = torch.tensor([[-1.0, 0.0, 1.0, 2.0, -2.0], [0.5, 0.5, 0.5, 1.5, -0.5]], dtype=dtype, requires_grad=True)
    q = layer.quantize_input(x)
    exact, config = layer._golden_values(q)
    eps_used = surrogate_eps(config, layer.eps)
    fmt = layer.out_fmt
    y = l1_surrogate_in_graph(exact, q, layer.weight, layer.bias, eps_used, fmt.lo * fmt.scale, fmt.hi * fmt.scale)
    grad = torch.tensor([[0.3, -1.0, 0.7, 0.2, -0.4], [1.0, -0.5, 0.25, 0.5, 2.0]], dtype=dtype)
    got = torch.autograd.grad(y, [x, layer.weight, layer.bias], grad)
    for g, w in zip(got, reference(q, layer, eps_used, grad), strict=True):
        assert float((g.double() - w).abs().max()) <= TOLERANCE[dtype] * float(w.abs().max())


def test_the_layer_takes_the_compiled_gradient_and_trains_like_the_graph():
    """An L1LayerNorm's backward runs the compiled loops (one autograd node of its own), and
    its gradients are the torch graph's (IntNorm's road) to float rounding."""
    gen = torch.Generator().manual_seed(7)
    layer = qnn.L1LayerNorm(32)
    with torch.no_grad():
        layer.weight.normal_(1.0, 0.3, generator=gen)
        layer.bias.normal_(0.0, 0.3, generator=gen)
    x = (torch.randn(64, 32, generator=gen) * 2).requires_grad_()
    target = torch.randn(64, 32, generator=gen)
    y = layer(x)
    assert type(y.grad_fn).__name__ == "_L1SurrogateBackward"
    leaves = [x, layer.weight, layer.bias]
    got = torch.autograd.grad((y - target).square().sum(), leaves)
    layer.eval()  # the calibration the forward made, frozen
    q = layer.quantize_input(x)
    exact, config = layer._golden_values(q)
    want = torch.autograd.grad((IntNorm._with_gradient(layer, exact, config, q) - target).square().sum(), leaves)
    for g, w in zip(got, want, strict=True):
        assert float((g - w).abs().max()) <= 2e-5 * float(w.abs().max())


def test_off_the_cpu_or_in_another_dtype_the_graph_serves():
    layer = qnn.L1LayerNorm(8, in_fmt=QFormat(8, 0.02), dtype=torch.bfloat16)
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    assert type(y.grad_fn).__name__ != "_L1SurrogateBackward"
    y.sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad.float()).all())


def test_no_graph_without_gradients():
    layer = qnn.L1LayerNorm(8, in_fmt=QFormat(8, 0.02))
    with torch.no_grad():
        assert layer(torch.randn(3, 8)).grad_fn is None
    layer.requires_grad_(False)
    assert layer(torch.randn(3, 8)).grad_fn is None
    assert math.isfinite(float(np.abs(layer(torch.randn(3, 8)).numpy()).max()))
