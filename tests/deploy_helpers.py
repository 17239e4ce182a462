"""What the whole-model deployment tests share: the two one-block integer transformers, a
briefly trained model, and the QAT model's output integers to compare a compiled one with."""

from dataclasses import replace

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from qnorm.train.data import load_digits_data
from qnorm.train.loop import seed_everything, train
from qnorm.train.models import build_model

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
