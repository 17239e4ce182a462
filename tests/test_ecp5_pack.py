"""The ECP5 netlist pass (compilers.rtl.ecp5): fabric registers after a DP16KD's read
port or a MULT18X18D's product move into the block only where that is the same
circuit; and the row buffer's collisions are don't-care in the RTLIL synthesis reads
(compilers.rtl.synth.collisions_dont_care)."""

from __future__ import annotations

import copy
import json

import pytest

pytest.importorskip("amaranth", reason="the RTL flow needs the fpga extra (pip install -e '.[fpga]')")

from amaranth import Module, Signal
from amaranth.lib.memory import Memory

from compilers import cache
from compilers.rtl.ecp5 import main, pack_output_registers
from compilers.rtl.synth import collisions_dont_care, synthesize, to_rtlil
from compilers.rtl.values import DISCARDED_COLLISIONS

CLK, CE, RST, OTHER_CE = 2, 3, 4, 5


def _ff(d: int, q: int, ce: int | None = CE, lsr: int | str = "0", clk: int = CLK) -> dict:
    connections = {"CLK": [clk], "DI": [d], "LSR": [lsr], "Q": [q]}
    params = {"CLKMUX": "CLK", "GSR": "DISABLED", "LSRMUX": "LSR", "REGSET": "RESET", "SRMODE": "LSR_OVER_CE",
              "CEMUX": "CE" if ce is not None else "1 "}
    if ce is not None:
        connections["CE"] = [ce]
    return {"type": "TRELLIS_FF", "parameters": params, "port_directions":
            {"CLK": "input", "CE": "input", "DI": "input", "LSR": "input", "Q": "output"}, "connections": connections}


def _ram() -> dict:
    connections = {"CLKB": [CLK], "CEB": [CE], "OCEB": ["1"], "RSTB": ["0"], "DOB0": [10], "DOB1": [11], "DOB2": [12]}
    return {"type": "DP16KD", "parameters": {"REGMODE_A": "NOREG", "REGMODE_B": "NOREG"},
            "port_directions": {p: "output" if p.startswith("DO") else "input" for p in connections},
            "connections": connections}


def _mult() -> dict:
    connections = {"A0": [30], "B0": [31], "P0": [10], "P1": [11], "P2": [12]}
    return {"type": "MULT18X18D", "parameters": {"REG_OUTPUT_CLK": "NONE"},
            "port_directions": {p: "output" if p[0] == "P" else "input" for p in connections},
            "connections": connections}


def _netlist(block: dict, **ffs: dict) -> dict:
    """The block driving nets 10 and 11 (12 unused) and the given flip-flops."""
    return {"modules": {"top": {"ports": {"out": {"direction": "output", "bits": [20, 21]}},
                                "cells": {"block": block, **ffs}}}}


def _registers(**changes: dict) -> dict:
    ffs = {"r0": _ff(10, 20), "r1": _ff(11, 21)}
    return {**ffs, **changes}


def test_a_block_rams_read_register_moves_into_it() -> None:
    netlist = _netlist(_ram(), **_registers())
    assert pack_output_registers(netlist) == 1
    cells = netlist["modules"]["top"]["cells"]
    assert set(cells) == {"block"}
    ram = cells["block"]
    assert ram["parameters"]["REGMODE_B"] == "OUTREG"
    assert ram["connections"]["OCEB"] == [CE]
    assert (ram["connections"]["DOB0"], ram["connections"]["DOB1"]) == ([20], [21])


def test_the_command_packs_a_netlist_file_in_place(tmp_path, capsys) -> None:
    path = tmp_path / "unit.ecp5.json"
    path.write_text(json.dumps(_netlist(_ram(), **_registers())))
    assert main([str(path)]) == 0
    assert set(json.loads(path.read_text())["modules"]["top"]["cells"]) == {"block"}
    assert "1 output register(s) packed" in capsys.readouterr().out


@pytest.mark.parametrize("text, why", [("{", "not a readable JSON netlist"), ("[]", "no 'modules'")])
def test_the_command_refuses_what_is_not_a_netlist_and_leaves_it(tmp_path, capsys, text: str, why: str) -> None:
    path = tmp_path / "unit.ecp5.json"
    path.write_text(text)
    assert main([str(path)]) == 1
    assert why in capsys.readouterr().err and path.read_text() == text


