"""``qnorm synth`` / ``make fpga-report``: every RTL unit synthesized for every FPGA
family, as ``out/fpga.md`` and ``out/fpga.png``.

The units are the integer ops' RTL (``compilers.rtl.rtl_unit`` over
:data:`OP_CASES`, int8 rows of 64 and 768 for the four norms, an int8 softmax
over rows of 64, a multi-threshold and a folded LIF neuron) and the FP16 LayerNorm reference (:mod:`.fp16`) at the
same row lengths.  The table gives, per unit × family, the post-synthesis LUT /
FF / DSP / BRAM counts, the place-and-route Fmax (ECP5, iCE40), cycles per row and
elements per second at Fmax; then the P5 ratios (L1 vs integer L2, each vs FP16:
LUT, FF, DSP on xc7 and ecp5), where the four norm units' resources go (each
synthesized again without its statistics passes and row engine, the per-row
values from ports: :class:`~compilers.rtl.norm.NormUnit` with ``row_engine=False``,
counts after synthesis on xc7 and ecp5), and the versions of the tools that
produced it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from amaranth.hdl import Elaboratable

from compilers.rtl.fp16 import FP16LayerNorm
from compilers.rtl.norm import NormUnit
from compilers.rtl.synth import (
    FAMILIES,
    PNR_FLAGS,
    Resources,
    SynthResult,
    synthesize_rtlil,
    to_rtlil,
)
from compilers.rtl.unit import rtl_unit
from qnorm.errors import UsageError
from qnorm.ops._normcore import NormOp

# The integer ops' configurations, as verify cases; "@768" is the case with rows of 768
# (every 768-wide unit is spelled so, which is how --quick leaves them all out).
OP_CASES: tuple[str, ...] = (
    "int_layernorm.int8.n64",
    "l1_layernorm.int8.n64",
    "shift_layernorm.int8.n64.m2",
    "int_rmsnorm.int8.n64",
    "int_layernorm.int8.n64@768",
    "l1_layernorm.int8.n64@768",
    "shift_layernorm.int8.n64.m2@768",
    "int_rmsnorm.int8.n64@768",
    "softmax.int8.n64",
    "multithreshold.int8.c16.relu4",
    "folded_lif.int8.c16.hard.ge.leak0875",
)
ROW_LENGTHS = (64, 768)  # of the FP16 reference units
QUICK_ROW_LENGTHS = (64,)
QUICK_FAMILIES = ("xc7", "ecp5", "ice40")  # --quick: the slower xcup flow and 768-wide rows left out
RATIO_FAMILIES = ("xc7", "ecp5")
RATIO_COUNTS = ("lut", "ff", "dsp")
L1, L2, FP16_OP = "l1_layernorm", "int_layernorm", "fp16_layernorm"


@dataclass(frozen=True)
class ReportUnit:
    """A unit of the report: what to synthesize and its throughput figures."""

    op: str  # the op family: "l1_layernorm", "fp16_layernorm", ...
    config: str  # the rest of its name: "int8.n64", "n768"
    elaboratable: Elaboratable
    cycles_per_row: int
    elements_per_cycle: float  # sustained, o.ready held high
    ports: tuple[Any, ...] | None = None  # a plain Elaboratable's ports (a component's come from its signature)
    # the unit's datapath alone (no statistics passes, no row engine): the breakdown's
    # measurement, synthesized on RATIO_FAMILIES without place and route
    datapath: bool = False

    @property
    def name(self) -> str:
        return f"{self.op}.{self.config}" + (".datapath" if self.datapath else "")

    @property
    def row_length(self) -> int | None:
        """N of a norm's rows (the ``n<N>`` of its config), for pairing units in the ratios."""
        for part in self.config.split("."):
            if part.startswith("n") and part[1:].isdigit():
                return int(part[1:])
        return None


def fp16_units(row_lengths: Iterable[int]) -> list[ReportUnit]:
    """The FP16 LayerNorm at each row length; γ, β seeded (constant ones would fold away)."""
    units = []
    for n in row_lengths:
        rng = np.random.default_rng(n)
        unit = FP16LayerNorm(n, rng.uniform(0.5, 2.0, n), rng.normal(0.0, 0.2, n))
        units.append(
            ReportUnit(FP16_OP, f"n{n}", unit, unit.cycles_per_row, n / unit.cycles_per_row, tuple(unit.ports))
        )
    return units


