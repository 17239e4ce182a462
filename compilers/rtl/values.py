"""HDL values the op's own integer code runs on: how the RTL units are the definition.

The golden ops are written with operators, :mod:`qnorm.fixedpoint` and the
:mod:`qnorm.ops._xp` helpers, so numpy, torch and TIR run one body.  :class:`Hdl`
is a fourth operand kind those bodies accept.  An ``Hdl`` is *lazy*: a function
from a stage's :class:`Ctx` (which element, channel and row bank the stage is
at) to an Amaranth value, so one expression graph is elaborated in every
pipeline stage that needs it — the norm's ``x`` is the input port in the first
pass and a row-buffer read in the output pass.

Semantics are those of Python integers: every leaf and constant is signed and
Amaranth widens every result, so nothing wraps; ``>>`` is arithmetic, ``//`` and
``%`` floor, comparisons 1-bit.  Shift amounts are at most 62 (the contract of
every fixedpoint shift, proven by the range analysis), so their low 6 bits are
the amount.  :func:`qnorm.fixedpoint.select`, ``land``, ``lor``, ``clamp`` and the
``1`` of a rounding shift come from :data:`HdlOps` (Mux and Amaranth's logic),
and :func:`qnorm.ops._xp.const_like` from :meth:`Hdl.const_like`: a ROM of the
per-channel constants at their exact width, read at the element's channel.

Widths are the proof's: :class:`ProvenTrace` receives every intermediate the op
records and gives it the interval of the op's range report, so the named wire
(``stat``, ``rsqrt``, ``mult``, ``xa``, ``acc`` …) is exactly as wide as
``op.ranges()`` says; truncating to it is exact because the report bounds it.

Pipelining.  In a pipelined :class:`Ctx` every recorded or reused value and
every product (a register after each multiply: DSP blocks keep their output
register, and the clock does not wait for a multiply and an add) is a register,
and each value carries its level (registers since the stage's
inputs); an operation first delays its operands to a common level, so every
path is balanced and a new input may enter every clock.  A division becomes one
compare-subtract register level per quotient bit (:func:`divide`).  The digit
loops of the definition (``bit_length_search``, ``isqrt_digits``) reuse each
step's value, so they become one level per step by the same rule.  A shared
leaf (the element itself) is already a port or register and is not registered
again; a per-channel table is read where it is used, at the channel index
delayed that far.

Block RAM.  A table of at least :data:`BRAM_MIN_DEPTH` channels read in a
pipeline that collects ROMs (``Ctx.roms``, the norms' output chain) is a
synchronous ROM (:class:`amaranth.lib.memory.Memory`): its address is the
channel :data:`ROM_LATENCY` levels early, the memory's own read register holds
the data, and two fabric registers more take it, so the value the chain reads is
a plain register (a block RAM's clock-to-out alone fills most of a clock): the
first may become the block's own output register (ECP5's DP16KD ``OUTREG``, see
:mod:`compilers.rtl.ecp5`), the second sits by the logic that reads it, so the
route from the block RAM to that logic is a path of its own.  Each
table is read once, at the first level that uses it (later readers take it through
delay registers); the tables first read at one level share one memory, their
fields side by side, and the read port advances with the pipeline's ``enable``
like every register of it.

Timing.  In a pipeline or a schedule each operation has an estimated logic
depth (``LOGIC``, ``CARRY``, ``PRODUCT``; a barrel shifter a LOGIC per amount
bit), and an operand whose path would exceed :data:`DEPTH_BUDGET` is registered
first, one register shared by its readers; a product whose wider operand exceeds
a DSP port (:data:`DSP_BITS`, the other fitting) becomes registered limb products
added a level later, a product moved into logic (:meth:`Hdl.in_luts`) a tree of
shifted adds with a register after each level (:func:`lut_product`), and a shift
by more than SHIFT_STAGE_BITS amount bits two registered stages
(:func:`barrel_shift`).  An order compare is the sign of a difference
(:func:`less`), a division or root step one subtraction whose sign decides
(:func:`compare_subtract`), and a schedule's clocks are the bits of a shift
register (:meth:`Ctx.at`): each path starts at a register, not at a decoder.
Widths: besides the recorded values, every value whose operands have bounds
(constants, recorded values, tables, and ``+ - *``, shifts, selects, divisions
and roots of bounded values) gets a wire of its bound's width, where Amaranth's
widening would be wider.

Sequential.  A sequential :class:`Ctx` evaluates one row at a time on a
schedule (a norm's per-row engine, where a new row arrives only every N
clocks): levels are clock counts of the schedule, each recorded or reused value
(and product; not a 1-bit compare, which feeds its select in the same clock,
nor a read of the row's bank, which holds anyway) is one register loaded at
the clock ``step == level`` and held until the next row, so operands need no
delay registers; a division and the isqrt
(:func:`qnorm.fixedpoint.isqrt` hands HDL values to :meth:`_HdlOps.isqrt`) run
one compare-subtract per clock on a single set of registers
(:func:`divide_serial`, :func:`isqrt_serial`), stepping through the same digits
as the definition.  A division by a power-of-two constant is a shift in every
context, and one whose operands are bounded (a recorded value, a constant, sums
and products of them) takes only as many steps as its quotient has bits.

Rates.  A value is per element or per row.  ``x.sum(...)`` (``_xp.row_sum``)
turns a per-element value into a per-row one: an accumulator in the pass that
evaluates the term, read by later stages from the row's bank.  A per-element
value that uses a per-row value of pass ``p`` belongs to pass ``p + 1`` (L1's
``N·x − Σx`` needs Σx, so its ``Σ|·|`` is a second pass over the row buffer).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from amaranth.hdl import Array, Cat, Const, Module, Mux, Signal, Value, signed, unsigned
from amaranth.lib.memory import Memory

from qnorm.analysis import Interval
from qnorm.fixedpoint import bits_for, isqrt_digits

SHIFT_BITS = 6  # fixedpoint shift amounts lie in [0, 62]
# Estimated logic levels of one operation (a carry chain counts as three), and
# the most a path between registers may have: a pipeline or schedule registers
# an operand where its path would grow beyond it (ECP5 at 150 MHz: one carry
# chain and a few LUTs per clock).
LOGIC, CARRY, PRODUCT = 1, 3, 6
SHIFT_STAGE_BITS = 5  # the amount bits one barrel-shifter stage takes: a mux level each
DSP_BITS, DSP_LIMB = 18, 17  # a DSP block's signed multiplier port, and the unsigned limb of a wider operand
DEPTH_BUDGET = 5
# A table this deep or deeper is a block-RAM ROM where the pipeline collects them.
# As a LUT mux a table costs about depth/16 LUT4 per bit plus its tree (a 768-deep
# table ~60 LUT4 per bit: the 768-wide norms' constants alone crowd an LFE5U-25F out
# of routing), while one ECP5 DP16KD holds 18 bits of up to 1024 entries (9 of 2048).
# At 64 entries a bit is 4 LUT4 (or one RAM64M bit on xc7): a whole block RAM of the
# few a small part has would buy nothing there.  Measured on the int8 IntLayerNorm of
# rows of 64 with its tables as ROMs: xc7 1890 LUT / 1804 FF (1898 / 1796 as muxes),
# and nextpnr-ecp5 did not route it within 15 minutes (as muxes: 118.5 MHz).
BRAM_MIN_DEPTH = 256
ROM_LATENCY = 3  # a block-RAM ROM's address to its value in the second fabric register
# The attribute of a memory whose unit discards every read that can meet a write to
# the same address in the same clock (the norm unit's row buffer): synthesis may
# return anything for such a read (compilers.rtl.synth.to_rtlil), where it would
# otherwise add bypass logic between the block RAM and its first register.
DISCARDED_COLLISIONS = "qnorm_discarded_collisions"


def signed_value(v: Value) -> Value:
    """``v`` as a signed value of the same integer (a 1-bit compare becomes 0 / 1)."""
    return v if v.shape().signed else Cat(v, Const(0, 1)).as_signed()


def less(a: Value, b: Value) -> Value:
    """``a < b`` as the sign bit of ``a − b`` taken one bit wider than both (exact):
    a sum output of the carry chain.  yosys computes a compare from the chain's
    carry-out, which on ECP5 leaves the chain through a CCU2C of its own (about
    1.7 ns of a 6.7 ns clock at 150 MHz)."""
    return (signed_value(a) - signed_value(b))[-1]


def compare_subtract(a: Value, b: Value) -> tuple[Value, Value]:
    """One restoring step's ``(a >= b, a − b)`` from a single subtraction: the
    difference is kept where the flag is high (its sign bit is the flag's inverse)."""
    diff = signed_value(a) - signed_value(b)
    return ~diff[-1], diff


def const(k: int) -> Value:
    """A Python int as a signed constant of its own width."""
    return Const(int(k), signed(bits_for(int(k), int(k))))


def sized(v: Value, iv: Interval, name: str, m: Module) -> Value:
    """A wire named ``name`` of exactly the width ``iv`` needs, driven by ``v``
    (exact: the caller proved v lies in iv)."""
    wire = Signal(signed(bits_for(iv.lo, iv.hi)), name=name)
    m.d.comb += wire.eq(v)
    return wire


@dataclass(eq=False)
class Ctx:
    """Where a stage evaluates expressions: its module, the element ``x`` it is at,
    that element's ``channel`` (index in the row or channel vector), its row
    ``bank``, and the per-row values it reads (``rows[slot]``: one register per bank;
    with ``bank`` None, the one register of the stage's own row)."""

    m: Module
    x: Value
    channel: Value
    bank: Value | None = None
    rows: dict[int, list[Signal]] = field(default_factory=dict)
    extra: dict[str, Value] = field(default_factory=dict)
    # pipelined: every shared or recorded value is a register (advancing with
    # ``enable``, None: every clock), operands are delayed to a common level, and
    # a division is a chain of one compare-subtract stage per quotient bit
    pipelined: bool = False
    enable: Value | None = None
    # sequential (module docstring): the at() bits mark the schedule's clocks;
    # ``level`` is that of the operands of the value being built
    sequential: bool = False
    level: int = 0
    schedule: dict[int, Signal] = field(default_factory=dict)  # the at() bits, by clock
    memo: dict[int, tuple[Value, int]] = field(default_factory=dict)
    depths: dict[int, int] = field(default_factory=dict)  # logic levels since a register, per Hdl
    delays: dict[tuple[int, int], Any] = field(default_factory=dict)
    keep: list[Value] = field(default_factory=list)  # keys are ids: their values must stay alive
    # the deep tables' block-RAM reads (module docstring): (table, level, wire); None: every
    # table is a LUT mux.  The unit calls :meth:`build_roms` once the chain is staged.
    roms: list[tuple[Table, int, Signal]] | None = None

    def register(self, v: Value, name: str, reset_less: bool = True) -> Value:
        """A register of ``v``: call it outside any ``m.If`` (it would advance only there).
        Data needs no reset, its readers wait for a valid flag (and a reset-less
        register may become a hard block's own: compilers.rtl.ecp5); a valid flag
        (``reset_less=False``) does."""
        reg = Signal(v.shape(), name=name, reset_less=reset_less)
        if self.enable is None:
            self.m.d.sync += reg.eq(v)
        else:
            with self.m.If(self.enable):
                self.m.d.sync += reg.eq(v)
        return reg

    def depth_of(self, h: Hdl, level: int, to: int) -> int:
        """The logic levels behind ``h``'s value (valid at ``level``) read at level ``to``:
        none where a pipeline delays it through registers."""
        return 0 if self.pipelined and level < to else self.depths.get(id(h), 0)

    def cut(self, h: Hdl, v: Value, level: int) -> tuple[Value, int]:
        """``h``'s value through a register (shared by its readers): its path ends here."""
        if isinstance(v, Const):
            return v, level
        reg = self.hold(v, "cut", level) if self.sequential else self.register(v, "cut")
        self.memo[id(h)] = (reg, level + 1)
        self.depths[id(h)] = 0
        return reg, level + 1

    def at(self, level: int) -> Signal:
        """High on the schedule's clock ``level`` (sequential): a bit of the schedule's
        shift register (:meth:`drive_schedule`), so the paths it enables begin at a
        register, not at a compare of the step counter."""
        if level not in self.schedule:
            self.schedule[level] = Signal(name=f"at{level}")
        return self.schedule[level]

    def during(self, first: int, last: int) -> Value:
        """High on the schedule's clocks ``first`` … ``last`` (sequential): ``at(first)``,
        or a register set on that clock and cleared on clock ``last``."""
        if last <= first:
            return self.at(first)
        key = ("during", first, last)
        if key not in self.delays:
            window = Signal(name=f"during{first}_{last}")
            with self.m.If(self.at(first)):
                self.m.d.sync += window.eq(1)
            with self.m.Elif(self.at(last)):
                self.m.d.sync += window.eq(0)
            self.delays[key] = self.at(first) | window
        return self.delays[key]

    def drive_schedule(self, issue: Value) -> None:
        """Drive the :meth:`at` bits of a schedule whose clock 0 follows the clock
        ``issue`` is high on: bit k is ``issue`` k + 1 clocks late (rows issued
        back to back overlap, each in its own bits)."""
        top = max(self.schedule, default=-1)
        previous = issue
        for level in range(top + 1):
            bit = self.at(level)
            self.m.d.sync += bit.eq(previous)
            previous = bit

    def hold(self, v: Value, name: str, level: int) -> Value:
        """A register loaded with ``v`` at the schedule's clock ``level``, then held
        (data: reset-less, see :meth:`register`)."""
        reg = Signal(v.shape(), name=name, reset_less=True)
        with self.m.If(self.at(level)):
            self.m.d.sync += reg.eq(v)
        return reg

    def rom_read(self, table: Table, level: int) -> Signal:
        """``table``'s value at the channel, valid at ``level`` (>= ROM_LATENCY) from a
        block-RAM ROM: a wire that :meth:`build_roms` drives."""
        assert self.roms is not None, "a context without block-RAM ROMs reads tables as muxes"
        data = Signal(table.shape_of(), name="rom")
        self.roms.append((table, level, data))
        return data

    def build_roms(self) -> None:
        """The ROMs of the reads :meth:`rom_read` collected: each table is read once, at
        the first level that uses it (later readers take it through delay registers),
        and the tables first read at one level share one synchronous ROM, side by side.
        Its address is the channel ROM_LATENCY levels early; its read register and
        two fabric registers more advance with ``enable``."""
        assert self.roms is not None, "a context without block-RAM ROMs has none to build"
        first: dict[int, tuple[Table, int]] = {}
        for table, level, _ in self.roms:
            if id(table) not in first or level < first[id(table)][1]:
                first[id(table)] = (table, level)
        by_level: dict[int, list[Table]] = {}
        for table, level in first.values():
            by_level.setdefault(level, []).append(table)
        fields: dict[int, Signal] = {}
        for level, tables in sorted(by_level.items()):
            widths = [t.shape_of().width for t in tables]
            offsets = [sum(widths[:i]) for i in range(len(widths))]
            words = [
                sum((int(t.values[c]) & ((1 << w) - 1)) << off for t, w, off in zip(tables, widths, offsets, strict=True))
                for c in range(len(tables[0].values))
            ]
            rom = Memory(shape=unsigned(sum(widths)), depth=len(words), init=words)
            self.m.submodules += rom
            port = rom.read_port(domain="sync")
            self.m.d.comb += port.addr.eq(self.delay(self.channel, 0, level - ROM_LATENCY))
            if self.enable is not None:
                self.m.d.comb += port.en.eq(self.enable)
            out = self.register(self.register(port.data, "rom_out"), "rom_near")
            for t, w, off in zip(tables, widths, offsets, strict=True):
                fields[id(t)] = Signal(t.shape_of(), name="rom_field")
                self.m.d.comb += fields[id(t)].eq(out[off:off + w])
        for table, level, data in self.roms:
            self.m.d.comb += data.eq(self.delay(fields[id(table)], first[id(table)][1], level))
        self.roms.clear()

    def delay(self, v: Value, level: int, to: int) -> Value:
        """``v`` (valid at ``level``) as of level ``to`` >= level: a register chain, shared
        (sequential: ``v`` itself, which holds until the next row)."""
        if isinstance(v, Const) or self.sequential:
            return v
        base = id(v)
        self.keep.append(v)
        for k in range(level + 1, to + 1):
            key = (base, k)
            if key not in self.delays:
                self.delays[key] = self.register(v, "d", reset_less=False)  # also delays valid flags
            v = self.delays[key]
        return v


def bank_read(ctx: Ctx, slot: int) -> Value:
    """A per-row value of the stage's row: its bank's register, or (``ctx.bank`` None)
    the one register a stage that copied its row's values holds."""
    regs = ctx.rows[slot]
    return regs[0] if ctx.bank is None else Array(regs)[ctx.bank]


@dataclass(eq=False)
class RowSum:
    """An accumulator: ``term`` reduced over the row in pass ``term.pass_``: summed
    (``kind`` "sum"), or its maximum ("max": a softmax's row max)."""

    slot: int
    term: Hdl
    result: Hdl | None = None
    kind: str = "sum"

    def width(self, term_bits: int) -> int:
        """The accumulator's width: the proven one where the op recorded the result,
        else enough for N terms of ``term_bits`` (a maximum: the term's own)."""
        iv = None if self.result is None else self.result.iv
        if iv is not None:
            return bits_for(iv.lo, iv.hi)
        if self.kind == "max":
            return term_bits
        n = 1 if self.result is None else self.result.graph.n
        return term_bits + max(n - 1, 1).bit_length()

    def combine(self, acc: Value, term: Value) -> Value:
        """The accumulator's next value after ``term``."""
        return Mux(less(acc, term), term, acc) if self.kind == "max" else acc + term

    def identity(self, width: int) -> int:
        """The accumulator's value before a row's first term: 0, or for a maximum the
        least value of its width (every term is at least that)."""
        return -(1 << (width - 1)) if self.kind == "max" else 0

    @property
    def cost(self) -> int:
        """The accumulator's logic levels: an add; a maximum's compare and select."""
        return CARRY + LOGIC if self.kind == "max" else CARRY


class Graph:
    """What one op's code built: the row sums (slots) and the per-row values latched
    into banks, plus the leaf of the element stream.  ``n``: the row length (1 for
    elementwise units); ``shape``: the trailing shape an element stands for."""

    def __init__(self, n: int, shape: tuple[int, ...] = (), row_period: int | None = None) -> None:
        self.n = n
        self.shape = shape
        self.sums: list[RowSum] = []
        self.latched: dict[int, Hdl] = {}
        self._slots = 0
        # a unit that counts its rows modulo row_period (a causal softmax's query
        # index): the bank slot that keeps each row's count, once the op reads it
        self.row_period = row_period
        self.row_slot: int | None = None
        self._row: Hdl | None = None

    def new_slot(self) -> int:
        self._slots += 1
        return self._slots - 1

    def leaf(self, name: str = "x") -> Hdl:
        """The stage's current element (``ctx.x``), or a named side value (``ctx.extra``)."""
        if name == "x":
            return Hdl(self, lambda ctx: ctx.x, (), 0, False)
        return Hdl(self, lambda ctx: ctx.extra[name], (), 0, False)

    def latch(self, v: Hdl) -> Hdl:
        """A per-row value computed once (the row stage) and read back from the row's bank."""
        slot = self.new_slot()
        self.latched[slot] = v
        read = Hdl(self, lambda ctx: bank_read(ctx, slot), (), v.pass_, True, v.iv)
        read.banked = True
        return read

    def passes(self) -> int:
        """How many passes over the row the statistic takes (at least one: the input)."""
        return 1 + max((s.term.pass_ for s in self.sums), default=0)

    def row_index(self) -> Hdl:
        """The row's index in the stream modulo ``row_period``: in the input pass the
        unit's row counter (``ctx.extra["row"]``), in later ones the count its bank
        kept.  Only ``row_index % q`` with q dividing the period is the op's row
        index mod q; the bound [0, period − 1] makes ``% period`` the value itself."""
        if self.row_period is None:
            raise NotImplementedError("this unit does not count its rows: the op reads a row index")
        if self._row is None:
            slot = self.row_slot = self.new_slot()

            def read(ctx: Ctx) -> Value:
                if "row" in ctx.extra:
                    return ctx.extra["row"]
                if ctx.bank is None:
                    raise NotImplementedError("the row engine reads no row index (it holds only the row's sums)")
                return bank_read(ctx, slot)

            self._row = Hdl(self, read, (), 0, True, cost=LOGIC)  # a register, or the banks' mux
            self._row.known = Interval(0, self.row_period - 1)
        return self._row

    def column_index(self) -> Hdl:
        """The element's column in its row (the stage's channel)."""
        column = Hdl(self, lambda ctx: ctx.channel, (), 0, False)
        column.known = Interval(0, self.n - 1)
        return column


class Hdl:
    """A lazy integer expression (see the module docstring): ``fn`` of the values
    of ``deps`` (a leaf: of the context alone)."""

    def __init__(self, graph: Graph, fn: Callable[..., Value], deps: tuple[Hdl, ...], pass_: int, per_row: bool,
                 iv: Interval | None = None, name: str | None = None, cost: int = 0) -> None:
        self.graph, self.fn, self.deps, self.pass_, self.per_row = graph, fn, deps, pass_, per_row
        self.iv, self.name = iv, name
        self.cost = cost  # estimated logic levels of the operation itself
        self.constant: int | None = None  # the value of a lifted integer constant
        self.known: Interval | None = None  # a bound derived from operands' bounds (see bound)
        self.banked = False  # a read of the row's bank registers (held while its row is in a stage)
        self.product = False  # a multiplier (not a power-of-two constant's shift): registered
        self.quotient_of: tuple | None = None  # a division's quotient: its divider's key
        self.uses = 0  # how many expressions read this one: a shared value gets a wire of its own
        for d in deps:
            d.uses += 1

    # ---- evaluation

    def value(self, ctx: Ctx) -> Value:
        """The Amaranth value in ``ctx`` (built once per context)."""
        return self.staged(ctx)[0]

    def staged(self, ctx: Ctx) -> tuple[Value, int]:
        """The value and its pipeline level in ``ctx`` (always 0 unless pipelined)."""
        key = id(self)
        if key not in ctx.memo:
            # a pipeline reads a per-channel table where it is used, at the channel's
            # delayed index, rather than delaying the table's (wider) value
            late = [ctx.pipelined and isinstance(d, Table) for d in self.deps]
            parts = [(Const(0), 0) if t else d.staged(ctx) for d, t in zip(self.deps, late, strict=True)]
            level = max((lv for _, lv in parts), default=0)
            timed = ctx.pipelined or ctx.sequential
            depth = max((d.read_depth(ctx, level) if t else ctx.depth_of(d, lv, level)  # type: ignore[attr-defined]
                         for d, t, (_, lv) in zip(self.deps, late, parts, strict=True)), default=0)
            rom_register = False  # the tables read a level earlier, through a register
            if timed and depth and depth + self.cost > DEPTH_BUDGET:  # cut the deep operands' paths
                cuts: dict[int, tuple[Value, int]] = {}  # one register for an operand read twice (S·S)
                for d, t, (v, lv) in zip(self.deps, late, parts, strict=True):
                    if id(d) not in cuts and ctx.depth_of(d, lv, level) and not t:
                        cuts[id(d)] = ctx.cut(d, v, lv)
                parts = [cuts.get(id(d), part) for d, part in zip(self.deps, parts, strict=True)]
                rom_register = any(late)
                level = max((lv for _, lv in parts), default=0) + (rom_register and level == 0)
                depth = max((ctx.depth_of(d, lv, level) for d, t, (_, lv) in zip(self.deps, late, parts, strict=True) if not t),
                            default=0)
            ctx.level = level
            got = self.fn(ctx, *(d.read_at(ctx, level, rom_register) if t  # type: ignore[attr-defined]
                                 else ctx.delay(v, lv, level) for d, t, (v, lv) in zip(self.deps, late, parts, strict=True)))
            v, level = (got[0], level + got[1]) if isinstance(got, tuple) else (got, level)
            if self.iv is not None:
                v = sized(v, self.iv, self.name or "v", ctx.m)
            elif self.known is not None and not isinstance(v, Const):
                bits = bits_for(self.known.lo, self.known.hi)
                if bits < len(v):  # narrower than Amaranth's widening
                    v = sized(v, self.known, self.name or "t", ctx.m)
            bank_mux = self.banked and ctx.bank is not None
            ctx.depths[id(self)] = depth + self.cost + (LOGIC if bank_mux else 0)
            # a shared leaf (the element itself) is a port or a register already
            shared = self.uses > 1 and ctx.depths[id(self)] > 0
            keep = not isinstance(v, Const) and (self.iv is not None or shared or self.product)
            # a schedule holds a bank read anyway, and a shared compare feeds a select
            # in the same clock: neither needs a register of its own
            if ctx.sequential and keep and not self.banked and (len(v) > 1 or self.iv is not None):
                v, level = ctx.hold(v, self.name or "s", level), level + 1
                ctx.depths[id(self)] = 0
            elif ctx.pipelined and keep:
                v, level = ctx.register(v, self.name or "p"), level + 1
                ctx.depths[id(self)] = 0
            elif self.uses > 1 and self.iv is None:
                # a wire, so the expression is not copied into every reader (the
                # digit loops reuse each step's value twice: a tree would double per step)
                wire = Signal(v.shape(), name=self.name or "t")
                ctx.m.d.comb += wire.eq(v)
                v = wire
            ctx.memo[key] = (v, level)
        return ctx.memo[key]

    def narrow(self, iv: Interval, name: str) -> None:
        """The op's proof bounds this value by ``iv``: its wire takes exactly that width."""
        self.iv = iv if self.iv is None else Interval(max(iv.lo, self.iv.lo), min(iv.hi, self.iv.hi))
        self.name = name

    @property
    def bound(self) -> Interval | None:
        """A proven interval of this value where one is known: the op's (recorded
        values), a constant's own, or one derived through ``+``, ``-``, ``*``."""
        if self.iv is not None:
            return self.iv
        if self.constant is not None:
            return Interval(self.constant, self.constant)
        return self.known

    @property
    def shape(self) -> tuple[int, ...]:
        """The trailing shape one element stands for (the ops' shape checks read it)."""
        return self.graph.shape

    # ---- lifting

    def _lift(self, o: Any) -> Hdl:
        if isinstance(o, Hdl):
            return o
        if isinstance(o, (bool, np.bool_)):
            return Hdl(self.graph, lambda ctx, k=int(o): Const(k, 1), (), 0, True)
        if isinstance(o, (int, np.integer)):
            lifted = Hdl(self.graph, lambda ctx, k=int(o): const(k), (), 0, True)
            lifted.constant = int(o)
            return lifted
        if isinstance(o, np.ndarray) and o.ndim == 0:
            return self._lift(int(o))
        raise TypeError(f"an HDL value combines with integers and HDL values, not {type(o).__name__}")

    def _combine(self, o: Any, f: Callable[[Value, Value], Value], arith: bool = True, cost: int = CARRY) -> Hdl:
        a, b = self, self._lift(o)

        def build(ctx: Ctx, va: Value, vb: Value) -> Value:
            return f(signed_value(va), signed_value(vb)) if arith else f(va, vb)

        return Hdl(self.graph, build, (a, b), max(a.pass_, b.pass_), a.per_row and b.per_row, cost=cost)

    def _bounded(self, o: Any, f: Callable[[Value, Value], Value], g: Callable[[Interval, Interval], Interval],
                 cost: int = CARRY) -> Hdl:
        """:meth:`_combine`, with the result's bound ``g`` of the operands' where both have one."""
        out = self._combine(o, f, cost=cost)
        a, b = out.deps
        if a.bound is not None and b.bound is not None:
            out.known = g(a.bound, b.bound)
        return out

    def _unary(self, f: Callable[[Value], Value], cost: int = CARRY) -> Hdl:
        return Hdl(self.graph, lambda ctx, v: f(signed_value(v)), (self,), self.pass_, self.per_row, cost=cost)

    # ---- arithmetic (Python-integer semantics)

    def __add__(self, o: Any) -> Hdl:
        return self._bounded(o, lambda a, b: a + b, lambda a, b: a + b)

    def __radd__(self, o: Any) -> Hdl:
        return self._lift(o) + self

    def __sub__(self, o: Any) -> Hdl:
        return self._bounded(o, lambda a, b: a - b, lambda a, b: a - b)

    def __rsub__(self, o: Any) -> Hdl:
        return self._lift(o) - self

    def __mul__(self, o: Any) -> Hdl:
        out = self._bounded(o, lambda a, b: a * b, lambda a, b: a * b, cost=PRODUCT)
        out.fn = _product
        out.product = not any(h.constant is not None and h.constant & (h.constant - 1) == 0 for h in out.deps)
        out.cost = PRODUCT if out.product else 0  # by a power of two: wiring
        return out

    def __rmul__(self, o: Any) -> Hdl:
        return self._lift(o) * self

    def in_luts(self) -> None:
        """Build this product as shifted adds in logic (:func:`lut_product`), not a DSP block."""
        if not self.product:
            raise TypeError("only a multiplier (not a shift by a power of two) can move into LUTs")
        self.fn = lut_product
        self.cost = LOGIC + CARRY  # its first level: a partial product's AND and one add

    def __floordiv__(self, o: Any) -> Hdl:
        return self._divide(o, quotient=True)

    def __rfloordiv__(self, o: Any) -> Hdl:
        return self._lift(o) // self

    def __mod__(self, o: Any) -> Hdl:
        return self._divide(o, quotient=False)

    def _divide(self, o: Any, quotient: bool) -> Hdl:
        """Floor division or modulo: a shift and a mask by a power-of-two constant;
        else combinational, pipelined (:func:`divide`) or serial (:func:`divide_serial`)."""
        a, b = self, self._lift(o)
        out = self._divider(b, quotient)
        if a.bound is not None and b.bound is not None and b.bound.lo > 0:
            n, d = a.bound, b.bound
            if quotient:  # n // d is monotone in n, and in d for either sign of n
                out.known = Interval.hull(*(x // y for x in (n.lo, n.hi) for y in (d.lo, d.hi)))
            else:
                out.known = Interval(0, d.hi - 1)
        return out

    def _divider(self, b: Hdl, quotient: bool) -> Hdl:
        a = self
        k = b.constant
        if k is not None and a.bound is not None and 0 <= a.bound.lo and a.bound.hi < k:
            # proven below the divisor (a row counter mod its own period): no divider
            return a._lift(0) if quotient else a._unary(lambda n: n, cost=0)
        if k is not None and k > 0 and k & (k - 1) == 0:
            s = k.bit_length() - 1
            if quotient:
                return a._unary(lambda n: n >> s, cost=0)
            return a._unary(lambda n: Cat(n[:s], Const(0, 1)).as_signed(), cost=0)
        # the operands by identity (a constant by value): n // d and n % d share one divider
        key = ("div", *((h.constant,) if h.constant is not None else (id(h), h) for h in (a, b)))

        def build(ctx: Ctx, n: Value, d: Value) -> Value | tuple[Value, int]:
            n, d = signed_value(n), signed_value(d)
            if not (ctx.pipelined or ctx.sequential):
                return n // d if quotient else n % d
            if key not in ctx.delays:  # one divider gives both results
                ctx.keep += [n, d]
                if ctx.sequential:
                    qbits = quotient_bits(n, d, a.bound, b.bound)
                    serial = divide_serial(ctx, n, d, qbits, a.bound is not None and a.bound.lo >= 0)
                    ctx.delays[("serial", key)] = serial
                    ctx.delays[key] = serial.q, serial.r, serial.steps
                else:
                    ctx.delays[key] = divide(ctx, n, d)
            q, r, steps = ctx.delays[key]
            return (q if quotient else r), steps

        out = Hdl(self.graph, build, (a, b), max(a.pass_, b.pass_), a.per_row and b.per_row, cost=CARRY + LOGIC)
        if quotient:
            out.quotient_of = key
        return out

    def __rmod__(self, o: Any) -> Hdl:
        return self._lift(o) % self

    def __neg__(self) -> Hdl:
        out = self._unary(lambda a: -a)
        out.known = None if self.bound is None else -self.bound
        return out

    def __abs__(self) -> Hdl:
        out = self._unary(lambda a: Mux(a < 0, -a, a), cost=CARRY + LOGIC)
        out.known = None if self.bound is None else self.bound.abs()
        return out

    def __and__(self, o: Any) -> Hdl:
        out = self._combine(o, lambda a, b: a & b, cost=LOGIC)
        mask = self._lift(o).constant
        if mask is not None and mask >= 0:  # a mask keeps bits of itself: [0, mask]
            out.known = Interval(0, mask)
        return out

    __rand__ = __and__

    def __or__(self, o: Any) -> Hdl:
        return self._combine(o, lambda a, b: a | b, cost=LOGIC)

    __ror__ = __or__

    def __xor__(self, o: Any) -> Hdl:
        return self._combine(o, lambda a, b: a ^ b, cost=LOGIC)

    __rxor__ = __xor__

    def __lshift__(self, o: Any) -> Hdl:
        return self._shift(o, left=True)

    def __rlshift__(self, o: Any) -> Hdl:
        return self._lift(o) << self

    def __rshift__(self, o: Any) -> Hdl:
        return self._shift(o, left=False)

    def _shift(self, o: Any, left: bool) -> Hdl:
        """``self << o`` or the floor ``self >> o``: wiring for a constant amount, else a
        barrel shifter over the amount's bits its bound allows (:func:`barrel_shift`)."""
        amount = self._lift(o)
        bound_of = shifted_left if left else shifted_right
        if amount.constant is not None:
            return self._bounded(amount, lambda a, b: _shifted(a, b.as_unsigned()[:SHIFT_BITS], left), bound_of, cost=0)
        span = amount.bound
        bits = SHIFT_BITS if span is None or span.lo < 0 else min(max(span.hi.bit_length(), 1), SHIFT_BITS)

        if self.constant is not None:  # a constant shifted: each result bit decodes the amount
            return self._bounded(amount, lambda a, b: _shifted(a, b.as_unsigned()[:bits], left), bound_of,
                                 cost=2 * LOGIC)

        def build(ctx: Ctx, va: Value, vb: Value) -> Value | tuple[Value, int]:
            width = None if out.known is None else bits_for(out.known.lo, out.known.hi)
            return barrel_shift(ctx, signed_value(va), vb.as_unsigned()[:bits], left, width)

        out = Hdl(self.graph, build, (self, amount), max(self.pass_, amount.pass_), self.per_row and amount.per_row,
                  cost=LOGIC * min(bits, SHIFT_STAGE_BITS))
        if self.bound is not None and span is not None:
            out.known = bound_of(self.bound, span)
        return out

    def __rrshift__(self, o: Any) -> Hdl:
        return self._lift(o) >> self

    # ---- comparisons (1-bit results)

    def __lt__(self, o: Any) -> Hdl:
        return self._compare(o, lambda a, b: a < b, lambda a, b: less(a, b))

    def __le__(self, o: Any) -> Hdl:
        return self._compare(o, lambda a, b: a <= b, lambda a, b: ~less(b, a))

    def __gt__(self, o: Any) -> Hdl:
        return self._compare(o, lambda a, b: a > b, lambda a, b: less(b, a))

    def __ge__(self, o: Any) -> Hdl:
        return self._compare(o, lambda a, b: a >= b, lambda a, b: ~less(a, b))

    def _compare(self, o: Any, plain: Callable[[Value, Value], Value], chained: Callable[[Value, Value], Value]) -> Hdl:
        """An order compare: against 0 as Amaranth writes it (the sign bit, an OR of the
        others), else the sign of the difference (:func:`less`)."""
        zero = self._lift(o).constant == 0
        return self._combine(o, plain if zero else chained, cost=self._compare_cost(o))

    def __eq__(self, o: object) -> Hdl:  # type: ignore[override]
        return self._combine(o, lambda a, b: a == b, cost=2 * LOGIC)

    def __ne__(self, o: object) -> Hdl:  # type: ignore[override]
        return self._combine(o, lambda a, b: a != b, cost=2 * LOGIC)

    __hash__ = object.__hash__

    def _compare_cost(self, o: Any) -> int:
        """An order compare: a carry chain, against a constant too (ECP5 synthesis maps
        one against a power of two to the carry logic as well); against 0 a few LUT
        levels (the sign bit and an OR of the others)."""
        return 2 * LOGIC if self._lift(o).constant == 0 else CARRY

    def __bool__(self) -> bool:
        raise TypeError("an HDL value has no truth value while the hardware is built; use fixedpoint.select")

    # ---- the numpy-style helpers of qnorm.ops._xp

    def sum(self, axis: int = -1, keepdims: bool = True, dtype: Any = None) -> Hdl:
        """``row_sum``: an accumulator over the row, in the pass that evaluates this term."""
        return self._reduce("sum")

    def max(self, axis: int = -1, keepdims: bool = True) -> Hdl:
        """``row_max``: a running maximum over the row, in the pass that evaluates this term."""
        return self._reduce("max")

    def row_index(self) -> Hdl:
        """``_xp.row_index``: :meth:`Graph.row_index`."""
        return self.graph.row_index()

    def column_index(self) -> Hdl:
        """``_xp.column_index``: :meth:`Graph.column_index`."""
        return self.graph.column_index()

    def _reduce(self, kind: str) -> Hdl:
        if self.per_row:
            raise TypeError(f"a per-row value has no row to {kind} over")
        graph = self.graph
        self.uses += 1
        acc = RowSum(graph.new_slot(), self, kind=kind)
        graph.sums.append(acc)
        acc.result = Hdl(graph, lambda ctx: bank_read(ctx, acc.slot), (), self.pass_ + 1, True)
        acc.result.banked = True
        return acc.result

    def __getitem__(self, key: Any) -> Hdl:
        """``x[..., :k]`` (``take_prefix``): the element where its channel is below k,
        else 0 — exact for the row sums the ops take over a prefix."""
        if not (isinstance(key, tuple) and len(key) == 2 and key[0] is Ellipsis and isinstance(key[1], slice)
                and key[1].start is None and key[1].step is None and isinstance(key[1].stop, int)):
            raise TypeError(f"an HDL row takes only prefixes x[..., :k], not {key!r}")
        k = key[1].stop
        channel = Hdl(self.graph, lambda ctx: ctx.channel, (), 0, False)
        out = Hdl(self.graph, lambda ctx, v, c: Mux(c < k, signed_value(v), 0), (self, channel), self.pass_, False,
                  cost=LOGIC)
        out.known = None if self.bound is None else self.bound.union(Interval(0, 0))
        return out

    def const_like(self, values: np.ndarray) -> Hdl:
        """Per-channel constants as a ROM of their exact width, read at the element's channel."""
        return Table(self.graph, np.asarray(values, dtype=np.int64))


class Table(Hdl):
    """Per-channel integer constants (shape ``(C,)`` or ``(*P, L)`` with ``[..., j]``)."""

    def __init__(self, graph: Graph, values: np.ndarray) -> None:
        self.values = values
        channel = Hdl(graph, lambda ctx: ctx.channel, (), 0, False)
        super().__init__(graph, self._read, (channel,), 0, False, cost=2 * LOGIC)
        if values.size:
            self.known = Interval(int(values.min()), int(values.max()))

    def shape_of(self) -> Any:
        """The values' exact signed shape."""
        return signed(bits_for(int(self.values.min()), int(self.values.max())))

    def _read(self, ctx: Ctx, channel: Value) -> Value:
        if self.values.ndim > 1 and self.values.shape != self.graph.shape:
            raise TypeError(f"a table of shape {self.values.shape} is read per level: index it [..., j]")
        vals = self.values.reshape(-1).tolist()
        lo, hi = min(vals), max(vals)
        if lo == hi:
            return const(lo)
        shape = self.shape_of()
        return Array(Const(v, shape) for v in vals)[channel]

    def in_block_ram(self, ctx: Ctx, level: int) -> bool:
        """Whether a read at ``level`` is a block-RAM ROM's (module docstring): a deep
        table of more than one value, in a context that collects ROMs, read late
        enough for its address to be issued ROM_LATENCY levels early."""
        return (ctx.roms is not None and self.values.ndim == 1 and len(self.values) >= BRAM_MIN_DEPTH
                and level >= ROM_LATENCY and self.values.min() != self.values.max())

    def read_depth(self, ctx: Ctx, level: int) -> int:
        """The logic levels a read at ``level`` adds to its reader's path: none from a
        block-RAM ROM's output register, else the mux's."""
        return 0 if self.in_block_ram(ctx, level) else self.cost

    def read_at(self, ctx: Ctx, level: int, registered: bool = False) -> Value:
        """The table read at pipeline level ``level``: from a block-RAM ROM where
        :meth:`in_block_ram` (always registered); else at the element's channel delayed
        as far, or (``registered``) one level earlier through a register (level >= 1)."""
        if self.in_block_ram(ctx, level):
            key: tuple = ("rom", id(self), level)
            if key not in ctx.delays:
                ctx.delays[key] = ctx.rom_read(self, level)
            return ctx.delays[key]
        key = ("table", id(self), level, registered)
        if key not in ctx.delays:
            if registered:
                read = self._read(ctx, ctx.delay(ctx.channel, 0, level - 1))
                ctx.delays[key] = read if isinstance(read, Const) else ctx.register(read, "rom")
            else:
                ctx.delays[key] = self._read(ctx, ctx.delay(ctx.channel, 0, level))
        return ctx.delays[key]

    def __getitem__(self, key: Any) -> Hdl:
        if isinstance(key, tuple) and len(key) == 2 and key[0] is Ellipsis and isinstance(key[1], (int, np.integer)):
            return Table(self.graph, self.values[..., int(key[1])])
        if isinstance(key, Hdl):  # _xp.lookup: a table read at a computed index
            return rom_lookup(self.values, key)
        raise TypeError(f"a constant table is indexed [..., j] or by an HDL value, not {key!r}")


def rom_lookup(values: np.ndarray, index: Hdl) -> Hdl:
    """``values[index]`` of a 1-D table at an index its bound proves inside the table:
    a ROM of the values' exact width (unsigned where none is negative) addressed by
    the index's low bits, holding the entries the index can reach."""
    if values.ndim != 1:
        raise TypeError(f"a table read at a computed index must be 1-D, not of shape {values.shape}")
    span = index.bound
    if span is None or span.lo < 0 or span.hi >= len(values):
        raise ValueError(f"a {len(values)}-entry table is read at an index bounded by {span}, "
                         f"not proven inside [0, {len(values) - 1}]")
    reach = [int(v) for v in values[: span.hi + 1]]
    lo, hi = min(reach), max(reach)
    shape = range(hi + 1) if lo >= 0 else signed(bits_for(lo, hi))  # a range: the unsigned width holding it
    address = max(span.hi.bit_length(), 1)

    def read(ctx: Ctx, at: Value) -> Value | tuple[Value, int]:
        data = Array(Const(v, shape) for v in reach)[at.as_unsigned()[:address]]
        if ctx.pipelined:
            # registered twice: synthesis may put a deep ROM in block RAM (the first
            # register its read register), whose slow clock-to-out must meet a plain
            # register (which may become its output register: compilers.rtl.ecp5)
            return ctx.register(ctx.register(data, "rom"), "rom_out"), 2
        return data

    # a mux tree of 2^address entries: about one logic level per 3 address bits
    out = Hdl(index.graph, read, (index,), index.pass_, index.per_row, cost=LOGIC * -(-address // 3))
    out.known = Interval(lo, hi)
    return out


def divide(ctx: Ctx, n: Value, d: Value) -> tuple[Value, Value, int]:
    """Floor quotient and modulo of ``n`` by ``d > 0`` (every division of the
    definition has a positive divisor), one restoring step per quotient bit,
    each step a register: (q, r, the steps' latency).

    A negative n divides ``−n + d − 1`` (= ceil of −n / d, floored): then
    ``n // d = −q`` and ``n % d = d − 1 − r``."""
    bits = max(len(n), len(d)) + 1  # −n + d − 1 fits
    neg = n < 0
    mag = Mux(neg, -n + d - 1, n).as_unsigned()[:bits]
    dd = d.as_unsigned()[: len(d)]
    rem: Value = Const(0, len(dd) + 1)
    quo: Value = Const(0, 1)
    level = 0
    neg_l = neg
    for i in range(bits - 1, -1, -1):
        trial = Cat(mag[i], rem)
        take, diff = compare_subtract(trial, dd)
        rem = Mux(take, diff, trial)[: len(dd) + 1]
        quo = Cat(take, quo)
        rem, quo = ctx.register(rem, "div_r"), ctx.register(quo[:bits], "div_q")
        mag, dd, neg_l = ctx.register(mag, "div_n"), ctx.register(dd, "div_d"), ctx.register(neg_l, "div_s")
        level += 1
    q = Mux(neg_l, -signed_value(quo), signed_value(quo))
    r = Mux(neg_l, signed_value(dd) - 1 - signed_value(rem), signed_value(rem))
    return q, r, level


def _product(ctx: Ctx, va: Value, vb: Value) -> Value | tuple[Value, int]:
    """``a · b``; in a pipeline or schedule, an operand wider than a DSP port is split
    into limbs whose products are registered before they are added, so each
    multiplier is one DSP block with a register after it: two products when the
    other operand fits a port, four when both are wider (:func:`_wide_product`)."""
    a, b = signed_value(va), signed_value(vb)
    if len(a) > len(b):
        a, b = b, a
    for k, other in ((va, vb), (vb, va)):
        if isinstance(k, Const) and k.value > 0 and bin(k.value).count("1") <= 2:
            return _two_shifts(signed_value(other), k.value)
    constant = isinstance(va, Const) or isinstance(vb, Const)  # shifts and adds: no DSP port to fit
    if constant or not (ctx.pipelined or ctx.sequential) or len(b) <= DSP_BITS:
        return a * b
    if len(a) > DSP_BITS:
        return _wide_product(ctx, a, b)
    low, high = _limbs(b)
    if ctx.sequential:
        p_low, p_high = ctx.hold(a * low, "p_lo", ctx.level), ctx.hold(a * high, "p_hi", ctx.level)
    else:
        p_low, p_high = ctx.register(a * low, "p_lo"), ctx.register(a * high, "p_hi")
    return (p_high << DSP_LIMB) + p_low, 1


def _two_shifts(v: Value, k: int) -> Value:
    """``v · k`` for a positive constant of at most two one bits: one shifted add (yosys
    would map a constant as wide as a DSP port onto a DSP block and an adder)."""
    low = k & -k
    return (v << (low.bit_length() - 1)) + ((v << ((k - low).bit_length() - 1)) if k != low else 0)


def _limbs(v: Value) -> tuple[Value, Value]:
    """``v`` as (its unsigned low DSP_LIMB bits, the signed rest): v = high·2^limb + low."""
    return Cat(v[:DSP_LIMB], Const(0, 1)).as_signed(), v[DSP_LIMB:].as_signed()


def _wide_product(ctx: Ctx, a: Value, b: Value) -> tuple[Value, int]:
    """``a · b`` with both operands wider than a DSP port (a 768-wide row's Σx times
    its multiplier): the four limb products, each registered (one DSP block each
    while the high limbs fit a port: operands of up to 35 bits), then one add of
    the two middle products and one of their sum to the outer two, which do not
    overlap (the low product is below 2^(2·limb)) and so are placed side by side."""
    (a_lo, a_hi), (b_lo, b_hi) = _limbs(a), _limbs(b)
    parts = {"p_ll": a_lo * b_lo, "p_lh": a_lo * b_hi, "p_hl": a_hi * b_lo, "p_hh": a_hi * b_hi}
    if ctx.sequential:
        held = {name: ctx.hold(p, name, ctx.level) for name, p in parts.items()}
    else:
        held = {name: ctx.register(p, name) for name, p in parts.items()}
    outer = Cat(held["p_ll"][: 2 * DSP_LIMB], held["p_hh"]).as_signed()
    return outer + ((held["p_lh"] + held["p_hl"]) << DSP_LIMB), 1


def element_products(roots: list[Hdl]) -> list[Hdl]:
    """The multipliers of per-element values reachable from ``roots`` (a row's
    per-row chain is left out: it reads the row sums, not the graph behind them)."""
    seen: set[int] = set()
    found: list[Hdl] = []
    stack = list(roots)
    while stack:
        h = stack.pop()
        if id(h) in seen or h.per_row:
            continue
        seen.add(id(h))
        if h.product:
            found.append(h)
        stack.extend(h.deps)
    return found


def lut_product(ctx: Ctx, va: Value, vb: Value) -> Value | tuple[Value, int]:
    """``a · b`` as shift-and-add over the narrower operand's bits, in logic: one
    partial product ``b << i`` per bit of a (the sign bit's subtracted: two's
    complement weighs it −2^(w−1)), summed pairwise in a tree.  In a pipeline each
    level of the tree but the last is a register, so a clock holds one AND and
    one add: (the product, the tree's registered levels)."""
    a, b = signed_value(va), signed_value(vb)
    if len(a) > len(b):
        a, b = b, a
    top = len(a) - 1
    # (value, subtracted): every partial product is added but the sign bit's
    terms: list[tuple[Value, bool]] = [(Mux(a[i], b << i, 0), i == top) for i in range(len(a))]
    levels = 0
    while len(terms) > 1:
        paired = []
        even = len(terms) - len(terms) % 2  # an odd count's last term moves up on its own, below
        for (p, p_neg), (q, q_neg) in zip(terms[0:even:2], terms[1::2], strict=True):
            # at most one of a pair is subtracted (only the sign bit's term ever is)
            paired.append((q - p, False) if p_neg else (p - q if q_neg else p + q, False))
        if len(terms) % 2:
            paired.append(terms[-1])
        terms = paired
        if len(terms) > 1 and ctx.pipelined:
            terms = [(ctx.register(v, "pp"), neg) for v, neg in terms]
            levels += 1
    value, negated = terms[0]
    product = -value if negated else value
    return (product, levels) if levels else product


def _shifted(a: Value, amount: Value, left: bool) -> Value:
    return a << amount if left else a >> amount


def barrel_shift(ctx: Ctx, a: Value, amount: Value, left: bool, width: int | None) -> Value | tuple[Value, int]:
    """``a << amount`` or ``a >> amount`` (floor) by an unsigned ``amount``.  In a
    pipeline or schedule an amount of more than SHIFT_STAGE_BITS bits shifts in two
    stages, a register between: by its high bits, then by its low ones (a 2:1 mux
    level per amount bit: six do not fit a clock).  Floor and left shifts compose
    exactly; the first stage's value is no wider than the result (``width``, its
    bound's, where known) or ``a``."""
    if len(amount) <= SHIFT_STAGE_BITS or not (ctx.pipelined or ctx.sequential):
        return _shifted(a, amount, left)
    high = Cat(Const(0, SHIFT_STAGE_BITS), amount[SHIFT_STAGE_BITS:])
    first = _shifted(a, high, left)
    if width is not None:
        first = first[: max(width, len(a))].as_signed()
    low = amount[:SHIFT_STAGE_BITS]
    if ctx.sequential:  # the amount holds still while its row is scheduled
        return _shifted(ctx.hold(first, "shift_hi", ctx.level), low, left), 1
    return _shifted(ctx.register(first, "shift_hi"), ctx.register(low, "shift_lo"), left), 1


def shifted_left(v: Interval, s: Interval) -> Interval:
    """The bound of ``v << s`` (s >= 0)."""
    lo, hi = max(s.lo, 0), min(max(s.hi, 0), (1 << SHIFT_BITS) - 1)
    return Interval.hull(v.lo << lo, v.lo << hi, v.hi << lo, v.hi << hi)


def shifted_right(v: Interval, s: Interval) -> Interval:
    """The bound of ``v >> s`` (s >= 0): a floor shift moves toward 0 or −1."""
    lo, hi = max(s.lo, 0), min(max(s.hi, 0), (1 << SHIFT_BITS) - 1)
    return Interval.hull(v.lo >> lo, v.lo >> hi, v.hi >> lo, v.hi >> hi)


def quotient_bits(n: Value, d: Value, n_iv: Interval | None, d_iv: Interval | None) -> int:
    """How many quotient bits :func:`divide_serial` must produce for ``n // d`` (d > 0):
    from the operands' bounds where both are known, else from their widths."""
    bits = max(len(n), len(d)) + 1
    if n_iv is None or d_iv is None or d_iv.lo < 1:
        return bits
    # the magnitude divided: n, or −n + d − 1 for a negative n
    mag = max(n_iv.hi, -n_iv.lo + d_iv.hi - 1 if n_iv.lo < 0 else 0, 0)
    return min(max((mag // d_iv.lo).bit_length(), 1), bits)


@dataclass(frozen=True, eq=False)
class SerialDivider:
    """A :func:`divide_serial` divider: its results, and where its quotient bits
    appear (``nq[0]`` holds quotient bit ``qbits − 1 − j`` from clock
    ``start + 1 + j``) for an isqrt that digests them as they come."""

    q: Value
    r: Value
    nq: Signal
    start: int
    qbits: int
    nonneg: bool  # the dividend is proven >= 0: q is nq itself
    steps: int  # clocks from the operands' level to q and r


def divide_serial(ctx: Ctx, n: Value, d: Value, qbits: int, nonneg: bool = False) -> SerialDivider:
    """Floor quotient and modulo of ``n`` by ``d > 0`` on one row's schedule: the
    restoring steps of :func:`divide`, one per clock on one remainder register.

    n and d hold still while it runs (sequential).  The magnitude's low ``qbits``
    bits are the quotient's; the bits above them are the first partial remainder,
    below d because the quotient fits ``qbits`` (:func:`quotient_bits`).  It
    steps on the operands' level ℓ (the first step from the operands themselves)
    … ℓ + qbits − 1; q and r are valid from ℓ + qbits.  A dividend not proven
    non-negative has its magnitude held first: each of those clocks one later."""
    level = start = ctx.level
    bits = max(len(n), len(d)) + 1
    neg = n < 0
    mag = Mux(neg, -n + d - 1, n).as_unsigned()[:bits]
    if not nonneg:  # −n + d − 1 is two carry chains: held a clock before the steps read it
        mag, start = ctx.hold(mag, "div_mag", start), start + 1
    dd = d.as_unsigned()[: len(d)]
    rem = Signal(len(dd), name="div_r")  # the partial remainder, always below d
    nq = Signal(qbits, name="div_q")  # the numerator's bits shift out as the quotient's shift in
    first = ctx.at(start)
    rem_in = Mux(first, mag[qbits:], rem)
    nq_in = Mux(first, mag[:qbits], nq)
    trial = Cat(nq_in[-1], rem_in)
    take, diff = compare_subtract(trial, dd)
    with ctx.m.If(ctx.during(start, start + qbits - 1)):
        ctx.m.d.sync += [rem.eq(Mux(take, diff, trial)), nq.eq(Cat(take, nq_in[:-1]))]
    q = Mux(neg, -signed_value(nq), signed_value(nq))
    r = Mux(neg, signed_value(dd) - 1 - signed_value(rem), signed_value(rem))
    return SerialDivider(q, r, nq, start, qbits, nonneg, start + qbits - level)


def isqrt_serial(ctx: Ctx, v: Value, max_input_bits: int) -> tuple[Value, int]:
    """:func:`qnorm.fixedpoint.isqrt_digits` on one row's schedule: its digit steps,
    one per clock, on one remainder, result and bit register.  Loaded at the
    operand's level ℓ (v >= 0 holds still), it steps on ℓ + 1 … ℓ + S: (root, S + 1)."""
    start = ctx.level
    top = max_input_bits + (max_input_bits & 1)
    steps = top // 2 + 1
    width = top + 2
    rem = Signal(max(len(v), width), name="isqrt_rem")
    res = Signal(width, name="isqrt_res")
    bit = Signal(width, name="isqrt_bit")  # 4^k of the current digit: one-hot
    trial = res + bit
    take, diff = compare_subtract(rem, trial)
    with ctx.m.If(ctx.at(start)):
        ctx.m.d.sync += [rem.eq(v.as_unsigned()), res.eq(0), bit.eq(1 << top)]
    with ctx.m.If(ctx.during(start + 1, start + steps)):
        ctx.m.d.sync += [
            rem.eq(Mux(take, diff, rem)),
            res.eq(Mux(take, (res >> 1) + bit, res >> 1)),
            bit.eq(bit >> 2),
        ]
    return signed_value(res), steps + 1


def isqrt_of_quotient(ctx: Ctx, div: SerialDivider) -> tuple[Value, int]:
    """The floor square root of a serial divider's non-negative quotient, digested
    two quotient bits at a time as the divider produces them (its digits are
    :func:`qnorm.fixedpoint.isqrt_digits`': the root's bits from the top, each the
    outcome of one compare-subtract; pairs above the quotient's ``qbits`` are 0).
    (root, the absolute level it is valid from: one clock after the quotient)."""
    odd = div.qbits & 1  # the top pair is (0, the quotient's top bit)
    pairs = (div.qbits + odd) // 2
    first = div.start + 2 - odd  # the clock the top pair is complete in nq[1:0]
    last = first + 2 * (pairs - 1)
    rem = Signal(pairs + 2, name="root_rem")  # below 2·root + 1
    root = Signal(pairs + 1, name="root")
    high = Mux(ctx.at(first), 0, div.nq[1]) if odd else div.nq[1]
    grown = Cat(div.nq[0], high, rem)  # 4·rem + the next pair
    trial = Cat(Const(1, 2), root)  # 4·root + 1
    take, diff = compare_subtract(grown, trial)
    with ctx.m.If(ctx.at(div.start)):
        ctx.m.d.sync += [rem.eq(0), root.eq(0)]
    # a digit every other clock: ``tock`` is high on the clock after each one
    tock = Signal(name="root_tock")
    tick = ctx.during(first, last) & ~tock
    ctx.m.d.sync += tock.eq(tick)
    with ctx.m.If(tick):
        ctx.m.d.sync += [rem.eq(Mux(take, diff, grown)), root.eq(Cat(take, root))]
    return signed_value(root), last + 1


class _HdlOps:
    """The primitives :mod:`qnorm.fixedpoint` takes from an operand kind of its own."""

    @staticmethod
    def _graph(*vals: Any) -> Hdl:
        return next(v for v in vals if isinstance(v, Hdl))

    def select(self, cond: Any, a: Any, b: Any) -> Hdl:
        h = self._graph(cond, a, b)
        c, x, y = h._lift(cond), h._lift(a), h._lift(b)
        pass_ = max(c.pass_, x.pass_, y.pass_)
        rate = c.per_row and x.per_row and y.per_row
        out = Hdl(h.graph, lambda ctx, vc, vx, vy: Mux(vc, signed_value(vx), signed_value(vy)), (c, x, y),
                  pass_, rate, cost=LOGIC)
        if x.bound is not None and y.bound is not None:
            out.known = x.bound.union(y.bound)
        return out

    def land(self, a: Any, b: Any) -> Hdl:
        h = self._graph(a, b)
        return h._lift(a)._combine(b, lambda p, q: p.bool() & q.bool(), arith=False, cost=LOGIC)

    def lor(self, a: Any, b: Any) -> Hdl:
        h = self._graph(a, b)
        return h._lift(a)._combine(b, lambda p, q: p.bool() | q.bool(), arith=False, cost=LOGIC)

    def clamp(self, v: Any, lo: Any, hi: Any) -> Hdl:
        h = self._graph(v, lo, hi)
        x = h._lift(v)
        up = self.select(x < lo, lo, x)
        return self.select(up > hi, hi, up)

    def one_like(self, s: Any) -> Hdl:
        return s._lift(1)

    def isqrt(self, v: Hdl, max_input_bits: int) -> Hdl:
        """``isqrt_digits(v)``: serial in a sequential context, else the unrolled loop."""
        unrolled = isqrt_digits(v, max_input_bits)

        def build(ctx: Ctx, value: Value) -> tuple[Value, int]:
            serial = ctx.delays.get(("serial", v.quotient_of)) if ctx.sequential else None
            if isinstance(serial, SerialDivider) and serial.nonneg:
                root, valid = isqrt_of_quotient(ctx, serial)
                return root, max(valid - ctx.level, 0)
            if ctx.sequential:
                return isqrt_serial(ctx, value, max_input_bits)
            base = ctx.level  # the operand's level (staging the loop moves ctx.level)
            out, level = unrolled.staged(ctx)
            return out, level - base

        out = Hdl(v.graph, build, (v,), v.pass_, v.per_row)
        top = max_input_bits + (max_input_bits & 1)
        hi = 1 << (top // 2 + 1) if v.bound is None else math.isqrt(max(v.bound.hi, 0))
        out.known = Interval(0 if v.bound is None else math.isqrt(max(v.bound.lo, 0)), hi)
        return out


Hdl.fixedpoint_ops = _HdlOps()


class ProvenTrace(dict):
    """A trace for the op's ``record`` calls: each recorded HDL value takes the op's
    proven interval for its name (its wire is exactly that wide), and the names
    arrive in order, so a caller can check it saw every stage of the op."""

    def __init__(self, proven: dict[str, Interval]) -> None:
        super().__init__()
        self.proven = proven

    def __setitem__(self, name: str, value: Any) -> None:
        item = value.item() if isinstance(value, np.ndarray) and value.dtype == object and value.ndim == 0 else value
        if isinstance(item, Hdl) and name in self.proven:
            item.narrow(self.proven[name], name)
        super().__setitem__(name, item)

    def require_every_stage(self, op_name: str, module: str) -> None:
        """Refuse a unit that saw other stages than the op's range report names, in
        order: a stage added to the op's forward fails here instead of going missing
        from the hardware (``module``: the generator to update)."""
        if list(self) != list(self.proven):
            raise NotImplementedError(
                f"{op_name}'s stages {list(self.proven)} differ from the unit's {list(self)}: "
                f"the op's forward changed; update {module}"
            )
