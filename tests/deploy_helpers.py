"""What the whole-model deployment tests share: the tiny mixer and SNN, the two one-block
integer transformers, a briefly trained model, a private compile cache per test module, the
skip for a missing cross toolchain, and the QAT model's output integers to compare a compiled
one with."""

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from qnorm.train.data import load_digits_data
from qnorm.train.loop import seed_everything, train
from qnorm.train.models import build_model

TINY_MIXER = {"dim": 16, "depth": 1, "token_hidden": 8, "channel_hidden": 16}
TINY_SNN = {"neuron": "int_mpbn_lif", "pow2": True, "channels": (4, 8), "time_steps": 2}

# One block keeps the compile short; the block is what the full models repeat.
TRANSFORMER_VARIANTS = {
    "gelu": {"norm": "int_ln", "integer": True, "depth": 1},
    "llama": {"norm": "int_rms", "integer": True, "mlp": "swiglu", "depth": 1},
}
# The qnorm layer classes each variant's exactness proof lists.
TRANSFORMER_INT_OPS = {
    "gelu": {"IntLayerNorm", "IntSoftmax", "IntGELU"},
    "llama": {"IntRMSNorm", "IntSoftmax", "IntSiLU"},
}


def briefly_trained(kind: str, **config) -> tuple[nn.Module, torch.Tensor]:
    """One epoch on 128 samples (bit-exactness does not need accuracy), in eval mode; the
    digits test inputs (360 samples)."""
    seed_everything(0)
    model = build_model(kind, **config)
    data = load_digits_data(model.input_layout, seed=0)
    x, y = data.train.tensors
    train(
        model,
        replace(data, train=TensorDataset(x[:128], y[:128])),
        1,
        5e-3,
        0,
        progress=False,
    )
    return model.eval(), data.test.tensors[0]


def qat_integers(model: nn.Module, x: torch.Tensor, scale: float) -> np.ndarray:
    """The QAT model's outputs as integers of the output grid (exact: a power-of-two scale)."""
    with torch.no_grad():
        k = model(x).numpy().astype(np.float64) / scale
    assert np.array_equal(k, np.rint(k))
    return k.astype(np.int32)


def private_cache(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A fresh ``QNORM_CACHE`` for one test module (a module-scoped fixture yields from it), so
    what a module compiles never comes from another module's or an earlier run's cache."""
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp(name)
        patch.setenv("QNORM_CACHE", str(path))
        yield path


def needs_tools(target: str) -> None:
    """Skip, naming the Debian packages, where ``target``'s cross toolchain is missing."""
    from compilers.tvm import cross  # imports TVM: only the modules that compile need it

    missing = cross.missing_tools(target)
    if missing is not None:
        pytest.skip(missing)
