"""The softmax RTL unit (compilers.rtl.softmax) against IntSoftmax, bit for bit, in HDL simulation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("amaranth")

from compilers.rtl import rtl_unit
from compilers.rtl.unit import has_rtl_unit
from compilers.rtl.sim import simulate
from compilers.rtl.softmax import SoftmaxUnit
from qnorm.ops.softmax import IntSoftmax
from qnorm.qformat import QFormat
from qnorm.verify.cases import case_named
from qnorm.verify.vectors import edge_vectors, random_inputs

INT8_CASES = ["softmax.int8.n64", "softmax.int8.n197", "softmax.int8.n16.causal", "softmax.int8.n32.padding"]
PROBS = QFormat(8, 2.0**-8, signed=False)


def run_unit(op: IntSoftmax, x: np.ndarray, **kw) -> np.ndarray:
    return simulate(rtl_unit(op), x.reshape(-1), **kw).out.reshape(x.shape)


@pytest.mark.parametrize("name", INT8_CASES)
def test_unit_is_bit_exact_on_the_int8_cases_under_back_pressure(name: str) -> None:
    case = case_named(name)
    op = case.build()
    x = np.concatenate([random_inputs(case, np.random.default_rng(7), 3), edge_vectors(case, complete=False)[:3]])
    assert has_rtl_unit(op)
    assert np.array_equal(run_unit(op, x, out_stall_every=3), op.forward(x))



def test_fully_masked_rows_output_zeros() -> None:
    """A padding-only row, and causal rows whose offset keeps no column, give all zeros."""
    lo = -128
    pad = IntSoftmax.build(8, QFormat(8, 0.1), PROBS, padding=True)
    x = np.random.default_rng(1).integers(-4, 5, (3, 8))  # close logits: every kept p > 0
    x[1] = lo  # every key padded
    x[2, ::2] = lo
    out = run_unit(pad, x)
    assert np.array_equal(out, pad.forward(x)) and not out[1].any() and out[0].all()
    # row q keeps columns c <= q - 2: rows 0 and 1 of every 4-row matrix keep none
    causal = IntSoftmax.build(8, QFormat(8, 0.1), PROBS, causal=True, causal_offset=-2, query_len=4)
    x = np.random.default_rng(2).integers(-4, 5, (8, 8))
    out = run_unit(causal, x)
    assert np.array_equal(out, causal.forward(x))
    assert not out[[0, 1, 4, 5]].any() and out[[2, 3, 6, 7], 0].all()


def test_causal_row_count_wraps_at_a_query_length_that_is_no_power_of_two() -> None:
    """Three 3-row score matrices with a KV-cache offset and padding together: the
    unit's row counter restarts every query_len rows."""
    op = IntSoftmax.build(5, QFormat(8, 0.25), PROBS, causal=True, causal_offset=1, query_len=3, padding=True)
    x = np.random.default_rng(4).integers(-128, 128, (9, 5))
    x[4, 1] = -128
    assert np.array_equal(run_unit(op, x), op.forward(x))


@settings(max_examples=4, deadline=None)
@given(
    n=st.integers(1, 12),
    bits=st.sampled_from([4, 8]),
    scale=st.sampled_from([0.05, 0.125, 0.5]),
    out_bits=st.sampled_from([4, 8]),
    rounding=st.sampled_from(["half_up", "half_even", "floor"]),
    padding=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_softmax_units_match_the_golden_op_over_shapes_and_formats(n: int, bits: int, scale: float, out_bits: int,
                                                                   rounding: str, padding: bool, seed: int) -> None:
    op = IntSoftmax.build(n, QFormat(bits, scale), QFormat(out_bits, 2.0**-out_bits, signed=False),
                          rounding=rounding, padding=padding)
    x = np.random.default_rng(seed).integers(op.in_fmt.lo, op.in_fmt.hi + 1, (3, n))
    x[0] = op.in_fmt.hi  # a constant row: every column at the max
    assert np.array_equal(run_unit(op, x), op.forward(x))


def test_an_op_that_changes_the_softmax_forward_is_refused() -> None:
    class Custom(IntSoftmax):
        def _forward(self, x, trace):
            return super()._forward(x, trace)

    with pytest.raises(NotImplementedError, match="overrides IntSoftmax._forward"):
        SoftmaxUnit(Custom(case_named("softmax.int8.n64").build().config))




def test_a_causal_layer_readme_says_which_query_row_each_row_is() -> None:
    from compilers.rtl.project import _row_count_note

    note = _row_count_note(IntSoftmax.build(8, QFormat(8, 0.1), PROBS, causal=True, causal_offset=2, query_len=3))
    assert "query row k mod 3 of its score matrix and keeps columns c <= (k mod 3) + 2" in note
    assert _row_count_note(case_named("softmax.int8.n32.padding").build()) == ""
