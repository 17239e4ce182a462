"""Lower :mod:`qnorm.fixedpoint` bodies to TE/TIR without rewriting them.

The fixedpoint functions run unchanged on TE expressions: called inside a compute
lambda they build a TIR expression.  What they build is a DAG, not a tree:
``isqrt`` reuses ``rem`` and ``res`` in every one of its 32 steps, ``bit_length``
and ``rsqrt`` likewise.  TVM's passes walk expressions as trees, so the tree size
(about 5^32 nodes for ``isqrt``) never compiles, and binding the shared nodes with
``tirx.Let`` does not help either: the arithmetic analyzer substitutes let-bound
values while simplifying (a 17-let ``bit_length`` took 257 s to compile).

:func:`staged_compute` therefore cuts the DAG at every shared node: each one
becomes its own ``te.compute`` stage over the output's index space, and the
expression that used it loads the stage instead.  The arithmetic is untouched
(no rounding rule is restated here); only where values are stored changes.  The
CPU schedule (:mod:`compilers.tvm.cpu`) then places all stages inside the row
loop, so a stage is a short vector in L1, not a tensor in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tvm
import tvm_ffi
from tvm import te, tirx

_TENSOR_LOAD = tvm.ir.Op.get("te.tensor_load")


def staged_compute(shape: Sequence[Any], fcompute: Callable[..., Any], name: str) -> te.Tensor:
    """``te.compute(shape, fcompute, name)`` with every shared subexpression staged.

    Stages are named ``{name}_s0, {name}_s1, ...`` in dependency order.  Shared
    boolean subexpressions are recomputed at each use instead (comparisons of
    staged values are cheap, and bool buffers would complicate vectorization).
    """
    axes = [tirx.IterVar((0, dim), f"{name}_i{k}", 0).var for k, dim in enumerate(shape)]
    root = tvm.runtime.convert(fcompute(*axes))  # a tensor element becomes a load; an int stays
    if not isinstance(root, tvm.ir.Expr):
        return te.compute(shape, lambda *idx: root, name=name)
    shared = shared_nodes_in_post_order(root)

    stages: dict[int, te.Tensor] = {}
    for j, node in enumerate(shared):
        stages[node.__chandle__()] = te.compute(
            shape, rebuilder(node, axes, stages), name=f"{name}_s{j}"
        )
    return te.compute(shape, rebuilder(root, axes, stages), name=name)


def staged_compute_many(
    shape: Sequence[Any], fcompute: Callable[..., Sequence[Any]], names: Sequence[str]
) -> list[te.Tensor]:
    """One tensor per expression ``fcompute`` returns, sharing their common stages.

    Like :func:`staged_compute` for each expression, except that a node reached
    from more than one of them is staged once (``{names[0]}_s{j}``) instead of
    once per tensor: two results of one fixedpoint call (a split's exponent and
    mantissa, an affine's multiplier and offset) share most of their DAG.
    """
    axes = [tirx.IterVar((0, dim), f"{names[0]}_i{k}", 0).var for k, dim in enumerate(shape)]
    roots = [tvm.runtime.convert(e) for e in fcompute(*axes)]
    if len(roots) != len(names):
        raise ValueError(f"{len(roots)} expressions for {len(names)} names")
    named = {r.__chandle__(): n for r, n in zip(roots, names, strict=True) if isinstance(r, tvm.ir.Expr)}
    stages: dict[int, te.Tensor] = {}
    forest = tvm.runtime.convert([r for r in roots if isinstance(r, tvm.ir.Expr)])
    for j, node in enumerate(shared_nodes_in_post_order(forest)):
        key = node.__chandle__()  # a result another result uses is staged under its name
        stages[key] = te.compute(shape, rebuilder(node, axes, stages), name=named.get(key, f"{names[0]}_s{j}"))
    out = []
    for root, name in zip(roots, names, strict=True):
        if not isinstance(root, tvm.ir.Expr):
            out.append(te.compute(shape, _constant(root), name=name))
        elif root.__chandle__() in stages:
            out.append(stages[root.__chandle__()])
        else:
            out.append(te.compute(shape, rebuilder(root, axes, stages), name=name))
    return out


def _constant(value: Any) -> Callable[..., Any]:
    """fcompute of a stage whose every element is ``value``."""
    return lambda *idx: value


def elementwise_func(
    fn: Callable[..., Any], arity: int, cols: int, name: str = "out", dtype: str = "int64"
) -> tirx.PrimFunc:
    """``out[r, c] = fn(in0[r, c], ..., in{arity-1}[r, c])`` for any number of rows.

    Vectors are laid out as rows of ``cols`` elements: a static row length lets
    the CPU schedule vectorize every stage without a tail (see :mod:`cpu`).
    """
    rows = te.var("rows", "int64")
    ins = [te.placeholder((rows, cols), dtype, name=f"in{k}") for k in range(arity)]
    out = staged_compute((rows, cols), lambda r, c: fn(*[t[r, c] for t in ins]), name=name)
    return te.create_prim_func([*ins, out])


# --------------------------------------------------------------------------- DAG


def _is_leaf(node: Any) -> bool:
    """Nodes never worth a stage: variables, constants and tensor loads."""
    return isinstance(node, (tirx.Var, tvm.ir.Constant)) or (
        isinstance(node, tvm.ir.Call) and node.op.same_as(_TENSOR_LOAD)
    )


def _stageable(node: Any) -> bool:
    ty = getattr(node, "ty", None)
    return isinstance(ty, tvm.ir.PrimType) and str(ty) != "bool" and not _is_leaf(node)


def shared_nodes_in_post_order(root: tvm.ir.Expr) -> list[tvm.ir.Expr]:
    """Stageable nodes reached along more than one DAG edge, producers first.

    One structural visit with a visited set: each node's children are visited
    once however often the node is reused, so the walk is linear in the DAG.
    Node identity is the object's address (``__chandle__``); every node stays
    alive through ``root`` while the addresses are in use.
    """
    uses: dict[int, int] = {}
    order: list[tvm.ir.Expr] = []

    def visit(node: Any, visitor: tvm_ffi.StructuralVisitor) -> Any:
        if isinstance(node, te.Tensor):
            return None  # a producer: already a stage of its own
        if not isinstance(node, tvm.ir.Expr):
            return visitor.default_visit(node)
        key = node.__chandle__()
        if key in uses:
            uses[key] += 1
            return None
        uses[key] = 1
        stop = visitor.default_visit(node)
        order.append(node)
        return stop

    tvm_ffi.structural_visit(root, visit)
    return [n for n in order if uses[n.__chandle__()] > 1 and _stageable(n)]


def rebuilder(
    node: tvm.ir.Expr, axes: list[tirx.Var], stages: dict[int, te.Tensor]
) -> Callable[..., Any]:
    """fcompute for ``node``'s stage: ``node`` with staged children loaded and the
    placeholder ``axes`` replaced by the stage's own index variables.

    A stage may span only the leading axes (e.g. a per-row stage of a row-wise
    kernel): it is loaded with as many indices as it has dimensions.
    """
    own = node.__chandle__()
    axis_keys = [a.__chandle__() for a in axes]

    def fcompute(*idx: tirx.Var) -> Any:
        by_axis = dict(zip(axis_keys[: len(idx)], idx, strict=True))  # a stage may span leading axes only
        memo: dict[int, Any] = {}

        def mutate(x: Any, mutator: tvm_ffi.StructuralMutator) -> Any:
            if isinstance(x, te.Tensor):
                return x
            if not isinstance(x, tvm.ir.Expr):
                return mutator.default_mutate(x)
            key = x.__chandle__()
            if key in by_axis:
                return by_axis[key]
            if key != own and key in stages:
                stage = stages[key]
                return tvm.runtime.convert(stage[tuple(idx[: len(stage.shape)])])
            if key not in memo:
                memo[key] = mutator.default_mutate(x)
            return memo[key]

        return tvm_ffi.structural_mutate(node, mutate)

    return fcompute
