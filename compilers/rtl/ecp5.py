"""A netlist pass for ECP5: fabric registers packed into the hard blocks' own.

yosys 0.70's ``synth_ecp5`` maps a synchronous memory read onto a DP16KD in
``NOREG`` mode and a product onto a MULT18X18D with no register enabled, and
leaves the registers the units put after them in the fabric.  On an LFE5U-25F a
DP16KD's data comes 5.8 ns after the clock and a combinational MULT18X18D takes
about 4 ns, so either one, with the net to its fabric register, fills most of a
150 MHz clock (6.7 ns).  Both primitives have an output register of their own
(DP16KD ``REGMODE = OUTREG`` enabled by ``OCE``; MULT18X18D ``REG_OUTPUT_CLK``
with a CE pin), which yosys' mapping does not use: :func:`pack_output_registers`
moves those fabric registers into them on the synthesized JSON netlist, before
nextpnr reads it.

It packs a block's output only where that is the same circuit: every output bit
read drives exactly one cell input, the D input of a TRELLIS_FF, and those
flip-flops share one clock (not inverted; a DP16KD port's own), one clock enable
and no set or reset (the units' data registers are reset-less: their readers wait
for a valid flag).  The block's register then holds what they held, on the same
clock edges: the flip-flops' outputs become the block's outputs and the flip-flops
are removed.  An output with any other reader (a LUT, a module port, a second
flip-flop) is left as it is.

``python -m compilers.rtl.ecp5 NETLIST.json`` runs the pass on a netlist file in
place (what a deployed RTL project's README runs between yosys and nextpnr).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PACK_VERSION = 2  # part of the synthesis cache key: bump when what the pass packs changes
_ONE = "1"


def _readers(module: Mapping[str, Any]) -> dict[Any, list[tuple[str, str]]]:
    """Net bit -> the (cell, port) inputs reading it; module outputs as ("", port)."""
    readers: dict[Any, list[tuple[str, str]]] = defaultdict(list)
    for name, cell in module["cells"].items():
        for port, bits in cell["connections"].items():
            if cell["port_directions"].get(port) == "input":
                for bit in bits:
                    readers[bit].append((name, port))
    for port, info in module.get("ports", {}).items():
        if info["direction"] != "input":
            for bit in info["bits"]:
                readers[bit].append(("", port))
    return readers


def _param(cell: Mapping[str, Any], name: str, default: str) -> str:
    """A string parameter: yosys' JSON pads one that reads as binary digits ("1 ")."""
    return str(cell["parameters"].get(name, default)).strip()


def _plain_enable_register(cell: Mapping[str, Any]) -> bool:
    """A TRELLIS_FF that is a D flip-flop on the rising clock with at most a clock
    enable: no set or reset wired."""
    c = cell["connections"]
    if cell["type"] != "TRELLIS_FF" or _param(cell, "CLKMUX", "CLK") != "CLK":
        return False
    if _param(cell, "CEMUX", "CE") not in ("CE", _ONE):
        return False
    no_reset = _param(cell, "LSRMUX", "LSR") == "LSR" and c.get("LSR", ["0"]) == ["0"]
    return no_reset and _param(cell, "REGSET", "RESET") == "RESET"


def _enable(cell: Mapping[str, Any]) -> list:
    if _param(cell, "CEMUX", "CE") == _ONE:
        return [_ONE]
    return list(cell["connections"].get("CE", [_ONE]))


Readers = Mapping[Any, list[tuple[str, str]]]


def _output_registers(cells: Mapping[str, Any], outputs: list[tuple[str, Any]],
                      readers: Readers) -> tuple[list[tuple[str, str]], list, list] | None:
    """The flip-flops that alone read ``outputs`` (pin, net bit) as (pin, flip-flop),
    with their common clock and enable; None when the outputs do not qualify."""
    registers: list[tuple[str, str]] = []
    for pin, bit in outputs:
        read = readers.get(bit, [])
        if not read:
            continue  # an unused output bit
        if len(read) != 1:
            return None
        reader, port = read[0]
        if port != "DI" or not reader or not _plain_enable_register(cells[reader]):
            return None
        registers.append((pin, reader))
    if not registers:
        return None
    first = cells[registers[0][1]]
    clock, enable = first["connections"]["CLK"], _enable(first)
    if any(cells[r]["connections"]["CLK"] != clock or _enable(cells[r]) != enable for _, r in registers):
        return None
    return registers, clock, enable


