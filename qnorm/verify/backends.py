"""The backends ``qnorm verify`` compares with the golden model: every column, registered.

The registry and what a backend returns or raises live in :mod:`.registry` (its
names are re-exported here); importing this module registers every column, in
the order the matrix shows them:

* ``golden`` — the numpy golden model itself (``op.forward``).  It computes the
  expected outputs of every other column, so its own column checks the stored
  golden vectors only: the regression check of qnorm/data/golden.
* ``qat`` — the PyTorch QAT path: the :mod:`qnorm.nn` layer of the op's family
  in eval mode, compared as integers (:mod:`.qat_layers`, imported lazily).
* ``x86_64`` — the TVM CPU kernels of :mod:`compilers.tvm.kernels`
  (``kernel_for(op).build(target)``), imported lazily;
* ``aarch64``, ``riscv64`` (:mod:`.backend_cross`), ``opencl``, ``cuda``
  (:mod:`.backend_gpu`), ``fpga-hls`` (:mod:`.backend_hls`) and ``fpga-rtl``
  (:mod:`.backend_rtl`), each module registering its columns.

Target names come from ``qnorm.targets.known_targets()``; a target without a
registered backend shows as SKIP ("backend not implemented").

Importing the registry and asking every column whether it can run loads neither
torch nor tvm (each costs seconds): ``qnorm verify --list`` and the command
line's argument checks stay fast, and the heavy modules load when a case is
prepared.
"""

from __future__ import annotations

import importlib
import importlib.util
import platform

from qnorm.extras import missing
from qnorm.ops.base import IntOp
from qnorm.verify.registry import (
    NOT_IMPLEMENTED,
    Backend,
    BackendError,
    NotRun,
    Refused,
    Runner,
    Unsupported,
    column_target,
    get,
    refuse_beyond_limits,
    register,
    registered,
    unregister,
)

__all__ = [
    "NOT_IMPLEMENTED",
    "Backend",
    "BackendError",
    "NotRun",
    "Refused",
    "Runner",
    "Unsupported",
    "column_target",
    "get",
    "refuse_beyond_limits",
    "register",
    "registered",
    "unregister",
]


# --------------------------------------------------------------------------- golden


register(
    Backend(
        "golden",
        "numpy golden model (qnorm.ops): the reference; checks the stored golden vectors",
        lambda op: Runner(op.forward, "numpy golden model"),
        stream=False,
    )
)


# --------------------------------------------------------------------------- qat


def _qat_prepare(op: IntOp) -> Runner:
    return importlib.import_module("qnorm.verify.qat_layers").prepare(op)


register(Backend("qat", "PyTorch QAT path (qnorm.nn layers, or the op body on torch int64)", _qat_prepare))


# --------------------------------------------------------------------------- x86_64 (TVM)

_KERNELS = "compilers.tvm.kernels"


def _x86_unavailable() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"host is {platform.machine()}, not x86-64"
    if (reason := missing("tvm")) is not None:
        return reason
    try:
        present = importlib.util.find_spec(_KERNELS) is not None
    except ModuleNotFoundError:  # a parent package is missing
        present = False
    if not present:  # found, not imported: importing the kernels loads tvm
        return f"unavailable: {_KERNELS} not present"
    return None


def _x86_prepare(op: IntOp) -> Runner:
    kernels = importlib.import_module(_KERNELS)
    target = column_target("x86_64")
    refuse_beyond_limits(op, target)
    try:
        kernel = kernels.kernel_for(op)
    except NotImplementedError as err:
        raise Unsupported(str(err) or f"no kernel for {type(op).__name__}") from None
    compiled = kernel.build(target)
    return Runner(compiled, f"TVM llvm kernel, -mcpu={target.tvm_spec().get('mcpu')}")


register(Backend("x86_64", "TVM llvm kernels (compilers.tvm.kernels), run natively", _x86_prepare, _x86_unavailable))

# The other columns register themselves on import, after the built-in ones.
import qnorm.verify.backend_cross  # noqa: E402,F401  (registers aarch64, riscv64)
import qnorm.verify.backend_gpu  # noqa: E402,F401  (registers opencl, cuda)
import qnorm.verify.backend_hls  # noqa: E402,F401  (registers fpga-hls)
import qnorm.verify.backend_rtl  # noqa: E402,F401  (registers fpga-rtl)
