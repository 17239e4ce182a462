"""The one arithmetic specification of qnorm.

Every rounding shift, rounding division, saturation, square root and dyadic
multiplication used by any qnorm op is defined here, once.  The golden models call
these functions on numpy int64 arrays (or Python ints, which the tests compare with
exact ``fractions.Fraction`` arithmetic); the QAT layers call the *same* functions
on torch int64 tensors, the TVM lowering on TIR expressions and the RTL
generator on HDL values (:mod:`compilers.rtl.values`).  That is why the
bodies use only ``+ - * >> & // %``, comparisons and :func:`select`/:func:`land`/
:func:`lor`: those mean the same thing on every kind of operand (``>>`` is an
arithmetic shift, ``//`` and ``%`` are floor division and modulo).

Default rounding: round half up, ``(v + 2**(s-1)) >> s``, the cheapest rule in
hardware and the one TVM's ``q_multiply_shift`` uses.  Other tie rules are explicit.

Preconditions (operand ranges) are checked at run time only for concrete numpy /
Python operands; for symbolic operands the static range analysis
(:mod:`qnorm.analysis`) has already proven them.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Union

import numpy as np

IntLike = Union[int, np.integer, np.ndarray, Any]  # Any: a TIR PrimExpr



class Round(enum.Enum):
    """Tie/direction rule for every rounding operation."""

    HALF_UP = "half_up"  # ties toward +inf: floor(x + 1/2)  (default)
    HALF_EVEN = "half_even"  # ties to the even neighbour (banker's, torch.round)
    HALF_AWAY = "half_away"  # ties away from zero (C's round())
    FLOOR = "floor"  # toward -inf
    CEIL = "ceil"  # toward +inf
    TRUNC = "trunc"  # toward zero (C integer division)

    @classmethod
    def parse(cls, mode: "Round | str") -> "Round":
        if isinstance(mode, Round):
            return mode
        try:
            return cls(mode)
        except ValueError:
            known = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown rounding mode {mode!r}; known: {known}") from None


DEFAULT_ROUND = Round.HALF_UP


# --------------------------------------------------------------------------- operands


def _is_torch(v: Any) -> bool:
    return type(v).__module__.startswith("torch")


def _is_concrete(*vals: Any) -> bool:
    """True unless some operand is symbolic (a TIR expression)."""
    return all(isinstance(v, (int, np.integer, np.ndarray, bool, np.bool_)) or _is_torch(v) for v in vals)


def _any_torch(*vals: Any) -> bool:
    return any(_is_torch(v) for v in vals)


def _any_numpy(*vals: Any) -> bool:
    return any(isinstance(v, np.ndarray) for v in vals)


def _check_int(v: Any, name: str) -> None:
    if isinstance(v, np.ndarray) and v.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an integer array, got dtype {v.dtype}")
    if _is_torch(v) and (v.dtype.is_floating_point or v.dtype.is_complex):
        raise ValueError(f"{name} must be an integer tensor, got dtype {v.dtype}")
    if isinstance(v, (float, np.floating)):
        raise ValueError(f"{name} must be an integer, got float {v!r}")


# Set only inside :func:`proven_ranges`: array operands skip their range checks.
_RANGES_PROVEN: contextvars.ContextVar[bool] = contextvars.ContextVar("qnorm_ranges_proven", default=False)


@contextlib.contextmanager
def proven_ranges() -> Iterator[None]:
    """Inside the block, numpy / torch array operands skip the run-time range checks.

    Only for callers whose operands a static range analysis has already proven: a
    qnorm op is constructed only after ``ranges().check()`` passed for every input
    its format admits, so running its body on integers that are inside that format
    (a QAT layer's own quantizer output, say) cannot leave the checked ranges.
    There the checks prove nothing new but cost two reductions per call, and on a
    GPU a device synchronization each.  Python-int and scalar operands are still
    checked, and so are dtypes.  A context variable: it covers the current thread /
    task only and is restored on exit, also when the block raises.  Golden numpy
    ``forward`` calls never set it, so they keep validating their input.
    """
    token = _RANGES_PROVEN.set(True)
    try:
        yield
    finally:
        _RANGES_PROVEN.reset(token)


def ranges_proven() -> bool:
    """Whether the current context is inside :func:`proven_ranges`."""
    return _RANGES_PROVEN.get()


def _check_range(v: Any, lo: int, hi: int | None, what: str, int64_guard: bool = False) -> None:
    """Raise if a concrete operand leaves [lo, hi] (hi None: no upper bound).

    Symbolic operands pass (the range analysis proved them).  ``int64_guard``
    marks limits that exist only to keep int64 from wrapping: exact Python ints
    (the analysis' own interval arithmetic) are exempt from those.  Array operands
    pass inside :func:`proven_ranges`.
    """
    if not _is_concrete(v) or (int64_guard and isinstance(v, int)):
        return
    if isinstance(v, np.ndarray) or _is_torch(v):
        if _RANGES_PROVEN.get():
            return
        if v.numel() == 0 if _is_torch(v) else v.size == 0:
            return
        vmin, vmax = int(v.min()), int(v.max())
    else:
        vmin = vmax = int(v)
    if vmin < lo or (hi is not None and vmax > hi):
        raise OverflowError(f"{what}: operand range [{vmin}, {vmax}] outside [{lo}, {hi}]")


def _own_ops(*vals: Any) -> Any:
    """The primitives of a symbolic operand kind that brings its own.

    A class with a ``fixedpoint_ops`` attribute (the RTL generator's HDL values,
    :mod:`compilers.rtl.values`) supplies ``select``, ``land``, ``lor``, ``clamp``
    and ``one_like``: the arithmetic bodies here then build hardware unchanged,
    the way they build TIR; and ``isqrt`` (:func:`isqrt_digits`' loop, which
    hardware may run as one digit per clock).  None when no operand is of such a kind.
    """
    for v in vals:
        ops = getattr(type(v), "fixedpoint_ops", None)
        if ops is not None:
            return ops
    return None


def select(cond: Any, a: Any, b: Any) -> Any:
    """Element-wise ``a if cond else b`` for numpy, torch, Python, TIR and HDL operands."""
    if (own := _own_ops(cond, a, b)) is not None:
        return own.select(cond, a, b)
    if _any_torch(cond, a, b):
        import torch

        return torch.where(cond, a, b)
    if _any_numpy(cond, a, b):
        return np.where(cond, a, b)
    if isinstance(cond, (bool, np.bool_)):
        return a if cond else b
    return _tir_select(cond, a, b)


def _tir_select(cond: Any, a: Any, b: Any) -> Any:
    """TIR Select does not promote: a Python int beside an int64 branch must be cast."""
    from tvm import runtime, tirx  # symbolic operand: only reached from the TVM lowering

    a, b = runtime.convert(a), runtime.convert(b)
    if isinstance(a, int) and not isinstance(b, int):
        a = tirx.const(a, str(b.ty))
    if isinstance(b, int) and not isinstance(a, int):
        b = tirx.const(b, str(a.ty))
    return tirx.Select(cond, a, b)


def land(a: Any, b: Any) -> Any:
    """Element-wise logical and (numpy, torch, Python, TIR and HDL booleans)."""
    if (own := _own_ops(a, b)) is not None:
        return own.land(a, b)
    if _any_torch(a, b):
        return a & b
    if _is_concrete(a, b):
        return np.logical_and(a, b) if _any_numpy(a, b) else bool(a and b)
    from tvm import tirx

    return tirx.And(a, b)


def lor(a: Any, b: Any) -> Any:
    """Element-wise logical or (numpy, torch, Python, TIR and HDL booleans)."""
    if (own := _own_ops(a, b)) is not None:
        return own.lor(a, b)
    if _any_torch(a, b):
        return a | b
    if _is_concrete(a, b):
        return np.logical_or(a, b) if _any_numpy(a, b) else bool(a or b)
    from tvm import tirx

    return tirx.Or(a, b)


def _as_int64(v: Any) -> Any:
    if isinstance(v, np.ndarray) and v.dtype != np.int64:
        return v.astype(np.int64)
    if _is_torch(v) and str(v.dtype) != "torch.int64":
        import torch

        return v.to(torch.int64)
    return v


# --------------------------------------------------------------------------- shifts


def rshift_round(v: IntLike, s: IntLike, mode: Round | str = DEFAULT_ROUND) -> IntLike:
    """``v / 2**s`` rounded by ``mode``; ``s >= 0`` (scalar or per-element array).

    Half-up is ``(v + 2**(s-1)) >> s``; ``(1 << s) >> 1`` makes the half term 0 at
    s = 0 without a branch, so per-element shift arrays need no special case.
    """
    mode = Round.parse(mode)
    if type(v) is int and type(s) is int:  # exact Python ints (the range analysis): no array checks
        if not 0 <= s <= 62:
            raise OverflowError(f"rshift_round shift amount: operand range [{s}, {s}] outside [0, 62]")
    else:
        _check_int(v, "rshift_round operand")
        v = _as_int64(v)
        if _is_concrete(s):
            _check_range(s, 0, 62, "rshift_round shift amount")
            _check_range(v, -(1 << 62), (1 << 62) - 1, "rshift_round value", int64_guard=True)
    one = _one_like(s)
    half = (one << s) >> 1
    if mode is Round.FLOOR:
        return v >> s
    if mode is Round.HALF_UP:
        return (v + half) >> s
    if mode is Round.CEIL:
        return (v + (one << s) - 1) >> s
    if mode is Round.TRUNC:
        return select(v < 0, -((-v) >> s), v >> s)
    if mode is Round.HALF_AWAY:
        return select(v < 0, -((half - v) >> s), (v + half) >> s)
    # HALF_EVEN: exact remainder decides; a tie rounds to the even quotient.
    q = v >> s
    r = v - (q << s)
    up = lor(r > half, land(land(r == half, half > 0), (q & 1) == 1))
    return select(up, q + 1, q)


def _one_like(s: Any) -> Any:
    if (own := _own_ops(s)) is not None:
        return own.one_like(s)
    if isinstance(s, np.ndarray):
        return np.ones_like(s, dtype=np.int64)
    if isinstance(s, (int, np.integer)):
        return 1
    if _is_torch(s):
        import torch

        return torch.ones_like(s, dtype=torch.int64)
    from tvm import runtime, tirx

    return tirx.const(1, str(runtime.convert(s).ty))  # the shift's own width (int32 lanes stay int32)


# --------------------------------------------------------------------------- division


def div_round(n: IntLike, d: IntLike, mode: Round | str = DEFAULT_ROUND) -> IntLike:
    """``n / d`` rounded by ``mode`` for a positive divisor ``d``.

    Built on floor division and its non-negative remainder (numpy ``//``/``%`` and
    TIR ``floordiv``/``floormod`` agree), so negatives are handled without the
    floor-vs-truncate trap between PyTorch and C.
    """
    mode = Round.parse(mode)
    _check_int(n, "div_round numerator")
    _check_int(d, "div_round divisor")
    n, d = _as_int64(n), _as_int64(d)
    if _is_concrete(d):
        _check_range(d, 1, None, "div_round divisor (must be positive)")
        _check_range(d, 1, 1 << 62, "div_round divisor", int64_guard=True)
        _check_range(n, -(1 << 62), (1 << 62) - 1, "div_round numerator", int64_guard=True)
    q = n // d
    r = n % d  # 0 <= r < d
    if mode is Round.FLOOR:
        return q
    if mode is Round.CEIL:
        return select(r > 0, q + 1, q)
    if mode is Round.TRUNC:
        return select(land(r > 0, n < 0), q + 1, q)
    twice_r = r + r  # < 2d <= 2**63
    if mode is Round.HALF_UP:
        return select(twice_r >= d, q + 1, q)
    if mode is Round.HALF_AWAY:
        return select(lor(twice_r > d, land(twice_r == d, n >= 0)), q + 1, q)
    up = lor(twice_r > d, land(twice_r == d, (q & 1) == 1))
    return select(up, q + 1, q)


# --------------------------------------------------------------------------- saturation


def int_range(bits: int, signed: bool = True) -> tuple[int, int]:
    """Inclusive [lo, hi] of a ``bits``-wide integer."""
    if not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 64:
        raise ValueError(f"bit width must be an integer in [1, 64], got {bits!r}")
    if signed:
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


def saturate(v: IntLike, bits: int, signed: bool = True) -> IntLike:
    """Clamp ``v`` to the range of a ``bits``-wide signed/unsigned integer."""
    lo, hi = int_range(bits, signed)
    _check_int(v, "saturate operand")
    if isinstance(v, np.ndarray):
        return np.clip(v.astype(np.int64), lo, hi)
    if _is_torch(v):
        return _as_int64(v).clamp(lo, hi)
    if _is_concrete(v):
        return min(max(int(v), lo), hi)
    return select(v < lo, lo, select(v > hi, hi, v))


def clamp(v: IntLike, lo: IntLike, hi: IntLike) -> IntLike:
    """``min(max(v, lo), hi)`` element-wise (lo <= hi), with per-element or scalar bounds.

    Unlike :func:`saturate` the bounds are values, not a width: per-channel windows
    (numpy / torch arrays broadcasting against ``v``, or TIR / HDL expressions).
    """
    if (own := _own_ops(v, lo, hi)) is not None:
        return own.clamp(v, lo, hi)
    if _is_torch(v):
        import torch

        lo_t = torch.as_tensor(lo, dtype=v.dtype, device=v.device)
        hi_t = torch.as_tensor(hi, dtype=v.dtype, device=v.device)
        return torch.minimum(torch.maximum(v, lo_t), hi_t)
    if _is_concrete(v):
        return np.minimum(np.maximum(v, lo), hi)
    from tvm import tirx

    return tirx.min(tirx.max(v, lo), hi)


def bits_for(lo: int, hi: int) -> int:
    """Smallest two's-complement width (sign bit included) holding [lo, hi]."""
    need = max(int(hi).bit_length(), (-int(lo) - 1).bit_length() if lo < 0 else 0)
    return need + 1


def bit_length(v: IntLike, max_bits: int = 62) -> IntLike:
    """Bit length of ``0 <= v < 2**max_bits`` (0 for 0): a leading-zero count.

    Binary search over the bit position, branch-free, so it lowers to a handful of
    compares and shifts on every backend (shift-based norms use it for log2).
    """
    if not 1 <= max_bits <= 62:
        raise ValueError(f"bit_length handles up to 62 bits, asked for {max_bits}")
    _check_int(v, "bit_length operand")
    v = _as_int64(v)
    _check_range(v, 0, (1 << max_bits) - 1, "bit_length operand")
    if isinstance(v, np.ndarray) or _is_torch(v):
        return _bit_length_of_array(v)
    return bit_length_search(v, max_bits)


def bit_length_search(v: IntLike, max_bits: int = 62) -> IntLike:
    """:func:`bit_length`'s binary search itself, on any backend (what TIR and RTL run)."""
    n = v * 0
    rest = v
    step = 1 << max(0, (max_bits - 1).bit_length() - 1)  # steps sum to >= max_bits - 1
    while step >= 1:
        big = rest >= (1 << step)
        rest = select(big, rest >> step, rest)
        n = select(big, n + step, n)
        step >>= 1
    return select(rest > 0, n + 1, n)


# --------------------------------------------------------------------------- dyadic


@dataclass(frozen=True)
class Dyadic:
    """A real constant approximated as ``m * 2**-s`` with integer m, s >= 0."""

    m: int
    s: int

    @property
    def value(self) -> Fraction:
        return Fraction(self.m, 1 << self.s)

    def rel_error(self, x: float) -> float:
        """|m 2^-s - x| / |x| (0 for x = 0 represented exactly)."""
        exact = Fraction(x)
        if exact == 0:
            return 0.0 if self.m == 0 else math.inf
        return float(abs(self.value - exact) / abs(exact))

    @classmethod
    def from_float(cls, x: float, mult_bits: int = 16, max_shift: int = 62) -> "Dyadic":
        """Largest shift whose rounded multiplier fits a signed ``mult_bits`` word.

        Exact, so the same on every machine: every value rounded is ``x · 2^s``, a
        power-of-two scaling of a finite double that stays below 2^33 in magnitude
        (or is ``x`` itself), so ``math.ldexp`` forms it without rounding, and
        :func:`round_float` rounds the double's exact value half up (what rounding
        ``Fraction(x) · 2^s`` gives, the definition the tests compare with).
        """
        _require_finite(x, "dyadic constant")
        if not 2 <= mult_bits <= 32:
            raise ValueError(f"mult_bits must be in [2, 32], got {mult_bits}")
        v = float(x)
        limit = 1 << (mult_bits - 1)
        if v == 0:
            return cls(0, 0)
        if abs(int(round_float(v))) >= limit:
            raise ValueError(
                f"constant {x!r} does not fit a signed {mult_bits}-bit multiplier even at shift 0"
            )
        # |round(x 2^s)| never decreases with s, so the answer is the largest fitting
        # s <= max_shift.  With |x| = f 2^E, f in [1/2, 1): |x| 2^(mult_bits-1-E) is in
        # [limit/2, limit), and rounding can reach the limit only there: try that shift,
        # step back at most once.
        s = min(max_shift, max(mult_bits - 1 - math.frexp(v)[1], 0))
        m = int(round_float(math.ldexp(v, s)))
        if abs(m) >= limit:
            s -= 1
            m = int(round_float(math.ldexp(v, s)))
        return cls(m, s)


def dyadic_vector(xs: np.ndarray, mult_bits: int = 16, max_shift: int = 62) -> tuple[np.ndarray, int]:
    """Per-channel multipliers sharing one shift (one shifter in hardware).

    The shift is the largest for which every |round(x 2^s)| fits ``mult_bits``
    signed bits, so the largest |x| gets full precision.
    """
    xs = np.asarray(xs, dtype=np.float64)
    if not np.all(np.isfinite(xs)):
        raise ValueError("per-channel constants contain NaN or Inf")
    big = float(np.max(np.abs(xs))) if xs.size else 0.0
    s = Dyadic.from_float(big, mult_bits, max_shift).s if big > 0 else 0
    # x * 2**s is exact in float64 (a power-of-two scaling that stays below 2**31),
    # so rounding it with the exact float rule equals rounding the exact rational.
    return round_float(np.ldexp(xs, s)).astype(np.int64), s


def round_float(t: Any, mode: Round | str = DEFAULT_ROUND) -> Any:
    """Round float64 values to integers (as float64) by ``mode``, exactly.

    The float -> int boundary (quantizers, constant derivation): ``t - floor(t)``
    is exact for |t| < 2**52, so ties are recognised exactly, unlike
    ``floor(t + 0.5)`` which rounds 0.49999999999999994 up.

    Backend-neutral: a numpy array (or scalar) rounds with numpy, a torch tensor
    with its own ``floor``/``ceil``/``trunc`` on its own device, so both give the
    identical integers (the same IEEE operations on the same float64 values).
    """
    mode = Round.parse(mode)
    torch_like = _is_torch(t)
    floor, ceil, trunc = (type(t).floor, type(t).ceil, type(t).trunc) if torch_like else (np.floor, np.ceil, np.trunc)
    if mode is Round.CEIL:
        return ceil(t)
    if mode is Round.TRUNC:
        return trunc(t)
    fl = floor(t)
    if mode is Round.FLOOR:
        return fl
    frac = t - fl  # exact below 2**52: the tie 1/2 is recognised exactly

    def step(cond: Any) -> Any:  # 0/1 to add to fl: a torch bool needs t's dtype, numpy adds bools
        return cond.to(t.dtype) if torch_like else cond

    if mode is Round.HALF_UP:
        return fl + step(frac >= 0.5)
    if mode is Round.HALF_AWAY:
        return select(t >= 0, fl + step(frac >= 0.5), fl + step(frac > 0.5))
    return select(frac == 0.5, fl + (fl % 2), fl + step(frac > 0.5))


def round_fraction(q: Fraction) -> int:
    """Round half up, on an exact rational (used when deriving constants)."""
    return math.floor(q + Fraction(1, 2))


def _require_finite(x: float, what: str) -> None:
    if not isinstance(x, (int, float, np.integer, np.floating)):
        raise ValueError(f"{what} must be a real number, got {type(x).__name__}")
    if not math.isfinite(float(x)):
        raise ValueError(f"{what} is {x!r}; NaN and Inf have no fixed-point value")


def dyadic_mul(v: IntLike, m: IntLike, s: IntLike, mode: Round | str = DEFAULT_ROUND) -> IntLike:
    """``round(v * m / 2**s)``: one integer multiply and one rounding shift."""
    return rshift_round(_as_int64(v) * m, s, mode)


# --------------------------------------------------------------------------- square roots


def isqrt(v: IntLike, max_input_bits: int = 62) -> IntLike:
    """Exact floor square root of ``0 <= v <= 2**max_input_bits`` (at most 2**62).

    The digit-by-digit (restoring) method: one compare-subtract per result bit,
    branch-free, so the identical sequence runs in numpy, in TIR and in RTL, and it
    has no convergence condition to get wrong for small inputs (unlike Newton).
    ``max_input_bits`` lets callers whose range analysis bounds v use fewer steps.
    """
    if not 0 <= max_input_bits <= 62:
        raise ValueError(f"isqrt handles inputs up to 2**62, asked for 2**{max_input_bits}")
    _check_int(v, "isqrt operand")
    v = _as_int64(v)
    _check_range(v, 0, 1 << max_input_bits, "isqrt operand")
    if isinstance(v, np.ndarray) or _is_torch(v):
        return _isqrt_of_array(v)
    if (own := _own_ops(v)) is not None:  # HDL: the same digit loop, one step per clock
        return own.isqrt(v, max_input_bits)
    return isqrt_digits(v, max_input_bits)


def isqrt_digits(v: IntLike, max_input_bits: int = 62) -> IntLike:
    """:func:`isqrt`'s digit-by-digit loop itself, on any backend (what TIR and RTL run)."""
    top = max_input_bits + (max_input_bits & 1)  # highest power of four >= the bound
    rem = v
    res = v * 0
    for k in range(top, -1, -2):
        bit = 1 << k
        trial = res + bit
        take = rem >= trial
        rem = select(take, rem - trial, rem)
        res = select(take, (res >> 1) + bit, res >> 1)
    return res


def _isqrt_of_array(v: Any) -> Any:
    """:func:`isqrt` of a numpy / torch int64 array in [0, 2^62], in a few vector ops.

    The same integers as the digit-by-digit method, by another route: the float64
    square root of float64(v) is within 2^-20 of sqrt(v) for v <= 2^62 (relative
    error below 2^-52 twice), so its floor is floor(sqrt(v)) or one off where
    sqrt(v) is that close to an integer; one exact integer correction each way
    fixes it (r*r and (r+1)^2 stay below 2^63).  TIR and RTL keep the digit loop.
    """
    if _is_torch(v):
        import torch

        r = torch.sqrt(v.to(torch.float64)).floor().to(torch.int64)
        r = r - (r * r > v).to(torch.int64)
        return r + ((r + 1) * (r + 1) <= v).to(torch.int64)
    r = np.floor(np.sqrt(v.astype(np.float64))).astype(np.int64)
    r = r - (r * r > v)
    return r + ((r + 1) * (r + 1) <= v)


def _bit_length_of_array(v: Any) -> Any:
    """:func:`bit_length` of a numpy / torch int64 array in [0, 2^62], in a few vector ops.

    float64(v)'s binary exponent is the bit length, except that rounding to 53
    bits can carry a value just below 2^k up to 2^k; ``v >> (n − 1)`` is 0 exactly
    then, and one exact integer test corrects it.
    """
    if _is_torch(v):
        import torch

        # frexp's exponent read from the float64's bits (biased exponent − 1022; 0 for 0):
        # torch.compile's vectorized CPU code cannot widen torch.frexp's int32 exponent
        n = ((v.to(torch.float64).view(torch.int64) >> 52) - 1022).clamp(min=0)
        over = (n > 0) & ((v >> (n - 1).clamp(min=0)) == 0)
        return n - over.to(torch.int64)
    n = np.frexp(v.astype(np.float64))[1].astype(np.int64)
    return n - ((n > 0) & ((v >> np.maximum(n - 1, 0)) == 0))


def isqrt_round(v: IntLike, max_input_bits: int = 62) -> IntLike:
    """sqrt(v) rounded to nearest; sqrt of an integer is never exactly r + 1/2."""
    r = isqrt(v, max_input_bits)
    return select(v > r * r + r, r + 1, r)


def reciprocal(d: IntLike, frac_bits: int, mode: Round | str = DEFAULT_ROUND) -> IntLike:
    """``2**frac_bits / d`` rounded by ``mode`` (d > 0): one divide per row."""
    if not 0 <= frac_bits <= 61:
        raise ValueError(f"reciprocal frac_bits must be in [0, 61], got {frac_bits}")
    return div_round(1 << frac_bits, d, mode)


RSQRT_MODES = (Round.FLOOR, Round.CEIL, Round.HALF_UP)


def rsqrt(v: IntLike, frac_bits: int, mode: Round | str = DEFAULT_ROUND, min_input: int = 1) -> IntLike:
    """``2**frac_bits / sqrt(v)`` for v >= min_input >= 1, exactly rounded by ``mode``.

    floor(sqrt(floor(N / v))) == floor(sqrt(N / v)) for real N/v >= 0, so the floor
    result needs one division and one isqrt; half-up and ceil then decide the last
    bit with an exact integer comparison (no float, no iteration).  A caller that
    guarantees ``v >= min_input`` (a normalized mantissa) bounds the quotient by
    N / min_input, which halves the isqrt's digit steps for a 30-bit mantissa.
    """
    mode = Round.parse(mode)
    if mode not in RSQRT_MODES:
        raise ValueError(f"rsqrt supports {[m.value for m in RSQRT_MODES]}, not {mode.value}")
    if not 0 <= frac_bits <= 30:
        raise ValueError(f"rsqrt frac_bits must be in [0, 30], got {frac_bits}")
    if not isinstance(min_input, int) or min_input < 1:
        raise ValueError(f"rsqrt min_input must be an integer >= 1, got {min_input!r}")
    _check_int(v, "rsqrt operand")
    v = _as_int64(v)
    _check_range(v, min_input, None, f"rsqrt operand (must be >= {min_input})")
    _check_range(v, 1, 1 << 62, "rsqrt operand", int64_guard=True)
    num = 1 << (2 * frac_bits)
    q = num // v
    rem = num % v  # num / v == q + rem / v, 0 <= rem < v
    # q <= num / min_input <= 2**(2 frac_bits - floor(log2 min_input))
    r = isqrt(q, max(2 * frac_bits - (min_input.bit_length() - 1), 0))  # r*r <= q
    if mode is Round.FLOOR:
        return r
    if mode is Round.CEIL:
        return select(lor(r * r < q, land(r * r == q, rem > 0)), r + 1, r)
    # Up iff num/v >= (r + 1/2)^2, i.e. k + rem/v >= 1/4 with k = q - r^2 - r (an
    # integer): true for k >= 1, false for k <= -1, and for k == 0 iff 4 rem >= v,
    # written rem >= ceil(v / 4) so nothing can overflow.
    k = q - r * r - r
    return select(lor(k > 0, land(k == 0, rem >= ((v + 3) >> 2))), r + 1, r)
