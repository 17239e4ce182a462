"""The per-row offset's fraction round(D·a0 / N) in two products where D·a0 would leave the
narrow datapath's row accumulator, and what the FPGA targets hold of the per-row constants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qnorm.analysis import TargetLimitError, check_target, products
from qnorm.fixedpoint import Round, div_round
from qnorm.ops import IntLayerNorm, L1LayerNorm, ShiftLayerNorm
from qnorm.ops._normcore import NARROW_ROW_BITS, NormOp, offset_fraction
from qnorm.qformat import QFormat
from qnorm.targets import load_target
from qnorm.verify import harness
from qnorm.verify.cases import CASES, case_named

ROW_LIMIT = (1 << (NARROW_ROW_BITS - 1)) - 1  # NARROW_ROW_BITS signed bits


@settings(max_examples=400, deadline=None)
@given(
    st.integers(1, 1 << 17),
    st.integers(0, 1 << 45),
    st.integers(1, 40),
    st.sampled_from(list(Round)),
    st.data(),
)
def test_the_split_is_the_same_integer_in_every_rounding_mode(n: int, a0: int, k: int, mode: Round, data) -> None:
    d = data.draw(st.integers(0, n - 1))
    assert offset_fraction(d, a0, n, mode, k) == div_round(d * a0, n, mode) == offset_fraction(d, a0, n, mode, 0)


def test_the_split_runs_on_arrays() -> None:
    rng = np.random.default_rng(0)
    n = 65536
    d, a0 = rng.integers(0, n, 1000), rng.integers(0, 1 << 40, 1000)
    for mode in Round:
        want = [div_round(int(u) * int(v), n, mode) for u, v in zip(d, a0, strict=True)]
        assert offset_fraction(d, a0, n, mode, 9).tolist() == want


def _l1(n: int, eps: float, scale: float = 0.03) -> NormOp:
    rng = np.random.default_rng(n)
    return L1LayerNorm.from_float(rng.normal(1, 0.1, n), rng.normal(0, 0.1, n), eps, QFormat(8, scale),
                                  QFormat.power_of_two(8, -5))  # fmt: skip


def test_only_rows_whose_d_a0_leaves_the_row_accumulator_split() -> None:
    assert not [c.name for c in CASES if getattr(c.build(), "_offset_split", 0)]
    # an L1LayerNorm of LLM-like rows (max-abs scale 450 σ / 127): D·a0 reached 2^49, past the DSP48's 48 bits
    op = _l1(65536, 1e-5, scale=3.0)
    k = op.row_constants().offset_split
    assert k > 0 and (op.config.n - 1) * op.row_constants().mult.hi > ROW_LIMIT
    split = [p for p in products(op) if "(in offset)" in p.formula and p.formula != "a0·mean (in offset)"]
    assert [p.formula for p in split] == ["D·(a0 >> k) (in offset)", "ρ·2^k + D·(a0 mod 2^k) (in offset)"]
    assert all(p.result.fits(NARROW_ROW_BITS) and p.narrow_bits <= 18 for p in split)
    # the least such k: one less leaves D·(a0 >> k) beyond the accumulator
    assert (op.config.n - 1) * (op.row_constants().mult.hi >> (k - 1)) > ROW_LIMIT


@pytest.mark.parametrize("cls", [IntLayerNorm, L1LayerNorm, ShiftLayerNorm], ids=lambda c: c.__name__)
def test_the_offset_products_are_checked_at_their_width(cls) -> None:
    """a0·mean and D·a0 (or its split) are each a product the target must hold; before,
    only mult·mean was, and D·a0 of L1 rows of 65536 (49 bits) passed unchecked."""
    op = case_named({IntLayerNorm: "int_layernorm.int8.n768", L1LayerNorm: "l1_layernorm.int8.n768",
                     ShiftLayerNorm: "shift_layernorm.int8.n64.m2"}[cls]).build()  # fmt: skip
    consts, n = op.row_constants(), op.config.n
    got = {p.formula: p for p in products(op)}
    assert got["D·a0 (in offset)"].result.hi == (n - 1) * consts.mult.hi
    mean = got["a0·mean (in offset)"].result
    assert (mean.lo, mean.hi) == (op.in_fmt.lo * consts.mult.hi, op.in_fmt.hi * consts.mult.hi)
    assert got[f"N·{op.inverse_name} (in mult)"].result.hi == n * op.ranges()[op.inverse_name].hi


@pytest.mark.parametrize(("n", "eps"), [(4096, 1e-12), (8192, 1e-12), (16384, 0.0), (65536, 0.0), (65536, 1e-12)])
def test_fpga_hls_holds_the_shifted_constants_modulo_its_lanes(n: int, eps: float) -> None:
    """L1LayerNorm with a tiny ε: a row of equal values gets a huge multiplier (every
    numerator is 0, so any a gives its outputs), and a, c = a0, c0 shifted left reach
    48-52 bits.  TVM's kernels take them modulo 2^32 (x·a − c in unsigned lanes), so
    fpga-hls holds a0 and c0; fpga-rtl builds every value whole and refuses."""
    op = _l1(n, eps)
    assert op.ranges()["offset"].bits > NARROW_ROW_BITS
    check_target(op, load_target("fpga-hls"))
    assert load_target("fpga-hls").hardware.wraps_lane_constants
    with pytest.raises(TargetLimitError, match=r"intermediate 'offset' spans .* needs (4[89]|5[0-2]) bits"):
        check_target(op, load_target("fpga-rtl"))


def test_the_wide_lanes_hold_their_constants_whole() -> None:
    assert case_named("int_layernorm.int16.n48").build().lane_wrapped() == {}
    op = _l1(4096, 1e-12)
    consts = op.lane_wrapped()
    assert set(consts) == {"mult", "offset"} and consts["offset"].bits < op.ranges()["offset"].bits


@pytest.mark.slow
def test_the_split_offset_and_wrapped_constants_are_bit_exact_on_the_kernels() -> None:
    pytest.importorskip("tvm")
    base = case_named("l1_layernorm.int8.n768")
    cases = [base.derived("l1_layernorm.int8.n65536.eps1e-12", n=65536, eps=1e-12),
             base.derived("l1_layernorm.int8.n4096.eps1e-12", n=4096, eps=1e-12)]  # fmt: skip
    assert [c.build()._offset_split > 0 for c in cases] == [True, False]
    report = harness.verify(cases, ["qat", "x86_64", "fpga-hls"], elements=140_000)
    assert report.ok and not report.failures, report.matrix()
    assert all(cell.status == harness.OK for case in report.cases for cell in case.cells.values())


@pytest.mark.slow
def test_a_split_offset_is_bit_exact_in_the_rtl_unit(monkeypatch) -> None:
    """No verify case splits (rows of 64–2048), so the unit of L1's rows of 64 is built
    with its offset forced into two products: the RTL runs offset_fraction's split."""
    pytest.importorskip("amaranth")
    assemble = NormOp._assemble

    def split_offset(self, *args, **kwargs) -> None:
        assemble(self, *args, **kwargs)
        self._offset_split = 5

    monkeypatch.setattr(NormOp, "_assemble", split_offset)
    case = case_named("l1_layernorm.int8.n64")
    assert case.build()._offset_split == 5
    report = harness.verify([case], ["fpga-rtl"], elements=3000)
    assert report.ok and report.cases[0].cells["fpga-rtl"].status == harness.OK, report.matrix()