def _absorb(cells: dict[str, Any], block: dict[str, Any], registers: list[tuple[str, str]]) -> None:
    """The flip-flops' outputs become the block's output pins; the flip-flops go."""
    for pin, reader in registers:
        block["connections"][pin] = cells[reader]["connections"]["Q"]
        del cells[reader]


def _pack_ram_port(module: dict[str, Any], name: str, side: str, readers: Readers) -> bool:
    """Pack the read data register of port ``side`` ("A"/"B") of the DP16KD ``name``."""
    cells = module["cells"]
    ram = cells[name]
    if _param(ram, f"REGMODE_{side}", "NOREG") != "NOREG":
        return False
    found = _output_registers(cells, [(p, b[0]) for p, b in ram["connections"].items() if p.startswith(f"DO{side}")],
                              readers)
    if found is None or found[1] != ram["connections"].get(f"CLK{side}"):
        return False
    registers, _, enable = found
    ram["parameters"][f"REGMODE_{side}"] = "OUTREG"
    ram["connections"][f"OCE{side}"] = enable
    _absorb(cells, ram, registers)
    return True


def _pack_product(module: dict[str, Any], name: str, readers: Readers) -> bool:
    """Pack the product register of the MULT18X18D ``name`` (clock, enable and reset
    pins 0, which yosys leaves unconnected)."""
    cells = module["cells"]
    mult = cells[name]
    if _param(mult, "REG_OUTPUT_CLK", "NONE") != "NONE" or any(
        p in mult["connections"] for p in ("CLK0", "CE0", "RST0")
    ):
        return False
    found = _output_registers(cells, [(p, b[0]) for p, b in mult["connections"].items() if p[0] == "P"], readers)
    if found is None:
        return False
    registers, clock, enable = found
    mult["parameters"].update(REG_OUTPUT_CLK="CLK0", REG_OUTPUT_CE="CE0", REG_OUTPUT_RST="RST0")
    mult["connections"].update(CLK0=clock, CE0=enable, RST0=["0"])
    mult["port_directions"].update(CLK0="input", CE0="input", RST0="input")
    _absorb(cells, mult, registers)
    return True


def pack_output_registers(netlist: dict[str, Any]) -> int:
    """Pack DP16KD read data and MULT18X18D product registers (module docstring), in
    place, in every module of a yosys JSON ``netlist``; how many outputs were packed."""
    packed = 0
    for module in netlist.get("modules", {}).values():
        cells = module.get("cells", {})
        for name in [n for n, c in cells.items() if c["type"] == "DP16KD"]:
            for side in "AB":
                # recomputed per output: packing rewires the nets the next check reads
                packed += _pack_ram_port(module, name, side, _readers(module))
        for name in [n for n, c in cells.items() if c["type"] == "MULT18X18D"]:
            packed += _pack_product(module, name, _readers(module))
    return packed


def main(argv: Sequence[str] | None = None) -> int:
    """Pack the registers of a yosys ECP5 JSON netlist file, in place."""
    parser = argparse.ArgumentParser(
        prog="python -m compilers.rtl.ecp5",
        description="Move fabric registers after ECP5 DP16KD reads and MULT18X18D products into the blocks' own.",
    )
    parser.add_argument("netlist", type=Path, help="yosys synth_ecp5 -json output, rewritten in place")
    args = parser.parse_args(argv)
    try:
        netlist = json.loads(args.netlist.read_text())
    except (OSError, ValueError) as err:
        print(f"error: {args.netlist}: not a readable JSON netlist ({err})", file=sys.stderr)
        return 1
    if not isinstance(netlist, dict) or not isinstance(netlist.get("modules"), dict):
        print(f"error: {args.netlist}: not a yosys JSON netlist (no 'modules')", file=sys.stderr)
        return 1
    packed = pack_output_registers(netlist)
    args.netlist.write_text(json.dumps(netlist))
    print(f"{args.netlist}: {packed} output register(s) packed into DP16KD / MULT18X18D")
    return 0


if __name__ == "__main__":
    sys.exit(main())
