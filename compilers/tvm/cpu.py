"""CPU schedule for row-wise integer kernels: rows in parallel, columns in vectors.

Every qnorm op is row-wise (statistics per row, then a per-element map), so one
schedule serves them all:

* the output's leading axes are fused into one row loop, run in parallel;
* every other stage (row reductions, per-row scalars, per-element stages made by
  :func:`compilers.tvm.primitives.staged_compute`) is computed inside that row
  loop, so its buffer shrinks to one row (per-row scalars to one value);
* each stage's own innermost data-parallel loop is vectorized separately.

Why each stage gets its own vector loop instead of all stages sharing the
output's vectorized loop: TVM 0.27 miscompiles the latter silently.  With
``compute_at`` into a vectorized loop, the compacted one-element stage buffers end
up allocated outside that loop, and VectorizeLoop stores all lanes to the same
element (every lane of the result equals one lane).  Vectorizing per stage keeps
lane-indexed row buffers and is bit-exact.

The row length should be static: a symbolic extent is left scalar, because a tail
predicate both scalarizes the loop and stops TVM from shrinking stage buffers.
"""

from __future__ import annotations

import tvm
import tvm.s_tir
from tvm import tirx

_DATA_PAR = 0  # IterVar.iter_type of a data-parallel block axis


def schedule_rowwise(func: tirx.PrimFunc | tvm.IRModule, output: str) -> tvm.IRModule:
    """Schedule ``func`` (its single output block named ``output``) as described above.

    ``output`` must have at least two axes: rows (leading axes) and columns.
    """
    sch = tvm.s_tir.Schedule(func)
    out = sch.get_sblock(output)
    loops = sch.get_loops(out)
    if len(loops) < 2:
        raise ValueError(
            f"schedule_rowwise needs a block with row and column axes; {output!r} has {len(loops)}"
        )
    row = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]

    producers = [
        b for b in sch.get_child_blocks(sch.get_sblock("root")) if sch.get(b).name_hint != output
    ]
    # Consumers first: compute_at needs every consumer of a block already in place.
    for block in reversed(producers):
        sch.compute_at(block, row, preserve_unit_loops=False)
    for block in [*producers, out]:
        _vectorize_inner(sch, block, row)
    sch.parallel(row)
    return sch.mod


def _vectorize_inner(
    sch: tvm.s_tir.Schedule, block: tvm.s_tir.schedule.SBlockRV, row: tvm.s_tir.schedule.LoopRV
) -> None:
    """Vectorize the block's innermost loop if it is a static data-parallel loop.

    Reductions stay scalar loops (LLVM vectorizes integer sums itself); per-row
    scalar stages have no loop under the row loop.
    """
    loops = sch.get_loops(block)
    inner = loops[-1]
    if sch.get(inner).same_as(sch.get(row)):
        return
    if any(iv.iter_type != _DATA_PAR for iv in sch.get(block).iter_vars):
        return
    if isinstance(sch.get(inner).extent, tirx.IntImm):
        sch.vectorize(inner)
