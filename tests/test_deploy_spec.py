"""Model specs reach the compiler through qnorm.deploy.spec: the model zoo registers its
describer there, so compilers/ keys its cache by a model's spec without importing qnorm.train."""

from __future__ import annotations

import pytest
from torch import nn

from qnorm.deploy import spec as deploy_spec
from qnorm.train.models import build_model
from qnorm.train.models import model_spec as zoo_spec


class Tiny(nn.Linear):
    """A model of a family outside the zoo."""


def test_zoo_models_are_described_and_other_models_are_not() -> None:
    model = build_model("mixer", dim=16, depth=1, token_hidden=8, channel_hidden=16)
    assert deploy_spec.model_spec(model) == zoo_spec(model) == {"kind": "mixer", "config": zoo_spec(model)["config"]}
    assert deploy_spec.model_spec(nn.Sequential(model)) is None
    with pytest.raises(TypeError, match="Sequential is not a registered model: register its class with qnorm.train.models.register_model"):
        zoo_spec(nn.Sequential(model))


def test_a_registered_describer_describes_its_models(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deploy_spec, "_DESCRIBERS", list(deploy_spec._DESCRIBERS))

    def describe(model: nn.Module) -> dict | None:
        return {"kind": "tiny", "features": model.in_features} if isinstance(model, Tiny) else None

    deploy_spec.register_spec(describe)
    deploy_spec.register_spec(describe)  # again: asked once
    assert deploy_spec._DESCRIBERS.count(describe) == 1
    assert deploy_spec.model_spec(Tiny(3, 2)) == {"kind": "tiny", "features": 3}
    assert deploy_spec.model_spec(nn.Linear(3, 2)) is None

