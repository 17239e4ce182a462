"""Integer softmax over the last axis: exp by exactly rounded tables, one reciprocal per row.

The float op is ``p_i = exp(s x_i) / Σ_j exp(s x_j)`` over the kept (unmasked)
columns of a row of integer logits x with input scale s; masked columns give 0.
Per row, in integers (F = ``exp_bits``, G = ``sum_guard``, R = ``inv_bits``,
M = R + 2 mantissa bits, f = the output's fraction bits, ``out_fmt.scale = 2^-f``):

    m   = max_j x_j                                 (over kept columns)
    d_i = m − x_i  ∈ [0, 2^b − 1]                   (so every exponent argument is ≤ 0)
    t_i = round(2^(F+G) exp(−s d_i))                (the sum's term: a table, see below; 0 if masked)
    e_i = round(2^F exp(−s d_i))                    (the output's numerator: a table; 0 if masked)
    S   = Σ t_i  ∈ [2^(F+G), N 2^(F+G)]             (the max column alone gives 2^(F+G))
    L   = bit_length(S),  μ = round(S / 2^(L−M))    (S's top M bits)
    r   = round(2^(M−1+R) / μ) ∈ [2^(R−1), 2^R]     (ONE division, of bounded operands)
    y_i = sat(round(e_i r / 2^(L−1+R−f−G)))         (one multiply, one rounding shift)

so ``y_i / 2^f = e_i / (S 2^-G)`` up to the relative errors 2^-M of μ and 2^-R
of r.  The G guard bits are the sum's: the table error of every term adds up in
S (N terms of half a unit each; with G = 0, 1023 entries that round 0.52 up to 1
moved a probability near 1 by 3.9 LSB at N = 1024), while each e_i's own error
only moves its own output.  Normalizing S by its leading one keeps r at R
significant bits for any row length, the division's operands within M−1+R bits,
and the product ``e_i r <= 2^(F+R)`` in the lanes.

**exp by tables, not by 2^(x log2 e) with a polynomial.**  d takes at most 2^b
values, so for b ≤ 8 bits ``exp(−s d)`` is one table of ≤ 256 entries, each the
exactly rounded ``2^F exp(−s d)`` (derived at construction with exact decimal
arithmetic where float64 cannot decide the rounding): error ≤ 1/2 unit of 2^-F,
the least any F-bit exponent can have, for one load per element.  The shift +
polynomial route (``t = d·s·log2 e`` in fixed point, ``2^-frac(t)`` by a
polynomial, ``>> floor(t)``) needs the constant multiply, 2–3 multiplies for
the polynomial, a variable shift and a clamp per element, and its error is the
polynomial's: measured max relative error of 2^-u on [0, 1) for Chebyshev
interpolants is 2.3e-3 (degree 2) and 1.0e-4 (degree 3), up to 0.58 and 0.026
LSB of a uint8 probability near 1 before any rounding of its own, where the
table's is 2^-16 (the whole op measures 0.50–0.51 LSB at most against float64
softmax: README "Softmax").  For b in 9..16 bits (int16 logits) the argument is
split in base-256 digits, ``exp(−s d) = exp(−s d_lo) · exp(−256 s d_hi)``: two tables
(256 and 2^(b−8) entries) and one multiply + rounding shift, exact to about one
unit of 2^-F — still cheaper and more accurate than a degree-3 polynomial.

**Masks** (config): ``causal`` keeps, in row q of a (…, T_q, N) score matrix,
the columns ``c <= q + causal_offset`` (q = the row's index in the flattened
leading axes modulo ``query_len`` = T_q, default N: a square matrix; a positive
offset is a KV cache of earlier keys).  ``padding`` marks a padded key by the
input's lowest code: ``x == in_fmt.lo`` is −∞ (``masked_fill(mask, -inf)`` of
float attention).  The mask then travels with the logits through every kernel
and file format, and a per-row valid length or a boolean key mask becomes that
code with :func:`mask_padding` (the QAT layer does this, and keeps real logits
at lo + 1 or above).  Masked columns output exactly 0 and do not enter max or
sum; a **fully masked row outputs all zeros** (S = 0 is divided as S = 1).

Saturation: a one-hot row has p = 1 = 2^f units, one more than an unsigned
f-bit format holds: it saturates to (2^f − 1) / 2^f (the error tables count it).
Input scale: any positive scale (power of two or dyadic: the tables are derived
from its exact value), so attention feeds the op ``QKᵀ · (1/sqrt(d_k))``
requantized to an int8 / int16 grid of its choice; the scale only changes the
tables.
"""

