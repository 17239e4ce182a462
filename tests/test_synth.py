"""FPGA synthesis of Amaranth units (compilers.rtl.synth): a tiny streaming unit through
yosys for xc7 and through yosys + nextpnr for ecp5, cached; a failing tool named with
its log."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("amaranth", reason="the RTL flow needs the fpga extra (pip install -e '.[fpga]')")

from amaranth import Module, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from compilers import cache
from compilers.rtl import synth
from compilers.rtl.synth import FAMILIES, SynthError, synthesize


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
