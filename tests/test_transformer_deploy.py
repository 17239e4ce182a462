"""The integer transformer deploys: IntSoftmax attention with an IntGELU MLP, and the
LLaMA-style variant (pre-RMSNorm, gated IntSiLU MLP), proven exact and compiled bit for
bit; the float-softmax transformer is still refused, with its float ops named."""

import numpy as np
import pytest
import torch
from deploy_helpers import TRANSFORMER_INT_OPS as INT_OPS
from deploy_helpers import TRANSFORMER_VARIANTS as VARIANTS
from deploy_helpers import briefly_trained, private_cache

from qnorm.deploy import NotDeployableError, export, freeze, prove_exact
from qnorm.train.experiment import _rows
from qnorm.train.families import FAMILIES
from qnorm.train.models import build_model


def layer_classes(report) -> set[str]:
    """The classes of the qnorm layers a proof lists as "name (Layer)"."""
    return {entry.rsplit("(", 1)[1].rstrip(")") for entry in report.int_ops}


def calibrated(**config) -> torch.nn.Module:
    """An untrained transformer whose qnorm layers calibrated their input scales, in eval mode."""
    model = build_model("transformer", **config)
    with torch.no_grad():
        model.train()(torch.rand(16, 8, 8))
    return model.eval()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    yield from private_cache(tmp_path_factory, "compile-cache")


@pytest.fixture(scope="module", params=list(VARIANTS))
def compiled(request, cache):
    """A briefly trained variant (bit-exactness does not need accuracy), compiled once."""
    from compilers.tvm.graph import compile_model

    model, x = briefly_trained("transformer", **VARIANTS[request.param])
    return request.param, model, x, compile_model(model, model.example_input())


def test_compiled_transformer_returns_the_qat_integers(compiled):
    variant, model, x, library = compiled
    x = x[:192]
    with torch.no_grad():
        want = model(x).numpy()
    got = library(x.numpy())
    assert got.dtype == want.dtype and np.array_equal(got, want)
    # the proof recorded with the library names every integer layer kind of the variant
    proven = {
        entry.rsplit("(", 1)[1].rstrip(")")
        for entry in library.metadata["exactness"]["int_ops"]
    }
    assert proven == INT_OPS[variant]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_full_size_integer_transformer_is_proven_exact(variant):
    model = calibrated(**{**VARIANTS[variant], "depth": 2})
    report = prove_exact(export(freeze(model), model.example_input()))
    assert layer_classes(report) == INT_OPS[variant]
    # per block: 2 norms, a softmax, an activation; plus the final norm
    assert len(report.int_ops) == 2 * 4 + 1
    assert report.tightest.headroom_bits > 0


def test_float_softmax_transformer_is_refused_naming_its_float_ops():
    model = calibrated(norm="int_ln")
    with pytest.raises(NotDeployableError) as err:
        prove_exact(export(freeze(model), model.example_input()))
    problems = "\n".join(err.value.problems)
    assert "aten._softmax (softmax) has no exact float form here" in problems
    assert "aten.gelu (GELU) has no exact float form here" in problems


def test_transformer_config_refuses_what_it_cannot_build():
    with pytest.raises(
        ValueError,
        match="the float transformer has a GELU MLP; mlp='swiglu' needs integer=True",
    ):
        build_model("transformer", mlp="swiglu")
    with pytest.raises(
        ValueError, match="unknown transformer mlp 'relu'; expected one of gelu, swiglu"
    ):
        build_model("transformer", norm="int_ln", integer=True, mlp="relu")
    with pytest.raises(
        ValueError,
        match="norm kind 'float' cannot calibrate a power-of-two input scale",
    ):
        build_model("transformer", integer=True)


def test_integer_families_are_compared_with_the_float_transformer(tmp_path):
    def summary(family: str, kind: str, accuracy: float) -> dict:
        return {
            "family": family,
            "kind": kind,
            "test_accuracy": accuracy,
            "train_seconds": 1.0,
            "integer": kind != "float",
        }

    results = [
        summary("transformer", "float", 0.95),
        summary("transformer-int", "int_ln", 0.945),
        summary("llama", "int_rms", 0.93),
    ]
    rows = {r.family: r for r in _rows(results, tmp_path)}
    assert rows["transformer"].delta_points is None
    assert (
        rows["transformer-int"].reference == "float"
        and rows["transformer-int"].delta_points == -0.5
    )
    assert rows["transformer-int"].within_goal
    assert rows["llama"].delta_points == -2.0 and rows["llama"].within_goal is False
    assert FAMILIES["transformer-int"].defaults == ("int_ln", "l1", "shift", "int_rms")
