"""GPU schedule for the row-wise integer kernels: rows over blocks (a warp or a block per
row), threads over columns.

One schedule serves CUDA and OpenCL (:mod:`compilers.tvm.cuda`, :mod:`compilers.tvm.opencl`):

* the output's leading axes are fused into one row loop, split over
  ``blockIdx.x`` and ``threadIdx.y``: :func:`row_geometry` gives a row of
  ``n <= WARP_ROW_LIMIT`` columns ``tx`` threads, about ``COLUMNS_PER_THREAD``
  columns each and at most a warp, and puts ``MAX_BLOCK_THREADS / tx`` rows in a
  block; a longer row takes a whole block.  Measured on an H200 (plans of the
  int8 norms through ``gpu_harness.cu``): every thread of a row runs the row's scalar chain
  (below), so eight warps on a row of 768 ran it eight times: a warp per row
  took 12.8 µs at (4096, 768) against 32.5 µs with a block per row (16 threads
  a row: 18.6 µs).  Shorter rows share a warp: the four norms together took
  47 µs at (49152, 64) with 4 threads a row, 51 with 8, 78 with 16 and 134 with
  32, and 54 µs at (16384, 256) with 16 threads a row, 62 with 8 and 65 with 32
  (ShiftLayerNorm, whose chain is the shortest, alone prefers more threads).
  At (1024, 4096) a warp per row leaves too few warps to hide latency (50 µs
  against 14 µs for IntLayerNorm), at (2048, 2048) too (23.6 against 18.3 µs),
  at (4096, 1024) not (15.5 against 30.6 µs).  The
  last block's rows past ``rows`` are masked inside every stage, as
  out-of-range columns are;
* the columns of a row are split over ``threadIdx.x`` (consecutive threads read
  consecutive columns: coalesced), a thread taking every ``tx``-th column;
* a row reduction (``row_sum*``) splits its reduction axis the same way and is a
  cross-thread allreduce (warp shuffles on CUDA, a shared-memory tree on
  OpenCL) whose result every thread of the row keeps in a register (local
  scope): with several rows per block a shared result would be sized by the
  rows left at the last block, which TVM 0.27 cannot allocate;
* per-row scalar stages (``stat``, ``exp*``, ``mant*``, ``inv*``, ``out_r*``) are
  computed **redundantly by every thread** of the row, in registers (local
  scope).  They are a serial dependency chain (leading-zero count, division,
  digit-by-digit isqrt) that one thread would run while the rest waited anyway;
* per-element stages are computed by the thread of their column, just before
  the output element, in registers.

All threads of a block take part in every barrier and shuffle: a thread whose
column or row is out of range is masked inside the stage, never skipped around it.

The LIF neurons (loop kernels) run a block per row (one neuron population of
the batch), a thread per channel, the membrane state in shared memory: each
thread only touches its own channel's element.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import tvm
import tvm.s_tir
import tvm_ffi
from tvm import tirx
from tvm.script.ir_builder import tirx as T
from tvm.sym import Analyzer
from tvm.tirx.build import codegen_build, split_host_device_mods

from compilers.tvm.build import non_integer_dtypes
from compilers.tvm.schedules import ChannelBody, Schedule

MAX_BLOCK_THREADS = 256  # the smallest max_threads among the GPU targets (OpenCL: 256)
WARP = 32  # threads of a row that reduce by shuffles alone on CUDA
WARP_ROW_LIMIT = 1024  # the longest row that runs on at most a warp (see the module docstring)
COLUMNS_PER_THREAD = 16  # a short row's columns per thread (see the module docstring)
_COMM_REDUCE = 2  # IterVar.iter_type of a reduction block axis
LOWERING_CONFIG = {"tirx.disable_storage_rewrite": True, "tirx.disable_cse_tir": True}  # see lower()
_DATA_PAR = 0  # IterVar.iter_type of a data-parallel block axis
_CALL_KERNEL = tvm.ir.Op.get("tirx.call_ffi_kernel")  # the host's launch of a device function
_THREAD_TAGS = ("blockIdx.", "threadIdx.")


def column_threads(n: int) -> int:
    """Threads over one row of ``n`` columns: for rows up to :data:`WARP_ROW_LIMIT`, the
    power of two that gives each about :data:`COLUMNS_PER_THREAD` columns, at most a warp;
    a longer row takes a block.

    A power of two keeps TVM's allreduce on its warp-shuffle path.
    """
    if n > WARP_ROW_LIMIT:
        return MAX_BLOCK_THREADS
    return min(WARP, 1 << max(-(-n // COLUMNS_PER_THREAD) - 1, 0).bit_length())


def row_geometry(n: int) -> tuple[int, int]:
    """(threads per row, rows per block) for rows of ``n`` columns: a block of
    :data:`MAX_BLOCK_THREADS` threads, whole rows."""
    tx = column_threads(n)
    return tx, MAX_BLOCK_THREADS // tx


def schedule_rowwise(func: tirx.PrimFunc | tvm.IRModule, output: str) -> tvm.IRModule:
    """Schedule ``func`` (its single output block named ``output``) as described above."""
    sch = tvm.s_tir.Schedule(func)
    out = sch.get_sblock(output)
    loops = sch.get_loops(out)
    if len(loops) < 2:
        raise ValueError(
            f"the GPU schedule needs a block with row and column axes; {output!r} has {len(loops)}"
        )
    extent = sch.get(loops[-1]).extent
    if not isinstance(extent, tirx.IntImm):
        raise TypeError(f"the GPU schedule needs a static row length; {output!r} has {extent}")
    tx, ty = row_geometry(int(extent))
    rows = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
    block, row = sch.split(rows, [None, ty])
    sch.bind(block, "blockIdx.x")
    sch.bind(row, "threadIdx.y")
    column = sch.split(loops[-1], [None, tx])[1]
    sch.bind(column, "threadIdx.x")

    producers = [
        b for b in sch.get_child_blocks(sch.get_sblock("root")) if sch.get(b).name_hint != output
    ]
    in_column = {output}
    # Consumers first: compute_at needs every consumer of a block already in place.
    for block in reversed(producers):
        name = sch.get(block).name_hint
        consumers = {sch.get(c).name_hint for c in sch.get_consumers(block)}
        if _spatial_axes(sch, block) > 1 and consumers <= in_column:
            sch.compute_at(block, column, preserve_unit_loops=False)
            sch.set_scope(block, 0, "local")
            in_column.add(name)
        else:
            sch.compute_at(block, row, preserve_unit_loops=False)
            _spread_over_threads(sch, block, row, tx)
    return sch.mod


def _spread_over_threads(
    sch: tvm.s_tir.Schedule,
    block: tvm.s_tir.schedule.SBlockRV,
    row: tvm.s_tir.schedule.LoopRV,
    tx: int,
) -> None:
    """A stage placed at the row loop: its own loops over ``threadIdx.x``, or none.

    A stage with loops of its own (a row reduction, or a per-element stage read
    by another thread's stage) splits its innermost loop over the row's
    threads.  A reduction's result is kept in every thread's registers (TVM's
    allreduce hands it to all of them); a per-element stage's results are shared
    memory, the only way another thread reads them (no kernel here has one: with
    several rows a block TVM 0.27 would size it by the rows left at the last
    block and refuse to build it).  A per-row scalar stage has no loop and stays
    in each thread's registers.
    """
    loops = sch.get_loops(block)
    anchor = next(i for i, lp in enumerate(loops) if sch.get(lp).same_as(sch.get(row)))
    own = loops[anchor + 1 :]
    if not own:
        sch.set_scope(block, 0, "local")
        return
    if len(own) > 1:
        raise ValueError(
            f"stage {sch.get(block).name_hint!r} has {len(own)} loops inside its row; "
            "the GPU schedule spreads one loop over a block's threads"
        )
    sch.bind(sch.split(own[0], [None, tx])[1], "threadIdx.x")
    reduces = any(iv.iter_type == _COMM_REDUCE for iv in sch.get(block).iter_vars)
    sch.set_scope(block, 0, "local" if reduces else "shared")


def _spatial_axes(sch: tvm.s_tir.Schedule, block: tvm.s_tir.schedule.SBlockRV) -> int:
    return sum(iv.iter_type == _DATA_PAR for iv in sch.get(block).iter_vars)


# --------------------------------------------------------------------------- loop kernels


@contextmanager
def _block_per_row(extent: Any) -> Iterator[Any]:
    with T.thread_binding(0, extent, "blockIdx.x") as r:
        yield r


def thread_channels(n: int, body: ChannelBody) -> None:
    """``body(c)`` for c in [0, n): a thread per channel, a block's threads in turns
    when n exceeds a block (the last turn masked, inside the loop)."""
    if n <= MAX_BLOCK_THREADS:
        with T.thread_binding(0, n, "threadIdx.x") as c:
            body(c)
        return
    turns = -(-n // MAX_BLOCK_THREADS)
    with T.serial(0, turns) as turn, T.thread_binding(0, MAX_BLOCK_THREADS, "threadIdx.x") as t:
        c = turn * MAX_BLOCK_THREADS + t
        with T.If(c < n), T.Then():
            body(c)


GPU = Schedule("gpu", schedule_rowwise, _block_per_row, thread_channels, scratch_scope="shared")


# --------------------------------------------------------------------------- lowering


@dataclass(frozen=True)
class Param:
    """A kernel parameter: one of ``main``'s buffers (a device pointer) or a shape variable."""

    name: str  # main's buffer parameter, or a shape variable such as ``rows``
    dtype: str  # the buffer's element type, or the scalar's type
    is_buffer: bool


@dataclass(frozen=True)
class Launch:
    """One kernel launch with concrete geometry: ``args`` are buffer names and scalar values."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[str | int, ...]

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]


@dataclass(frozen=True)
class DeviceKernel:
    """A device function TVM split out of ``main``, with its launch extents as expressions
    of its scalar parameters (the shape variables)."""

    name: str
    params: tuple[Param, ...]
    extents: Mapping[str, tirx.PrimExpr]  # thread tag ("blockIdx.x", "threadIdx.y", ...) -> extent
    scalars: Mapping[str, tirx.Var]  # the scalar parameters the extents are written in

    def launch(self, shape_vars: Mapping[str, int]) -> Launch:
        analyzer = Analyzer()
        for name, var in self.scalars.items():
            analyzer.bind(var, tirx.const(shape_vars[name], str(var.ty)))

        def extent(tag: str) -> int:
            value = analyzer.simplify(self.extents.get(tag, tirx.const(1, "int64")))
            if not isinstance(value, tirx.IntImm):
                raise TypeError(f"kernel {self.name}: extent of {tag} is {value}, not a number")
            return int(value)

        grid = tuple(extent(f"blockIdx.{a}") for a in "xyz")
        block = tuple(extent(f"threadIdx.{a}") for a in "xyz")
        args = tuple(p.name if p.is_buffer else shape_vars[p.name] for p in self.params)
        return Launch(self.name, grid, block, args)  # type: ignore[arg-type]


@dataclass(frozen=True)
class DeviceModule:
    """Device source for one GPU-scheduled kernel, and how the host would launch it."""

    source: str
    kernels: tuple[DeviceKernel, ...]  # in the order the host launches them
    buffers: Mapping[str, tuple[str, tuple[Any, ...]]]  # main's params: name -> (dtype, shape)

    def shape_vars(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
        """Values of the symbolic dimensions (``rows``, ``steps``) given ``main``'s buffer shapes."""
        found: dict[str, int] = {}
        for name, (_, dims) in self.buffers.items():
            got = tuple(shapes[name])
            if len(got) != len(dims):
                raise ValueError(f"buffer {name!r} has {len(dims)} dimensions, got shape {got}")
            for d, n in zip(dims, got, strict=True):
                key = d.name if isinstance(d, tirx.Var) else None
                if key is None and int(d) != n:
                    raise ValueError(f"buffer {name!r} has shape {dims}, got {got}")
                if key is not None and found.setdefault(key, n) != n:
                    raise ValueError(f"{key} is {found[key]} and {n} in the same call")
        return found

    def launches(self, shapes: Mapping[str, tuple[int, ...]]) -> list[Launch]:
        """The launches of one call of ``main`` on buffers of the given shapes, in order."""
        values = self.shape_vars(shapes)
        return [k.launch(values) for k in self.kernels]

    def max_threads(self) -> int:
        """Threads in the largest block of any kernel (block sizes are static)."""
        return max((_block_threads(k) for k in self.kernels), default=1)


def _block_threads(kernel: DeviceKernel) -> int:
    count = 1
    for axis in "xyz":
        count *= int(kernel.extents.get(f"threadIdx.{axis}", 1))
    return count


def lower(mod: tirx.PrimFunc | tvm.IRModule, target: tvm.target.Target, *, allow_float: bool = False) -> DeviceModule:
    """``mod`` through TVM's own build steps (those of ``tvm.compile``) for a device
    target, stopping at the device source; launches are read off the lowered IR.

    ``tvm.compile`` would return the same source inside a host module that
    cannot be loaded here; stopping early exposes the device functions, whose
    thread extents and parameters are the launch geometry and argument order.
    ``allow_float``: the float32 ops of a whole model (exact on power-of-two grids),
    not a qnorm kernel, which is integer-only.
    """
    mod = _with_named_params(tvm.IRModule({"main": mod}) if isinstance(mod, tirx.PrimFunc) else mod)
    bad = non_integer_dtypes(mod)
    if bad and not allow_float:
        raise ValueError(
            f"kernel uses non-integer dtypes {sorted(bad)}; qnorm kernels are integer-only"
        )
    main = mod["main"]
    buffers = {p.name: (str(p.ty.dtype), tuple(p.ty.shape)) for p in main.params}
    host_target = target.host or tvm.target.Target("llvm")
    bound = tvm.tirx.transform.BindTarget(target.with_host(host_target))(mod)
    pipeline, _, finalize_device = tvm.tirx.get_tir_pipeline("default")
    # StorageRewrite runs before LowerThreadAllreduce: it may give a reduction's
    # register result and a later stage's register the same buffer, which the
    # allreduce then turns into the shared slot its result passes through, so every
    # thread of the row would update one shared value in place (a race: seen as
    # wrong rows on PoCL and run-to-run differences on a GPU).  Registers gain
    # nothing from the rewrite; it stays off.  Common-subexpression elimination stays
    # off too: on the host it binds an expression the launches share (the block count
    # of a model's kernels, ceil(rows / rows per block)) to a new scalar argument that
    # only TVM's host function computes, and the launches here come from the shape
    # variables alone (nvcc and the OpenCL compiler eliminate the device's own).
    with tvm.transform.PassContext(config=LOWERING_CONFIG):
        host, devices = split_host_device_mods(pipeline(bound))
    if len(devices) != 1:
        raise ValueError(f"expected device code for one target, got {len(devices)}")
    device = finalize_device()(next(iter(devices.values())))
    source = codegen_build(device, target).inspect_source()
    by_name = {gv.name_hint: f for gv, f in device.functions.items()}
    kernels = tuple(_device_kernel(name, by_name[name], buffers) for name in _launch_order(host))
    return DeviceModule(source, kernels, buffers)


def _with_named_params(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod``, checked to have unique names on ``main``'s parameters: the key that
    ties a device pointer to the buffer it stands for (every kernel builder names
    its buffers)."""
    names = [p.name for p in mod["main"].params]
    if not all(names) or len(set(names)) != len(names):
        raise ValueError(f"the kernel's parameters need unique names to be launched; got {names}")
    return mod


def _launch_order(host: tvm.IRModule) -> list[str]:
    """Kernel names in the order the host function calls them."""
    names: list[str] = []

    def visit(node: Any, visitor: tvm_ffi.StructuralVisitor) -> Any:
        if isinstance(node, tvm.ir.Call) and node.op.same_as(_CALL_KERNEL):
            names.append(str(node.args[0].value))
        return visitor.default_visit(node)

    for func in host.functions.values():
        tvm_ffi.structural_visit(func.body, visit)
    return names


def _device_kernel(
    name: str, func: tirx.PrimFunc, buffers: Mapping[str, tuple[str, tuple[Any, ...]]]
) -> DeviceKernel:
    """Parameters (pointers named by the buffer each is declared as) and thread extents."""
    declared: dict[int, str] = {}
    extents: dict[str, tirx.PrimExpr] = {}

    def visit(node: Any, visitor: tvm_ffi.StructuralVisitor) -> Any:
        if isinstance(node, tirx.DeclBuffer):
            declared.setdefault(node.data.__chandle__(), node.buffer.name)
        elif isinstance(node, tirx.AttrStmt) and node.attr_key == "thread_extent":
            extents[node.node.thread_tag] = node.value
        return visitor.default_visit(node)

    tvm_ffi.structural_visit(func.body, visit)
    unknown = [t for t in func.attrs["tirx.kernel_launch_params"] if not t.startswith(_THREAD_TAGS)]
    if unknown:  # e.g. a dynamic shared-memory size: nothing this module's launchers pass
        raise ValueError(
            f"kernel {name} takes launch parameters {unknown} besides its thread extents"
        )
    params, scalars = [], {}
    for p in func.params:
        if isinstance(p.ty, tvm.ir.PointerType):
            buf = declared.get(p.__chandle__())
            if buf not in buffers:
                raise ValueError(f"kernel {name}: pointer parameter {p.name} is no buffer of main")
            params.append(Param(buf, buffers[buf][0], True))
        else:
            params.append(Param(p.name, str(p.ty), False))
            scalars[p.name] = p
    return DeviceKernel(name, tuple(params), extents, scalars)