def test_a_products_register_moves_into_the_multiplier() -> None:
    netlist = _netlist(_mult(), **_registers())
    assert pack_output_registers(netlist) == 1
    mult = netlist["modules"]["top"]["cells"]["block"]
    assert len(netlist["modules"]["top"]["cells"]) == 1
    assert mult["parameters"]["REG_OUTPUT_CLK"] == "CLK0" and mult["parameters"]["REG_OUTPUT_CE"] == "CE0"
    assert mult["connections"]["CLK0"] == [CLK] and mult["connections"]["CE0"] == [CE]
    assert mult["connections"]["RST0"] == ["0"] and mult["port_directions"]["CLK0"] == "input"
    assert (mult["connections"]["P0"], mult["connections"]["P1"]) == ([20], [21])


def test_registers_without_an_enable_pack_with_the_enable_tied_high() -> None:
    netlist = _netlist(_ram(), r0=_ff(10, 20, ce=None), r1=_ff(11, 21, ce=None))
    assert pack_output_registers(netlist) == 1
    assert netlist["modules"]["top"]["cells"]["block"]["connections"]["OCEB"] == ["1"]


def _lut_reading(net: int) -> dict:
    return {"type": "LUT4", "parameters": {"INIT": "1010101010101010"},
            "port_directions": {"A": "input", "Z": "output"}, "connections": {"A": [net], "Z": [40]}}


@pytest.mark.parametrize("block", [_ram, _mult])
@pytest.mark.parametrize("why, changes", [
    ("a data bit with a second reader", {"extra": _lut_reading(11)}),
    ("a data bit read by logic, not a register", {"r1": _lut_reading(11)}),
    ("a register with a reset wired", {"r1": _ff(11, 21, lsr=RST)}),
    ("registers with different enables", {"r1": _ff(11, 21, ce=OTHER_CE)}),
    ("registers on different clocks", {"r1": _ff(11, 21, clk=9)}),
])
def test_outputs_that_are_not_the_same_circuit_are_left(block, why: str, changes: dict) -> None:
    netlist = _netlist(block(), **_registers(**changes))
    before = copy.deepcopy(netlist)
    assert pack_output_registers(netlist) == 0, why
    assert netlist == before


def test_a_ram_read_register_on_another_clock_than_the_port_is_left() -> None:
    ffs = {"r0": _ff(10, 20, clk=9), "r1": _ff(11, 21, clk=9)}
    netlist = _netlist(_ram(), **ffs)
    assert pack_output_registers(netlist) == 0


def _buffered(discarded: bool) -> tuple[Module, list[Signal]]:
    """A memory written at one address and read at another, its data registered."""
    m = Module()
    attrs = {DISCARDED_COLLISIONS: 1} if discarded else {}
    m.submodules.buf = buf = Memory(shape=8, depth=512, init=[], attrs=attrs)
    wr, rd = buf.write_port(), buf.read_port()
    waddr, raddr, data, we = Signal(9), Signal(9), Signal(8), Signal()
    out = Signal(8, reset_less=True)
    m.d.comb += [wr.addr.eq(waddr), wr.data.eq(data), wr.en.eq(we), rd.addr.eq(raddr)]
    m.d.sync += out.eq(rd.data)
    return m, [waddr, raddr, data, we, out]


@pytest.mark.parametrize("discarded", [True, False])
def test_only_a_marked_memorys_reads_are_dont_care_on_a_collision(discarded: bool) -> None:
    text = to_rtlil(*_buffered(discarded))
    masks = [line.split()[-1] for line in text.splitlines() if "COLLISION_X_MASK" in line]
    assert masks == (["1'1"] if discarded else ["1'0"])
    assert collisions_dont_care(text) == text  # the rewrite is settled


@pytest.mark.parametrize("discarded", [True, False])
def test_a_marked_row_buffer_synthesizes_to_a_registered_block_ram(tmp_path, monkeypatch, discarded: bool) -> None:
    """End to end on ECP5: marked, no bypass logic lies between the DP16KD and its
    register, which then moves into the block (no fabric flip-flop holds the data);
    unmarked, yosys keeps the old value on a collision and the register stays."""
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    m, ports = _buffered(discarded)
    result = synthesize(m, "buffered", "ecp5", ports=ports)
    assert result.resources.bram == 1
    assert (result.resources.ff == 0) == discarded, result.resources.cells
