"""Byte-reproducible Relax builds: the same module compiles to the same library.

TVM 0.27's ``VMShapeLower`` emits each ``shape_func`` (the host function that
computes a dynamic model's symbolic shapes, e.g. ``64 * batch``, into the VM's
shape heap) with its stores in the iteration order of a hash map keyed by
structural hashes of TIR expressions; those hashes include object addresses, so
the order changes from one run to the next, LLVM schedules the stores
differently and the library bytes (and the linker's build id) differ although
every run computes the same values.  :func:`relax_pipeline` is TVM's default
Relax pipeline followed by :data:`sort_shape_func_stores`, which puts those
stores in slot order: one order for every run, and the same values, because a
shape function only reads the heap slots of shape variables and only writes the
slots of expressions (checked, or the function is left as it is).
"""

from __future__ import annotations

from typing import Any

import tvm
import tvm_ffi
from tvm import relax, tirx

SHAPE_FUNC_PREFIX = "shape_func"  # VMShapeLower's name for the functions it adds


@tvm.transform.module_pass(opt_level=0, name="qnorm.SortShapeFuncStores")
def sort_shape_func_stores(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Every VMShapeLower shape function of ``mod`` with its stores in slot order."""
    updates = {
        gv: sorted_stores(func)
        for gv, func in mod.functions.items()
        if gv.name_hint.startswith(SHAPE_FUNC_PREFIX) and isinstance(func, tirx.PrimFunc)
    }
    for gv, func in updates.items():
        mod[gv] = func
    return mod


def relax_pipeline() -> tvm.transform.Pass:
    """TVM's default Relax build pipeline, then :data:`sort_shape_func_stores`."""
    return tvm.transform.Sequential([relax.get_pipeline("default"), sort_shape_func_stores])


def sorted_stores(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with its stores sorted by index, when its body is only stores to
    constant indices that no store reads back; otherwise ``func`` unchanged
    (reordering could then change what it computes)."""
    body = func.body
    stores = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
    written = [_constant_index(s) for s in stores if isinstance(s, tirx.BufferStore)]
    if len(written) != len(stores) or None in written or len(set(written)) != len(written):
        return func
    read = [_constant_index(load) for s in stores for load in _loads(s.value)]
    if None in read or set(read) & set(written):
        return func
    order = sorted(range(len(stores)), key=written.__getitem__)
    return func.with_body(tirx.SeqStmt([stores[i] for i in order]))


def _constant_index(node: Any) -> int | None:
    """The single constant index of a store or load, or None."""
    indices = list(node.indices)
    if len(indices) == 1 and isinstance(indices[0], tvm.tirx.IntImm):
        return int(indices[0].value)
    return None


def _loads(expr: Any) -> list[Any]:
    found: list[Any] = []

    def visit(node: Any) -> None:
        if isinstance(node, tvm.ir.TensorLoad):
            found.append(node)

    tvm_ffi.structural_walk(expr, visit, order="pre")
    return found
