"""The activation units (IntGELU, IntSiLU) against the golden ops, bit for bit, in Amaranth's simulator."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("amaranth")

from compilers.rtl import rtl_unit
from compilers.rtl.sim import simulate
from compilers.rtl.unit import has_rtl_unit
from qnorm.ops.activation import IntActivation, IntGELU, IntSiLU
from qnorm.qformat import QFormat
from qnorm.verify.cases import case_named

TABLE_CASES = ["int_gelu.s8.s8", "int_silu.s8.s8", "int_gelu.d8.d8out.half_even"]
SEGMENT_CASES = ["int_gelu.s16.s16", "int_silu.d16.d16out.floor"]


def every_code(op: IntActivation) -> np.ndarray:
    return np.arange(op.in_fmt.lo, op.in_fmt.hi + 1, dtype=np.int64)


def segment_codes(op: IntActivation, count: int) -> np.ndarray:
    """``count`` random codes, both ends of every segment, and the codes around zero."""
    assert op.segments is not None
    lo, hi, width = op.in_fmt.lo, op.in_fmt.hi, 1 << op.segments.bits
    starts = np.arange(lo, hi + 1, width, dtype=np.int64)
    edges = np.concatenate([starts, starts + width - 1, [-1, 0, 1]])
    return np.concatenate([np.random.default_rng(12).integers(lo, hi + 1, count), edges])


@pytest.mark.parametrize("name", TABLE_CASES)
def test_table_unit_is_bit_exact_on_every_input_code(name: str) -> None:
    op = case_named(name).build()
    assert op.algorithm == "table"
    x = every_code(op)
    assert np.array_equal(simulate(rtl_unit(op), x).out, op.forward(x))


@pytest.mark.parametrize("name", SEGMENT_CASES)
def test_segment_unit_is_bit_exact_on_random_codes_and_every_segment_edge(name: str) -> None:
    op = case_named(name).build()
    assert op.algorithm == "segments"
    x = segment_codes(op, 3000)
    assert np.array_equal(simulate(rtl_unit(op), x).out, op.forward(x))


@pytest.mark.parametrize(("name", "latency"), [("int_silu.s8.s8", 2), ("int_gelu.s16.s16", 13)])
def test_unit_takes_one_element_per_clock_after_its_latency(name: str, latency: int) -> None:
    op = case_named(name).build()
    unit = rtl_unit(op)
    x = every_code(op)[:200]
    run = simulate(unit, x)
    assert unit.latency == latency and unit.elements_per_cycle == 1.0
    assert np.array_equal(run.in_cycles, np.arange(x.size))
    assert np.array_equal(run.out_cycles, np.arange(x.size) + latency)


def test_unit_holds_its_outputs_under_back_pressure() -> None:
    op = case_named("int_silu.d16.d16out.floor").build()
    x = segment_codes(op, 300)
    run = simulate(rtl_unit(op), x, out_stall_every=3)
    assert np.array_equal(run.out, op.forward(x))
    assert run.cycles > x.size * 4 // 3


def test_activations_have_an_rtl_unit() -> None:
    fmt = QFormat(8, 2.0**-4, True)
    assert has_rtl_unit(IntGELU.of(fmt, fmt)) and has_rtl_unit(IntSiLU.of(fmt, fmt))


def test_an_activation_that_changes_its_forward_is_refused() -> None:
    class Doubled(IntGELU):
        def _forward(self, x, trace):
            return 2 * super()._forward(x, trace)

    fmt = QFormat(8, 2.0**-4, True)
    with pytest.raises(NotImplementedError, match="Doubled overrides IntActivation._forward"):
        rtl_unit(Doubled(IntGELU.of(fmt, fmt).cfg))
