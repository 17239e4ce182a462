"""Row sums narrowed by the op's proven bound stay exact where the bound is reached.

L1LayerNorm's Σ|N·x − S| at N = 4096 on int8 rows is proven < 2^31 (half the
row at each end of the range reaches it), while N × max|N·x − S| is not: the
kernel sums it in int32 on that proof.  A wrong proof, or a narrowing applied
to signed terms, would wrap on the worst-case rows below.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from compilers.tvm.kernels import kernel_for
from compilers.tvm.kernels._rows import ProvenTrace, Rows
from qnorm.analysis import Interval
from qnorm.ops import L1LayerNorm
from qnorm.qformat import QFormat
from qnorm.targets import load_target

N = 4096
INT8 = QFormat(8, 0.05)


@functools.cache
def l1_op() -> L1LayerNorm:
    rng = np.random.default_rng(7)
    gamma = rng.normal(1.0, 0.1, N).astype(np.float32)
    beta = rng.normal(0.0, 0.1, N).astype(np.float32)
    return L1LayerNorm.from_float(gamma, beta, 1e-5, INT8)


def worst_rows() -> np.ndarray:
    """Rows whose Σ|N·x − S| is the proven maximum: half at each end, in several orders."""
    lo, hi = INT8.lo, INT8.hi
    halves = np.repeat([lo, hi], N // 2)
    rng = np.random.default_rng(11)
    return np.stack(
        [halves, halves[::-1], np.tile([lo, hi], N // 2), rng.permutation(halves)]
    ).astype(np.int64)


def test_l1_sum_abs_bound_is_reached_and_fits_int32():
    op = l1_op()
    bound = op.ranges()["sum_abs"]
    assert bound.hi < 2**31 <= N * op.ranges()["centered"].hi
    trace: dict = {}
    op.forward(worst_rows(), trace)
    assert np.all(trace["sum_abs"] == bound.hi)


def test_l1_kernel_sums_in_int32():
    mod = kernel_for(l1_op()).mod
    sums = [b for b in mod["main"].body.block.alloc_buffers if b.name.startswith("row_sum")]
    assert len(sums) == 2 and {str(b.dtype) for b in sums} == {"int32"}


def test_l1_kernel_exact_on_rows_reaching_the_bound():
    op = l1_op()
    x = worst_rows()
    got = kernel_for(op).build(load_target("x86_64"))(x)
    assert np.array_equal(got, op.forward(x))


def _rows(lo: int, hi: int, n: int = N, dtype: str = "int32") -> Rows:
    x = tvm.te.placeholder((tvm.te.var("rows", "int64"), n), dtype, name="x")
    return Rows.of_tensor(x, Interval(lo, hi))


def _built_dtype(s: Rows) -> str:
    return str(tvm.te.compute((s.rows,), lambda r: s.at(r, 0), name="use").dtype)


def test_non_negative_terms_sum_in_the_proven_dtype():
    s = _rows(0, 1 << 20).sum()
    assert s.dtype == "int64"
    s.bound_by(Interval(0, 2**31 - 1))
    assert s.dtype == "int32" and _built_dtype(s) == "int32"


def test_signed_terms_keep_the_wide_accumulator():
    """A partial sum of signed terms can leave the total's bound: no narrowing."""
    s = _rows(-(1 << 20), 1 << 20).sum()
    s.bound_by(Interval(-100, 100))
    assert s.iv == Interval(-100, 100) and s.dtype == "int64"
    assert _built_dtype(s) == "int64"


def test_bound_after_the_reduction_is_built_is_refused():
    s = _rows(0, 1 << 20).sum()
    _built_dtype(s)
    with pytest.raises(RuntimeError, match="after the row sum was built"):
        s.bound_by(Interval(0, 2**31 - 1))


def test_disjoint_bound_is_a_wrong_proof():
    with pytest.raises(ValueError, match="do not overlap"):
        _rows(0, 10).bound_by(Interval(20, 30))


def test_proven_trace_bounds_recorded_rows_by_name():
    trace = ProvenTrace({"total": Interval(0, 2**31 - 1)})
    s, other = _rows(0, 1 << 20).sum(), _rows(0, 1 << 20).sum()
    trace["total"] = np.asarray(s)  # as ``record`` stores it
    trace["unproven"] = np.asarray(other)
    assert s.dtype == "int32" and other.dtype == "int64"
    assert list(trace) == ["total", "unproven"]


def test_shift_runs_in_a_type_wider_than_its_amount():
    """A proven-zero value shifted by 28 must not be an int16 shift (LLVM poison)."""
    z = _rows(0, 0, 1, "int8")
    assert (z << 28).dtype == "int32" and (z >> 28).dtype == "int32"
