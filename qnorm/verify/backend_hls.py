"""``qnorm verify`` column fpga-hls: the HLS project of each op, run in C simulation.

Per op: the target limits of ``qnorm/data/targets/fpga-hls.toml`` first
(:func:`qnorm.verify.registry.refuse_beyond_limits`); a config they refuse is
reported as ``refused`` with the reason, which names the intermediate, its
bits and the limit.  Refusing is the contract, not a defect, so it is not a
FAIL of the matrix; it is never a pass either (no vectors run).
Otherwise the project's sources are written (:func:`compilers.fpga.hls.write_sources`:
TVM's C for the HLS-scheduled kernel, ``qnorm_top``, the testbench), gcc builds
the C simulation once (cached by content), and every batch of vectors runs
through it: the runner writes them as a vectors file, the testbench calls
``qnorm_top`` block by block and writes the outputs, which the harness compares.

Importing this module registers the column without importing tvm.
"""

from __future__ import annotations

import importlib
import tempfile
from typing import Any

import numpy as np

from compilers.toolchains import compiler_unavailable
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

NAME = "fpga-hls"


def _module(name: str) -> Any:
    return importlib.import_module(f"compilers.fpga.{name}")


def _unavailable() -> str | None:
    return missing("tvm") or compiler_unavailable(column_target(NAME))


def _prepare(op: IntOp) -> Runner:
    hls, csim, vectors = _module("hls"), _module("csim"), _module("vectors")
    target = column_target(NAME)
    refuse_beyond_limits(op, target)
    with tempfile.TemporaryDirectory(prefix="qnorm-hls-") as project:
        try:
            _, spec = hls.write_sources(op, project, target=target)
        except NotImplementedError as err:
            raise Unsupported(str(err) or f"no kernel for {type(op).__name__}") from None
        built = csim.build_csim(project, target)
    in_bytes, out_bytes = (int(d[3:]) // 8 for d in (spec.x.dtype, spec.y.dtype))

    def run(x: np.ndarray) -> np.ndarray:
        x = op.in_fmt.check(np.asarray(x))  # an out-of-format value must not wrap in the port type
        units = csim.simulate(built.binary, vectors.as_units(spec, x), in_bytes, out_bytes)
        return vectors.from_units(spec, units, x.shape)

    return Runner(
        run,
        f"TVM c kernel + qnorm_top ({spec.rows} rows per call), C simulation: "
        f"{target.build.cc} {' '.join(target.build.cflags)}",
    )


register(
    Backend(
        NAME,
        "HLS project (TVM c kernel, qnorm_top, C testbench) run in gcc C simulation; "
        "configs beyond the target's declared widths are refused",
        _prepare,
        _unavailable,
    )
)
