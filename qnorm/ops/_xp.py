"""Row reductions and element helpers that mean the same on numpy and torch.

Golden ops write their ``_forward`` with operators, :mod:`qnorm.fixedpoint` and
these helpers only, so the QAT layers run the identical body on torch int64 tensors
(bit-identity by construction, not by a second implementation).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def row_sum(x: Any) -> Any:
    """Sum over the last axis, keeping it (int64 in, int64 out)."""
    if is_torch(x):
        return x.sum(dim=-1, keepdim=True)
    return x.sum(axis=-1, keepdims=True, dtype=np.int64)


def absolute(x: Any) -> Any:
    return x.abs() if is_torch(x) else np.abs(x)


def take_prefix(x: Any, k: int) -> Any:
    """The first ``k`` elements of every row (partial statistics)."""
    return x[..., :k]


def take(values: Any, index: Any) -> Any:
    """``values[index]`` element-wise: a gather from a 1-D constant (a table) by an int64
    index array of any shape (numpy and torch index the same way)."""
    return values[index]


def const_like(x: Any, values: np.ndarray) -> Any:
    """An int64 constant (e.g. per-channel multipliers) on the operand's backend/device.

    An operand kind with its own ``const_like`` (the RTL generator's HDL values:
    a ROM read at the element's channel) builds the constant itself.
    """
    values = np.asarray(values, dtype=np.int64)
    own = getattr(type(x), "const_like", None)
    if own is not None:
        return own(x, values)
    if is_torch(x):
        import torch

        return torch.as_tensor(values, dtype=torch.int64, device=x.device)
    return values


def row_max(x: Any) -> Any:
    """Maximum over the last axis, keeping it."""
    if is_torch(x):
        return x.amax(dim=-1, keepdim=True)
    return x.max(axis=-1, keepdims=True)


def lookup(table: np.ndarray, idx: Any) -> Any:
    """``table[idx]`` element-wise: an int64 table read at int64 indices (on idx's backend)."""
    return const_like(idx, table)[idx]


def row_index(x: Any) -> Any:
    """Each row's position in the flattened leading axes, shape ``(*x.shape[:-1], 1)``.

    An operand kind with its own ``row_index`` (the RTL generator's HDL values: the
    unit's row counter) gives it itself."""
    own = getattr(type(x), "row_index", None)
    if own is not None:
        return own(x)
    lead = tuple(x.shape[:-1])
    count = int(np.prod(lead, dtype=np.int64))
    if is_torch(x):
        import torch

        return torch.arange(count, dtype=torch.int64, device=x.device).reshape(*lead, 1)
    return np.arange(count, dtype=np.int64).reshape(*lead, 1)


def column_index(x: Any) -> Any:
    """Each column's position in its row, shape ``(n,)`` (an operand kind with its own
    ``column_index``, the HDL values: the element's column)."""
    own = getattr(type(x), "column_index", None)
    if own is not None:
        return own(x)
    n = int(x.shape[-1])
    if is_torch(x):
        import torch

        return torch.arange(n, dtype=torch.int64, device=x.device)
    return np.arange(n, dtype=np.int64)
