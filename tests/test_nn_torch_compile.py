"""The QAT layers under ``torch.compile`` (Inductor's vectorized CPU code) return the eager
integers: every integer step of their bodies must be one Inductor can generate (its
vectorized code could not widen ``torch.frexp``'s int32 exponent, which the row
bit-length once used)."""

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
