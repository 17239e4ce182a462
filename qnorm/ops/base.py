"""What every golden integer op provides."""

from __future__ import annotations

import abc
from typing import ClassVar

import numpy as np

from qnorm.analysis import RangeReport
from qnorm.qformat import QFormat

Trace = dict[str, np.ndarray]


def record(trace: Trace | None, name: str, value: np.ndarray) -> np.ndarray:
    """Store an intermediate when the caller asked for a trace (range tests do).

    A torch tensor is stored as it is (on its device: ``np.asarray`` would fail on
    CUDA and synchronize), anything else as a numpy array.
    """
    if trace is not None:
        trace[name] = value if type(value).__module__.startswith("torch") else np.asarray(value)
    return value


class IntOp(abc.ABC):
    """A golden integer op: pure integer forward, static ranges, float reference.

    Subclasses build all integer constants in ``__init__``/``from_float`` and call
    ``self.ranges().check()`` there, so an op that exists cannot overflow int64
    (with the one bit of rounding headroom fixedpoint needs).
    The names passed to :func:`record` in ``_forward`` are the names in
    ``ranges()``; the range tests match them up.
    """

    name: ClassVar[str]
    # The multiplications the body makes, by the names of qnorm.analysis._FORMULAS
    # (target limits bound each one); deliberately no default: an op that does not
    # list them is refused by the target check, never assumed product-free.
    multiplications: ClassVar[tuple[str, ...]]
    # The version of the op's integer definition: stored integers (golden vectors,
    # checkpoint constants) made by another version are refused, never reinterpreted.
    definition: ClassVar[int] = 1
    in_fmt: QFormat
    out_fmt: QFormat

    @abc.abstractmethod
    def ranges(self) -> RangeReport:
        """Exact bounds of every named intermediate, from the config alone."""

    @abc.abstractmethod
    def _forward(self, x: np.ndarray, trace: Trace | None) -> np.ndarray:
        """Integer forward on an already validated int64 array."""

    @abc.abstractmethod
    def float_reference(self, x: np.ndarray) -> np.ndarray:
        """The unquantized op on real-valued input (float64 out, real units)."""

    def forward(self, x: np.ndarray, trace: Trace | None = None) -> np.ndarray:
        """Validate ``x`` against ``in_fmt`` and run the integer forward."""
        return self._forward(self.in_fmt.check(x), trace)

    def __call__(self, x: np.ndarray, trace: Trace | None = None) -> np.ndarray:
        return self.forward(x, trace)
