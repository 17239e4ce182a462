"""Integer GELU and SiLU: elementwise activations of transformer MLPs, exactly defined.

``y = saturate(round(f(x_in s_in) / s_out))`` for ``f`` = GELU (``x Φ(x)``, the
exact erf form) or SiLU (``x σ(x)``), computed from integers alone.  Which
integer algorithm runs depends on how many input codes there are, and was chosen
by measured error and cost (the README's "GELU and SiLU" table measures both):

**Table (inputs of at most 12 bits, ≤ 4096 codes).**  Every input code has one
output, so the op *is* a table: ``T[q − lo] = saturate(round_mode(f(q s_in) / s_out))``,
built once from float64 math (``math.erfc``, ``numpy.exp``; one correctly rounded
division by ``s_out`` and the exact rounding of :meth:`QFormat.quantize`).  The
result is the correctly rounded function: at most 0.5 LSB from ``f`` for the
nearest-rounding modes (1 LSB for floor / ceil / trunc), plus the float64
reference's own rounding (~1e-13 LSB).  It costs one load per element on every
target (a 256-byte ROM on an FPGA for int8).  Polynomial or shift-based
approximations cost multiplies per element and are less accurate: I-BERT's
second-order erf polynomial alone is off by up to 0.018 in real units (measured
with :mod:`qnorm.report_activation`: 0.65 LSB at int8 with scale 2^-4, 38 LSB at
int16 with scale 2^-11), and ShiftGELU's ``x σ(1.702 x)`` by up to 0.020.

**Segments (13 to 16 bits).**  A table would hold up to 65536 words.  Instead the
codes are cut into ``2^k``-code segments (the index is one shift), and on each a
quadratic through three fixed-point samples of ``f / s_out``, taken at the
segment's start, middle and end with ``FRAC_BITS`` fraction bits
(``Y_i = round(2^FRAC_BITS f(q_i s_in) / s_out)``, ``h = 2^(k−1)``):

    p(t) = Y0 + (Y1 − Y0) t / h + (Y2 − 2 Y1 + Y0) t (t − h) / (2 h²),   t = q − q_start in [0, 2^k)

Scaled by ``2^(2k−1)`` that is integer Horner form with per-segment integers

    A = Y0 2^(2k−1),  B = (Y1 − Y0) 2^k,  C = Y2 − 2 Y1 + Y0:   N = A + t (B + C (t − h)),

and ``y = saturate(rshift_round(N, FRAC_BITS + 2k − 1, mode))``: three loads, two
multiplies, one rounding shift.  The coefficients are exact integer functions of
the samples (no fitting, no float in the coefficients), so the same config
always gives the same op.  ``k`` is the largest segment size (at most
``MAX_SEGMENT_BITS``) whose measured deviation ``max |N / 2^(FRAC_BITS+2k−1) −
f / s_out|`` over *every* input code stays within ``SEGMENT_TOLERANCE`` (1/16 LSB);
so the error is at most 0.5 + 1/16 LSB (1 + 1/16 for directed rounding), and the
measured deviation is kept in ``segment_error``.  For int16 at equal scales
``k = 8``: 256 segments, 3 × 256 constants instead of 65536 outputs.  The tails
need no case of their own: where ``f`` is a line (GELU(x) = x and SiLU(x) = x
for large x, 0 for very negative x) the quadratic through its samples is that
line, so the tails are exact up to the samples' rounding (2^-13 LSB).

Both tables (outputs, or A/B/C) are stored in the op, so golden vectors catch
any change of the construction; ``definition`` versions the integer algorithm.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from qnorm import fixedpoint as fp
from qnorm.analysis import Interval, OverflowRiskError, RangeReport
from qnorm.fixedpoint import DEFAULT_ROUND, Round
from qnorm.ops._xp import const_like, take
from qnorm.ops.base import IntOp, Trace, record
from qnorm.qformat import QFormat

TABLE = "table"
SEGMENTS = "segments"
ALGORITHMS = (TABLE, SEGMENTS)
MAX_TABLE_BITS = 12  # up to 4096 codes: one exactly rounded output per code
MAX_IN_BITS = 16  # the segment construction measures every code: 2^16 at most
FRAC_BITS = 12  # fraction bits of the segment samples (their rounding: 2^-13 LSB)
MAX_SEGMENT_BITS = 10
SEGMENT_TOLERANCE = 1 / 16  # LSB: the most a segment quadratic may deviate from f / s_out

Load = Callable[[str, Any], Any]  # (table name, index) -> int64 value, on any backend


# --------------------------------------------------------------------------- float functions


def gelu(x: np.ndarray) -> np.ndarray:
    """``x Φ(x) = x erfc(−x/√2) / 2`` in float64 (erfc: no cancellation for x < 0)."""
    x = np.asarray(x, dtype=np.float64)
    erfc = np.frompyfunc(math.erfc, 1, 1)(-x / math.sqrt(2.0)).astype(np.float64)
    return 0.5 * x * erfc


def silu(x: np.ndarray) -> np.ndarray:
    """``x σ(x)`` in float64, with ``exp(−|x|)`` so nothing overflows."""
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(-np.abs(x))
    return x * np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class ActivationConfig:
    """Input and output formats and the output's tie rule; ``algorithm`` None: chosen by
    input width (a table up to ``MAX_TABLE_BITS``, else segments)."""

    in_fmt: QFormat
    out_fmt: QFormat
    rounding: Round = DEFAULT_ROUND
    algorithm: str | None = None

    def __post_init__(self) -> None:
        for name in ("in_fmt", "out_fmt"):
            if not isinstance(getattr(self, name), QFormat):
                raise ValueError(f"{name} must be a QFormat, got {type(getattr(self, name)).__name__}")
        object.__setattr__(self, "rounding", Round.parse(self.rounding))
        if self.in_fmt.bits > MAX_IN_BITS:
            raise ValueError(
                f"integer activations take inputs of at most {MAX_IN_BITS} bits, got {self.in_fmt.bits}"
            )
        if self.algorithm is not None and self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown activation algorithm {self.algorithm!r}; known: {', '.join(ALGORITHMS)}")
        if self.algorithm == TABLE and self.in_fmt.bits > MAX_TABLE_BITS:
            raise ValueError(
                f"a table of a {self.in_fmt.bits}-bit input would hold {1 << self.in_fmt.bits} outputs; "
                f"tables are limited to {MAX_TABLE_BITS}-bit inputs (use {SEGMENTS!r})"
            )

    @property
    def chosen(self) -> str:
        if self.algorithm is not None:
            return self.algorithm
        return TABLE if self.in_fmt.bits <= MAX_TABLE_BITS else SEGMENTS

    @property
    def codes(self) -> np.ndarray:
        """Every input code, ascending (int64)."""
        return np.arange(self.in_fmt.lo, self.in_fmt.hi + 1, dtype=np.int64)


# --------------------------------------------------------------------------- segment construction


@dataclass(frozen=True, eq=False)
class Segments:
    """The per-segment integers of the quadratic (see the module docstring)."""

    bits: int  # k: 2^k codes per segment
    a: np.ndarray  # Y0 2^(2k-1)
    b: np.ndarray  # (Y1 - Y0) 2^k
    c: np.ndarray  # Y2 - 2 Y1 + Y0
    error: float  # measured max |p - f / s_out| over every code, in output LSB

    @property
    def shift(self) -> int:
        return FRAC_BITS + 2 * self.bits - 1


def _samples(scaled: np.ndarray) -> np.ndarray:
    """``round(2^FRAC_BITS v)`` half up, exactly (ldexp is exact, rounding then exact)."""
    v = np.ldexp(scaled, FRAC_BITS)
    if np.max(np.abs(v)) >= 2.0**52:
        raise OverflowRiskError(
            f"activation samples reach {float(np.max(np.abs(scaled))):.3g} output LSB, too many for "
            f"{FRAC_BITS} fraction bits in float64; choose an output scale closer to the input's"
        )
    return fp.round_float(v).astype(np.int64)


def _segments_of(bits: int, exact: np.ndarray, beyond: float) -> Segments:
    """Segments of ``2^bits`` codes for ``exact`` = f / s_out at every code (``beyond``:
    at one code past the last, the last segment's end sample)."""
    h = 1 << (bits - 1)
    y = _samples(np.append(exact, beyond)[::h])  # samples at every half segment
    y0, y1, y2 = y[:-1:2], y[1::2], y[2::2]
    seg = Segments(bits, y0 << (2 * bits - 1), (y1 - y0) << bits, y2 - 2 * y1 + y0, 0.0)
    n = _numerator(seg, np.arange(exact.size, dtype=np.int64))
    err = float(np.max(np.abs(np.ldexp(n.astype(np.float64), -seg.shift) - exact)))
    return Segments(seg.bits, seg.a, seg.b, seg.c, err)


def _numerator(seg: Segments, u: np.ndarray) -> np.ndarray:
    """N at input offsets u = q − lo (construction only: numpy int64, sizes checked by the caller)."""
    j = u >> seg.bits
    t = u - (j << seg.bits)
    return seg.a[j] + t * (seg.b[j] + seg.c[j] * (t - (1 << (seg.bits - 1))))


def choose_segments(exact: np.ndarray, beyond: float) -> Segments:
    """The largest segments (fewest constants) within ``SEGMENT_TOLERANCE`` of f / s_out.

    Two-code segments always qualify: their quadratic passes through a sample at
    every code, so only the samples' rounding (2^-(FRAC_BITS+1) LSB) remains.
    """
    top = min(MAX_SEGMENT_BITS, int(exact.size).bit_length() - 1)
    for bits in range(top, 1, -1):
        seg = _segments_of(bits, exact, beyond)
        if seg.error <= SEGMENT_TOLERANCE:
            return seg
    return _segments_of(1, exact, beyond)


# --------------------------------------------------------------------------- the ops


class IntActivation(IntOp):
    """An elementwise activation ``f`` as an exact integer op (module docstring)."""

    multiplications = ("segment_curve", "segment_slope")  # none for a table (the formulas say so)
    _float: ClassVar[Callable[[np.ndarray], np.ndarray]]

    def __init__(self, cfg: ActivationConfig) -> None:
        if not isinstance(cfg, ActivationConfig):
            raise ValueError(f"cfg must be an ActivationConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.in_fmt, self.out_fmt = cfg.in_fmt, cfg.out_fmt
        self.algorithm = cfg.chosen
        x = cfg.in_fmt.dequantize(cfg.codes)
        self.segments: Segments | None = None
        if self.algorithm == TABLE:
            self.table = cfg.out_fmt.quantize(self.function(x), cfg.rounding)
            self.tables = {"table": self.table}
        else:
            exact = self.function(x) / cfg.out_fmt.scale
            beyond = float(self.function(np.array([(cfg.in_fmt.hi + 1) * cfg.in_fmt.scale]))[0] / cfg.out_fmt.scale)
            self.segments = choose_segments(exact, beyond)
            self.tables = {"seg_a": self.segments.a, "seg_b": self.segments.b, "seg_c": self.segments.c}
        self._ranges = self._build_ranges()
        self._ranges.check()

    @classmethod
    def of(
        cls, in_fmt: QFormat, out_fmt: QFormat, rounding: Round | str = DEFAULT_ROUND, algorithm: str | None = None
    ) -> "IntActivation":
        """The op of a config, built once per config (construction measures every code)."""
        return _cached(cls, ActivationConfig(in_fmt, out_fmt, Round.parse(rounding), algorithm))

    @classmethod
    def function(cls, x: np.ndarray) -> np.ndarray:
        """The float64 activation on real values."""
        return cls._float(x)

    def float_reference(self, x: np.ndarray) -> np.ndarray:
        return self.function(x)

    # ---- the integer body (numpy, torch and TIR alike)

    def evaluate(self, x: Any, load: Load, trace: Trace | None = None) -> Any:
        """The body on int64 input codes ``x``; ``load(name, i)`` reads ``self.tables[name][i]``.

        The op's ``_forward`` passes a gather from the tables, the TVM kernel a load
        from its constant argument buffers: both run this code.
        """
        u = x - self.in_fmt.lo  # the code's offset: a table index, or segment and position
        if self.segments is None:
            return record(trace, "output", load("table", u))
        k = self.segments.bits
        j = record(trace, "segment", u >> k)
        t = u - (j << k)
        curve = record(trace, "curve", load("seg_c", j) * (t - (1 << (k - 1))))
        slope = record(trace, "slope", load("seg_b", j) + curve)
        num = record(trace, "numerator", load("seg_a", j) + t * slope)
        level = fp.rshift_round(num, self.segments.shift, self.cfg.rounding)
        return record(trace, "output", fp.saturate(level, self.out_fmt.bits, self.out_fmt.signed))

    def _forward(self, x: np.ndarray, trace: Trace | None) -> np.ndarray:
        tables = {name: const_like(x, values) for name, values in self.tables.items()}
        return self.evaluate(x, lambda name, i: take(tables[name], i), trace)

    # ---- analysis

    def ranges(self) -> RangeReport:
        return self._ranges

    def _build_ranges(self) -> RangeReport:
        """Exact bounds, by evaluating every input code (the whole domain is at most 2^16)."""
        rep = RangeReport(self.name)
        rep.add("offset", Interval(0, self.in_fmt.hi - self.in_fmt.lo))
        if self.segments is None:
            rep.add("output", _hull(self.table))
            return rep
        seg = self.segments
        # |A|, |B| W, |C| W^2 below 2^62 keep the exhaustive int64 evaluation exact
        w = 1 << seg.bits
        widest = max(_max_abs(seg.a), _max_abs(seg.b) * w, _max_abs(seg.c) * w * w)
        if widest.bit_length() > 60:
            raise OverflowRiskError(
                f"{self.name}: segment constants reach {widest.bit_length()} bits; choose an output "
                "scale closer to the input's"
            )
        trace: Trace = {}
        u = np.arange(self.in_fmt.hi - self.in_fmt.lo + 1, dtype=np.int64)
        self.evaluate(u + self.in_fmt.lo, lambda name, i: self.tables[name][i], trace)
        for name in ("segment", "curve", "slope", "numerator", "output"):
            rep.add(name, _hull(trace[name]))
        rep.add("segment_const_c", _hull(seg.c))
        return rep

    def cost(self) -> dict[str, dict[str, int]]:
        """Operation counts per element, and the constants (words) the op reads."""
        if self.segments is None:
            return {"per_element": {"add": 1, "load": 1}, "constants": {"words": int(self.table.size)}}
        return {
            "per_element": {"add": 4, "mul": 2, "shift": 3, "load": 3, "saturate": 1},
            "constants": {"words": 3 * int(self.segments.a.size)},
        }


def _hull(values: np.ndarray) -> Interval:
    return Interval(int(np.min(values)), int(np.max(values)))


def _max_abs(values: np.ndarray) -> int:
    return max(abs(int(values.min())), abs(int(values.max())))


@functools.lru_cache(maxsize=64)
def _cached(cls: type[IntActivation], cfg: ActivationConfig) -> IntActivation:
    return cls(cfg)


class IntGELU(IntActivation):
    """GELU ``x Φ(x)`` (the erf form of ``torch.nn.GELU()``) as an exact integer op."""

    name = "int_gelu"
    _float = staticmethod(gelu)


class IntSiLU(IntActivation):
    """SiLU ``x σ(x)`` (``torch.nn.SiLU``) as an exact integer op."""

    name = "int_silu"
    _float = staticmethod(silu)


ACTIVATIONS: tuple[type[IntActivation], ...] = (IntGELU, IntSiLU)
