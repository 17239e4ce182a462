"""Combinational IEEE-754 binary floating-point arithmetic in Amaranth: add, multiply,
convert between widths.  The FP16 LayerNorm reference unit (:mod:`compilers.rtl.fp16`)
is built from these.

What they implement: round to nearest, ties to even, on normal numbers, exactly as
IEEE 754 does (tests compare them bit for bit with numpy).  What they simplify, as
small FPGA floating-point cores commonly do:

* subnormals are flushed to zero, on input and on output (a result below the
  smallest normal is a zero of the result's sign);
* there are no infinities or NaNs: an all-ones exponent is read as an ordinary
  exponent, and a result beyond the largest finite value saturates to it;
* an exact cancellation gives +0; the sign of a zero sum is not otherwise tracked.
"""

from __future__ import annotations

from dataclasses import dataclass

from amaranth import Cat, Const, Elaboratable, Module, Mux, Signal, signed

GUARD_BITS = 3  # guard, round and sticky: enough for round-to-nearest-even of a sum


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: sign, ``exp_bits`` of biased exponent, ``mant_bits``
    of stored mantissa (the leading one is implicit)."""

    exp_bits: int
    mant_bits: int

    @property
    def width(self) -> int:
        return 1 + self.exp_bits + self.mant_bits

    @property
    def bias(self) -> int:
        return (1 << (self.exp_bits - 1)) - 1

    @property
    def exp_max(self) -> int:
        """The largest biased exponent of a finite number (the all-ones one is reserved)."""
        return (1 << self.exp_bits) - 2


FP16 = FloatFormat(5, 10)
FP32 = FloatFormat(8, 23)


def _fields(fmt: FloatFormat, v: Signal) -> tuple:
    """Sign, biased exponent, significand with its leading one (zero for a zero or a
    flushed subnormal)."""
    exp = v[fmt.mant_bits : fmt.mant_bits + fmt.exp_bits]
    sig = Mux(exp == 0, 0, Cat(v[: fmt.mant_bits], Const(1, 1)))
    return v[fmt.width - 1], exp, sig


def _round_pack(m: Module, fmt: FloatFormat, sign, exp, mant, guard, sticky, zero, out: Signal) -> None:
    """Round ``1.mant × 2^(exp − bias)`` (with the bits below it summarized by ``guard``
    and ``sticky``) to nearest even and pack it into ``out``: a zero when ``zero`` or
    below the normal range, the largest finite value beyond it."""
    up = guard & (sticky | mant[0])
    rounded = Signal(fmt.mant_bits + 1)
    final_exp = Signal(signed(fmt.exp_bits + 3))
    m.d.comb += [rounded.eq(mant + up), final_exp.eq(exp + rounded[fmt.mant_bits])]
    max_finite = Cat(Const(-1, fmt.mant_bits), Const(fmt.exp_max, fmt.exp_bits))
    with m.If(zero | (final_exp <= 0)):
        m.d.comb += out.eq(Cat(Const(0, fmt.width - 1), sign))
    with m.Elif(final_exp > fmt.exp_max):
        m.d.comb += out.eq(Cat(max_finite, sign))
    with m.Else():
        m.d.comb += out.eq(Cat(rounded[: fmt.mant_bits], final_exp[: fmt.exp_bits], sign))


class FloatMul(Elaboratable):
    """``o = a × b`` in ``fmt``, combinational."""

    def __init__(self, fmt: FloatFormat) -> None:
        self.fmt = fmt
        self.a, self.b, self.o = Signal(fmt.width), Signal(fmt.width), Signal(fmt.width)

    def elaborate(self, platform: object) -> Module:
        m, fmt, mb = Module(), self.fmt, self.fmt.mant_bits
        sa, ea, siga = _fields(fmt, self.a)
        sb, eb, sigb = _fields(fmt, self.b)
        product = Signal(2 * mb + 2)
        m.d.comb += product.eq(siga * sigb)  # in [1, 4) with 2·mb fraction bits
        top = product[2 * mb + 1]  # a product in [2, 4): one more exponent, one more dropped bit
        mant = Mux(top, product[mb + 1 : 2 * mb + 1], product[mb : 2 * mb])
        guard = Mux(top, product[mb], product[mb - 1])
        sticky = Mux(top, product[: mb] != 0, product[: mb - 1] != 0)
        exp = Signal(signed(fmt.exp_bits + 3))
        m.d.comb += exp.eq(ea + eb - fmt.bias + top)
        _round_pack(m, fmt, sa ^ sb, exp, mant, guard, sticky, (ea == 0) | (eb == 0), self.o)
        return m


class FloatAdd(Elaboratable):
    """``o = a + b`` in ``fmt`` (``a − b`` when ``sub_b`` is set), combinational."""

    def __init__(self, fmt: FloatFormat) -> None:
        self.fmt = fmt
        self.a, self.b, self.o = Signal(fmt.width), Signal(fmt.width), Signal(fmt.width)
        self.sub_b = Signal()

    def elaborate(self, platform: object) -> Module:
        m, fmt, mb, g = Module(), self.fmt, self.fmt.mant_bits, GUARD_BITS
        b = Signal(fmt.width)
        m.d.comb += b.eq(Cat(self.b[: fmt.width - 1], self.b[fmt.width - 1] ^ self.sub_b))
        # The operand of larger magnitude first: the sum has its sign, and the aligned
        # difference of significands is never negative.
        swap = b[: fmt.width - 1] > self.a[: fmt.width - 1]
        big, small = Signal(fmt.width), Signal(fmt.width)
        m.d.comb += [big.eq(Mux(swap, b, self.a)), small.eq(Mux(swap, self.a, b))]
        sign, e_big, sig_big = _fields(fmt, big)
        s_small, e_small, sig_small = _fields(fmt, small)

        # Align the smaller significand: shifted right by the exponent difference into
        # `span` fraction bits (a shift past them leaves only sticky bits), then kept to
        # GUARD_BITS fraction bits with everything below ORed into the last one.
        span = mb + 1 + g
        diff = Signal(fmt.exp_bits)
        m.d.comb += diff.eq(Mux(e_big - e_small > span, span, e_big - e_small))
        shifted = Signal(mb + 1 + span)
        m.d.comb += shifted.eq((sig_small << span) >> diff)
        aligned = Signal(mb + 1 + g)
        m.d.comb += aligned.eq(Cat(shifted[span - g] | (shifted[: span - g] != 0), shifted[span - g + 1 :]))

        width = mb + g + 2  # one carry bit above the significand
        total = Signal(width)
        wide_big = sig_big << g
        m.d.comb += total.eq(Mux(sign == s_small, wide_big + aligned, wide_big - aligned))
        lead = Const(width, range(width + 1))  # leading zeros of `total`: the highest set bit wins
        for i in range(width):
            lead = Mux(total[i], width - 1 - i, lead)
        zeros = Signal(range(width + 1))
        normalized = Signal(width)
        m.d.comb += [zeros.eq(lead), normalized.eq(total << zeros)]
        exp = Signal(signed(fmt.exp_bits + 3))
        m.d.comb += exp.eq(e_big + 1 - zeros)
        _round_pack(
            m, fmt, sign & (total != 0), exp, normalized[g + 1 : g + 1 + mb], normalized[g],
            normalized[:g] != 0, total == 0, self.o,
        )  # fmt: skip
        return m


class FloatConvert(Elaboratable):
    """``o = a`` converted from ``src`` to ``dst``, rounded to nearest even when narrowing."""

    def __init__(self, src: FloatFormat, dst: FloatFormat) -> None:
        self.src, self.dst = src, dst
        self.a, self.o = Signal(src.width), Signal(dst.width)

    def elaborate(self, platform: object) -> Module:
        m, src, dst = Module(), self.src, self.dst
        sign, exp_in = self.a[src.width - 1], self.a[src.mant_bits : src.mant_bits + src.exp_bits]
        frac = self.a[: src.mant_bits]
        exp = Signal(signed(max(src.exp_bits, dst.exp_bits) + 3))
        m.d.comb += exp.eq(exp_in - src.bias + dst.bias)
        drop = src.mant_bits - dst.mant_bits
        if drop > 0:
            mant, guard, sticky = frac[drop:], frac[drop - 1], frac[: drop - 1] != 0
        else:
            mant, guard, sticky = Cat(Const(0, -drop), frac), Const(0, 1), Const(0, 1)
        _round_pack(m, dst, sign, exp, mant, guard, sticky, exp_in == 0, self.o)
        return m