from __future__ import annotations

import decimal
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from qnorm import fixedpoint as fp
from qnorm.analysis import Interval, OverflowRiskError, RangeReport
from qnorm.fixedpoint import DEFAULT_ROUND, Round
from qnorm.metrics import ErrorStats, error_in_lsb
from qnorm.ops._xp import column_index, lookup, row_index, row_max, row_sum
from qnorm.ops.base import IntOp, Trace, record
from qnorm.qformat import QFormat

IN_BITS = (2, 16)  # logits of 2..16 bits: one table digit up to 8 bits, two above
OUT_BITS = (2, 16)
DIGIT_BITS = 8  # table index width: one 256-entry table per base-256 digit of d
LANES = (32, 64)
# (exp_bits F, sum_guard G, extra reciprocal bits over f) per datapath: 32-bit
# lanes hold e·r <= 2^(F+R) with F + R <= 29 and the sum's terms 2^(F+G); 64 lets
# int16 outputs have F = 22, R = f + 8, two-digit table products 2^(2(F+G)) <= 2^60.
DEFAULT_BITS = {32: (15, 8, 6), 64: (22, 8, 8)}
MANTISSA_EXTRA = 2  # S's mantissa keeps R + 2 bits: its rounding costs r a quarter of its own


def _exp_bits_short(fo: int, inv_bits: int, lanes: int, default: int, room: int) -> str:
    """Why the default F = min(default, room) is below the f + 2 an output LSB of 2^-f
    needs: the lanes (``room``, what they leave beside R), or the default's own cap."""
    if room < fo + 2:
        wider = " or lanes=64" if lanes < LANES[-1] else ""
        return (
            f"an output LSB of 2^-{fo} needs exp_bits >= {fo + 2} beside inv_bits = {inv_bits}, more than "
            f"{lanes}-bit lanes hold (exp_bits + inv_bits <= {lanes - 3}): use a coarser output scale{wider}"
        )
    return (
        f"an output LSB of 2^-{fo} needs exp_bits >= {fo + 2}, above the default {default} of {lanes}-bit "
        f"lanes: use a coarser output scale, or pass an exp_bits, sum_guard and inv_bits that hold it"
    )


