"""scikit-learn's bundled 8x8 digits as torch datasets.

The data ships inside the scikit-learn wheel, so nothing is downloaded. The split is
stratified and seeded, and the normalization constants come from the training part
only, so the test set never leaks into preprocessing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import TensorDataset

Layout = Literal["image", "tokens"]

NUM_CLASSES = 10
IMAGE_SIDE = 8
# Raw digits pixels are integers in [0, 16].
PIXEL_MAX = 16.0


@dataclass(frozen=True)
class DigitsData:
    """A seeded split of the digits set.

    `train_index` / `test_index` index the rows of `sklearn.datasets.load_digits()`,
    so the split can be checked (and reproduced) independently of the tensors.
    """

    train: TensorDataset
    test: TensorDataset
    train_index: np.ndarray
    test_index: np.ndarray
    layout: Layout
    mean: float
    std: float


def _shape(x: np.ndarray, layout: Layout) -> np.ndarray:
    if layout == "image":
        # (N, 1, 8, 8): one input channel for the convolutional SNN.
        return x.reshape(-1, 1, IMAGE_SIDE, IMAGE_SIDE)
    if layout == "tokens":
        # (N, 8, 8): each image row is one token of 8 pixel features.
        return x.reshape(-1, IMAGE_SIDE, IMAGE_SIDE)
    raise ValueError(f"unknown layout {layout!r}; expected 'image' or 'tokens'")


def load_digits_data(layout: Layout, seed: int = 0, test_fraction: float = 0.2) -> DigitsData:
    """Load digits, split stratified by class with `seed`, standardize with train stats.

    Pixels are scaled to [0, 1] and then standardized with one global mean/std over
    the training pixels (a per-pixel std would divide by zero on the always-blank
    border pixels).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    digits = load_digits()
    x = digits.data.astype(np.float32) / PIXEL_MAX
    y = digits.target.astype(np.int64)
    train_index, test_index = train_test_split(
        np.arange(len(y)), test_size=test_fraction, random_state=seed, stratify=y
    )
    mean = float(x[train_index].mean())
    std = float(x[train_index].std())
    x = (x - mean) / std

    def dataset(index: np.ndarray) -> TensorDataset:
        features = torch.from_numpy(np.ascontiguousarray(_shape(x[index], layout)))
        return TensorDataset(features, torch.from_numpy(y[index]))

    return DigitsData(
        train=dataset(train_index),
        test=dataset(test_index),
        train_index=train_index,
        test_index=test_index,
        layout=layout,
        mean=mean,
        std=std,
    )
