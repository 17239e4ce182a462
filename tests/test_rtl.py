"""The RTL units (compilers.rtl) against the golden ops, bit for bit, in HDL simulation."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from amaranth.hdl import Const, Module, Signal, signed
from amaranth.sim import Simulator

pytest.importorskip("amaranth")

from compilers.rtl import rtl_unit, values
from compilers.rtl.norm import READ_LATENCY, WRITE_LATENCY, NormUnit
from compilers.rtl.sim import simulate
from compilers.rtl.stream import stream_order
from compilers.rtl.synth import to_rtlil
from compilers.rtl.values import DSP_BITS, Ctx
from qnorm.ops import IntLayerNorm, IntRMSNorm, L1LayerNorm, ShiftLayerNorm
from qnorm.ops._normcore import row_affine
from qnorm.qformat import QFormat
from qnorm.verify.cases import case_named
from qnorm.verify.vectors import edge_vectors, random_inputs

# One small case per family (and per rounding rule / statistic variant).
FAMILY_CASES = [
    "int_layernorm.int8.n7.half_even",
    "int_layernorm.int4.n4",
    "l1_layernorm.int4.n7.trunc",
    "shift_layernorm.int4.n7.m2.half_away",
    "int_rmsnorm.int4.n7.p05.floor",
    "int_rmsnorm.int8.n2.half_even",
    "multithreshold.int8.c16.s3.floor",
    "bn_quant.int8.c16.s8.half_away",
    "folded_lif.int4.c8.soft.ge.leak05",
    "mpbn_lif.int8.c16.hard.ge.leak0875",
]


def run_unit(op, x: np.ndarray, **kw) -> np.ndarray:
    stream, first, restore = stream_order(op, x)
    return restore(simulate(rtl_unit(op), stream, first, **kw).out)


@pytest.mark.parametrize("name", FAMILY_CASES)
def test_unit_is_bit_exact_on_random_and_edge_inputs(name: str) -> None:
    case = case_named(name)
    op = case.build()
    x = random_inputs(case, np.random.default_rng(7), 2 if case.layout == "rows" else 4)
    if case.layout == "rows":  # and the edge rows: extremes, constant rows (the ε path)
        x = np.concatenate([x, edge_vectors(case, complete=False)[:3]])
    assert np.array_equal(run_unit(op, x), op.forward(x))


NORMS = [IntLayerNorm, L1LayerNorm, ShiftLayerNorm, IntRMSNorm]


@settings(max_examples=3, deadline=None)
@given(
    family=st.sampled_from(NORMS),
    n=st.integers(1, 9),
    bits=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**16),
)
def test_norm_units_match_the_golden_op_over_shapes_and_widths(family, n: int, bits: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    gamma = rng.normal(1.0, 0.5, n)
    op = family.from_float(gamma, rng.normal(0.0, 0.5, n), eps=1e-3, in_fmt=QFormat(bits, 0.1))
    x = rng.integers(op.in_fmt.lo, op.in_fmt.hi + 1, (2, n))
    x[0] = op.in_fmt.lo  # a constant row: the ε path
    assert np.array_equal(run_unit(op, x), op.forward(x))


@pytest.mark.parametrize(
    "build,passes",
    [
        (lambda: IntLayerNorm.from_float(np.linspace(0.5, 1.5, 64)), 1),
        pytest.param(lambda: L1LayerNorm.from_float(np.linspace(0.5, 1.5, 64)), 2, marks=pytest.mark.slow),
        (case_named("softmax.int8.n64").build, 2),  # the max, then the sum of the exponentials
    ],
    ids=["int_layernorm", "l1_layernorm", "softmax"],
)
def test_row_unit_streams_one_element_per_clock_for_n64(build, passes) -> None:
    """Row k+1 streams in while row k streams out: inputs accepted and outputs
    produced on consecutive clocks, after the documented latency."""
    n, rows = 64, 4
    op = build()
    unit = rtl_unit(op)
    x = np.random.default_rng(3).integers(-128, 128, (rows, n))
    res = simulate(unit, x.reshape(-1))
    assert np.array_equal(res.out.reshape(x.shape), op.forward(x))
    assert np.array_equal(np.diff(res.in_cycles), np.ones(n * rows - 1))
    assert np.array_equal(np.diff(res.out_cycles), np.ones(n * rows - 1))
    norm = unit.elaboratable
    assert norm.passes == passes
    assert res.out_cycles[0] - res.in_cycles[0] == unit.latency
    assert unit.latency == norm.passes * n + sum(norm.pass_depths) + norm.row_depth + READ_LATENCY + norm.element_depth + 3
    assert unit.cycles_per_row == n and unit.elements_per_cycle == 1.0


def test_norm_unit_holds_its_output_under_back_pressure() -> None:
    case = case_named("int_layernorm.int8.n7.half_even")
    op = case.build()
    x = random_inputs(case, np.random.default_rng(11), 3)
    assert np.array_equal(run_unit(op, x, out_stall_every=3), op.forward(x))


def rom_memories(unit) -> list[str]:
    """The unit's memories other than its row buffer, as RTLIL declares them."""
    text = to_rtlil(unit.elaboratable, unit.ports)
    return [line.strip() for line in text.splitlines() if line.strip().startswith("memory ") and "buf" not in line]


