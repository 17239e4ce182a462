"""FPGA synthesis of Amaranth units (compilers.rtl.synth): a tiny streaming unit through
yosys for xc7 and through yosys + nextpnr for ecp5, cached; a failing tool named with
its log."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("amaranth", reason="the RTL flow needs the fpga extra (pip install -e '.[fpga]')")

from amaranth import Module, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.sim import Simulator

from compilers import cache
from compilers.rtl import fp16, synth
from compilers.rtl.fp16 import FP16LayerNorm
from compilers.rtl.fparith import FP16, FP32, FloatAdd, FloatConvert, FloatMul
from compilers.rtl.synth import FAMILIES, SynthError, synthesize

UINT = {np.float16: np.uint16, np.float32: np.uint32}


class SquareSum(wiring.Component):
    """A tiny unit of the units' interface: int8 in, the running sum of squares out,
    one element per clock with valid/ready back-pressure."""

    def __init__(self) -> None:
        # Explicit: with postponed annotations Amaranth cannot read member annotations.
        super().__init__({"i": In(stream.Signature(8)), "o": Out(stream.Signature(16))})

    def elaborate(self, platform: object) -> Module:
        m = Module()
        acc = Signal(16)
        m.d.comb += self.i.ready.eq(~self.o.valid | self.o.ready)
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += self.o.valid.eq(0)
        with m.If(self.i.valid & self.i.ready):
            m.d.sync += [acc.eq(acc + self.i.payload * self.i.payload), self.o.valid.eq(1), self.o.payload.eq(acc)]
        return m


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("family", ["xc7", "ecp5"])
def test_a_tiny_unit_synthesizes_then_hits_the_cache(fresh_cache, family: str) -> None:
    first = synthesize(SquareSum(), "square_sum", family)
    res = first.resources
    assert not first.cache_hit and first.family == family and first.unit == "square_sum"
    assert res.lut > 0 and res.ff >= 17 and res.dsp == 1 and res.bram == 0  # 16-bit sum + valid
    assert res.lut == synth.count_resources(FAMILIES[family], res.cells).lut
    assert "yosys" in first.tools and first.tools["yosys"].startswith("Yosys 0.")
    if family == "ecp5":
        assert first.fmax_mhz is not None and first.fmax_mhz > 0
        assert first.tools["nextpnr-ecp5"].startswith("nextpnr-0.")
    else:
        assert first.fmax_mhz is None  # no open place and route for Xilinx
    again = synthesize(SquareSum(), "another_name", family)
    assert again.cache_hit and again.key == first.key and again.unit == "another_name"
    assert (again.resources, again.fmax_mhz, again.tools) == (first.resources, first.fmax_mhz, first.tools)


def test_source_locations_do_not_change_the_key() -> None:
    text = synth.to_rtlil(SquareSum())
    assert "\\src" not in text and "module \\top" in text


def test_a_failing_synthesis_names_yosys_the_family_and_its_log(fresh_cache, monkeypatch) -> None:
    broken = dataclasses.replace(FAMILIES["ecp5"], name="ecp5", synth="synth_nosuchfamily -top top")
    monkeypatch.setitem(FAMILIES, "ecp5", broken)
    with pytest.raises(SynthError, match=r"(?s)yosys \(ecp5\) failed.*synth_nosuchfamily"):
        synthesize(SquareSum(), "square_sum", "ecp5")
    assert not list((fresh_cache / "synth").glob("[!.]*"))  # nothing published


def test_a_failing_place_and_route_names_nextpnr_and_its_log(fresh_cache, monkeypatch) -> None:
    ecp5 = FAMILIES["ecp5"]
    broken = dataclasses.replace(ecp5, pnr=(*ecp5.pnr, "--no-such-flag"))
    monkeypatch.setitem(FAMILIES, "ecp5", broken)
    with pytest.raises(SynthError, match=r"(?s)nextpnr-ecp5 \(ecp5\) failed.*no-such-flag"):
        synthesize(SquareSum(), "square_sum", "ecp5")


def test_an_unknown_family_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown FPGA family 'xc9'.*xc7, xcup, ecp5, ice40"):
        synthesize(SquareSum(), "square_sum", "xc9")


# --------------------------------------------------------------------------- fp arithmetic


def _comb_outputs(dut, inputs: list, pairs: list[tuple[int, ...]]) -> list[int]:
    """The combinational output of ``dut`` for each tuple of input bit patterns."""
    got: list[int] = []

    async def bench(ctx) -> None:
        for values in pairs:
            for signal, value in zip(inputs, values):
                ctx.set(signal, int(value))
            got.append(ctx.get(dut.o))

    sim = Simulator(dut)
    sim.add_testbench(bench)
    sim.run()
    return got


def _operands(rng: np.random.Generator, dtype: type, count: int, span: int) -> tuple[np.ndarray, np.ndarray]:
    """Random pairs of normal numbers: a third near-cancelling (a + b tiny), a third of
    widely different exponents, a third anything."""
    def draw(k: int) -> np.ndarray:
        return (rng.choice([-1.0, 1.0], k) * np.exp2(rng.uniform(-span, span, k))).astype(dtype)

    a, b = draw(count), draw(count)
    third = count // 3
    b[:third] = (-a[:third] * (1 + rng.uniform(-2e-3, 2e-3, third))).astype(dtype)
    b[third : 2 * third] = (a[third : 2 * third] * np.exp2(rng.integers(-span, span + 1, third))).astype(dtype)
    return a, b


@pytest.mark.parametrize(("fmt", "dtype", "span"), [(FP32, np.float32, 30), (FP16, np.float16, 5)])
@pytest.mark.parametrize("op", ["add", "sub", "mul"])
def test_float_add_and_multiply_round_exactly_like_ieee(fmt, dtype, span: int, op: str) -> None:
    a, b = _operands(np.random.default_rng(7), dtype, 240, span)
    dut = FloatMul(fmt) if op == "mul" else FloatAdd(fmt)
    pairs = list(zip(a.view(UINT[dtype]), b.view(UINT[dtype]), [op == "sub"] * len(a)))
    signals = [dut.a, dut.b] if op == "mul" else [dut.a, dut.b, dut.sub_b]
    got = np.array(_comb_outputs(dut, signals, pairs), dtype=UINT[dtype]).view(dtype)
    with np.errstate(over="ignore"):
        want = {"add": np.add, "sub": np.subtract, "mul": np.multiply}[op](a, b)
    normal = np.abs(want) >= np.finfo(dtype).tiny  # subnormals are flushed (fparith's docstring)
    assert normal.sum() > 200 and np.isfinite(want).all()
    assert (got.view(UINT[dtype])[normal] == want.view(UINT[dtype])[normal]).all()
    assert (got[~normal] == 0).all()


def test_float_conversions_widen_exactly_and_narrow_to_nearest_even() -> None:
    rng = np.random.default_rng(3)
    wide = (rng.choice([-1.0, 1.0], 300) * np.exp2(rng.uniform(-13, 15, 300))).astype(np.float32)
    narrow = FloatConvert(FP32, FP16)
    got = np.array(_comb_outputs(narrow, [narrow.a], [(v,) for v in wide.view(np.uint32)]), np.uint16)
    assert (got == wide.astype(np.float16).view(np.uint16)).all()
    halves = wide.astype(np.float16)
    widen = FloatConvert(FP16, FP32)
    back = np.array(_comb_outputs(widen, [widen.a], [(v,) for v in halves.view(np.uint16)]), np.uint32)
    assert (back == halves.astype(np.float32).view(np.uint32)).all()


# --------------------------------------------------------------------------- FP16 LayerNorm


def run_layernorm(unit: FP16LayerNorm, rows: np.ndarray, stall_every: int = 0) -> tuple[np.ndarray, list[int]]:
    """Stream ``rows`` through the unit in the simulator; its outputs and the clock of each
    accepted output.  ``stall_every``: drop ``o.ready`` one clock in that many."""
    outputs: list[int] = []
    clocks: list[int] = []

    async def source(ctx) -> None:
        for value in rows.astype(np.float16).view(np.uint16).ravel():
            ctx.set(unit.i.payload, int(value))
            ctx.set(unit.i.valid, 1)
            await ctx.tick().until(unit.i.ready)
        ctx.set(unit.i.valid, 0)

    async def sink(ctx) -> None:
        clock = 0
        while len(outputs) < rows.size:
            ready = not (stall_every and clock % stall_every == 0)
            ctx.set(unit.o.ready, ready)
            _, _, valid, taken, payload = await ctx.tick().sample(unit.o.valid, unit.o.ready, unit.o.payload)
            clock += 1
            if valid and taken:
                outputs.append(payload)
                clocks.append(clock)

    sim = Simulator(unit)
    sim.add_clock(1e-8)
    sim.add_testbench(source)
    sim.add_testbench(sink)
    sim.run()
    return np.array(outputs, dtype=np.uint16).view(np.float16).reshape(rows.shape), clocks


def test_rsqrt_seed_table_is_within_its_stated_error() -> None:
    table = fp16.rsqrt_seed_table()
    for parity in (0, 1):
        for i in range(1 << fp16.SEED_BITS):
            seed = 0.5 + table[parity * (1 << fp16.SEED_BITS) + i] * 2.0**-24
            for edge in (i, i + 1):  # the interval's ends are the worst points
                exact = 1 / np.sqrt((1 + edge / (1 << fp16.SEED_BITS)) * 2**parity)
                assert abs(seed / exact - 1) <= 2.0**-8


@pytest.mark.parametrize(("mean", "std", "stall_every"), [(0.5, 2.0, 0), (-20.0, 3.0, 3), (4.0, 0.25, 0)])
def test_fp16_layernorm_is_within_its_error_bound(mean: float, std: float, stall_every: int) -> None:
    n, rng = 24, np.random.default_rng(11)
    rows = rng.normal(mean, std, (4, n)).astype(np.float16)
    rows[3] = rows[3, 0]  # a constant row: σ² = 0, the output is β
    gamma = rng.uniform(-2, 2, n).astype(np.float16)
    beta = rng.uniform(-1, 1, n).astype(np.float16)
    got, _ = run_layernorm(FP16LayerNorm(n, gamma, beta), rows, stall_every)
    want = fp16.reference(rows, gamma, beta)
    error = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert (error <= fp16.error_bound(rows, gamma, beta)).all(), f"worst error {error.max()}"
    assert (got[3] == beta).all()


def test_fp16_layernorm_takes_its_stated_cycles_per_row() -> None:
    n = 8
    unit = FP16LayerNorm(n, np.ones(n, np.float16), np.zeros(n, np.float16))
    _, clocks = run_layernorm(unit, np.arange(3 * n, dtype=np.float16).reshape(3, n))
    assert clocks[2 * n] - clocks[n] == clocks[n] - clocks[0] == unit.cycles_per_row
    assert np.diff(clocks[:n]).tolist() == [1] * (n - 1)  # one result per clock within a row
