"""``qnorm verify`` columns aarch64 and riscv64: TVM kernels cross-compiled, run under qemu-user.

Each column builds the op's CPU kernel (``compilers.tvm.kernels.kernel_for``)
for the target with :mod:`compilers.tvm.cross` (LLVM for the target's triple and
CPU, linked statically by the Debian cross gcc) and runs every batch of vectors
as one qemu-user process.  Importing this module registers the columns without
importing tvm; ``unavailable()`` (:mod:`compilers.toolchains`, no tvm either)
names the Debian packages of a missing cross gcc, static libc or qemu binary.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from compilers.toolchains import cross_tools_missing
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

CROSS_TARGETS = ("aarch64", "riscv64")
_CROSS = "compilers.tvm.cross"


def _cross() -> Any:
    return importlib.import_module(_CROSS)


def _unavailable(name: str) -> str | None:
    return missing("tvm") or cross_tools_missing(column_target(name))


def _prepare(name: str, op: IntOp) -> Runner:
    kernels = importlib.import_module("compilers.tvm.kernels")
    target = column_target(name)
    refuse_beyond_limits(op, target)
    try:
        kernel = kernels.kernel_for(op)
    except NotImplementedError as err:
        raise Unsupported(str(err) or f"no kernel for {type(op).__name__}") from None
    compiled = _cross().cross_build(kernel, target)
    spec = target.tvm_spec()
    return Runner(
        compiled,
        f"TVM llvm -mtriple={spec['mtriple']} -mcpu={spec['mcpu']}, {target.build.cc} "
        f"{' '.join(target.build.cflags)}, {target.run.emulator}",
    )


for _name in CROSS_TARGETS:
    register(
        Backend(
            _name,
            f"TVM llvm kernels cross-compiled for {_name}, linked by the cross gcc, run under qemu-user",
            functools.partial(_prepare, _name),
            functools.partial(_unavailable, _name),
        )
    )
