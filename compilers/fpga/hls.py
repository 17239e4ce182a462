"""HLS projects for the golden ops: TVM's C for the kernel, a top function, tcl, testbench.

:func:`write_hls_project` writes, for one op (refused first if the target's
declared widths cannot run it exactly, :func:`qnorm.analysis.check_target`):

* ``kernel.c`` — TVM's C for the op's kernel, serial with static scratch
  (:mod:`.kernel_c`), its runtime includes replaced by ``qnorm_tvm_abi.h``;
* ``qnorm_top.c``/``.h`` — ``qnorm_top`` with fixed-width integer ports, the
  per-channel constants as ``static const`` arrays of the kernel's dtypes;
* ``qnorm_tb.c`` + ``vectors.bin`` — the C testbench and the golden vectors
  (inputs and the golden op's outputs), compared bit for bit;
* ``run_hls.tcl`` (Vitis HLS: csim, then synthesis) and ``README.txt``;
* the ``#pragma HLS`` directives of :mod:`.pragmas` (interfaces, pipelining,
  partitioning) in the top and the kernel.

C simulation here is gcc on testbench + top + kernel (:mod:`.csim`).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import tvm

from compilers.fpga import csource
from compilers.fpga.csource import Const, Port, TopSpec
from compilers.fpga.kernel_c import HLS, HLSError, kernel_source
from compilers.fpga.pragmas import pipeline_element_loops
from compilers.fpga.vectors import as_units, from_units, write_vectors
from compilers.tvm.kernels import Kernel, kernel_for
from qnorm.analysis import check_target
from qnorm.ops.base import IntOp
from qnorm.targets import Target, load_target

TARGET = "fpga-hls"
DEFAULT_ROWS = 16  # rows per qnorm_top call: the port arrays' row count
DEFAULT_VECTORS = 64  # vectors in a project written without explicit ones
DEFAULT_STEPS = 16  # time steps of those vectors for a spiking neuron
C_DIR = Path(__file__).resolve().parent / "c"  # the hand-written C of every project


# --------------------------------------------------------------------------- the top


def _const_names(kernel: Kernel) -> list[str]:
    """C names of the kernel's constant arguments: their buffer names when those are
    C identifiers distinct from the ports ``x`` and ``y``, else ``const<i>``."""
    func = kernel.mod["main"] if isinstance(kernel.mod, tvm.IRModule) else kernel.mod
    if len(func.params) != len(kernel.consts) + 2:
        raise HLSError(f"kernel takes {len(func.params)} arguments, expected x, {len(kernel.consts)} constants, out")
    names = [str(p.name) for p in func.params[1:-1]]
    usable = all(re.fullmatch(r"[a-z][a-z0-9_]*", n) for n in names) and not {"x", "y"} & set(names)
    if usable and len(set(names)) == len(names):
        return names
    return [f"const{i}" for i in range(len(names))]


def _max_steps(op: IntOp, steps: int | None) -> int:
    """Time steps the port arrays hold: ``steps``, else the op's analysis horizon."""
    if steps is not None:
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive integer, got {steps!r}")
        return steps
    return op.bounds.steps or op.cfg.max_steps


def top_spec(op: IntOp, kernel: Kernel, rows: int = DEFAULT_ROWS, steps: int | None = None) -> TopSpec:
    """What ``qnorm_top`` passes to ``kernel`` (built by :func:`kernel_for` with :data:`HLS`);
    ``steps``: time steps the ports hold, for a time-major kernel."""
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be a positive integer, got {rows!r}")
    width = int(np.prod(kernel.row_shape))
    return TopSpec(
        op_name=op.name,
        summary=_summary(op, kernel, width),
        x=Port("x", kernel.in_dtype),
        y=Port("y", kernel.out_dtype),
        in_range=(op.in_fmt.lo, op.in_fmt.hi),
        width=width,
        rows=rows,
        consts=tuple(Const(n, c) for n, c in zip(_const_names(kernel), kernel.consts, strict=True)),
        time_major=kernel.time_major,
        max_steps=_max_steps(op, steps) if kernel.time_major else 0,
    )


def _summary(op: IntOp, kernel: Kernel, width: int) -> str:
    f = op.in_fmt
    what = f"{width} channels over time" if kernel.time_major else f"rows of {width}"
    return f"{op.name}, {'signed' if f.signed else 'unsigned'} {f.bits}-bit input, {what}"


# --------------------------------------------------------------------------- vectors