def op_units(quick: bool, case_named: Callable[[str], Any]) -> list[ReportUnit]:
    """The integer ops' RTL units of :data:`OP_CASES` (rows of 64 only with ``quick``);
    ``case_named``: the verify catalogue's lookup (``qnorm.verify.cases.case_named``,
    passed in by the command: the catalogue sits above the compilers)."""
    units = []
    for spec in OP_CASES:
        name, _, length = spec.partition("@")
        if quick and length:
            continue
        case = case_named(name)
        if length:
            case = dataclasses.replace(
                case, name=name.replace(f"n{case.config['n']}", f"n{length}"), config={**case.config, "n": int(length)}
            )
        built = case.build()
        unit = rtl_unit(built)
        op, _, config = case.name.partition(".")
        units.append(
            ReportUnit(op, config, unit.elaboratable, unit.cycles_per_row, unit.elements_per_cycle, tuple(unit.ports))
        )
        if type(unit.elaboratable) is NormUnit:  # the four norms (not the softmax's row unit)
            units.append(datapath_unit(op, config, built))
    return units


def datapath_unit(op: str, config: str, built: NormOp) -> ReportUnit:
    """The norm unit of ``built`` without its statistics passes and row engine (its
    per-row values from ports): what the row buffer, the banks and the element chain
    cost alone, so the whole unit's counts less these are the statistics' and the
    engine's."""
    unit = NormUnit(built, row_engine=False)
    unit._MustUse__silence = True  # built for a report that may not select it
    return ReportUnit(op, config, unit, unit.cycles_per_row, unit.n / unit.cycles_per_row, tuple(unit.ports),
                      datapath=True)


# --------------------------------------------------------------------------- running


def synthesize_all(
    units: Sequence[ReportUnit], families: Sequence[str], progress: Callable[[str], None] = lambda line: None
) -> list[tuple[ReportUnit, SynthResult]]:
    """Every unit on every family, results in order; ``progress`` gets one line per result.

    The units are elaborated one at a time (Amaranth is not thread-safe), then the
    yosys / nextpnr runs, each its own process, go one per usable CPU: a 768-wide
    unit takes minutes per family, so a cold report is that many times shorter.
    """
    texts = [to_rtlil(unit.elaboratable, unit.ports) for unit in units]
    runs = [
        (unit, text, family)
        for unit, text in zip(units, texts, strict=True)
        for family in families
        if not unit.datapath or family in RATIO_FAMILIES
    ]
    pool = ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0)))
    try:
        futures = [
            pool.submit(synthesize_rtlil, text, unit.name, family, place=not unit.datapath)
            for unit, text, family in runs
        ]
        results = []
        for (unit, _, family), future in zip(runs, futures, strict=True):
            result = future.result()
            state = "cache hit" if result.cache_hit else f"{result.seconds:.0f} s"
            progress(f"{unit.name} on {family}: LUT {result.resources.lut}, FF {result.resources.ff} ({state})")
            results.append((unit, result))
    finally:  # on an error, the runs not started yet are dropped
        pool.shutdown(wait=False, cancel_futures=True)
    return results


# --------------------------------------------------------------------------- markdown


def _fmax(result: SynthResult) -> str:
    if not FAMILIES[result.family].pnr:
        return "—"  # no open place and route
    if result.unplaced is not None:
        return result.unplaced
    return "no reg-to-reg path" if result.fmax_mhz is None else f"{result.fmax_mhz:.1f}"


def _rate(unit: ReportUnit, result: SynthResult) -> str:
    if result.fmax_mhz is None:
        return "—"
    return f"{unit.elements_per_cycle * result.fmax_mhz:.1f}"


