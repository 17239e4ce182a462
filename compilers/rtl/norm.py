"""The row-normalization unit (IntLayerNorm, L1LayerNorm, ShiftLayerNorm, IntRMSNorm).

Built from the op's own stages on :class:`~compilers.rtl.values.Hdl` values, in
the order of :meth:`NormOp._forward`: ``_statistic`` (its ``row_sum`` calls become
accumulators), ``add_eps``, ``split_exponent``, ``_inverse``, ``row_affine``
(per row), then ``normalize`` and ``_output`` (per element).  The names the
stages record must be exactly the op's range-report names, in order, and an op
class that overrides ``_forward`` is refused: a stage added to the definition
fails loudly here instead of going missing from the hardware.

Architecture: a ring of ``B`` row banks (row buffer + per-row registers) that
the stages walk in order, each bank handed from stage to stage:

* pass 0 — accepts the row's N elements (one per clock), writes them to the
  bank's buffer (WRITE_LATENCY clocks after each accept: the accept drives a
  register, not every block RAM's enable; S_0 >= WRITE_LATENCY, so the bank is
  handed on only once its last write has landed) and accumulates the sums of
  pass 0 (Σx, Σx² …); a stage's
  buffer address is bank·N + element: wiring for N a power of two, else a
  counter of its own (no multiply in front of the RAM);
* passes 1 … P−1 — re-read the buffer, one element per clock, for sums that
  need an earlier one (L1's Σ|N·x − Σx|: P = 2; the other norms P = 1);
  each pass's terms are pipelined, so its sums land S_p clocks after its last
  element (S_p includes the buffer read's READ_LATENCY for p >= 1);
* row — the per-row chain (ε, leading-zero split, inverse, multiplier a,
  offset c, shift K) on a **row engine** that takes one row at a time: a
  schedule of D clocks (a sequential :class:`~compilers.rtl.values.Ctx`) where
  every value the op records or reuses is one register loaded at its clock,
  so the leading-zero search takes one clock per step, and each division and
  the isqrt is one compare-subtract per clock on one set of registers
  (:func:`~compilers.rtl.values.divide_serial`,
  :func:`~compilers.rtl.values.isqrt_serial`; an isqrt of a quotient digests
  its bits as the divider produces them); the engine copies the row's sums out
  of the bank when it takes the row (its first clock reads registers, not the
  bank mux); at clock D (the schedule's own bit: its clocks are a shift register) the results
  are latched into the bank and the engine takes the next row on the same clock;
* out — reads the buffer (READ_LATENCY clocks: the memory's read register and
  one more), one element per clock, through the element chain (``x·a − c``,
  the rounding shift, the output window, gain, bias, rounding, saturation)
  pipelined in L levels, all stalled together while the output is not taken.
  Its per-channel constants (window ends, offset, gain, bias; ShiftLayerNorm's
  shifts and signs) are LUT muxes for rows shorter than
  :data:`~compilers.rtl.values.BRAM_MIN_DEPTH` and block-RAM ROMs from there on:
  the channel is known ahead, so each ROM is addressed ROM_LATENCY levels before
  its value is used, its read port stalls with the chain, and tables first used
  at one level share one ROM (int8 rows of 768: five ROMs, six for
  ShiftLayerNorm, three for RMSNorm; a ROM's output is a register, so L is
  14 IntLayerNorm and L1, 15 ShiftLayerNorm, 12 RMSNorm).

Every pipeline and schedule also registers where an estimated path would
outgrow a clock (:data:`~compilers.rtl.values.DEPTH_BUDGET`), and splits a
product wider than a DSP port into registered limb products.  ShiftLayerNorm's
γ is a shift, so its element path's only products (x·a, and the statistic's
x²) are built in logic (:func:`~compilers.rtl.values.lut_product`): it takes no
DSP block per element, only in its row engine.

The engine's hardware is one row's worth, not D levels of it: a row arrives
only every N clocks and the engine needs D + 1, so ``E = min(ceil((D + 1) /
N), MAX_ENGINES)`` engines take the rows in turn, and N >= (D + 1) / E streams
at **one element per clock**.  Int8 rows of 64: D = 63 IntLayerNorm (its
division and the square root of the quotient: 33 clocks), 56 RMSNorm, 46 L1,
32 ShiftLayerNorm, so one engine each; L = 13 RMSNorm, 14 IntLayerNorm and L1,
16 ShiftLayerNorm (its x·a tree: two more levels).  With S = Σ S_p,
``B = P + 1 + min(ceil((S + D + 2) / N), EXTRA_BANKS)`` banks: a bank is held
from its row's first input until its last element is read out,
P·N + S + D + N + 2 cycles, so with B banks a new row starts every N cycles
when the engines keep up.  Rows shorter than (D + 1) / E take
``max(ceil((D + 1) / E), ceil((P·N + S + D + N + 2) / B))`` cycles per row.
Latency, first input accepted to first output valid:
``P·N + S + D + READ_LATENCY + L + 3`` cycles (``NormUnit.latency``).

The softmax unit (:mod:`compilers.rtl.softmax`) is this unit running
IntSoftmax's forward: its row max is an accumulator like the sums (a
:class:`~compilers.rtl.values.RowSum` of kind "max"), and where an op reads its
row index the input pass counts rows (``_row_counter``) and each bank keeps
its row's count.

Interface (plain signals, not amaranth.lib.stream): ``in_valid``,
``in_ready``, ``in_data`` (the input format's width), ``out_valid``,
``out_ready``, ``out_data`` (the output format's width); a transfer happens on
a rising clock edge where valid and ready are both high.  Rows are the
consecutive groups of N elements, element 0 first.
"""