def test_tables_from_bram_min_depth_channels_are_block_ram_roms() -> None:
    """A 256-wide IntLayerNorm's five per-channel tables (window ends, offset, gain,
    bias) are synchronous ROMs of 256 words; one channel fewer, LUT muxes."""
    n = values.BRAM_MIN_DEPTH
    deep = rtl_unit(IntLayerNorm.from_float(np.linspace(0.5, 1.5, n), np.linspace(-0.2, 0.2, n)))
    roms = rom_memories(deep)
    assert len(roms) == 5 and all(f"size {n} " in rom for rom in roms)
    assert rom_memories(rtl_unit(IntLayerNorm.from_float(np.linspace(0.5, 1.5, n - 1)))) == []


def register_outputs(text: str) -> set[str]:
    """The wires RTLIL's flip-flop cells drive."""
    return set(re.findall(r"cell \$\w*dff\w* \S+\n(?:    .*\n)*?    connect \\Q \\(\S+)", text))


@pytest.mark.parametrize("build", [
    lambda n: IntLayerNorm.from_float(np.linspace(0.5, 1.5, n)),
    lambda n: L1LayerNorm.from_float(np.linspace(0.5, 1.5, n)),
], ids=["int_layernorm", "l1_layernorm"])
@pytest.mark.parametrize("n", [8, 7])  # the buffer address as wiring, and as a counter
def test_row_buffer_is_written_from_registers(build, n: int) -> None:
    """The accept (valid and ready, behind the bank mux) drives registers, and the
    row buffer's write port reads only them; its first pass hands the bank on no
    sooner than the last write lands (L1's Σx alone would take no clock)."""
    unit = rtl_unit(build(n))
    assert {"wr__en", "wr__addr", "wr__data"} <= register_outputs(to_rtlil(unit.elaboratable, unit.ports))
    assert unit.elaboratable.pass_depths[0] >= WRITE_LATENCY


def test_block_ram_rom_values_pass_two_fabric_registers() -> None:
    """A ROM's read register, then two registers: the first may become the block's
    own output register, the second stays by the logic that reads it."""
    n = values.BRAM_MIN_DEPTH
    unit = rtl_unit(IntLayerNorm.from_float(np.linspace(0.5, 1.5, n), np.linspace(-0.2, 0.2, n)))
    regs = register_outputs(to_rtlil(unit.elaboratable, unit.ports))
    # the second register is named after the table fields it drives ("rom…")
    assert sum(r.startswith("rom_out") for r in regs) == len(rom_memories(unit)) == 5
    assert sum(r.startswith("rom") for r in regs) == 2 * 5


@pytest.mark.parametrize("name", [c for c in FAMILY_CASES if c.split(".")[0] in {f.name for f in NORMS}])
def test_block_ram_tables_stay_bit_exact_under_random_back_pressure(name: str, monkeypatch) -> None:
    """With every table a block-RAM ROM, out_ready dropped at random: the ROMs' read
    ports stall with the rest of the chain, so each output keeps its channel's constants."""
    monkeypatch.setattr(values, "BRAM_MIN_DEPTH", 2)
    case = case_named(name)
    op = case.build()
    x = random_inputs(case, np.random.default_rng(13), 3)
    stream, first, restore = stream_order(op, x)
    unit = rtl_unit(op)
    assert rom_memories(unit)
    ready = np.random.default_rng(17).random(997) < 0.6
    assert np.array_equal(restore(simulate(unit, stream, first, out_ready=ready).out), op.forward(x))


