"""The QAT layers under ``torch.compile`` (Inductor's vectorized CPU code) return the eager
integers: every integer step of their bodies must be one Inductor can generate (its
vectorized code could not widen ``torch.frexp``'s int32 exponent, which the row
bit-length once used)."""

import warnings

import pytest
import torch

import qnorm.nn as qn


def calibrated(layer: torch.nn.Module, n: int) -> torch.nn.Module:
    with torch.no_grad():
        layer.train()(torch.randn(32, n, generator=torch.Generator().manual_seed(0)))
    return layer.eval()


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    [lambda: qn.IntSoftmax(64, pow2=True), lambda: qn.IntLayerNorm(64, pow2=True)],
    ids=["IntSoftmax", "IntLayerNorm"],
)
def test_compiled_layer_returns_the_eager_outputs(make) -> None:
    torch._dynamo.reset()
    layer = calibrated(make(), 64)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 3
    with torch.no_grad():
        assert torch.equal(torch.compile(layer)(x), layer(x))


@pytest.mark.slow
@pytest.mark.parametrize("make", [lambda: qn.IntLayerNorm(16), lambda: qn.L1LayerNorm(16)], ids=["IntLayerNorm", "L1"])
def test_a_layer_calibrates_and_trains_under_compile(make) -> None:
    """From an uncalibrated layer: the compiled layer calibrates on its training batches
    as the eager one does (the same buffers, the same first outputs) and trains on."""
    torch._dynamo.reset()
    eager, layer = make(), make()
    compiled = torch.compile(layer)
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        x = torch.randn(4, 16, generator=gen) * (1 + step)
        want, got = eager(x), compiled(x)
        if step == 0:
            assert torch.equal(got, want)
        assert torch.equal(layer.input_quant.running_max_abs, eager.input_quant.running_max_abs)
        got.square().sum().backward()
        assert layer.weight.grad is not None and bool(torch.isfinite(layer.weight.grad).all())


@pytest.mark.slow
def test_a_compiled_layer_does_not_recompile_for_each_batch_range() -> None:
    """The input quantizer's host logic is one opaque call: batches of one shape with other
    max |x| reuse the compiled graph (it once specialized on each batch's max |x|)."""
    torch._dynamo.reset()
    layer = calibrated(qn.IntLayerNorm(16), 16)
    compiled = torch.compile(layer)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        compiled(torch.randn(4, 16, generator=gen))
        with torch._dynamo.config.patch(error_on_recompile=True):
            for scale in (0.5, 1.5, 2.0, 3.0):
                x = torch.randn(4, 16, generator=gen) * scale
                assert torch.equal(compiled(x), layer(x))


@pytest.mark.slow
@pytest.mark.parametrize("make", [lambda: qn.IntGELU(), lambda: qn.IntSiLU()], ids=["IntGELU", "IntSiLU"])
def test_a_compiled_activation_looks_its_op_up_instead_of_tracing_the_cache(make) -> None:
    """The golden op is fetched outside the graph: Dynamo once traced through the ops
    layer's ``lru_cache`` (and warned that it ignores the cache wrapper)."""
    torch._dynamo.reset()
    layer = calibrated(make(), 16)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(4), requires_grad=True) * 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(layer)(x)
        got.sum().backward()
    assert not [w for w in caught if "lru_cache" in str(w.message)]
    assert torch.equal(got, layer(x))