from __future__ import annotations

from collections.abc import Callable

from amaranth.hdl import (
    Array,
    Const,
    Module,
    Mux,
    Signal,
    Value,
    signed,
)
from amaranth.lib.memory import Memory

from compilers.rtl.stream import StreamUnit, fmt_shape
from compilers.rtl.values import (
    DEPTH_BUDGET,
    DISCARDED_COLLISIONS,
    Ctx,
    Graph,
    Hdl,
    ProvenTrace,
    RowSum,
    element_products,
    signed_value,
)
from qnorm.fixedpoint import bits_for
from qnorm.ops._normcore import NormOp, add_eps, normalize, row_affine, split_exponent

EXTRA_BANKS = 3  # row banks beyond P + 1 that hide the row engine's schedule behind short rows
READ_LATENCY = 2  # clocks from a row buffer address to its element in a register
# clocks from an accept to its row-buffer write (the write port's inputs are one sync
# register): the accept drives a register, not every block RAM's enable of the buffer
WRITE_LATENCY = 1
MAX_ENGINES = 2  # row engines: enough for one element per clock at N >= 64 (D <= 127)


def norm_graph(op: NormOp) -> tuple[Graph, Hdl]:
    """Run the op's stages on HDL values: the graph (row sums, latched per-row values)
    and the per-element output."""
    cls = type(op)
    if cls._forward is not NormOp._forward:
        raise NotImplementedError(f"{cls.__name__} overrides NormOp._forward, which the RTL unit mirrors")
    cfg, rep = op.config, op.ranges()
    graph = Graph(cfg.n)
    trace = ProvenTrace(dict(rep.items))
    x = graph.leaf()
    s, s1 = op._statistic(x, trace)
    w = add_eps(s, cfg, trace)
    e, m = split_exponent(w, cfg, op._stat_bits, trace)
    r = op._inverse(m, trace)
    a, c, k = row_affine(s1, r, e, cfg, op._mult_shift, trace, op._offset_split)
    rows = [v for v in (a, c, k) if isinstance(v, Hdl)]
    latched = [graph.latch(v) for v in rows]
    a_l, k_l = latched[0], latched[-1]
    c_l = latched[1] if isinstance(c, Hdl) else c
    y = op._output(normalize(x, a_l, c_l, k_l, cfg, trace), trace)
    if "scaled" not in op.multiplications:
        # the op's gain is no multiplier (ShiftLayerNorm's are shifts), so x·a and the
        # statistic's x² are the element path's only ones: in logic, no DSP per element
        for product in element_products([y, *(rs.term for rs in graph.sums)]):
            product.in_luts()
    trace.require_every_stage(cls.__name__, "compilers/rtl/norm.py")
    return graph, y


