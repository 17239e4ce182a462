"""How a kernel's loops map to a machine: one :class:`Schedule` per kind of target.

A kernel's arithmetic is target-independent (the op's own fixedpoint code on
TIR); only its loop structure differs between a vector CPU (rows in parallel,
channels in SIMD lanes), a GPU (a warp or a block per row, threads over channels) and
plain C for HLS (serial loops an HLS tool pipelines itself).  Kernels are built
in two ways, and a schedule says what to do for each:

* **Stage kernels** (the norms, MultiThreshold, BNQuant) are TE stages ending in
  an output block named ``"out"``; ``rowwise(func, "out")`` schedules them.
* **Loop kernels** (the LIF neurons: a time loop carrying membrane state) are
  written as loops directly; ``rows`` opens the loop over rows and ``channels``
  runs a body for every channel of a row, the row's scratch buffers living in
  ``scratch_scope``.  Each channel body only touches its own channel's
  scratch element, so consecutive channel loops need no synchronization.

:data:`CPU` is the schedule of :mod:`compilers.tvm.cpu`; other targets define
their own next to their code.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import tvm
from tvm import tirx
from tvm.script.ir_builder import tirx as T

from compilers.tvm.cpu import schedule_rowwise

ChannelBody = Callable[[Any], None]

CPU_LANES = 8  # the neuron computes in int64: 8 lanes fill one 512-bit register
# Scheduled kernels kept for reuse: a model's ops that share a kernel text (the five
# LayerNorms of the demo transformer) are scheduled once; each schedule costs about
# a second of TIR scheduling calls.
SCHEDULED_KEPT = 64


@dataclass(frozen=True)
class Schedule:
    name: str
    rowwise: Callable[[tirx.PrimFunc, str], tvm.IRModule]
    rows: Callable[[Any], AbstractContextManager[Any]]
    channels: Callable[[int, ChannelBody], None]
    scratch_scope: str = "global"
    # ShiftLayerNorm's ±2^l gains as the op writes them, a shift and a conditional
    # negate (fabric whose multipliers are DSP blocks: HLS), instead of one multiply
    # by ±2^l, the same integers in a quarter of the instructions on CPUs and GPUs.
    shift_gains: bool = False
    # Rows whose z keeps every output sum in the lanes skip the norms' window clamp (a
    # branch per row: two of the element loop's instructions saved on CPUs and GPUs);
    # in fabric the branch would build both datapaths, and the clamp costs no cycle.
    unclamped_rows: bool = True


_scheduled: OrderedDict[tuple[Schedule, str, str], tvm.IRModule] = OrderedDict()


def scheduled_rowwise(schedule: Schedule, func: tirx.PrimFunc, output: str) -> tvm.IRModule:
    """``schedule.rowwise(func, output)``, reusing the result for a ``func`` of the same text.

    Kernels whose per-channel constants are arguments (every stage kernel) have one
    text per op configuration, so ops that differ only in those constants schedule
    once.  The key is the printed function, names included: a reused module is the
    very one ``func`` would have been scheduled into, so build-cache keys and the
    compiled bytes do not depend on which kernels were scheduled before.  The
    last :data:`SCHEDULED_KEPT` are kept (a module is immutable: sharing it is safe).
    """
    key = (schedule, output, func.script())
    if key in _scheduled:
        _scheduled.move_to_end(key)
        return _scheduled[key]
    mod = schedule.rowwise(func, output)
    _scheduled[key] = mod
    while len(_scheduled) > SCHEDULED_KEPT:
        _scheduled.popitem(last=False)
    return mod


def vector_channels(n: int, body: ChannelBody) -> None:
    """``body(c)`` for c in [0, n): register-sized vectorized loops, then the tail
    in vectors of falling powers of two (7 = 4 + 2 + 1).

    One vectorized loop over all n would become one n-lane vector, which LLVM
    legalizes with long shuffle sequences; and a vector of any lane count other
    than a power of two takes LLVM's widening path, which has miscompiled (see
    ``compilers.tvm.cpu._register_lanes``).
    """
    main = n - n % CPU_LANES
    if main:
        with T.serial(0, main // CPU_LANES) as co, T.vectorized(0, CPU_LANES) as ci:
            body(co * CPU_LANES + ci)
    start, lanes = main, CPU_LANES
    while start < n:
        while lanes > n - start:
            lanes //= 2
        with T.vectorized(0, lanes) as ci:
            body(start + ci)
        start += lanes


def serial_channels(n: int, body: ChannelBody) -> None:
    """``body(c)`` for c in [0, n) in one plain loop."""
    with T.serial(0, n) as c:
        body(c)


def _parallel_rows(extent: Any) -> AbstractContextManager[Any]:
    return T.parallel(0, extent)


def _serial_rows(extent: Any) -> AbstractContextManager[Any]:
    return T.serial(0, extent)


def _unscheduled(func: tirx.PrimFunc, output: str) -> tvm.IRModule:
    return tvm.IRModule({"main": func})


CPU = Schedule("cpu", schedule_rowwise, _parallel_rows, vector_channels)
# Loops as written: every stage over all rows, then the next; a reference point
# for other schedules and the input of targets that schedule for themselves.
SERIAL = Schedule("serial", _unscheduled, _serial_rows, serial_channels)