def resource_table(results: Sequence[tuple[ReportUnit, SynthResult]]) -> list[str]:
    lines = [
        "| unit | family | LUT | FF | DSP | BRAM | Fmax (MHz) | cycles/row | Melem/s at Fmax |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for unit, r in whole_units(results):
        res = r.resources
        lines.append(
            f"| {unit.name} | {r.family} | {res.lut} | {res.ff} | {res.dsp} | {res.bram} | {_fmax(r)} "
            f"| {unit.cycles_per_row} | {_rate(unit, r)} |"
        )
    return lines


def whole_units(results: Sequence[tuple[ReportUnit, SynthResult]]) -> list[tuple[ReportUnit, SynthResult]]:
    """The results of whole units (not a breakdown's datapath alone)."""
    return [(unit, r) for unit, r in results if not unit.datapath]


def _ratio(num: int, den: int) -> str:
    if den == 0:
        return "—" if num == 0 else "∞"  # 0/0: neither uses any
    return f"{num / den:.2f}"


def ratio_rows(results: Sequence[tuple[ReportUnit, SynthResult]]) -> list[tuple[str, int, str, dict[str, str]]]:
    """P5: per row length and family, (comparison, N, family, count -> ratio) for L1 / L2,
    L1 / FP16 and L2 / FP16, where both units of a pair were synthesized."""
    counts = {
        (unit.op, unit.row_length, r.family): r.resources
        for unit, r in whole_units(results)
        if unit.op in (L1, L2, FP16_OP)
    }
    rows = []
    lengths = sorted({n for _, n, _ in counts if n is not None})
    for num, den in ((L1, L2), (L1, FP16_OP), (L2, FP16_OP)):
        for n in lengths:
            for family in RATIO_FAMILIES:
                a, b = counts.get((num, n, family)), counts.get((den, n, family))
                if a is None or b is None:
                    continue
                ratios = {c: _ratio(getattr(a, c), getattr(b, c)) for c in RATIO_COUNTS}
                rows.append((f"{num} / {den}", n, family, ratios))
    return rows


def ratio_table(results: Sequence[tuple[ReportUnit, SynthResult]]) -> list[str]:
    rows = ratio_rows(results)
    if not rows:
        return ["No pair to compare: the report holds no synthesized L1LayerNorm / IntLayerNorm pair."]
    lines = ["| comparison | N | family | LUT | FF | DSP |", "|---|---:|---|---:|---:|---:|"]
    lines += [f"| {what} | {n} | {family} | {r['lut']} | {r['ff']} | {r['dsp']} |" for what, n, family, r in rows]
    return lines


def breakdown_rows(
    results: Sequence[tuple[ReportUnit, SynthResult]],
) -> list[tuple[ReportUnit, str, Resources, Resources]]:
    """(whole unit, family, its counts, its datapath's counts) wherever both were synthesized."""
    alone = {(unit.op, unit.config, r.family): r.resources for unit, r in results if unit.datapath}
    return [
        (unit, r.family, r.resources, alone[(unit.op, unit.config, r.family)])
        for unit, r in whole_units(results)
        if (unit.op, unit.config, r.family) in alone
    ]


def _share(part: int, whole: int) -> str:
    return "—" if whole == 0 else f"{100 * part / whole:.0f} %"


def breakdown_table(results: Sequence[tuple[ReportUnit, SynthResult]]) -> list[str]:
    """Per norm unit and family: the whole unit, its datapath alone, and the rest (the
    statistics passes and the row engine) with its share of the whole."""
    rows = breakdown_rows(results)
    if not rows:
        return ["No breakdown: the report holds no norm unit with its datapath alone."]
    lines = [
        "| unit | family | whole LUT / FF / DSP | datapath alone | statistics and row engine | their share of LUT / FF |",
        "|---|---|---|---|---|---|",
    ]
    for unit, family, whole, alone in rows:
        rest = [getattr(whole, c) - getattr(alone, c) for c in RATIO_COUNTS]
        lines.append(
            f"| {unit.name} | {family} | {whole.lut} / {whole.ff} / {whole.dsp} | {alone.lut} / {alone.ff} / {alone.dsp} "
            f"| {rest[0]} / {rest[1]} / {rest[2]} | {_share(rest[0], whole.lut)} / {_share(rest[1], whole.ff)} |"
        )
    return lines


def tool_lines(results: Sequence[tuple[ReportUnit, SynthResult]]) -> list[str]:
    tools = sorted({(tool, version) for _, r in results for tool, version in r.tools.items()})
    return [f"- {tool}: {version}" for tool, version in tools]


def family_lines(families: Sequence[str]) -> list[str]:
    lines = []
    for name in families:
        fam = FAMILIES[name]
        flow = f"`{fam.synth.split(' -json')[0]}`"
        if fam.netlist_pass is not None:
            flow += f", `{fam.netlist_pass.__module__}.{fam.netlist_pass.__name__}` (version {fam.netlist_pass_version})"
        if fam.pnr:
            flow += f", then `{' '.join(fam.pnr)} --freq {fam.pnr_freq_mhz} {' '.join(PNR_FLAGS)}`"
        lines.append(f"- {name}: {fam.part}; {flow}; BRAM in {fam.bram_unit}")
    return lines


def markdown(results: Sequence[tuple[ReportUnit, SynthResult]], families: Sequence[str]) -> str:
    return "\n".join(
        [
            "# FPGA resources",
            "",
            (
                "Written by `qnorm synth` (`make fpga-report`). LUT / FF / DSP / BRAM: yosys `stat` after "
                "synthesis (LUTs include those LUT-RAM and carry cells occupy; see compilers/rtl/synth.py). "
                "Fmax: nextpnr's timing report after place and route, where an open flow exists. "
                "Elements per second: the unit's sustained elements per clock × Fmax."
            ),
            "",
            *resource_table(results),
            "",
            "## P5: L1 vs integer L2, and each vs FP16 (ratio of counts)",
            "",
            *ratio_table(results),
            "",
            "### Where the norm units' resources go",
            "",
            (
                "Each unit synthesized again without its statistics passes and row engine (its per-row "
                "multiplier, offset and shift from ports): the datapath alone, i.e. the row buffer, the "
                "banks and the element chain. The whole unit less that is what its statistics and row "
                "engine take. Counts after synthesis (on ecp5 after its netlist pass), no place and route."
            ),
            "",
            *breakdown_table(results),
            "",
            "## Families and flows",
            "",
            *family_lines(families),
            "",
            "## Tools",
            "",
            *tool_lines(results),
            "",
        ]
    )


def plot(results: Sequence[tuple[ReportUnit, SynthResult]], families: Sequence[str], path: Path) -> None:
    """LUT, FF and DSP per unit, one group of bars per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = whole_units(results)
    names = list(dict.fromkeys(unit.name for unit, _ in results))
    by_key = {(unit.name, r.family): r.resources for unit, r in results}
    fig, axes = plt.subplots(1, 3, figsize=(15, 0.45 * len(names) + 2), sharey=True)
    height = 0.8 / len(families)
    for ax, count in zip(axes, ("lut", "ff", "dsp"), strict=True):
        for k, family in enumerate(families):
            values = [getattr(by_key[(n, family)], count) if (n, family) in by_key else 0 for n in names]
            ax.barh(np.arange(len(names)) + k * height, values, height, label=family)
        ax.set_title(count.upper())
        ax.set_xlabel("count (post-synthesis)")
    axes[0].set_yticks(np.arange(len(names)) + 0.4 - height / 2, names)
    axes[0].invert_yaxis()
    axes[-1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report_paths(out: Path) -> list[Path]:
    """What :func:`write_report` writes for ``out``: the markdown and the PNG beside it."""
    return [out, out.with_suffix(".png")]


def select_units(units: Sequence[ReportUnit], patterns: Sequence[str]) -> list[ReportUnit]:
    """The units whose name matches one of the shell-style ``patterns`` (none: all);
    a pattern that matches no unit is refused with the names there are."""
    if not patterns:
        return list(units)
    names = [unit.name for unit in units]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise UsageError(f"--unit {pattern!r} matches no unit of the report; its units: {', '.join(names)}")
    chosen = [unit for unit in units if any(fnmatch.fnmatchcase(unit.name, p) for p in patterns)]
    for unit in units:
        if unit not in chosen:  # built, never elaborated: not the mistake Amaranth warns of
            unit.elaboratable._MustUse__silence = True  # type: ignore[attr-defined]
    return chosen


def write_report(
    out: Path,
    case_named: Callable[[str], Any],
    quick: bool = False,
    progress: Callable[[str], None] = lambda line: None,
    patterns: Sequence[str] = (),
    families: Sequence[str] = (),
) -> list[Path]:
    """Synthesize every unit (``quick``: rows of 64, no xcup) and write ``out`` (markdown)
    and the PNG beside it; returns the paths written.  ``case_named``: see :func:`op_units`.
    ``patterns``: only the units whose name matches one (:func:`select_units`);
    ``families``: only these (default: all, or the quick ones)."""
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise UsageError(f"unknown FPGA family {', '.join(unknown)}; known: {', '.join(FAMILIES)}")
    families = tuple(families) or (QUICK_FAMILIES if quick else tuple(FAMILIES))
    units = [*op_units(quick, case_named), *fp16_units(QUICK_ROW_LENGTHS if quick else ROW_LENGTHS)]
    results = synthesize_all(select_units(units, patterns), families, progress)
    table, png = report_paths(out)
    table.parent.mkdir(parents=True, exist_ok=True)
    table.write_text(markdown(results, families))
    plot(results, families, png)
    return [table, png]
