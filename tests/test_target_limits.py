"""Target limits: the analysis refuses a config a target's declared widths cannot run exactly.

``qnorm.analysis.check_target`` holds every named intermediate and every
product's result to the accumulator (less one bit of rounding headroom) and
every product's narrower operand to the multiplier.  Tested on the shipped
descriptions, on tighter fake ones (the boundaries: one bit less refuses), and
through ``qnorm verify``, where a refusal is shown with its reason and is not a
failure of the matrix.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from qnorm.analysis import (
    Interval,
    OverflowRiskError,
    RangeReport,
    TargetLimitError,
    check_target,
    products,
)
from qnorm.ops import NORMS, IntRMSNorm
from qnorm.qformat import QFormat
from qnorm.targets import load_target, load_target_file
from qnorm.verify import backends, harness
from qnorm.verify.backends import refuse_beyond_limits
from qnorm.verify.cases import CASES, case_named
from qnorm.verify.vectors import golden_inputs

SQUARED_IN_TWO_ON_HLS = "int_layernorm.int16.n48"
# int16 probabilities need 30-bit exp table digits: their product passes the 48-bit accumulator
SOFTMAX_REFUSED_ON_HLS = "softmax.int16.n64"
FAMILY_CASES = (
    "int_layernorm.int8.n64",
    "l1_layernorm.int8.n64",
    "shift_layernorm.int8.n64.m2",
    "int_rmsnorm.int8.n64.p025",
    "bn_quant.int8.c16.relu4",
    "multithreshold.int8.c16.relu4",
    "mpbn_lif.int8.c16.hard.ge.leak0875",
    "folded_lif.int8.c16.hard.ge.leak0875",
    "softmax.int16.n64",  # two table digits: exp_lo·exp_hi
)


def fake_target(tmp_path: Path, accumulator_bits: int, multiplier_bits: int, name: str = "tight"):
    path = tmp_path / f"{name}.toml"
    path.write_text(
        f'name = "{name}"\ndescription = "a narrower datapath than any shipped target"\n'
        '[tvm]\nkind = "c"\n'
        f"[hardware]\naccumulator_bits = {accumulator_bits}\nmultiplier_bits = {multiplier_bits}\n"
        "has_divider = false\nvector_bits = 0\n"
        '[build]\ncc = "gcc"\npart = "xc7a35t-cpg236-1"\nclock_period_ns = 10\n'
        '[run]\nmethod = "gcc-csim"\n'
    )
    return load_target_file(path)


# --------------------------------------------------------------------------- shipped targets


def test_fpga_hls_refuses_exactly_the_int16_softmax_case() -> None:
    hls = load_target("fpga-hls")
    refused = {}
    for case in CASES:
        try:
            check_target(case.build(), hls)
        except TargetLimitError as err:
            refused[case.name] = str(err)
    assert list(refused) == [SOFTMAX_REFUSED_ON_HLS]
    message = refused[SOFTMAX_REFUSED_ON_HLS]
    for part in (
        "softmax cannot run exactly on fpga-hls",
        "fpga-hls.toml",
        "'exp_product' spans [0, 1152921504606846976], which needs 62 bits",
    ):
        assert part in message


def test_a_sum_wider_than_the_dsp_port_is_squared_in_two_products() -> None:
    """Σx of int16 rows of 48 spans 22 bits: S·S was beyond the DSP48's 18-bit port on
    both sides (refused on fpga-hls).  Squared as h·(S + l)·2^18 + l², the narrower
    operand of each product is h (4 bits) or l (18), and the op runs there."""
    op = case_named(SQUARED_IN_TWO_ON_HLS).build()
    rep = check_target(op, load_target("fpga-hls"))
    assert rep["sum"].bits == 22
    square = {p.intermediate: p for p in products(op) if p.intermediate in ("square_high", "square_low")}
    assert (square["square_high"].narrow_bits, square["square_low"].narrow_bits) == (4, 18)
    assert max(p.narrow_bits for p in products(op)) <= 18


@pytest.mark.parametrize("cls", NORMS, ids=lambda c: c.__name__)
def test_fpga_hls_runs_every_int4_int8_norm_of_trained_looking_rows(cls) -> None:
    """The narrow definition fits the DSP48E2 for int4/int8 rows of every length up to
    65536, at the max-abs scales of Gaussian rows and of LLM-like rows (one channel
    ×100), with the ε of LayerNorm and RMSNorm.  Definition version 2 refused 93 of
    these 192 configs (ε's guard bits pushed W past 47 bits; S·S past the 18-bit port)."""
    hls = load_target("fpga-hls")
    for n in (64, 768, 2048, 4096, 16384, 65536):
        rng = np.random.default_rng(n)
        gamma, beta = rng.normal(1, 0.1, n), (None if cls is IntRMSNorm else rng.normal(0, 0.1, n))
        for bits in (4, 8):
            for spread in (4.5, 450.0):  # max |x| in units of the rows' σ
                for eps in (1e-6, 1e-5):
                    in_fmt = QFormat(bits, spread / ((1 << (bits - 1)) - 1))
                    op = cls.from_float(gamma, beta, eps, in_fmt, QFormat.power_of_two(bits, 3 - bits))
                    check_target(op, hls)


@pytest.mark.parametrize("name", ["x86_64", "aarch64", "riscv64", "opencl"])
def test_64_bit_targets_run_every_case(name: str) -> None:
    target = load_target(name)
    for case in CASES:
        check_target(case.build(), target)


# --------------------------------------------------------------------------- tighter fake targets


def test_a_narrow_accumulator_refuses_the_row_statistic(tmp_path) -> None:
    with pytest.raises(TargetLimitError) as err:
        check_target(case_named("int_layernorm.int8.n64").build(), fake_target(tmp_path, 32, 16))
    message = str(err.value)
    assert "int_layernorm cannot run exactly on tight" in message
    assert "intermediate 'stat' spans [16777, 68183671177], which needs 37 bits" in message
    assert "the target's 32-bit accumulator holds 31 (hardware.accumulator_bits" in message


def test_accumulator_boundary_is_one_bit_of_headroom(tmp_path) -> None:
    op = case_named("mpbn_lif.int8.c16.hard.ge.leak0875").build()
    assert op.ranges()["bn_product"].bits == 47
    check_target(op, fake_target(tmp_path, 48, 18, "fits"))
    with pytest.raises(TargetLimitError, match=r"'bn_product' .* needs 47 bits, .* accumulator holds 46"):
        check_target(op, fake_target(tmp_path, 47, 18, "short"))


def test_an_unrounded_intermediate_may_fill_the_accumulator(tmp_path) -> None:
    """N·Σx² and (Σx)² only form V's subtraction: no rounding adds a half to them, so they
    may use the headroom bit the other intermediates keep; V itself may not."""
    op = case_named("int_layernorm.int8.n768").build()
    rep = op.ranges()
    assert rep["n_sum_sq"].unrounded and rep["sum_squared"].unrounded and not rep["var"].unrounded
    assert rep["n_sum_sq"].bits == rep["var"].bits == 35
    both = RangeReport(op.name)
    both.add("n_sum_sq", rep["n_sum_sq"])
    both.add("var", rep["var"])
    both.check(35)
    with pytest.raises(OverflowRiskError, match=r"'var' .* needs 35 bits, but only 34-bit"):
        both.check(34)  # N·Σx² passes with the headroom bit, V does not
    with pytest.raises(OverflowRiskError, match=r"'n_sum_sq' .* needs 35 bits, but only 33-bit"):
        both.check(33)
    with pytest.raises(TargetLimitError, match=r"'n_sum_sq' .* needs 35 bits, but the target's 34-bit accumulator holds 34;"):
        check_target(op, fake_target(tmp_path, 34, 18))
    ordinary = Interval(rep["n_sum_sq"].lo, rep["n_sum_sq"].hi)
    assert ordinary == rep["n_sum_sq"] and not ordinary.fits(34) and rep["n_sum_sq"].fits(34)
    assert not (rep["n_sum_sq"] + 0).unrounded  # what is computed from one is ordinary again


def test_multiplier_boundary_is_the_narrower_operand(tmp_path) -> None:
    op = case_named("int_layernorm.int8.n768").build()
    assert op.ranges()["sum"].bits == 18
    check_target(op, fake_target(tmp_path, 48, 18, "fits"))
    with pytest.raises(TargetLimitError, match=r"product 'sum_squared = sum·sum' .* at most 17 bits"):
        check_target(op, fake_target(tmp_path, 48, 17, "short"))


def test_an_unnamed_product_is_held_to_the_accumulator(tmp_path) -> None:
    """x·x inside Σx² is no intermediate of the report; its result still counts.

    A stand-in op whose report entries are all tiny isolates the rule: only the
    int16 square (32 bits) can exceed a 32-bit accumulator (31 usable).
    """

    class TinyReportRMS:
        name = "int_rmsnorm"
        multiplications = IntRMSNorm.multiplications
        inverse_name = "rsqrt"
        in_fmt = QFormat(16, 1.0)
        config = SimpleNamespace(n=4, gain=(1, 1, 1, 1), num_mult=1)

        def ranges(self) -> RangeReport:
            rep = RangeReport(self.name)
            for name in ("sum_sq", "rsqrt", "mult", "xa", "zc", "scaled"):
                rep.add(name, Interval(0, 1))
            return rep

    op = TinyReportRMS()
    square = next(p for p in products(op) if p.intermediate is None)
    assert square.formula == "x·x (in sum_sq)" and square.result == Interval(0, 1 << 30)
    check_target(op, fake_target(tmp_path, 33, 16, "wide"))
    with pytest.raises(TargetLimitError, match=r"intermediate 'x·x \(in sum_sq\)' spans \[0, 1073741824\], which needs 32 bits"):
        check_target(op, fake_target(tmp_path, 32, 16))


# --------------------------------------------------------------------------- the product tables


@pytest.mark.parametrize("name", FAMILY_CASES)
def test_products_bound_the_values_the_op_computes(name: str) -> None:
    case = case_named(name)
    op = case.build()
    trace: dict[str, np.ndarray] = {}
    op.forward(golden_inputs(case), trace)
    for p in products(op):
        assert p.narrow_bits <= max(p.a.bits, p.b.bits)
        if p.intermediate is not None and p.intermediate in trace:
            values = np.asarray(trace[p.intermediate])
            assert p.result.lo <= values.min() and values.max() <= p.result.hi, p.label


def test_product_tables_cover_the_families() -> None:
    labels = {c.op: [p.label for p in products(c.build())] for c in CASES if c.name in FAMILY_CASES}
    assert labels["int_layernorm"] == [
        "x·x (in sum_sq)",
        "n_sum_sq = N·sum_sq",
        "sum_squared = sum·sum",
        "N·rsqrt (in mult)",
        "a0·mean (in offset)",
        "D·a0 (in offset)",
        "xa = x·mult",
        "scaled = zc·gain",
    ]
    assert labels["shift_layernorm"] == [  # scales by shifts: no zc·gain
        *labels["int_layernorm"][:3],
        "N·rsqrt_pow2 (in mult)",
        "a0·mean (in offset)",
        "D·a0 (in offset)",
        "xa = x·mult",
    ]
    assert labels["multithreshold"] == []
    assert labels["mpbn_lif"] == ["leak_product = membrane·leak", "bn_product = membrane·slope"]
    assert labels["folded_lif"] == ["leak_product = membrane·leak"]
    assert labels["softmax"] == ["exp_product = exp_lo·exp_hi", "prob_product = exp·recip"]


def test_an_op_without_a_product_table_is_refused() -> None:
    class Mystery:
        name = "mystery"

        def ranges(self):
            raise AssertionError("not reached")

    with pytest.raises(ValueError, match=r"op 'mystery' does not list its multiplications"):
        products(Mystery())

    class Unknown(Mystery):
        multiplications = ("x_times_the_moon",)

    with pytest.raises(ValueError, match=r"cannot bound: \['x_times_the_moon'\]"):
        products(Unknown())


# --------------------------------------------------------------------------- in qnorm verify


def test_other_backends_refuse_the_same_way(tmp_path) -> None:
    tight = fake_target(tmp_path, 32, 16)
    with pytest.raises(backends.Refused, match="^int_layernorm cannot run exactly on tight"):
        refuse_beyond_limits(case_named("int_layernorm.int8.n64").build(), tight)
    assert refuse_beyond_limits(case_named("multithreshold.int8.c16.relu4").build(), tight) is None


def test_verify_shows_a_refusal_with_its_reason_and_does_not_fail(monkeypatch) -> None:
    pytest.importorskip("tvm")
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not on PATH: the fpga-hls column is unavailable")
    monkeypatch.setattr(harness, "run_batches", lambda case, elements, seed: iter(()))  # stored vectors only
    report = harness.verify([case_named(SOFTMAX_REFUSED_ON_HLS)], ["golden", "qat", "fpga-hls"], elements=0)
    cell = report.cases[0].cells["fpga-hls"]
    assert cell.status == harness.REFUSED and cell.vectors == 0
    assert cell.reason.startswith("softmax cannot run exactly on fpga-hls")
    assert report.ok and not report.failures
    text = report.matrix()
    assert "refused fpga-hls: softmax cannot run exactly" in text
    assert "1 refused by target limits" in text.splitlines()[-1]


# --------------------------------------------------------------------------- the HLS build fields


def test_hls_build_fields_parse_and_are_checked(tmp_path) -> None:
    hls = load_target("fpga-hls")
    assert (hls.build.part, hls.build.clock_period_ns) == ("xczu7ev-ffvc1156-2-e", 5)
    assert load_target("x86_64").build.part is None
    path = fake_target(tmp_path, 48, 18).path
    path.write_text(path.read_text().replace("clock_period_ns = 10", "clock_period_ns = 0"))
    with pytest.raises(ValueError, match=r"field 'build.clock_period_ns' must be >= 1, got 0"):
        load_target_file(path)
    path.write_text(path.read_text().replace("clock_period_ns = 0", 'clock_period_ns = "5ns"'))
    with pytest.raises(ValueError, match=r"field 'build.clock_period_ns' must be an integer"):
        load_target_file(path)
