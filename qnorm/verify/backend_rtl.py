"""``qnorm verify`` column fpga-rtl: the RTL unit of each op, in HDL simulation.

Per op: the target limits of ``qnorm/data/targets/fpga-rtl.toml`` first (the
DSP48E2's widths, as for fpga-hls: a config beyond them is ``refused``), then
:func:`compilers.rtl.rtl_unit` builds the op's streaming unit and Verilator
builds its simulation model (cached by the Verilog's hash).  Each batch of
vectors is streamed through the unit in its stream order
(:mod:`compilers.rtl.unit`).  Amaranth's Python simulator runs ~100 cycles
per second on the pipelined norm units, so it takes the first vectors of the stored
golden set (up to :data:`AMARANTH_ELEMENTS` elements) and Verilator everything
else (the rest of the golden set, and the random streams: >= 10^5 elements per
case); so both simulators of the one design are checked against the golden model.

Importing this module registers the column without importing amaranth.
"""

from __future__ import annotations

import importlib
import shutil
from typing import Any

import numpy as np

from qnorm.extras import missing
from qnorm.ops.base import IntOp
from qnorm.verify.registry import (
    Backend,
    Runner,
    Unsupported,
    column_target,
    refuse_beyond_limits,
    register,
)

NAME = "fpga-rtl"
AMARANTH_ELEMENTS = 256  # elements of the golden set run in Amaranth's simulator
GOLDEN_MAX_ELEMENTS = 1 << 14  # a batch this small is the stored golden set (random chunks are 2^18)


def _unavailable() -> str | None:
    reason = missing("amaranth") or missing("verilator")
    if reason is not None:
        return reason
    if shutil.which("g++") is None or shutil.which("make") is None:
        return "unavailable: Verilator builds its simulation with g++ and make, which are not on PATH"
    return None


def batch_axis(op: IntOp) -> int:
    """The axis that counts vectors: time comes first for a neuron."""
    from qnorm.ops.spiking import _LIFNeuron

    return 1 if isinstance(op, _LIFNeuron) else 0


def _prepare(op: IntOp) -> Runner:
    rtl = importlib.import_module("compilers.rtl")
    sim = importlib.import_module("compilers.rtl.sim")
    stream_order = importlib.import_module("compilers.rtl.stream").stream_order
    verilator = importlib.import_module("compilers.rtl.verilator")
    refuse_beyond_limits(op, column_target(NAME))
    try:
        unit = rtl.rtl_unit(op)
    except NotImplementedError as err:
        raise Unsupported(str(err) or f"no RTL unit for {type(op).__name__}") from None
    built = verilator.build(unit)

    def simulated(x: np.ndarray, amaranth: bool) -> np.ndarray:
        stream, first, restore = stream_order(op, x)
        out = sim.simulate(unit, stream, first).out if amaranth else built.run(stream, first)[0]
        return restore(out)

    def run(x: np.ndarray) -> Any:
        x = op.in_fmt.check(np.asarray(x))  # an out-of-format value must not wrap in the port
        if x.size == 0 or x.size > GOLDEN_MAX_ELEMENTS:
            return simulated(x, amaranth=False)
        axis = batch_axis(op)
        head = max(1, AMARANTH_ELEMENTS * x.shape[axis] // max(x.size, 1))  # whole vectors
        parts = [simulated(part, amaranth=i == 0) for i, part in enumerate(np.split(x, [head], axis=axis))
                 if part.size]
        return np.concatenate(parts, axis=axis)

    return Runner(
        run,
        f"{unit.name} (latency {unit.latency}, {unit.elements_per_cycle:.3g} element/clock): "
        f"Amaranth's simulator for the first {AMARANTH_ELEMENTS} golden elements, Verilator for the rest",
    )


register(
    Backend(
        NAME,
        f"RTL units (compilers.rtl, Amaranth) in HDL simulation: the first {AMARANTH_ELEMENTS} golden elements in "
        "Amaranth's simulator, the rest and the random streams in Verilator; configs beyond the DSP48E2's "
        "widths are refused",
        _prepare,
        _unavailable,
    )
)
