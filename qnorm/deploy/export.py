"""The frozen model as a decomposed ExportedProgram with a dynamic batch dimension."""

from __future__ import annotations

import warnings

import torch
from torch import nn


def export(frozen: nn.Module, example: torch.Tensor) -> torch.export.ExportedProgram:
    """``torch.export`` of ``frozen`` (see :func:`qnorm.deploy.freeze`) on float32 input like
    ``example``, dimension 0 dynamic, decomposed to core ATen (the form compilers import).
    """
    if not isinstance(example, torch.Tensor) or example.dtype != torch.float32:
        got = getattr(example, "dtype", type(example).__name__)
        raise ValueError(f"the example input must be a float32 tensor, got {got}")
    if example.dim() < 1 or example.shape[0] < 1:
        raise ValueError(f"the example input needs a non-empty batch dimension, got shape {tuple(example.shape)}")
    # torch.export specializes sizes 0 and 1; a batch of 2 keeps dimension 0 symbolic.
    x = example[:1].expand(2, *example.shape[1:]).contiguous() if example.shape[0] == 1 else example
    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad(), warnings.catch_warnings():
        # torch 2.13's own pytree code trips its deprecation of LeafSpec (noise, not ours)
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        program = torch.export.export(frozen, (x,), dynamic_shapes=({0: batch},))
        return program.run_decompositions()