@dataclass(frozen=True)
class SoftmaxConfig:
    """IntSoftmax's integer configuration (validated, immutable).

    ``exp_bits`` (F), ``sum_guard`` (G), ``inv_bits`` (R) and ``lanes`` default
    from the formats: 32-bit lanes with F = 15, G = 8, R = f + 6 for inputs and
    outputs of up to 8 bits, else 64-bit lanes with F = 22, G = 8, R = f + 8
    (F capped to what the lanes hold).
    """

    n: int
    in_fmt: QFormat
    out_fmt: QFormat
    rounding: Round = DEFAULT_ROUND
    causal: bool = False
    causal_offset: int = 0
    query_len: int | None = None
    padding: bool = False
    exp_bits: int | None = None
    sum_guard: int | None = None
    inv_bits: int | None = None
    lanes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "rounding", Round.parse(self.rounding))
        _check_int("n", self.n, 1)
        for name in ("in_fmt", "out_fmt"):
            if not isinstance(getattr(self, name), QFormat):
                raise ValueError(f"{name} must be a QFormat, got {type(getattr(self, name)).__name__}")
        if not self.in_fmt.signed or not IN_BITS[0] <= self.in_fmt.bits <= IN_BITS[1]:
            raise ValueError(
                f"softmax logits must be signed {IN_BITS[0]}..{IN_BITS[1]}-bit integers, got {self.in_fmt}"
            )
        if not OUT_BITS[0] <= self.out_fmt.bits <= OUT_BITS[1]:
            raise ValueError(
                f"softmax outputs of {OUT_BITS[0]}..{OUT_BITS[1]} bits are supported, got {self.out_fmt.bits}"
            )
        if not self.out_fmt.is_power_of_two or self.out_fmt.scale > 0.5:
            raise ValueError(
                f"the output scale must be 2^-f with f >= 1 (probabilities in 2^-f units), got {self.out_fmt.scale!r}"
            )
        for name in ("causal", "padding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.query_len is None:
            object.__setattr__(self, "query_len", self.n)
        _check_int("query_len", self.query_len, 1)
        _check_int("causal_offset", self.causal_offset, -(1 << 30))
        if self.causal and self.causal_offset + self.query_len - 1 < 0:
            raise ValueError(
                f"causal_offset {self.causal_offset} masks every column of every row of a {self.query_len}-row matrix"
            )
        lanes = self.lanes if self.lanes is not None else (32 if max(self.in_fmt.bits, self.out_fmt.bits) <= 8 else 64)
        if lanes not in LANES:
            raise ValueError(f"lanes (the per-element datapath width) must be one of {LANES}, got {lanes!r}")
        object.__setattr__(self, "lanes", lanes)
        f_bits, guard, extra = DEFAULT_BITS[lanes]
        fo = self.out_frac_bits
        if self.inv_bits is None:
            object.__setattr__(self, "inv_bits", fo + extra)
        if self.exp_bits is None:  # what the lanes leave beside R: e·r <= 2^(F+R) in lanes − 1 bits
            room = lanes - 3 - self.inv_bits
            object.__setattr__(self, "exp_bits", min(f_bits, room))
            if self.exp_bits < fo + 2:  # name the cause: the caller chose the output, not F
                raise ValueError(_exp_bits_short(fo, self.inv_bits, lanes, f_bits, room))
        if self.sum_guard is None:
            object.__setattr__(self, "sum_guard", guard)
        # F >= f + 2 and R >= f + 4 keep y <= 2^f + 1 (the range analysis' proof)
        _check_int("exp_bits", self.exp_bits, fo + 2, 30)
        _check_int("inv_bits", self.inv_bits, fo + 4, 30)
        _check_int("sum_guard", self.sum_guard, 0, 30 - self.exp_bits)
        if self.mant_bits > self.sum_bits_min:
            raise ValueError(
                f"inv_bits {self.inv_bits} needs a {self.mant_bits}-bit mantissa of the row sum, which has "
                f"only {self.sum_bits_min} bits at least: raise exp_bits + sum_guard or lower inv_bits"
            )

    @property
    def out_frac_bits(self) -> int:
        """f: the output's LSB is 2^-f."""
        return -(math.frexp(self.out_fmt.scale)[1] - 1)

    @property
    def sum_frac_bits(self) -> int:
        """F + G: the sum's terms are exp in units of 2^-(F+G)."""
        return self.exp_bits + self.sum_guard

    @property
    def sum_bits_min(self) -> int:
        """Bit length of the smallest divisor, 2^(F+G) (the max column alone, or an empty row)."""
        return self.sum_frac_bits + 1

    @property
    def mant_bits(self) -> int:
        return self.inv_bits + MANTISSA_EXTRA

    @property
    def digits(self) -> int:
        """Base-256 digits of d = max − x: one table each."""
        return 1 if self.in_fmt.bits <= DIGIT_BITS else 2

    @property
    def diff_max(self) -> int:
        return self.in_fmt.hi - self.in_fmt.lo

    @property
    def masked(self) -> bool:
        return self.causal or self.padding


def _check_int(name: str, v: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo or (hi is not None and v > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be an integer {bounds}, got {v!r}")


# --------------------------------------------------------------------------- tables


def exp_table(scale: float, step: int, count: int, frac_bits: int) -> np.ndarray:
    """``round(2^F exp(−scale · step · j))`` for j in [0, count), half up, exactly.

    float64 decides the rounding wherever its value is more than 2^-20 units from a
    half (its error is below 2^-25 units); the rest are computed in 60-digit
    decimal arithmetic from the exact binary value of ``scale``.  exp of a nonzero
    rational is irrational, so no entry is a true tie and the rounding is unique.
    """
    j = np.arange(count, dtype=np.float64)
    approx = np.ldexp(np.exp(-(scale * step) * j), frac_bits)
    out = np.floor(approx + 0.5)
    unsure = np.abs(approx - np.floor(approx) - 0.5) < 2.0**-20
    if unsure.any():
        with decimal.localcontext() as ctx:
            ctx.prec = 60
            s = decimal.Decimal(scale) * step
            for k in np.flatnonzero(unsure):
                exact = (-(s * int(k))).exp() * (1 << frac_bits)
                out[k] = float(int((exact + decimal.Decimal("0.5")).to_integral_value(decimal.ROUND_FLOOR)))
    return out.astype(np.int64)


def mask_padding(x: Any, in_fmt: QFormat, lengths: Any = None, key_mask: Any = None) -> Any:
    """Integer logits with padded keys set to ``in_fmt.lo`` (IntSoftmax's padding code).

    ``lengths``: valid keys per row (shape ``x.shape[:-1]``, broadcastable): column
    c is padding when ``c >= length``.  ``key_mask``: a boolean array broadcastable
    to ``x``, True where a key is **kept**.  Real logits are raised to lo + 1 first,
    so only padding carries the code.
    """
    xs = fp.select(x > in_fmt.lo, x, x * 0 + (in_fmt.lo + 1))
    keep = None
    if lengths is not None:
        keep = column_index(x) < lengths[..., None]
    if key_mask is not None:
        keep = key_mask if keep is None else fp.land(keep, key_mask)
    return xs if keep is None else fp.select(keep, xs, xs * 0 + in_fmt.lo)


# --------------------------------------------------------------------------- the op


class IntSoftmax(IntOp):
    """Integer softmax over the last axis (see the module docstring)."""

    name = "softmax"
    multiplications = ("exp_product", "prob_product")
    definition = 1

    def __init__(self, config: SoftmaxConfig) -> None:
        if not isinstance(config, SoftmaxConfig):
            raise ValueError(f"IntSoftmax needs a SoftmaxConfig, got {type(config).__name__}")
        self.config = config
        self.in_fmt, self.out_fmt = config.in_fmt, config.out_fmt
        s, levels, base = config.in_fmt.scale, config.diff_max + 1, 1 << DIGIT_BITS
        fs = config.sum_frac_bits
        if config.digits == 1:  # the sum's table (F + G bits) and the output's (F bits)
            self.tables: tuple[np.ndarray, ...] = (
                exp_table(s, 1, levels, fs),
                exp_table(s, 1, levels, config.exp_bits),
            )
        else:  # both digits with F + G bits: their product serves the sum and the output
            self.tables = (exp_table(s, 1, base, fs), exp_table(s, base, -(-levels // base), fs))
        self._report = self._ranges()

    @classmethod
    def build(cls, n: int, in_fmt: QFormat, out_fmt: QFormat, **options: Any) -> IntSoftmax:
        """The op of ``SoftmaxConfig(n, in_fmt, out_fmt, **options)``."""
        return cls(SoftmaxConfig(n, in_fmt, out_fmt, **options))

    # ---- the integer forward

    def forward(self, x: np.ndarray, trace: Trace | None = None) -> np.ndarray:
        """Validate ``x`` (integer dtype, in ``in_fmt``, last axis N) and run the forward."""
        arr = np.asarray(x)
        if arr.ndim == 0 or arr.shape[-1] != self.config.n:
            raise ValueError(f"{self.name} takes rows of {self.config.n} logits; got input shape {arr.shape}")
        return self._forward(self.in_fmt.check(arr), trace)

    def keep(self, x: Any, lowest: Any) -> Any:
        """Where a column is kept (None: everywhere): padding is ``x == lowest``."""
        cfg, keep = self.config, None
        if cfg.padding:
            keep = x > lowest
        if cfg.causal:
            causal = column_index(x) <= row_index(x) % cfg.query_len + cfg.causal_offset
            keep = causal if keep is None else fp.land(keep, causal)
        return keep

    def _forward(self, x: Any, trace: Trace | None) -> Any:
        cfg = self.config
        keep = self.keep(x, cfg.in_fmt.lo)
        top = record(trace, "max", row_max(x if keep is None else fp.select(keep, x, x * 0 + cfg.in_fmt.lo)))
        d = top - x
        if keep is not None:  # a masked column may exceed the row's max: read entry 0, then drop it
            d = fp.select(keep, d, d * 0)
        term, e = self.exp(record(trace, "diff", d), trace)
        if keep is not None:
            term, e = fp.select(keep, term, term * 0), fp.select(keep, e, e * 0)
        total = record(trace, "exp_sum", row_sum(term))
        r, k = self.reciprocal(total, trace)
        prod = record(trace, "prob_product", e * r)
        y = record(trace, "y", fp.rshift_round(prod, k, cfg.rounding))
        return record(trace, "out", fp.saturate(y, cfg.out_fmt.bits, cfg.out_fmt.signed))

    def exp(self, d: Any, trace: Trace | None) -> tuple[Any, Any]:
        """The sum's term ``round(2^(F+G) exp(−s d))`` and the output's ``round(2^F exp(−s d))``:
        two tables, or the two digits' tables, their product and two rounding shifts."""
        cfg = self.config
        if cfg.digits == 1:
            return record(trace, "sum_term", lookup(self.tables[0], d)), record(trace, "exp", lookup(self.tables[1], d))
        low = lookup(self.tables[0], d & ((1 << DIGIT_BITS) - 1))
        high = lookup(self.tables[1], d >> DIGIT_BITS)
        both = record(trace, "exp_product", low * high)
        term = record(trace, "sum_term", fp.rshift_round(both, cfg.sum_frac_bits))
        return term, record(trace, "exp", fp.rshift_round(both, cfg.sum_frac_bits + cfg.sum_guard))

    def reciprocal(self, total: Any, trace: Trace | None) -> tuple[Any, Any]:
        """Per row: r = round(2^(M−1+R) / μ) of S's mantissa μ, and the output shift
        L − 1 + R − f − G (S = 0, a fully masked row, is divided as 2^(F+G))."""
        s1 = self.divisor(total)
        return self.reciprocal_of(s1, record(trace, "sum_bits", fp.bit_length(s1, self._sum_bits)), trace)

    def divisor(self, total: Any) -> Any:
        """S, or 2^(F+G) for a fully masked row (as if one column were kept: its e are all 0)."""
        return fp.select(total > 0, total, total * 0 + (1 << self.config.sum_frac_bits))

    def reciprocal_of(self, s1: Any, lead: Any, trace: Trace | None) -> tuple[Any, Any]:
        """:meth:`reciprocal` given the divisor and its bit length L (>= M: the config's check)."""
        cfg = self.config
        mant = record(trace, "mant", fp.rshift_round(s1, lead - cfg.mant_bits))
        r = record(trace, "recip", fp.div_round(mant * 0 + (1 << (cfg.mant_bits - 1 + cfg.inv_bits)), mant))
        k = record(trace, "out_shift", lead - 1 + cfg.inv_bits - cfg.out_frac_bits - cfg.sum_guard)
        return r, k

    @property
    def _sum_bits(self) -> int:
        return (self.config.n << self.config.sum_frac_bits).bit_length()

    # ---- static ranges

    def ranges(self) -> RangeReport:
        return self._report

    def _ranges(self) -> RangeReport:
        """Every intermediate's exact bounds; per-element ones must fit the lanes less a bit.

        y's bound: e_i 2^G <= t_i + 1/2 + 2^(G−1) and t_i <= S >= 2^(F+G) give
        e_i 2^(f+G) / S <= 2^f + 2^(f−F); μ and r are rounded to M and R bits, so
        e_i r / 2^k <= (2^f + 2^(f−F)) (1 + 2^(1−M)) (1 + 2^-R) < 2^f + 1/2 for
        F >= f + 2 and R >= f + 4 (the config's checks): y <= 2^f + 1 in any mode.
        """
        cfg = self.config
        rep = RangeReport(self.name)
        f_bits, r_bits, fo, guard = cfg.exp_bits, cfg.inv_bits, cfg.out_frac_bits, cfg.sum_guard
        rep.add("max", Interval(cfg.in_fmt.lo, cfg.in_fmt.hi))
        rep.add("diff", Interval(0, cfg.diff_max))
        if cfg.digits == 2:
            rep.add("exp_product", Interval(0, int(self.tables[0].max()) * int(self.tables[1].max())))
        rep.add("sum_term", Interval(0, 1 << cfg.sum_frac_bits))
        rep.add("exp", Interval(0, 1 << f_bits))
        rep.add("exp_sum", Interval(0, cfg.n << cfg.sum_frac_bits))
        lmax = self._sum_bits
        rep.add("sum_bits", Interval(cfg.sum_bits_min, lmax))
        rep.add("mant", Interval(1 << (cfg.mant_bits - 1), 1 << cfg.mant_bits))
        rep.add("recip", Interval(1 << (r_bits - 1), 1 << r_bits))
        rep.add("out_shift", Interval(cfg.sum_bits_min - 1 + r_bits - fo - guard, lmax - 1 + r_bits - fo - guard))
        rep.add("prob_product", Interval(0, 1 << (f_bits + r_bits)))
        rep.add("y", Interval(0, (1 << fo) + 1))
        rep.add("out", rep["y"].clamp(cfg.out_fmt.lo, cfg.out_fmt.hi))
        rep.check()
        for name in ("diff", "exp_product", "sum_term", "exp", "prob_product", "y"):
            if name in rep.items and rep[name].bits > cfg.lanes - 1:
                iv = rep[name]
                raise OverflowRiskError(
                    f"{self.name}: per-element intermediate {name!r} spans [{iv.lo}, {iv.hi}], which needs "
                    f"{iv.bits} bits, but the {cfg.lanes}-bit lanes hold {cfg.lanes - 1} (less one bit of rounding "
                    "headroom); lower exp_bits / sum_guard / inv_bits or use lanes=64"
                )
        return rep

    # ---- float reference, cost

    def float_reference(self, x: np.ndarray) -> np.ndarray:
        """float64 softmax of the real-valued logits over the kept columns (0 elsewhere,
        all 0 in a fully masked row); padding is ``x == lo · scale``."""
        a = np.asarray(x, dtype=np.float64)
        if a.ndim == 0 or a.shape[-1] != self.config.n:
            raise ValueError(f"{self.name} takes rows of {self.config.n} logits; got input shape {a.shape}")
        keep = self.keep(a, self.in_fmt.lo * self.in_fmt.scale)
        keep = np.ones(a.shape, dtype=bool) if keep is None else np.broadcast_to(keep, a.shape)
        top = np.max(np.where(keep, a, -np.inf), axis=-1, keepdims=True)
        top = np.where(np.isfinite(top), top, 0.0)
        ex = np.where(keep, np.exp(np.where(keep, a - top, 0.0)), 0.0)
        total = ex.sum(axis=-1, keepdims=True)
        return ex / np.where(total > 0, total, 1.0)

    def cost(self) -> dict[str, dict[str, int]]:
        cfg = self.config
        mask = int(cfg.causal) + int(cfg.padding)
        return {
            # the max and the sum of the exponentials (two passes), leading-one
            # position, the one division, the shift amount
            "per_row": {"max": cfg.n, "add": cfg.n + 1, "lzc": 1, "div": 1, "shift": 1},
            # d = m − x, table lookups (and the digits' product), e·r, its rounding
            # shift, saturation; each mask a compare and a select or two
            "per_element": {
                "add": 1,
                "lookup": 2,  # the sum's and the output's entries (or the two digits')
                "mul": cfg.digits,
                "shift": 2 * cfg.digits - 1,
                "saturate": 1,
                "compare": mask,
                "select": 3 * bool(mask),
            },
        }


def measure_error(op: IntSoftmax, x: np.ndarray) -> ErrorStats:
    """Error of the integer op against its float reference on integer logits ``x``, in LSB."""
    return error_in_lsb(op.forward(x), op.out_fmt, op.float_reference(op.in_fmt.dequantize(x)))
