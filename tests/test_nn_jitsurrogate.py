"""The L1 and RMS norms' compiled surrogate gradients against the VJPs they stand for."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qnorm.nn as qnn
from qnorm.nn import jitchain
from qnorm.nn.norms import IntNorm
from qnorm.nn.quantizer import QuantizedInput
from qnorm.nn.surrogate import surrogate_in_graph
from qnorm.qformat import QFormat

pytestmark = pytest.mark.skipif(not jitchain.available(), reason="the compiled loops need the fast extra (numba)")

TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-9}  # of the largest gradient element (sums in another order)
COMPILED = "_CompiledSurrogateBackward"


def make_layer(kind: str, n: int, eps: float, affine: bool, bias: bool, dtype: torch.dtype, **kw) -> IntNorm:
    if kind == "l1":
        return qnn.L1LayerNorm(n, eps, affine, bias, dtype=dtype, **kw)
    return qnn.IntRMSNorm(n, eps, affine, partial=1.0 if kind == "rms" else 0.3, dtype=dtype, **kw)


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(["l1", "rms", "prms"]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    rows, n = draw(st.integers(1, 24)), draw(st.integers(1, 48))
    affine, bias = draw(st.booleans()), draw(st.booleans())
    out_fmt = QFormat(8, draw(st.sampled_from([2.0**-5, 2.0**-3, 0.01])))  # narrow ranges clip some outputs
    eps = draw(st.sampled_from([0.0, 1e-5, 0.1]))
    seed = draw(st.integers(0, 2**31 - 1))
    constant_rows = draw(st.lists(st.integers(0, rows - 1), max_size=3))
    masked = draw(st.booleans())
    return kind, dtype, rows, n, affine, bias, out_fmt, eps, seed, constant_rows, masked


def peak(t: torch.Tensor) -> float:
    """max |t|, 0 for an empty tensor."""
    return float(t.abs().max()) if t.numel() else 0.0


def reference(q: QuantizedInput, layer: IntNorm, config, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The clipped surrogate's VJP by autograd in float64 (the layer's float op with its
    surrogate ε, clamped to the output range, the input mask applied): ∂x, then ∂γ, ∂β
    where present."""
    lo, hi = layer.out_fmt.real_range
    xd = q.dequant.to(torch.float64, copy=True).requires_grad_()
    params = [p.detach().to(torch.float64, copy=True).requires_grad_() for p in (layer.weight, layer.bias) if p is not None]
    w = params[0] if layer.weight is not None else None
    b = params[-1] if layer.bias is not None else None
    y = layer._float_op(xd, w, b, qnn.norms.surrogate_eps(config, layer.eps)).clamp(lo, hi)
    found = torch.autograd.grad(y, [xd, *params], grad.double())
    dx = found[0] * q.pass_mask.double() if q.pass_mask is not None else found[0]
    return (dx, *found[1:])


def compiled_gradients(layer: IntNorm, x: torch.Tensor, grad: torch.Tensor, masked: bool = True):
    """The layer's compiled road on ``x`` (the quantizer's mask dropped unless ``masked``):
    its gradients for ``grad``, the float64 reference's, and the quantized input."""
    q = layer.quantize_input(x)
    if not masked:
        q = QuantizedInput(q.ints, q.fmt, q.value, q.dequant, None)
    exact, config = layer._golden_values(q)
    y = layer._compiled_gradient(exact, config, q)
    assert torch.equal(y, exact) and type(y.grad_fn).__name__ == COMPILED
    leaves = [x, *(p for p in (layer.weight, layer.bias) if p is not None)]
    return torch.autograd.grad(y, leaves, grad), reference(q, layer, config, grad), q


