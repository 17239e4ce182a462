"""Run an op's own statistic code on symbolic rows: reductions become TE stages.

The norms' ``_statistic(x, trace)`` is written with operators and the
:mod:`qnorm.ops._xp` helpers (``row_sum``, ``absolute``, ``take_prefix``), so
numpy and torch run the same body.  :class:`Rows` is a third operand kind those
bodies accept: a lazily built TIR expression per (row, column) plus an exact
:class:`~qnorm.analysis.Interval` bound.  ``row_sum`` on it creates a TE
reduction over the row; arithmetic composes expressions.  So the kernel's
statistic *is* the op's statistic (a change to how W or ε is formed propagates),
and anything the body does that has no meaning here (a comparison, a rounding
with a data-dependent select) raises instead of being silently re-implemented.

Every result takes the narrowest dtype its interval allows (interval arithmetic
is conservative, so this is exact): an int8 row's squares stay in int16 and its
sums in int32, which is what the vector units are widest at.

The op knows more than interval arithmetic: its range report proves, say, that
L1LayerNorm's Σ|N·x − S| stays below 2^31 at N = 4096, where N × max|N·x − S|
does not.  A :class:`ProvenTrace` hands each recorded row the op's proven
interval for that name (:meth:`Rows.bound_by`); a row sum of terms of one sign
then accumulates in the dtype of that interval.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from tvm import runtime, te, tirx

from compilers.tvm.kernels._base import int_dtype, wider
from qnorm.analysis import Interval
from qnorm.fixedpoint import Round

Index = Any  # a TIR index expression


class Rows:
    """A (rows, length) block of integers, or one value per row (``length`` None).

    ``at(r, c)`` builds the element's expression in ``dtype`` (a per-row value
    ignores ``c``); ``iv`` bounds every element.
    """

    def __init__(
        self,
        at: Callable[[Index, Index], Any],
        iv: Interval,
        length: int | None,
        dtype: str,
        rows: Any,
    ):
        self.at, self.iv, self.length, self.dtype, self.rows = at, iv, length, dtype, rows

    @classmethod
    def of_tensor(cls, x: te.Tensor, iv: Interval) -> Rows:
        """The rows of a (rows, N) placeholder whose values lie in ``iv``."""
        rows, n = x.shape
        return cls(lambda r, c: x[r, c], iv, int(n), str(x.dtype), rows)

    # ---- arithmetic

    def _binary(
        self, other: Any, iv: Interval, op: Callable[[Any, Any], Any], least: str = "int8"
    ) -> Rows:
        o = self._lift(other)
        if self.length is not None and o.length is not None and self.length != o.length:
            raise ValueError(f"row lengths differ: {self.length} and {o.length}")
        dtype = wider(int_dtype(iv), self.dtype, o.dtype, least)
        a, b = self.at, o.at
        return Rows(
            lambda r, c: op(_as(a(r, c), dtype), _as(b(r, c), dtype)),
            iv,
            _length(self, o),
            dtype,
            self.rows,
        )

    def _lift(self, v: Any) -> Rows:
        if isinstance(v, Rows):
            return v
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            k = int(v)
            return Rows(
                lambda r, c: k, Interval.point(k), None, int_dtype(Interval.point(k)), self.rows
            )
        raise TypeError(
            f"a symbolic row combines with integers and rows only, not {type(v).__name__}"
        )

    def __add__(self, o: Any) -> Rows:
        return self._binary(o, self.iv + self._lift(o).iv, lambda a, b: a + b)

    __radd__ = __add__

    def __sub__(self, o: Any) -> Rows:
        return self._binary(o, self.iv - self._lift(o).iv, lambda a, b: a - b)

    def __rsub__(self, o: Any) -> Rows:
        return self._lift(o) - self

    def __mul__(self, o: Any) -> Rows:
        # x * x is a square, not a product of two independent values: tighter bound
        iv = self.iv.square() if o is self else self.iv * self._lift(o).iv
        # At least 32 bits: x86 multiplies sign-extended 8/16-bit words into 32-bit sums
        # in one instruction (vpmaddwd), where a 16-bit product needs a widening step
        # before the row sum adds it.
        return self._binary(o, iv, lambda a, b: a * b, "int32")

    __rmul__ = __mul__

    def __neg__(self) -> Rows:
        return 0 - self

    def __lshift__(self, s: Any) -> Rows:
        s = _shift_amount(s)
        return self._binary(s, self.iv * (1 << s), lambda a, b: a << b, _shiftable(s))

    def __rshift__(self, s: Any) -> Rows:
        s = _shift_amount(s)
        return self._binary(s, self.iv.rshift(s, Round.FLOOR), lambda a, b: a >> b, _shiftable(s))

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Rows:
        """``np.abs`` (``_xp.absolute``) is the one ufunc a statistic applies to rows."""
        if ufunc is not np.absolute or method != "__call__" or inputs != (self,) or kwargs:
            raise TypeError(
                f"symbolic rows support np.absolute only, not {ufunc.__name__}.{method}"
            )
        at = self.at
        return Rows(
            lambda r, c: tirx.abs(at(r, c)), self.iv.abs(), self.length, self.dtype, self.rows
        )

    # ---- what has no meaning on a symbolic row

    def _refuse(self, *args: Any) -> Any:
        raise TypeError(
            "a symbolic row has no truth value and no comparisons: "
            "stage 1 must be arithmetic and row sums"
        )

    # == must raise too: its default (identity) would make select() take a branch silently
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = _refuse  # type: ignore[assignment]
    __hash__ = object.__hash__

    # ---- row structure

    def __getitem__(self, key: Any) -> Rows:
        """``x[..., :k]`` (``_xp.take_prefix``): the first k columns."""
        ok = (
            isinstance(key, tuple)
            and len(key) == 2
            and key[0] is Ellipsis
            and isinstance(key[1], slice)
            and key[1].start in (None, 0)
            and key[1].step in (None, 1)
            and self.length is not None
        )
        if not ok or not 1 <= int(key[1].stop) <= self.length:
            raise TypeError(f"symbolic rows support a column prefix x[..., :k] only, got {key!r}")
        return Rows(self.at, self.iv, int(key[1].stop), self.dtype, self.rows)

    def sum(self, axis: int = -1, keepdims: bool = True, dtype: Any = None) -> Rows:
        """``_xp.row_sum``: a TE reduction over the row, in the narrowest exact dtype."""
        if axis != -1 or not keepdims or self.length is None:
            raise TypeError("symbolic rows reduce over the last axis with keepdims only")
        return _RowSum(self)

    def bound_by(self, proven: Interval) -> None:
        """Tighten the bound to ``proven``, an interval the op proves for these values.

        Rows composed earlier keep their wider bound (still true); later ones
        benefit.  The expression's dtype stays: narrowing a value means casting it.
        """
        self.iv = _meet(self.iv, proven)


class _RowSum(Rows):
    """One value per row: the sum of ``terms`` over the row, built on first use.

    Built late so that an op's proven bound, recorded right after the sum is
    taken (:class:`ProvenTrace`), can still narrow the accumulator.
    """

    def __init__(self, terms: Rows):
        n = terms.length
        iv = Interval(terms.iv.lo * n, terms.iv.hi * n)
        super().__init__(self._load, iv, None, wider(int_dtype(iv), terms.dtype), terms.rows)
        self._terms = terms
        self._total: te.Tensor | None = None

    def _load(self, r: Index, c: Index) -> Any:
        if self._total is None:
            at, acc = self._terms.at, self.dtype
            k = te.reduce_axis((0, self._terms.length), name="k")
            self._total = te.compute(
                (self.rows,), lambda r: te.sum(_as(at(r, k), acc), axis=k), name="row_sum"
            )
        return self._total[r]

    def bound_by(self, proven: Interval) -> None:
        """Also narrow the accumulator, where the bound holds for every partial sum.

        With terms of one sign every partial sum (in any order: LLVM reassociates
        the vectorized sum) lies between 0 and the total, so the total's proven
        bound, widened to 0, bounds them all.  With signed terms a partial sum
        can exceed the total's bound, and signed overflow is undefined in the
        LLVM TVM emits (``add nsw``): the accumulator keeps its width.
        """
        super().bound_by(proven)
        if self._terms.iv.lo < 0 < self._terms.iv.hi:
            return
        narrow = wider(int_dtype(self.iv.union(Interval.point(0))), self._terms.dtype)
        if narrow == self.dtype:
            return
        if self._total is not None:
            raise RuntimeError(
                "a proven bound arrived after the row sum was built: "
                "record the sum as soon as it is taken"
            )
        self.dtype = narrow


class ProvenTrace(dict):
    """A stage trace that bounds each recorded symbolic row by the op's proven interval.

    ``record`` stores a value as ``np.asarray(value)``, a 0-d object array for a
    :class:`Rows`; names the op proves nothing for are stored untouched.
    """

    def __init__(self, proven: Mapping[str, Interval]):
        super().__init__()
        self._proven = proven

    def __setitem__(self, name: str, value: Any) -> None:
        rows = value.item() if isinstance(value, np.ndarray) and value.shape == () else value
        if isinstance(rows, Rows) and name in self._proven:
            rows.bound_by(self._proven[name])
        super().__setitem__(name, value)


def _meet(a: Interval, b: Interval) -> Interval:
    """The values in both ``a`` and ``b``; disjoint bounds mean a wrong proof."""
    if a.hi < b.lo or b.hi < a.lo:
        raise ValueError(f"bounds [{a.lo}, {a.hi}] and [{b.lo}, {b.hi}] do not overlap")
    return Interval(max(a.lo, b.lo), min(a.hi, b.hi))


def _length(a: Rows, b: Rows) -> int | None:
    return a.length if a.length is not None else b.length


def _shift_amount(s: Any) -> int:
    if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or not 0 <= int(s) <= 62:
        raise TypeError(f"symbolic rows shift by a constant in [0, 62] only, got {s!r}")
    return int(s)


def _shiftable(s: int) -> str:
    """The narrowest dtype a shift by ``s`` can run in.

    LLVM makes a shift by the type's width or more poison, even of a zero (a
    proven-zero statistic of one-element rows shifted by 28 was an int16).
    """
    return int_dtype(Interval.point(1 << s))


def _as(v: Any, dtype: str) -> Any:
    """``v`` in ``dtype``: Python ints become typed constants, expressions are cast."""
    if isinstance(v, int):
        return tirx.const(v, dtype)
    v = runtime.convert(v)  # a tensor element (TensorSlice) becomes a load
    return v if str(v.ty) == dtype else v.astype(dtype)
