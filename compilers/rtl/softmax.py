"""The softmax unit (IntSoftmax): the norms' row unit running the softmax op's own forward.

:meth:`IntSoftmax._forward` runs unchanged on :class:`~compilers.rtl.values.Hdl`
values; the one thing the unit adds is where a row's per-row results live: the
outputs of the op's per-row stage (``reciprocal``: r and the output shift) are
latched into the row's bank, so the element chain reads registers, not the row
engine's logic.  The recorded names must be exactly the op's range-report
names, in order, and an op class that overrides ``_forward`` is refused.

What the op's code becomes on the row unit of :mod:`compilers.rtl.norm` (its
banks, passes, row engine and output pipeline; see that docstring):

* pass 0 — buffers the row and keeps the running maximum of the kept logits
  (``row_max`` of the masked row: a max accumulator);
* pass 1 — re-reads the buffer: d = max − x, the sum's table (a ROM of 2^b
  entries of the term's exact width), Σ over the kept columns;
* row engine — the divisor (S, or 2^(F+G) for a fully masked row), its bit
  length (one binary-search step per clock), the mantissa μ (a barrel shift),
  r = round(2^(M−1+R) / μ) (one compare-subtract per clock) and the output shift;
* out pass — re-reads x and **recomputes** e from it (d = max − x, the output's
  table), then e·r, the rounding shift and the saturation.  Recomputing costs a
  subtract and a second ROM of 2^b entries (256 for int8); storing e instead
  would take a second row buffer of F + 1 = 16 bits per element and bank (twice
  the x buffer's 8, 4 banks deep) and e would no longer be the op's expression
  evaluated where it is used.

Masks are the op's ``keep``: padding compares x with the input's lowest code;
causal compares the column (the stage's channel) with the row's index modulo
``query_len`` plus ``causal_offset``: the unit counts its input rows modulo
query_len (a counter in pass 0, kept per bank for the later passes).  A fully
masked row's max is the input's lowest code and every term 0, so every output
is 0, as in the op.

Throughput and latency are the row unit's (``NormUnit.cycles_per_row``,
``latency``) with P = 2 passes: one element per clock once N >= (D + 1) / E
(D: the row engine's schedule, E <= 2 engines); int8 rows of 64 stream at one
element per clock.
"""

from __future__ import annotations

from typing import Any

from compilers.rtl.norm import NormUnit
from compilers.rtl.values import Graph, Hdl, ProvenTrace
from qnorm.ops.base import Trace
from qnorm.ops.softmax import IntSoftmax


class _RowsLatched:
    """The op as its ``_forward`` sees it, but with the per-row stage's results read
    back from the row's bank (every other attribute is the op's own)."""

    def __init__(self, op: IntSoftmax, graph: Graph) -> None:
        self._op, self._graph = op, graph

    def __getattr__(self, name: str) -> Any:
        return getattr(self._op, name)

    def reciprocal(self, total: Hdl, trace: Trace | None) -> tuple[Hdl, Hdl]:
        r, k = self._op.reciprocal(total, trace)
        return self._graph.latch(r), self._graph.latch(k)


def softmax_graph(op: IntSoftmax) -> tuple[Graph, Hdl]:
    """Run the op's forward on HDL values: the graph (the row max and sum, the latched
    reciprocal and shift) and the per-element output."""
    cls = type(op)
    if cls._forward is not IntSoftmax._forward:
        raise NotImplementedError(f"{cls.__name__} overrides IntSoftmax._forward, which the RTL unit runs")
    cfg, rep = op.config, op.ranges()
    graph = Graph(cfg.n, row_period=cfg.query_len)
    trace = ProvenTrace(dict(rep.items))
    y = IntSoftmax._forward(_RowsLatched(op, graph), graph.leaf(), trace)  # type: ignore[arg-type]
    trace.require_every_stage(cls.__name__, "compilers/rtl/softmax.py")
    return graph, y


class SoftmaxUnit(NormUnit):
    """One softmax instance as a streaming unit (see the module docstring)."""

    def _build_graph(self, op: Any) -> tuple[Graph, Hdl]:
        return softmax_graph(op)
