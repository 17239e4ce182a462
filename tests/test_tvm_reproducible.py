"""compilers.tvm.reproducible: the shape functions TVM's VMShapeLower emits get one store
order (slot order) whatever order the run produced, and only where that cannot change
what they compute.  The whole-model check (two cold compiles, identical bytes) is in
test_compile_model.py."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from compilers.tvm.reproducible import SHAPE_FUNC_PREFIX, relax_pipeline, sorted_stores


@T.prim_func(s_tir=True)
def shuffled(H: T.Buffer((T.int64(5),), "int64")):
    T.func_attr({"tirx.is_host_func": True})
    H[T.int64(4)] = T.int64(64) * H[T.int64(0)]
    H[T.int64(2)] = H[T.int64(0)] * T.int64(8)
    H[T.int64(3)] = T.int64(40) * H[T.int64(1)]


@T.prim_func(s_tir=True)
def in_slot_order(H: T.Buffer((T.int64(5),), "int64")):
    T.func_attr({"tirx.is_host_func": True})
    H[T.int64(2)] = H[T.int64(0)] * T.int64(8)
    H[T.int64(3)] = T.int64(40) * H[T.int64(1)]
    H[T.int64(4)] = T.int64(64) * H[T.int64(0)]


@T.prim_func(s_tir=True)
def chained(H: T.Buffer((T.int64(5),), "int64")):
    H[T.int64(4)] = T.int64(64) * H[T.int64(2)]  # reads the slot the next store writes
    H[T.int64(2)] = H[T.int64(0)] * T.int64(8)


@I.ir_module
class Dynamic:
    """Four reshapes of a dynamic batch: one shape function computing four expressions of n."""

    @R.function
    def main(x: R.Tensor(("n", 4, 16), "float32")):
        n = T.int64()
        a = R.reshape(x, R.shape([n * 4, 16]))
        b = R.reshape(x, R.shape([n * 64]))
        c = R.reshape(x, R.shape([n * 8, 8]))
        d = R.reshape(x, R.shape([n * 2, 32]))
        return (a, b, c, d)


def store_slots(func) -> list[int]:
    body = func.body
    return [int(s.indices[0].value) for s in (body.seq if hasattr(body, "seq") else [body])]


def test_independent_stores_are_sorted_by_slot() -> None:
    assert store_slots(shuffled) == [4, 2, 3]
    renamed = sorted_stores(shuffled).with_attr("global_symbol", "in_slot_order")
    tvm.ir.assert_structural_equal(renamed, in_slot_order)


def test_a_store_that_feeds_another_keeps_its_order() -> None:
    assert sorted_stores(chained).same_as(chained)


def test_the_pipeline_sorts_every_shape_function_and_the_model_still_runs() -> None:
    target = tvm.target.Target("llvm")
    with target:
        lowered = relax_pipeline()(Dynamic)
    shape_funcs = [f for gv, f in lowered.functions.items() if gv.name_hint.startswith(SHAPE_FUNC_PREFIX)]
    assert shape_funcs and max(len(store_slots(f)) for f in shape_funcs) >= 4  # TVM still names them so
    assert all(store_slots(f) == sorted(store_slots(f)) for f in shape_funcs)
    vm = relax.VirtualMachine(tvm.compile(Dynamic, target, relax_pipeline=relax_pipeline()), tvm.cpu())
    x = np.arange(3 * 64, dtype=np.float32).reshape(3, 4, 16)
    got = vm["main"](tvm.runtime.tensor(x))
    for out, shape in zip(got, [(12, 16), (192,), (24, 8), (6, 32)], strict=True):
        assert np.array_equal(out.numpy(), x.reshape(shape))
