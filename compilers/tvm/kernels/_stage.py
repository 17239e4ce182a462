"""Staging of a per-element expression that also computes per-row values.

:func:`~compilers.tvm.primitives.staged_compute` cuts every shared node of an
expression DAG into a stage over the output's full index space.  In a norm's
per-element stage some shared nodes depend on the row only — z's rounding shift
K and its half ``2^(K−1)`` come from the row's exponent and are used by every
element — and a (rows, N) stage would recompute them for every element and store
them as whole vectors.  :func:`row_staged_compute`
gives such nodes a (rows,) stage instead, computed once per row; nodes that
depend on the column keep (rows, N) stages as before.  The arithmetic is
untouched: only where values are stored changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tvm
import tvm_ffi
from tvm import te, tirx

from compilers.tvm.primitives import rebuilder, shared_nodes_in_post_order


def row_staged_compute(
    rows: Any, n: int, fcompute: Callable[[Any, Any], Any], name: str
) -> te.Tensor:
    """``te.compute((rows, n), fcompute, name)`` with shared nodes staged per row or per element.

    Stages are named ``{name}_r{j}`` (per row) and ``{name}_s{j}`` (per element).
    """
    row, col = tirx.Var(f"{name}_i0", "int64"), tirx.Var(f"{name}_i1", "int64")
    root = tvm.runtime.convert(fcompute(row, col))
    stages: dict[int, te.Tensor] = {}  # node address -> stage, (rows,) or (rows, N)
    for j, node in enumerate(shared_nodes_in_post_order(root)):
        per_row = not _uses(node, col)
        shape, kind = ((rows,), "r") if per_row else ((rows, n), "s")
        stages[node.__chandle__()] = te.compute(shape, rebuilder(node, [row, col], stages), name=f"{name}_{kind}{j}")
    return te.compute((rows, n), rebuilder(root, [row, col], stages), name=name)


def _uses(node: Any, var: tirx.Var) -> bool:
    """Whether ``var`` occurs in ``node`` (one visit per DAG node)."""
    seen: set[int] = set()
    found = False

    def visit(x: Any, visitor: tvm_ffi.StructuralVisitor) -> Any:
        nonlocal found
        if found or isinstance(x, te.Tensor):
            return None
        if isinstance(x, tvm.ir.Expr):
            key = x.__chandle__()
            if key in seen:
                return None
            seen.add(key)
            if x.same_as(var):
                found = True
                return None
        return visitor.default_visit(x)

    tvm_ffi.structural_visit(node, visit)
    return found