@pytest.mark.parametrize("widths", [(19, 28), (DSP_BITS + 1, DSP_BITS + 1), (35, 35)])
def test_a_product_of_two_operands_wider_than_a_dsp_port_is_exact(widths: tuple[int, int]) -> None:
    """Both operands wider than a DSP port (a 768-wide row's Σx times its multiplier):
    four registered limb products, added a level later, give a·b at the extremes too."""
    m = Module()
    a, b = Signal(signed(widths[0]), name="a"), Signal(signed(widths[1]), name="b")
    product, level = values._product(Ctx(m, a, Const(0), pipelined=True), a, b)
    out = Signal(signed(sum(widths)), name="out")
    m.d.comb += out.eq(product)
    assert level == 1
    ends = [[-(1 << (w - 1)), -1, 0, 1, (1 << (w - 1)) - 1, (1 << 17) - 1, -(1 << 17)] for w in widths]
    rng = np.random.default_rng(23)
    pairs = [(x, y) for x in ends[0] for y in ends[1]]
    pairs += [(int(rng.integers(-(1 << (widths[0] - 1)), 1 << (widths[0] - 1))),
               int(rng.integers(-(1 << (widths[1] - 1)), 1 << (widths[1] - 1)))) for _ in range(40)]
    got: list[int] = []

    async def bench(ctx) -> None:
        for x, y in pairs:
            ctx.set(a, x)
            ctx.set(b, y)
            await ctx.tick()
            got.append(ctx.get(out))

    sim = Simulator(m)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    assert got == [x * y for x, y in pairs]


def test_neuron_stream_order_round_trips() -> None:
    op = case_named("folded_lif.int4.c8.soft.ge.leak05").build()
    x = np.arange(3 * 2 * 8).reshape(3, 2, 8)
    stream, first, restore = stream_order(op, x)
    assert stream[:8].tolist() == x[0, 0].tolist() and stream[8:16].tolist() == x[1, 0].tolist()
    assert np.flatnonzero(first).tolist() == [0, 24]
    assert np.array_equal(restore(stream), x)


def test_an_op_that_changes_the_norm_forward_is_refused() -> None:
    class Custom(IntLayerNorm):
        def _forward(self, x, trace):
            return super()._forward(x, trace)

    op = IntLayerNorm.from_float(np.ones(4))
    custom = Custom(op.config, op.params)
    with pytest.raises(NotImplementedError, match="overrides NormOp._forward"):
        rtl_unit(custom)


@pytest.mark.slow
@pytest.mark.parametrize("name,rows", [("l1_layernorm.int8.n64", 1600), ("softmax.int8.n32.padding", 3200)])
def test_verilator_model_is_bit_exact_on_a_large_stream(name: str, rows: int) -> None:
    from compilers.rtl.verilator import build

    case = case_named(name)
    op = case.build()
    unit = rtl_unit(op)
    x = random_inputs(case, np.random.default_rng(5), rows)
    out, cycles = build(unit).run(x.reshape(-1))
    assert np.array_equal(out.reshape(x.shape), op.forward(x))
    assert cycles == unit.latency + x.size  # one element per clock end to end


@pytest.mark.parametrize("name", ["l1_layernorm.int8.n64", "int_layernorm.int4.n4", "int_rmsnorm.int4.n7.p05.floor"])
def test_norm_datapath_alone_computes_the_op_from_given_row_values(name: str) -> None:
    """The unit without its row engine (the FPGA report's breakdown) is the unit's own
    datapath: given a row's multiplier, offset and shift on its ports, it streams the
    op's outputs for rows with those values."""
    case = case_named(name)
    op = case.build()
    unit = NormUnit(op, row_engine=False)
    assert (unit.passes, unit.row_depth) == (1, 0)
    row = random_inputs(case, np.random.default_rng(3), 1)[:1]
    values = [v for v in row_affine(*op.row_inverse(row), op.config, op._mult_shift, None, op._offset_split) if not isinstance(v, int)]
    assert len(values) == len(unit.row_values)  # an uncentred op has no offset: c = 0, no port
    held = [(port, int(np.asarray(v).item())) for port, v in zip(unit.row_values.values(), values, strict=True)]
    rows = np.repeat(row, 3, axis=0)
    whole = rtl_unit(op)
    alone = dataclasses.replace(whole, elaboratable=unit, latency=unit.latency)
    out = simulate(alone, rows.reshape(-1), held=held).out.reshape(rows.shape)
    assert np.array_equal(out, op.forward(rows))