@given(cases())
@settings(max_examples=150, deadline=None)
def test_the_compiled_gradients_are_the_float64_vjp(case):
    """∂x, ∂γ, ∂β from the compiled loops are the clipped surrogate's VJP evaluated in
    float64, rounded once to the layer's dtype: L1, RMS and partial RMS; clipped outputs,
    constant rows (a zero deviation, D = ε, for L1), the input mask, layers without γ or β,
    ε = 0 (the surrogate's one unit) and both float dtypes.  (The torch float32 graphs they
    replace are further off on nearly constant rows, where deviations are rounding noise.)"""
    kind, dtype, rows, n, affine, bias, out_fmt, eps, seed, constant_rows, masked = case
    gen = torch.Generator().manual_seed(seed)
    layer = make_layer(kind, n, eps, affine, bias, dtype, in_fmt=QFormat(8, 0.02), out_fmt=out_fmt)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.5, 0.8, generator=gen)
    x = (torch.randn(rows, n, generator=gen, dtype=dtype) * 1.5).requires_grad_()
    with torch.no_grad():
        for r in constant_rows:
            x[r] = 0.3
    grad = torch.randn(rows, n, generator=gen, dtype=dtype)
    got, want, q = compiled_gradients(layer, x, grad, masked)
    if kind == "l1":
        # |x − μ| has a kink at 0: where an element lies within rounding of its row's mean,
        # the two sums of μ (in another order) may pick different sides of it, so ∂x of that
        # row is compared in test_an_element_on_its_rows_mean_differentiates_as_torch instead
        dev = q.dequant.double() - q.dequant.double().mean(dim=-1, keepdim=True)
        smooth = (dev.abs() > 1e-9 * (1.0 + float(q.dequant.abs().max()))).all(dim=-1) | (dev == 0).all(dim=-1)
        got, want = (got[0][smooth], *got[1:]), (want[0][smooth], *want[1:])
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
    grad = torch.tensor([[0.3, -1.0, 0.7, 0.2, -0.4], [1.0, -0.5, 0.25, 0.5, 2.0]], dtype=dtype)
    got, want, _ = compiled_gradients(layer, x, grad)
    for g, w in zip(got, want, strict=True):
        assert peak(g.double() - w) <= TOLERANCE[dtype] * peak(w)


@pytest.mark.parametrize("kind", ["l1", "rms", "prms"])
def test_the_layer_takes_the_compiled_gradient_and_trains_like_the_graph(kind):
    """A training layer's backward runs the compiled loops (one autograd node of its own),
    and its gradients are the torch graph's to float rounding."""
    gen = torch.Generator().manual_seed(7)
    layer = make_layer(kind, 32, 1e-5, True, True, torch.float32)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(1.0, 0.3, generator=gen)
    x = (torch.randn(64, 32, generator=gen) * 2).requires_grad_()
    target = torch.randn(64, 32, generator=gen)
    y = layer(x)
    assert type(y.grad_fn).__name__ == COMPILED
    leaves = [x, *layer.parameters()]
    got = torch.autograd.grad((y - target).square().sum(), leaves)
    layer.eval()  # the calibration the forward made, frozen
    q = layer.quantize_input(x)
    exact, config = layer._golden_values(q)
    graph = surrogate_in_graph(exact, layer._surrogate(config), q, tuple(layer.parameters()), fresh=True)
    want = torch.autograd.grad((graph - target).square().sum(), leaves)
    for g, w in zip(got, want, strict=True):
        assert peak(g - w) <= 2e-5 * peak(w)


@pytest.mark.parametrize("kind", ["l1", "rms"])
def test_in_another_dtype_the_graph_serves(kind):
    layer = make_layer(kind, 8, 1e-5, True, True, torch.bfloat16, in_fmt=QFormat(8, 0.02))
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    assert type(y.grad_fn).__name__ != COMPILED
    y.sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad.float()).all())


@pytest.mark.parametrize("kind", ["l1", "rms"])
def test_no_graph_without_gradients(kind):
    layer = make_layer(kind, 8, 1e-5, True, True, torch.float32, in_fmt=QFormat(8, 0.02))
    with torch.no_grad():
        assert layer(torch.randn(3, 8)).grad_fn is None
    layer.requires_grad_(False)
    assert layer(torch.randn(3, 8)).grad_fn is None


@pytest.mark.parametrize("kind", ["l1", "rms"])
def test_an_empty_batch_has_zero_gradients(kind):
    layer = make_layer(kind, 8, 1e-5, True, True, torch.float32, in_fmt=QFormat(8, 0.02))
    x = torch.zeros(0, 8, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad.shape == (0, 8) and not bool(layer.weight.grad.any())


@pytest.mark.parametrize("kind", ["l1", "rms"])
def test_an_input_changed_in_place_before_the_backward_is_refused(kind):
    """An IntQuantTensor's values are the caller's tensor, which the backward reads again:
    changed in place after the forward, the backward raises (as torch's saved tensors do)
    instead of forming another gradient."""
    pytest.importorskip("brevitas")
    from brevitas.quant_tensor import IntQuantTensor

    scale = 2.0**-5
    layer = make_layer(kind, 8, 1e-5, True, True, torch.float32, in_fmt=QFormat(8, scale))
    value = (torch.randint(-100, 100, (4, 8)).float() * scale).requires_grad_()
    inner = value * 1.0  # a non-leaf, so it may be changed in place
    qt = IntQuantTensor(inner, torch.tensor(scale), torch.tensor(0.0), torch.tensor(8.0), True, False)
    y = layer(qt)
    assert type(y.grad_fn).__name__ == COMPILED
    with torch.no_grad():
        inner.add_(scale)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
