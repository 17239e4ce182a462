"""Amaranth's Python simulator for an :class:`~compilers.rtl.unit.RtlUnit`: quick runs.

:func:`simulate` streams integers through the unit's valid/ready ports (input
valid and output ready held high unless a ``stall`` pattern says otherwise) and
collects its outputs; it also counts the cycles, so tests can check latency and
throughput.  About 500 cycles per second on a norm unit (int8 rows of 64, a
loaded machine): the large random runs use Verilator
(:mod:`compilers.rtl.verilator`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from amaranth.hdl import Signal
from amaranth.sim import Simulator

from compilers.rtl.unit import RtlUnit


@dataclass(frozen=True)
class SimResult:
    """Outputs in stream order, the cycle each one appeared, and the total cycles run."""

    out: np.ndarray
    out_cycles: np.ndarray
    in_cycles: np.ndarray
    cycles: int


def simulate(unit: RtlUnit, stream: np.ndarray, first: np.ndarray | None = None,
             out_stall_every: int = 0, out_ready: np.ndarray | None = None,
             held: Sequence[tuple[Signal, int]] = ()) -> SimResult:
    """Feed ``stream`` (1-D, in the unit's stream order) and read as many outputs.

    ``first``: per element, the start-of-sample flag (neuron units).
    ``out_stall_every``: drop ``out_ready`` every k-th cycle (0: never) to
    exercise back-pressure; ``out_ready``: the level of ``out_ready`` per cycle,
    repeated when the run is longer (random back-pressure).  ``held``: other input
    ports, each with the level it is held at for the whole run.
    """
    dut = unit.elaboratable
    values = [int(v) for v in np.asarray(stream).reshape(-1)]
    flags = [False] * len(values) if first is None else [bool(f) for f in np.asarray(first).reshape(-1)]
    outs: list[int] = []
    out_cycles: list[int] = []
    in_cycles: list[int] = []
    limit = unit.latency + 4 * len(values) * max(unit.cycles_per_element, 1) + 64
    total = [0]

    async def bench(ctx: object) -> None:
        sent, cycle = 0, 0
        for port, level in held:
            ctx.set(port, level)  # type: ignore[attr-defined]
        while len(outs) < len(values):
            if cycle > limit:
                raise RuntimeError(f"{unit.name}: {len(outs)} of {len(values)} outputs after {cycle} cycles")
            ready = not (out_stall_every and cycle % out_stall_every == out_stall_every - 1)
            if out_ready is not None:
                ready = ready and bool(out_ready[cycle % len(out_ready)])
            ctx.set(dut.out_ready, ready)  # type: ignore[attr-defined]
            if sent < len(values):
                ctx.set(dut.in_valid, 1)  # type: ignore[attr-defined]
                ctx.set(dut.in_data, values[sent])  # type: ignore[attr-defined]
                if unit.has_first:
                    ctx.set(dut.in_first, flags[sent])  # type: ignore[attr-defined]
            else:
                ctx.set(dut.in_valid, 0)  # type: ignore[attr-defined]
            took = sent < len(values) and ctx.get(dut.in_ready)  # type: ignore[attr-defined]
            if ready and ctx.get(dut.out_valid):  # type: ignore[attr-defined]
                outs.append(ctx.get(dut.out_data))  # type: ignore[attr-defined]
                out_cycles.append(cycle)
            if took:
                in_cycles.append(cycle)
                sent += 1
            await ctx.tick()  # type: ignore[attr-defined]
            cycle += 1
        total[0] = cycle

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    return SimResult(np.array(outs, dtype=np.int64), np.array(out_cycles), np.array(in_cycles), total[0])