def default_inputs(
    op: IntOp, kernel: Kernel, spec: TopSpec, count: int = DEFAULT_VECTORS, seed: int = 0
) -> np.ndarray:
    """Op-layout inputs for a project written without vectors: constant vectors at
    the format's ends and zero, alternating extremes, then seeded uniform ones."""
    lo, hi = op.in_fmt.lo, op.in_fmt.hi
    steps = min(DEFAULT_STEPS, spec.max_steps) if spec.time_major else 1
    unit = spec.width * steps
    alternating = np.where(np.arange(unit) % 2 == 0, lo, hi)
    fixed = np.stack([np.full(unit, lo), np.zeros(unit, dtype=np.int64), np.full(unit, hi), alternating])
    rng = np.random.default_rng(seed)
    units = np.concatenate([fixed, rng.integers(lo, hi + 1, (max(count - len(fixed), 0), unit))])
    if spec.time_major:
        return from_units(spec, units, (steps, len(units), *kernel.row_shape))
    return units.reshape(-1, *kernel.row_shape)


def vectors_file(path: Path, op: IntOp, spec: TopSpec, x: np.ndarray, expected: bool = True) -> Path:
    """``x`` (op layout) and, with ``expected``, the golden op's outputs, as a vectors file."""
    units = as_units(spec, x)
    want = as_units(spec, op.forward(x)) if expected else None
    size = {d: int(d[3:]) // 8 for d in (spec.x.dtype, spec.y.dtype)}
    return write_vectors(path, units, size[spec.x.dtype], size[spec.y.dtype], want)


# --------------------------------------------------------------------------- projects


def write_sources(
    op: IntOp,
    out_dir: Path | str,
    *,
    rows: int = DEFAULT_ROWS,
    steps: int | None = None,
    target: Target | None = None,
) -> tuple[Kernel, TopSpec]:
    """Every file of ``op``'s project but the vectors (C, tcl, README) into ``out_dir``.

    Refuses first (:class:`qnorm.analysis.TargetLimitError`) an op the target's
    declared widths cannot run exactly.  Returns the kernel and the top's spec.
    """
    target = load_target(TARGET) if target is None else target
    part, clock = target.build.part, target.build.clock_period_ns
    if part is None or clock is None:
        raise ValueError(f"{target.path}: an HLS target needs build.part and build.clock_period_ns")
    check_target(op, target)
    kernel = kernel_for(op, HLS)
    spec = top_spec(op, kernel, rows, steps)
    files = {
        csource.KERNEL_C: pipeline_element_loops(kernel_source(kernel), spec.width),
        csource.TOP_H: csource.top_header(spec),
        csource.TOP_C: csource.top_source(spec),
        csource.TCL: csource.tcl_script(spec, part, clock),
        csource.README: csource.readme(spec, part, clock, target.build.cc, target.build.cflags),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
    for name in (csource.ABI_H, csource.ABI_C, csource.TESTBENCH_C):
        shutil.copyfile(C_DIR / name, out / name)
    return kernel, spec


def write_hls_project(
    op: IntOp,
    out_dir: Path | str,
    *,
    vectors: np.ndarray | None = None,
    rows: int = DEFAULT_ROWS,
    steps: int | None = None,
    target: Target | None = None,
) -> Path:
    """Write the HLS project of ``op`` into ``out_dir`` (created) and return its path.

    ``vectors``: op-layout inputs for ``vectors.bin`` (the golden op computes the
    expected outputs); default :func:`default_inputs`.  ``rows``: rows per
    ``qnorm_top`` call.  ``steps``: time steps the ports hold, for a spiking
    neuron (default: the op's analysis horizon).  ``target``: default
    ``qnorm/data/targets/fpga-hls.toml``, whose widths the op must fit
    (:class:`qnorm.analysis.TargetLimitError` otherwise).
    """
    out = Path(out_dir)
    kernel, spec = write_sources(op, out, rows=rows, steps=steps, target=target)
    x = default_inputs(op, kernel, spec) if vectors is None else np.asarray(vectors)
    vectors_file(out / csource.VECTORS, op, spec, x)
    return out


def write_hls_projects(
    ops: Mapping[str, IntOp],
    out_dir: Path | str,
    *,
    rows: int = DEFAULT_ROWS,
    steps: int | None = None,
    target: Target | None = None,
) -> dict[str, Path]:
    """One project per named op (a model's qnorm layers, say) in ``out_dir/<name>``,
    each with its default vectors; options as for :func:`write_hls_project`.
    Every op is checked against the target first, so a refused op leaves no
    partial set of projects behind."""
    target = load_target(TARGET) if target is None else target
    for name, op in ops.items():
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
            raise ValueError(f"op name {name!r} is not a safe directory name (letters, digits, _ . -)")
        check_target(op, target)
    return {
        name: write_hls_project(op, Path(out_dir) / name, rows=rows, steps=steps, target=target)
        for name, op in ops.items()
    }
