"""CPU schedule for row-wise integer kernels: rows in parallel, columns in vectors.

Every qnorm op is row-wise (statistics per row, then a per-element map), so one
schedule serves them all:

* the output's leading axes are fused into one row loop, run in parallel;
* every other stage (row reductions, per-row scalars, per-element stages made by
  :func:`compilers.tvm.primitives.staged_compute`) is computed inside that row
  loop, so its buffer shrinks to one row (per-row scalars to one value);
* where the kernel has a per-row chain (a norm's inverse, multiplier and
  shifts), the row loop runs over blocks of :data:`ROW_BLOCK` rows instead: the
  block's row sums, then each per-row stage as one vector over the block's
  rows, then the block's rows one by one (see :func:`_whole_row_blocks`);
* row reductions that read only the kernel's inputs share one loop over the
  row (see :func:`_merge_input_reductions`);
* per-element stages go one level deeper, into a loop over column tiles of one
  vector register each, so that LLVM keeps their values in registers (see
  :func:`_column_tile`);
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

from typing import Any

import tvm
import tvm.s_tir
import tvm_ffi
from tvm import tirx

_DATA_PAR = 0  # IterVar.iter_type of a data-parallel block axis
# TVM gives a buffer of this many bytes or more a heap allocation
# (TVMBackendAllocWorkspace) each time its scope is entered; smaller ones live on
# the stack (kMaxStackAlloca in tvm/runtime/device_api.h).
_STACK_BYTES = 1024
_MIN_TILE = 8  # a narrower column tile would not fill a vector register
# Rows whose per-row chain (statistic -> inverse -> multiplier, offset, shift: about
# a hundred dependent int64 steps) runs as one vector of rows, between their row
# sums and their element loops (see _whole_row_blocks).  Measured, int8, one
# thread, against one row at a time: 49152 x 64 1.7x faster (AVX2 host); on an
# AVX-512 host, 4096 x 768 1.16-1.29x (an x86-64-v3 build there: 0.99-1.38x over
# two runs), N = 1024-2048 1.07-1.33x, 1024 x 4096 even (its chain is a small part
# of a row).  A block's rows are read twice, and rows of 768 or more leave a 32 KiB
# L1 between the two reads; the vector chain still wins.
ROW_BLOCK = 16
_VECTOR_BITS = 1024  # vectorized loops are cut into chunks of this many bits: two
# registers per step on AVX-512, four on AVX2, so the int32 -> int8 narrowing of the
# norms packs whole registers (measured: fewer shuffles per output than at 512)


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
    per_element = [b for b in producers if _spatial_axes(sch, b) > 1]
    per_row = [b for b in producers if b not in per_element]
    block_rows = _row_block(sch, per_row)
    rows, row = sch.split(row, [None, block_rows]) if block_rows > 1 else (row, row)
    tile = _column_tile(sch, loops[-1], per_element)
    tiles = sch.split(loops[-1], [None, tile])[0] if tile else None
    in_tile = {output}
    # Consumers first: compute_at needs every consumer of a block already in place.
    for block in reversed(producers):
        name = sch.get(block).name_hint
        consumers = {sch.get(c).name_hint for c in sch.get_consumers(block)}
        if tiles is not None and block in per_element and consumers <= in_tile:
            sch.compute_at(block, tiles, preserve_unit_loops=False)
            in_tile.add(name)
        elif block in per_row:
            sch.compute_at(block, rows, preserve_unit_loops=False)
        else:
            sch.compute_at(block, row, preserve_unit_loops=False)
    _merge_input_reductions(sch, producers)
    # Parallel first: it needs compact dataflow under the row loop, which a
    # reduction split into init and update blocks (below) no longer has.
    sch.parallel(rows)
    anchors = [rows, row] if tiles is None else [rows, row, tiles]
    for block in [*producers, out]:
        # a block's row sums stay one scalar loop per row (LLVM vectorizes each sum)
        if block_rows == 1 or block not in per_row or not _is_reduction(sch, block):
            _vectorize_inner(sch, block, anchors)
    return sch.mod if block_rows == 1 else _whole_row_blocks(sch, per_row)


def _row_block(sch: tvm.s_tir.Schedule, per_row: list) -> int:
    """Rows per block of the row loop: :data:`ROW_BLOCK` where the kernel has a
    per-row chain, else 1.

    Blocking needs every per-row stage other than a row sum to read only values
    the kernel computes: :func:`_whole_row_blocks` runs those stages on every
    lane of the last block, also past the last row, and a stage that read an
    argument there would read past its end.
    """
    computed = {b.__chandle__() for b in sch.get(sch.get_sblock("root")).alloc_buffers}
    chain = [b for b in per_row if not _is_reduction(sch, b)]
    reads_args = any(r.source.__chandle__() not in computed for b in chain for r in sch.get(b).reads)
    return ROW_BLOCK if chain and not reads_args else 1


def _whole_row_blocks(sch: tvm.s_tir.Schedule, per_row: list) -> tvm.IRModule:
    """The scheduled module with the per-row chain free of row predicates.

    Splitting the symbolic row loop by :data:`ROW_BLOCK` gives every stage the
    predicate ``row < rows``; on a vectorized per-row stage it is a per-lane
    condition, which scalarizes the vector and which TVM lowers by sizing the
    stage buffers ``min(rows, ROW_BLOCK)``, allocated from the workspace on
    every block.  Measured on 49152 x 64 int8 rows: slower than no blocking.

    So the per-row stages run on every lane of a block: the row sums' zero
    initialization covers all lanes (only their updates keep the predicate),
    so a lane past the last row computes the chain of an all-zero row, a legal
    input (no division by zero, no out-of-range shift), whose values stay in
    the block's own stage buffers and never reach ``out``.  Those buffers are
    declared ``max(rows, ROW_BLOCK)`` long so that they compact to exactly one
    block of lanes.
    """
    whole = []
    for block in per_row:
        if _is_reduction(sch, block):
            init = sch.decompose_reduction(block, sch.get_loops(block)[1])
            sch.vectorize(sch.get_loops(init)[-1])
            block = init
        whole.append(sch.get(block))
    keys = {b.__chandle__() for b in whole}
    written = {w.source.__chandle__() for b in whole for w in b.writes}
    func = sch.mod["main"]
    lanes = tirx.const(ROW_BLOCK, "int64")
    widened = {
        buf.__chandle__(): tirx.decl_buffer((tirx.max(buf.shape[0], lanes),), buf.dtype, buf.name)
        for buf in func.body.block.alloc_buffers
        if buf.__chandle__() in written
    }

    def mutate(x: Any, mutator: tvm_ffi.StructuralMutator) -> Any:
        if isinstance(x, tirx.Buffer) and x.__chandle__() in widened:
            return widened[x.__chandle__()]
        y = mutator.default_mutate(x)
        if isinstance(x, tvm.s_tir.SBlockRealize) and x.block.__chandle__() in keys:
            return tvm.s_tir.SBlockRealize(y.iter_values, tirx.const(True, "bool"), y.block)
        return y

    return tvm.IRModule({"main": func.with_body(tvm_ffi.structural_mutate(func.body, mutate))})


def _is_reduction(sch: tvm.s_tir.Schedule, block: tvm.s_tir.schedule.SBlockRV) -> bool:
    return any(iv.iter_type != _DATA_PAR for iv in sch.get(block).iter_vars)


def _spatial_axes(sch: tvm.s_tir.Schedule, block: tvm.s_tir.schedule.SBlockRV) -> int:
    return sum(iv.iter_type == _DATA_PAR for iv in sch.get(block).iter_vars)


def _merge_input_reductions(sch: tvm.s_tir.Schedule, producers: list) -> None:
    """One loop over the row for the row reductions that read only kernel inputs.

    Each reduction is its own loop that loads and widens the row again.  Those
    reading nothing the kernel computes (a LayerNorm's Σx and Σx²) are
    independent, so one loop feeds them all: measured 2-4 % faster on
    IntLayerNorm and ShiftLayerNorm.  A reduction that reads a computed value
    (L1LayerNorm's Σ|N·x − S| reads S) keeps its own loop after it: ``merge``
    does not check dataflow, and a merged S would be read before it is complete.
    """
    # by identity: stages may share a name (every row_sum is "row_sum")
    computed = {b.__chandle__() for b in sch.get(sch.get_sblock("root")).alloc_buffers}
    by_extent: dict[int, list] = {}
    for block in producers:
        b, loops = sch.get(block), sch.get_loops(block)
        is_row_sum = _spatial_axes(sch, block) == 1 and len(b.iter_vars) == 2 and len(loops) in (2, 3)
        writes = {w.source.__chandle__() for w in b.writes}
        reads = {r.source.__chandle__() for r in b.reads} - writes
        extent = sch.get(loops[-1]).extent
        if is_row_sum and not reads & computed and isinstance(extent, tirx.IntImm):
            by_extent.setdefault(int(extent), []).append(loops[-1])
    for loops in by_extent.values():
        if len(loops) > 1:
            sch.merge(*loops)


def _column_tile(
    sch: tvm.s_tir.Schedule, col: tvm.s_tir.schedule.LoopRV, per_element: list
) -> int | None:
    """Columns per tile, or None to keep whole rows.

    :data:`_VECTOR_BITS` of the widest per-element value (32 int32 lanes)
    when that divides the row: every stage then computes one register of
    columns before the next stage reads it, so LLVM keeps the stage buffers in
    registers.  Row-sized stage buffers went to the stack and back instead:
    one store and one load per stage per element, 8-12 % of the norm kernels'
    time on 4096 x 768 int8 rows (within ±2 % on 1024 x 4096).

    Where the register does not divide the row (a tail would need a predicate,
    see the module docstring), a whole row of every per-element stage on the
    stack when it fits; else the largest divisor of the row length whose stage
    buffers do.  None also when no such divisor reaches ``_MIN_TILE``: then the
    rows stay whole and their stage buffers come from the workspace allocator.
    """
    extent = sch.get(col).extent
    if not per_element or not isinstance(extent, tirx.IntImm):
        return None
    n = int(extent)
    lanes = max(_VECTOR_BITS // max(_value_bits(sch.get(b).body) for b in per_element), 1)
    if n % lanes == 0:
        return lanes if n > lanes else None
    widest = max(
        tvm.runtime.DataType(str(w.source.dtype)).bits // 8
        for b in per_element
        for w in sch.get(b).writes
    )
    if n * widest < _STACK_BYTES:
        return None
    tile = max(d for d in range(1, (_STACK_BYTES - 1) // widest + 1) if n % d == 0)
    return tile if tile >= _MIN_TILE else None


def _vectorize_inner(
    sch: tvm.s_tir.Schedule, block: tvm.s_tir.schedule.SBlockRV, anchors: list
) -> None:
    """Vectorize the block's own innermost loop if it is a static data-parallel loop.

    A block's own loops are those below its ``compute_at`` anchor (the row or the
    column-tile loop).  Reductions over the row stay scalar loops (LLVM vectorizes
    integer sums itself); per-row scalar stages have no loop of their own.  A
    reduction with a column axis of its own (one count per column, say) is turned
    inside out instead: see :func:`_vectorize_across_reduction`.
    """
    loops = sch.get_loops(block)
    anchored = [
        i for i, lp in enumerate(loops) if any(sch.get(lp).same_as(sch.get(a)) for a in anchors)
    ]
    own = loops[max(anchored) + 1 :]
    if not own:
        return
    kind = _axis_kinds(sch, block, own)
    spatial = [lp for lp in own if kind[lp] == _DATA_PAR]
    reduce = [lp for lp in own if kind[lp] != _DATA_PAR]
    if len(spatial) != 1 or not isinstance(sch.get(spatial[0]).extent, tirx.IntImm):
        return
    if reduce:
        _vectorize_across_reduction(sch, block, spatial[0], reduce)
    else:
        lanes = _register_lanes(sch, block, spatial[0])[1]
        if lanes is not None:
            sch.vectorize(lanes)


def _vectorize_across_reduction(
    sch: tvm.s_tir.Schedule, block: tvm.s_tir.schedule.SBlockRV, spatial, reduce: list
) -> None:
    """One register of columns at a time: the reduction loops inside, over vector lanes.

    Each lane accumulates its own column (no horizontal reduction), and one
    register of accumulators serves the whole reduction before the next columns
    start (measured 1.5x faster than the levels outside all columns): the shape
    of a threshold count, which compares a vector of columns with every level.
    The initialization moves into its own block so that both loops vectorize.
    """
    outer, lanes = _register_lanes(sch, block, spatial, counters=True)
    if lanes is None:
        return
    sch.reorder(*outer, *reduce, lanes)
    sch.vectorize(lanes)
    init = sch.decompose_reduction(block, reduce[0])
    sch.vectorize(sch.get_loops(init)[-1])


def _register_lanes(
    sch: tvm.s_tir.Schedule, block: tvm.s_tir.schedule.SBlockRV, loop: tvm.s_tir.schedule.LoopRV,
    counters: bool = False,
) -> tuple[list, tvm.s_tir.schedule.LoopRV | None]:
    """``loop`` split into (outer loops, the part to vectorize), or None for the
    part where the loop stays scalar.

    The part is one register: :data:`_VECTOR_BITS` of the block's widest value
    (two AVX-512 registers, four AVX2 ones).  TVM turns a vectorized loop into one
    vector of its whole extent; LLVM then splits, say, a 64-lane int8→int64
    conversion with long insert/extract sequences, which measured 1.3–2.6× slower
    than register-sized vectors.  So a loop that the register divides is split and
    its inner part vectorized; a loop shorter than a register is vectorized whole
    when its length is a power of two.

    Any other loop stays scalar (a tail would need a predicate), for LLVM's loop
    vectorizer, which picks register-wide vectors and a remainder loop.  Measured
    against the alternatives (IntLayerNorm and IntRMSNorm, 4096 rows, x86-64-v4,
    interleaved): at N = 100, 150, 196, 197, 300 the scalar loops ran 1.1–2.3× faster
    than whole-row vectors of N lanes and 1.0–3.6× faster than vectors of the
    largest power of two dividing N (2 lanes at 150 and 300).

    ``counters``: a loop of per-column counters, each lane running a reduction of its
    own (:func:`_vectorize_across_reduction`), which LLVM vectorizes poorly as a
    scalar loop; it gets the largest power of two dividing it instead (MultiThreshold,
    int8 in, 4- and 8-bit out, 7 to 100 channels: 1.5–13× faster than whole-row
    vectors at 7, 67, 96 and 100 channels; even to 2.3× slower at 24 and 48).

    Vectors of a lane count other than a power of two take LLVM's widening path,
    which has miscompiled: LLVM 22 stores a ``<3 x i8>`` truncated from
    ``<3 x i64>`` on AArch64 as lanes 0 and 2 at offsets 0 and 1, dropping lane 1
    (an IntLayerNorm of three int12 columns, half-even).  No rule here makes one.
    """
    extent = int(sch.get(loop).extent)
    lanes = max(_VECTOR_BITS // _value_bits(sch.get(block).body), 1)
    if counters:
        lanes = min(lanes, extent & -extent)
    if extent % lanes == 0 and extent > lanes:
        outer, inner = sch.split(loop, [None, lanes])
        return [outer], inner
    if extent <= lanes and extent > 1 and extent & (extent - 1) == 0:
        return [], loop
    return [], None


def _value_bits(store: tirx.Stmt) -> int:
    """Widest integer type among the values a block computes (not its index arithmetic).

    A load cast on the spot counts at the cast's width: the norms' element stage
    reads its per-row multiplier, offset and shift as int64 and casts them to 32
    bits, so its lanes are int32.  Counted at int64, those loads halved the
    element tile to 16 lanes; at 32 lanes the int32 -> int8 narrowing packs four
    AVX2 registers at a time: x86-64-v3 kernels 1.03-1.10x faster on every norm
    and shape of ``make bench`` (interleaved A/B, AMD Zen 5 at the AVX2 level),
    x86-64-v4 ones even (0.96-1.04x over two runs).
    """
    bits = [8]

    def visit(node: Any, visitor: tvm_ffi.StructuralVisitor) -> Any:
        if isinstance(node, tirx.Cast) and isinstance(node.value, tvm.ir.expr.TensorLoad):
            bits.append(tvm.runtime.DataType(str(node.ty)).bits)
            return None
        ty = getattr(node, "ty", None)
        if (
            isinstance(node, tvm.ir.Expr)
            and isinstance(ty, tvm.ir.PrimType)
            and str(ty).startswith("int")
        ):
            bits.append(tvm.runtime.DataType(str(ty)).bits)
        if isinstance(node, tvm.ir.expr.TensorLoad):
            return None  # its indices are addresses, not values
        return visitor.default_visit(node)

    tvm_ffi.structural_visit(store.value, visit)
    return max(bits)


def _axis_kinds(sch: tvm.s_tir.Schedule, block: tvm.s_tir.schedule.SBlockRV, loops: list) -> dict:
    """Loop → iter type of the block axis whose binding uses the loop's variable.

    The block's realize (its binding of axes to loop variables) is the body of
    its innermost loop, one of ``loops``, or one statement of that body where
    loops were merged (:func:`_merge_input_reductions`).
    """
    realize = sch.get(sch.get_loops(block)[-1]).body
    if isinstance(realize, tirx.SeqStmt):
        realize = next(r for r in realize.seq if r.block.same_as(sch.get(block)))
    used = [
        (iv.iter_type, {v.__chandle__() for v in tirx.analysis.undefined_vars(value)})
        for iv, value in zip(sch.get(block).iter_vars, realize.iter_values, strict=True)
    ]
    return {
        lp: next(k for k, vs in used if sch.get(lp).loop_var.__chandle__() in vs) for lp in loops
    }