class NormUnit(StreamUnit):
    """One norm instance as a streaming unit (see the module docstring).

    ``row_engine`` False: the unit's datapath alone, for measuring what it costs (the
    FPGA report's breakdown).  No statistics and no row engine: the input pass only
    fills the row buffer, and the per-row values the engine would latch (multiplier,
    offset, shift) are input ports (``row_values``, by slot), taken into a row's bank
    on the clock the row is issued.  It computes no norm by itself.
    """

    def __init__(self, op: NormOp, *, row_engine: bool = True) -> None:
        self._MustUse__silence = True  # Amaranth's unused-unit warning: not for a refused op
        self.op = op
        self.n = op.config.n
        self.row_engine = row_engine
        self.graph, self.y = self._build_graph(op)
        self._MustUse__silence = False
        # without the engine, the passes after the first (which feed only it) go too
        self.passes = self.graph.passes() if row_engine else 1
        self.pass_depths, self.row_depth, self.element_depth = self._depths()
        # a row holds its bank from its first input until its last element is read
        # out, P·N + S + D + N + 2 cycles (S: the passes' pipeline depths): with
        # P + 1 + ceil((S + D + 2) / N) banks a row starts every N cycles (short
        # rows: at most EXTRA_BANKS more than P + 1)
        self.banks = self.passes + 1 + min(-(-(self._held + 2) // self.n), EXTRA_BANKS)
        # engines in turn, so a row's D + 1 clocks fit the N of each of E rows
        self.engines = min(-(-(self.row_depth + 1) // self.n), MAX_ENGINES)
        self._make_streams(op.in_fmt, op.out_fmt)
        # without the engine: each per-row value the engine would latch, as an input port
        self.row_values = {} if row_engine else {
            slot: Signal(signed(rs_bits(v)), name=f"row_value{slot}") for slot, v in self.graph.latched.items()
        }

    @property
    def ports(self) -> list[Signal]:
        return [*super().ports, *self.row_values.values()]

    def _build_graph(self, op: NormOp) -> tuple[Graph, Hdl]:
        """The op's stages on HDL values (a unit of another row op overrides this)."""
        return norm_graph(op)

    @property
    def cycles_per_row(self) -> int:
        """Steady-state cycles per row: N, or for short rows the row engines' limit
        (D + 1 clocks per row on each of E) or the bank ring's."""
        occupancy = self.passes * self.n + self._held + self.n + 2
        return max(self.n, -(-(self.row_depth + 1) // self.engines), -(-occupancy // self.banks))

    @property
    def latency(self) -> int:
        """First input accepted to first output valid: the passes and their
        pipelines, the row engine's schedule, the buffer read, the element
        pipeline, and three registered hand-offs."""
        return self.passes * self.n + self._held + READ_LATENCY + self.element_depth + 3

    @property
    def _phases(self) -> tuple[int, int, int]:
        """A bank's phases (p < P: waiting for, or in, pass p): waiting for the row
        engine, in it, and waiting for (or in) the output pass; back to 0 once read out."""
        return self.passes, self.passes + 1, self.passes + 2

    @property
    def _held(self) -> int:
        """S + D: the clocks a row's bank waits, beyond its elements, for its sums
        and the row engine."""
        return sum(self.pass_depths) + self.row_depth

    def _depths(self) -> tuple[list[int], int, int]:
        """(the passes' pipeline depths, D, L): the accumulated terms' register levels,
        the row engine's schedule length and the element chain's register levels,
        from a trial elaboration (the divider's steps depend on operand widths)."""
        m = Module()
        m._MustUse__silence = True
        widths = {rs.slot: rs.width(64) for rs in self.graph.sums}
        widths.update({slot: rs_bits(v) for slot, v in self.graph.latched.items()})
        if self.graph.row_slot is not None:
            widths[self.graph.row_slot] = bits_for(0, self.graph.row_period - 1)
        rows = {slot: [Signal(signed(w))] for slot, w in widths.items()}
        zero = Signal(range(2))
        d = 0
        if self.row_engine:
            row = Ctx(m, Signal(8), zero, None, rows, sequential=True)
            d = max(v.staged(row)[1] for v in self.graph.latched.values())
        passes = []
        for p in range(self.passes):
            acc = Ctx(m, Signal(fmt_shape(self.op.in_fmt)), zero, zero, rows, pipelined=True)
            depth = max(accumulated_term(acc, s)[1] for s in self.graph.sums if s.term.pass_ == p)
            # passes after the first read the buffer; the first hands its bank on no
            # sooner than its last element's write has landed
            passes.append(depth + READ_LATENCY if p else max(depth, WRITE_LATENCY))
        elem = Ctx(m, Signal(fmt_shape(self.op.in_fmt)), zero, zero, rows, pipelined=True, enable=Signal(), roms=[])
        return passes, d, self.y.staged(elem)[1]

    def elaborate(self, platform: object) -> Module:
        m = Module()
        n, banks, graph, p_count = self.n, self.banks, self.graph, self.passes
        row_ready, _, out_ready = self._phases
        phase = [Signal(range(p_count + 3), name=f"phase{b}") for b in range(banks)]
        stages = p_count + 2  # passes, row issue, output pass: each walks the banks in order
        ptr = [Signal(range(banks), name=f"ptr{s}") for s in range(stages)]
        want = [*range(p_count), row_ready, out_ready]
        # each bank's phase compared first, then one bit picked by the stage's pointer:
        # the row issue's enable fans out to the engine's registers, so its path is short
        active = [Array(p == want[s] for p in phase)[ptr[s]] for s in range(stages)]
        chan = [Signal(range(n), name=f"chan{s}") for s in range(stages)]

        def hand_on(s: int, to: int | None) -> None:
            """Stage s moves to the next bank, handing this one to phase ``to`` (None:
            the stage sets the phase itself, later)."""
            if to is not None:
                m.d.sync += Array(phase)[ptr[s]].eq(to)
            with m.If(ptr[s] == banks - 1):
                m.d.sync += ptr[s].eq(0)
            with m.Else():
                m.d.sync += ptr[s].eq(ptr[s] + 1)

        # a stage's row-buffer address ptr·N + chan: for N a power of two the bits of
        # ptr above chan's; else a multiply and an add in front of the RAM's address
        # (the 768-wide units' critical path), so the stage counts the address itself
        counted: dict[int, Signal] = {}

        def address(s: int) -> Value:
            if n & (n - 1) == 0:
                return ptr[s] * n + chan[s]
            counted[s] = Signal(range(banks * n), name=f"addr{s}")
            return counted[s]

        def at_top(counter: Signal, top: int, step: Value) -> Value:
            """High while ``counter`` (from 0, one up per ``step``, back to 0 after ``top``)
            is at ``top``: a register loaded on each step with ``counter == top − 1``, so
            no compare of a wide counter lies before the bank hand-off it drives."""
            if top == 0:
                return Const(1)
            flag = Signal(name=f"{counter.name}_top")
            with m.If(step):
                m.d.sync += flag.eq(counter == top - 1)
            return flag

        def count(s: int, step: Value, to: int | None = None) -> None:
            """Count the stage's elements (and its address); the last one hands the bank on."""
            last = at_top(chan[s], n - 1, step)
            wrap = at_top(counted[s], banks * n - 1, step) if s in counted else None
            with m.If(step):
                with m.If(last):
                    m.d.sync += chan[s].eq(0)
                    hand_on(s, to)
                with m.Else():
                    m.d.sync += chan[s].eq(chan[s] + 1)
                if wrap is not None:
                    with m.If(wrap):
                        m.d.sync += counted[s].eq(0)
                    with m.Else():
                        m.d.sync += counted[s].eq(counted[s] + 1)

        # Every read port reads on each clock, also while its stage waits, and a bank
        # is written only in phase 0, which no reading stage is in: a read that meets
        # the write of its address is one its stage discards.
        m.submodules.buf = buf = Memory(shape=self.in_data.shape(), depth=banks * n, init=[],
                                        attrs={DISCARDED_COLLISIONS: 1})
        wr = buf.write_port()

        def later(v: Value, enable: Value | None, reset_less: bool = False) -> Value:
            reg = Signal(v.shape(), name="later", reset_less=reset_less)
            with m.If(1 if enable is None else enable):
                m.d.sync += reg.eq(v)
            return reg

        def buffer_read(s: int, step: Value, enable: Value | None) -> tuple[Value, Value, Value, Value]:
            """Stage s's element from the row buffer READ_LATENCY clocks after its
            address (the memory's read register, then one more: a block RAM's output
            is slow), with its channel, bank and step delayed alike: (x, channel,
            bank, step), advancing with ``enable`` (None: every clock)."""
            rd = buf.read_port(domain="sync")
            m.d.comb += rd.addr.eq(address(s))
            if enable is not None:
                m.d.comb += rd.en.eq(enable)
            out = [later(rd.data, enable, reset_less=True), chan[s], ptr[s], step]
            for _ in range(READ_LATENCY):
                out[1:] = [later(v, enable) for v in out[1:]]
            return out[0], out[1], out[2], out[3]

        # per-row registers, one per bank, for every row sum and latched value
        rows: dict[int, list[Signal]] = {}

        def slot_regs(slot: int, width: int) -> list[Signal]:
            if slot not in rows:
                rows[slot] = [Signal(signed(width), name=f"row{slot}_b{b}") for b in range(banks)]
            return rows[slot]

        # ---- statistic passes: accumulate as the elements go by
        for p in range(p_count):
            if p == 0:
                x: Value = self.in_data
                step = self.in_valid & self.in_ready
                m.d.comb += self.in_ready.eq(active[0])
                m.d.sync += [wr.addr.eq(address(0)), wr.data.eq(self.in_data), wr.en.eq(step)]
                here, bank, going = chan[0], ptr[0], step
                late = self.pass_depths[p]
            else:
                step = active[p]
                x, here, bank, going = buffer_read(p, step, None)
                late = self.pass_depths[p] - READ_LATENCY
            # the terms are pipelined (their element, step, last flag and bank move
            # together), so the sums and the bank's hand-on come pass_depth clocks late
            extra = self._row_counter(m, slot_regs, ptr[0], chan[0]) if p == 0 else {}
            ctx = Ctx(m, x, here, bank, rows, pipelined=True, extra=extra)
            step_l, last_l = ctx.delay(going, 0, late), ctx.delay(going & (here == n - 1), 0, late)
            bank_l = ctx.delay(bank, 0, late)
            for rs in [s for s in graph.sums if s.term.pass_ == p]:
                value, level = accumulated_term(ctx, rs)
                term = signed_value(ctx.delay(value, level, late))
                width = rs.width(len(term))
                acc = Signal(signed(width), name=f"acc{rs.slot}", init=rs.identity(width))
                regs = slot_regs(rs.slot, width)
                with m.If(step_l):
                    with m.If(last_l):
                        m.d.sync += [Array(regs)[bank_l].eq(rs.combine(acc, term)), acc.eq(rs.identity(width))]
                    with m.Else():
                        m.d.sync += acc.eq(rs.combine(acc, term))
            with m.If(last_l):
                m.d.sync += Array(phase)[bank_l].eq(p + 1 if p + 1 < p_count else row_ready)
            count(p, step)

        # ---- the row engine: the per-row chain's schedule of D clocks, one row at a time
        for slot, v in graph.latched.items():
            slot_regs(slot, rs_bits(v))
        if self.row_engine:
            self._row_engines(m, rows, phase, ptr[p_count], active[p_count], chan[0], hand_on)
        else:  # the row's values from the ports, on the clock it is issued
            with m.If(active[p_count]):
                m.d.sync += [Array(rows[slot])[ptr[p_count]].eq(port) for slot, port in self.row_values.items()]
                hand_on(p_count, out_ready)

        # ---- output pass: a pipeline of L levels, all stalled while the output waits
        o = p_count + 1
        advance = ~self.out_valid | self.out_ready
        step = active[o] & advance
        x, here, bank, going = buffer_read(o, step, advance)
        ctx = Ctx(m, x, here, bank, rows, pipelined=True, enable=advance, roms=[])
        y, level = self.y.staged(ctx)
        ctx.build_roms()
        if level != self.element_depth:
            raise RuntimeError(f"{self.op.name}: the element chain's depth differs from its trial elaboration")
        valid = ctx.delay(going, 0, level)
        with m.If(advance):
            m.d.sync += [self.out_data.eq(y), self.out_valid.eq(valid)]
        count(o, step, 0)
        return m

    def _row_engines(self, m: Module, rows: dict[int, list[Signal]], phase: list[Signal], ptr: Value, ready: Value,
                     channel: Value, hand_on: Callable[[int, int | None], None]) -> None:
        """The row engines: each takes the row at the issue stage's pointer ``ptr`` when it
        is ``ready``, in turn, runs the per-row chain's schedule of D clocks and latches
        the results into the row's bank (phases as in :meth:`elaborate`)."""
        graph, p_count, banks = self.graph, self.passes, self.banks
        _, row_busy, out_ready = self._phases
        turn = Signal(range(self.engines), name="engine_turn")  # rows go to the engines in turn
        for e in range(self.engines):
            busy = Signal(name=f"engine{e}_busy")
            bank = Signal(range(banks), name=f"engine{e}_bank")
            # the row's sums, copied from its bank when the row is issued: the
            # schedule's first clock reads registers, not the bank mux
            own = {rs.slot: [Signal.like(rows[rs.slot][0], name=f"engine{e}_sum{rs.slot}")] for rs in graph.sums}
            ctx = Ctx(m, self.in_data, channel, None, own, sequential=True)
            results = {slot: v.staged(ctx) for slot, v in graph.latched.items()}
            if max(level for _, level in results.values()) != self.row_depth:
                raise RuntimeError(f"{self.op.name}: the per-row chain's schedule differs from its trial elaboration")
            # high on the schedule's last clock D: the schedule's own bit, a register
            done = ctx.at(self.row_depth)
            # the engine's next row starts on the clock this one ends
            issue = ready & (turn == e) & (~busy | done)
            ctx.drive_schedule(issue)
            with m.If(done):
                for slot, (v, _) in results.items():
                    m.d.sync += Array(rows[slot])[bank].eq(v)
                m.d.sync += [Array(phase)[bank].eq(out_ready), busy.eq(0)]
            with m.If(issue):
                m.d.sync += [busy.eq(1), bank.eq(ptr), turn.eq((e + 1) % self.engines)]
                m.d.sync += [own[slot][0].eq(Array(rows[slot])[ptr]) for slot in own]
                hand_on(p_count, row_busy)

    def _row_counter(self, m: Module, slot_regs: Callable[[int, int], list[Signal]], bank: Value,
                     column: Value) -> dict[str, Value]:
        """The input pass's extra leaves: the row counter (modulo the graph's row
        period) where the op reads its row index; each row's count is kept in its
        bank for the later passes."""
        graph = self.graph
        if graph.row_slot is None:
            return {}
        period = graph.row_period
        count = Signal(range(period), name="row_count")
        regs = slot_regs(graph.row_slot, bits_for(0, period - 1))
        with m.If(self.in_valid & self.in_ready):
            m.d.sync += Array(regs)[bank].eq(count)
            with m.If(column == self.n - 1):
                m.d.sync += count.eq(Mux(count == period - 1, 0, count + 1))
        return {"row": count}


def accumulated_term(ctx: Ctx, rs: RowSum) -> tuple[Value, int]:
    """A row sum's term in a pass's pipeline, registered where its path and the
    accumulator's add would outgrow a clock: (value, level)."""
    value, level = rs.term.staged(ctx)
    if ctx.depths.get(id(rs.term), 0) + rs.cost > DEPTH_BUDGET:
        value, level = ctx.cut(rs.term, value, level)
    return value, level


def rs_bits(v: Hdl) -> int:
    """The width of a recorded per-row value (its proven interval)."""
    assert v.iv is not None
    return bits_for(v.iv.lo, v.iv.hi)
