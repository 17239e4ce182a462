"""The backends ``qnorm verify`` compares with the golden model, in a registry keyed by name.

A :class:`Backend` says whether it can run on this machine (``unavailable()``:
None, or the reason it cannot; ``not_run()``: None, or why it only builds its
kernels here) and, per op, returns a :class:`Runner` mapping
op-layout integer inputs to integer outputs, or raises :class:`Unsupported`
(this op has no implementation on the backend yet: a SKIP with the reason,
never a silent pass), :class:`Refused` (the target's declared widths cannot run
the op exactly: ``refused`` with the reason) or :class:`NotRun` (built for
hardware this machine does not have: ``compiled``).  Anything else a backend raises is a failure.

Built in:

* ``golden`` — the numpy golden model itself (``op.forward``).  It computes the
  expected outputs of every other column, so its own column checks the stored
  golden vectors only: the regression check of qnorm/data/golden.
* ``qat`` — the PyTorch QAT path: the :mod:`qnorm.nn` layer of the op's family
  in eval mode, compared as integers (:mod:`.qat_layers`, imported lazily).
* ``x86_64`` — the TVM CPU kernels of :mod:`compilers.tvm.kernels`
  (``kernel_for(op).build(target)``), imported lazily.

Target names come from ``qnorm.targets.known_targets()``; a target without a
registered backend shows as SKIP ("backend not implemented").

Importing the registry and asking every column whether it can run loads neither
torch nor tvm (each costs seconds): ``qnorm verify --list`` and the command
line's argument checks stay fast, and the heavy modules load when a case is
prepared.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import platform
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from qnorm.analysis import TargetLimitError, check_target
from qnorm.extras import missing
from qnorm.ops.base import IntOp
from qnorm.targets import Target, load_target

NOT_IMPLEMENTED = "backend not implemented"


class Unsupported(Exception):
    """The backend has no implementation for this op (reported as SKIP with the reason)."""


class NotRun(Exception):
    """The backend built the op's kernel but cannot run it here (its cell: ``compiled``, with the reason)."""


class Refused(Exception):
    """The target's declared widths cannot run this op exactly (reported as ``refused``
    with the reason: refusing is the contract, so neither a pass nor a FAIL)."""


def refuse_beyond_limits(op: IntOp, target: Target) -> None:
    """Raise :class:`Refused` if ``target``'s accumulator or multiplier widths cannot
    run ``op`` exactly (:func:`qnorm.analysis.check_target`); every compiled backend
    calls it before building."""
    try:
        check_target(op, target)
    except TargetLimitError as err:
        raise Refused(str(err)) from None


class BackendError(Exception):
    """A backend ran but broke its contract (reported as FAIL with the message)."""


@dataclass(frozen=True, eq=False)
class Runner:
    """Integer inputs (op layout) to integer outputs; ``via`` says how (for the report)."""

    run: Callable[[np.ndarray], np.ndarray]
    via: str


def _available() -> str | None:
    return None


@dataclass(frozen=True, eq=False)
class Backend:
    name: str
    description: str
    prepare: Callable[[IntOp], Runner]
    unavailable: Callable[[], str | None] = _available
    stream: bool = True  # False: only the stored golden vectors (the reference itself)
    not_run: Callable[[], str | None] = _available  # why its cells will be ``compiled`` here, if so


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    if backend.name in _REGISTRY:
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    _REGISTRY[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    del _REGISTRY[name]


def get(name: str) -> Backend | None:
    return _REGISTRY.get(name)


def registered() -> list[str]:
    return list(_REGISTRY)


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


@functools.cache
def column_target(name: str) -> Target:
    """The target description of a column, loaded once per process (every backend's
    prepare and availability check reads it)."""
    return load_target(name)


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
import qnorm.verify.backend_cross  # noqa: E402,F401  (registers aarch64, riscv64)
import qnorm.verify.backend_gpu  # noqa: E402,F401  (registers cuda, opencl)
import qnorm.verify.backend_hls  # noqa: E402,F401  (registers fpga-hls)
