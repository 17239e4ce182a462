"""A model class of the user's own — qnorm and Brevitas layers, not the digits zoo —
saved, compiled by ``qnorm compile --import`` and exported, bit for bit.

The module below is written to a temporary directory (as a user's package would
be) and registers its model with ``qnorm.train.models.register_model``.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("tvm")

REPO = Path(__file__).resolve().parent.parent

USER_MODULE = '''
from dataclasses import dataclass

import torch
from torch import nn

from qnorm.nn import IntRMSNorm
from qnorm.train.models import pow2_linear, register_model


@dataclass(frozen=True)
class TinyConfig:
    features: int = 12
    dim: int = 16
    classes: int = 3


class TinyNet(nn.Module):
    """linear -> integer RMSNorm -> ReLU -> linear, on power-of-two grids."""

    kind = "tiny-own"

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = pow2_linear(config.features, config.dim, 4.0)
        self.norm = IntRMSNorm(config.dim, pow2=True)
        self.head = pow2_linear(config.dim, config.classes, 4.0)

    def example_input(self, batch: int = 2) -> torch.Tensor:
        return torch.zeros(batch, self.config.features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.embed(x))))


register_model(TinyNet, TinyConfig)
'''


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "pkg"), str(REPO)])}


@pytest.fixture
def own_checkpoint(tmp_path: Path) -> tuple[Path, torch.Tensor, np.ndarray]:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "tinynet_models.py").write_text(textwrap.dedent(USER_MODULE))
    sys.path.insert(0, str(pkg))
    try:
        import tinynet_models
    finally:
        sys.path.remove(str(pkg))
    from qnorm.train.checkpoint import save_checkpoint

    torch.manual_seed(0)
    model = tinynet_models.TinyNet(tinynet_models.TinyConfig())
    model.train()(torch.randn(64, 12))  # calibrate
    model.eval()
    x = torch.randn(40, 12)
    with torch.no_grad():
        want = model(x).numpy()
    path = save_checkpoint(model, tmp_path / "ckpt")
    return path, x, want


def test_compile_own_model_through_the_cli(tmp_path, own_checkpoint):
    from compilers.tvm.graph import load_compiled

    ckpt, x, want = own_checkpoint
    out = tmp_path / "compiled"
    argv = [sys.executable, "-m", "qnorm.cli", "compile", str(ckpt), "--import", "tinynet_models", "-o", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, env=_env(tmp_path), cwd=tmp_path, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    assert "tiny-own" in done.stdout
    assert np.array_equal(load_compiled(out)(x.numpy()), want)  # bit for bit with the QAT model


def test_without_the_import_the_kind_is_named_and_refused(tmp_path, own_checkpoint):
    ckpt, _, _ = own_checkpoint
    argv = [sys.executable, "-m", "qnorm.cli", "compile", str(ckpt), "-o", str(tmp_path / "c")]
    done = subprocess.run(argv, capture_output=True, text=True, env=_env(tmp_path), cwd=tmp_path, timeout=600, check=False)
    assert done.returncode == 1
    assert "unknown model kind 'tiny-own'" in done.stderr and "--import MODULE" in done.stderr
    bad = [sys.executable, "-m", "qnorm.cli", "compile", str(ckpt), "--import", "no_such_module", "-o", str(tmp_path / "c")]
    done = subprocess.run(bad, capture_output=True, text=True, env=_env(tmp_path), cwd=tmp_path, timeout=600, check=False)
    assert done.returncode == 2 and "--import no_such_module" in done.stderr


def test_register_model_checks_the_protocol():
    from qnorm.train.models import register_model

    class NoKind(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="class attribute `kind`"):
        register_model(NoKind, object)
