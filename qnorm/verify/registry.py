"""The registry of ``qnorm verify``'s backends (columns), and what a backend returns or raises.

A :class:`Backend` says whether it can run on this machine (``unavailable()``:
None, or the reason it cannot; ``not_run()``: None, or why it only builds its
kernels here) and, per op, returns a :class:`Runner` mapping
op-layout integer inputs to integer outputs, or raises :class:`Unsupported`
(this op has no implementation on the backend yet: a SKIP with the reason,
never a silent pass), :class:`Refused` (the target's declared widths cannot run
the op exactly: ``refused`` with the reason) or :class:`NotRun` (built for
hardware this machine does not have: ``compiled``).  Anything else a backend raises is a failure.

Every backend module imports this one and registers its columns;
:mod:`qnorm.verify.backends` imports them all.  Nothing here loads torch or tvm.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from qnorm.analysis import TargetLimitError, check_target
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


@functools.cache
def column_target(name: str) -> Target:
    """The target description of a column, loaded once per process (every backend's
    prepare and availability check reads it)."""
    return load_target(name)
