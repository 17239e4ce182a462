"""The row-normalization unit (IntLayerNorm, L1LayerNorm, ShiftLayerNorm, IntRMSNorm).

Built from the op's own stages on :class:`~compilers.rtl.values.Hdl` values, in
the order of :meth:`NormOp._forward`: ``_statistic`` (its ``row_sum`` calls become
accumulators), ``add_eps``, ``split_exponent``, ``_inverse``, ``row_affine``
(per row), then ``normalize`` and ``_output`` (per element).  The names the
stages record must be exactly the op's range-report names, in order, and an op
class that overrides ``_forward`` is refused: a stage added to the definition
fails loudly here instead of going missing from the hardware.

Architecture: a ring of ``B`` row banks (row buffer + per-row registers) and
``B`` stages, each holding one bank at a time and handing it to the next:

* pass 0 — accepts the row's N elements (one per clock), writes them to the
  bank's buffer and accumulates the sums of pass 0 (Σx, Σx² …);
* passes 1 … P−1 — re-read the buffer, one element per clock, for sums that
  need an earlier one (L1's Σ|N·x − Σx|: P = 2; the other norms P = 1);
* row — the per-row chain (ε, leading-zero split, inverse, multiplier a,
  offset c, shift K) from the bank's sums, latched into the bank: one clock
  (a combinational path from the sums to a, c, K);
* out — reads the buffer, one element per clock: ``x·a − c``, the rounding
  shift, the output window, gain, bias, rounding and saturation, into the
  output register.

``B = P + 2``: while row k streams out, row k+1 is in its row stage and row
k+2 streams in, so the unit accepts and emits **one element per clock** in
steady state for every N (the per-row work is hidden behind the banks).
Latency, first input accepted to first output valid: ``P·N + 2`` cycles;
one row every N cycles.

Interface (plain signals, not amaranth.lib.stream): ``in_valid``,
``in_ready``, ``in_data`` (the input format's width), ``out_valid``,
``out_ready``, ``out_data`` (the output format's width); a transfer happens on
a rising clock edge where valid and ready are both high.  Rows are the
consecutive groups of N elements, element 0 first.
"""

from __future__ import annotations

from amaranth.hdl import Array, Elaboratable, Module, Shape, Signal, signed, unsigned
from amaranth.lib.memory import Memory

from compilers.rtl.values import Ctx, Graph, Hdl, ProvenTrace, signed_value
from qnorm.fixedpoint import bits_for
from qnorm.ops._normcore import NormOp, add_eps, normalize, row_affine, split_exponent
from qnorm.qformat import QFormat


def fmt_shape(fmt: QFormat) -> Shape:
    """The port shape of an integer format."""
    return signed(fmt.bits) if fmt.signed else unsigned(fmt.bits)


def norm_graph(op: NormOp) -> tuple[Graph, Hdl, list[Hdl]]:
    """Run the op's stages on HDL values: (graph, per-element output, latched per-row values)."""
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
    a, c, k = row_affine(s1, r, e, cfg, op._mult_shift, trace)
    rows = [v for v in (a, c, k) if isinstance(v, Hdl)]
    latched = [graph.latch(v) for v in rows]
    a_l, k_l = latched[0], latched[-1]
    c_l = latched[1] if isinstance(c, Hdl) else c
    y = op._output(normalize(x, a_l, c_l, k_l, cfg, trace), trace)
    if list(trace) != list(rep.items):
        raise NotImplementedError(
            f"{cls.__name__}'s stages {list(rep.items)} differ from the unit's {list(trace)}: "
            "the op's forward changed; update compilers/rtl/norm.py"
        )
    return graph, y, rows


class NormUnit(Elaboratable):
    """One norm instance as a streaming unit (see the module docstring)."""

    def __init__(self, op: NormOp) -> None:
        self._MustUse__silence = True  # Amaranth's unused-unit warning: not for a refused op
        self.op = op
        self.n = op.config.n
        self.graph, self.y, self._rows = norm_graph(op)
        self._MustUse__silence = False
        self.passes = self.graph.passes()
        self.banks = self.passes + 2
        self.in_valid, self.in_ready = Signal(name="in_valid"), Signal(name="in_ready")
        self.in_data = Signal(fmt_shape(op.in_fmt), name="in_data")
        self.out_valid, self.out_ready = Signal(name="out_valid"), Signal(name="out_ready")
        self.out_data = Signal(fmt_shape(op.out_fmt), name="out_data")

    @property
    def ports(self) -> list[Signal]:
        return [self.in_valid, self.in_ready, self.in_data, self.out_valid, self.out_ready, self.out_data]

    @property
    def latency(self) -> int:
        return self.passes * self.n + 2

    def elaborate(self, platform: object) -> Module:
        m = Module()
        n, banks, graph = self.n, self.banks, self.graph
        stages = banks  # passes 0 … P−1, row, out
        row_stage, out_stage = self.passes, self.passes + 1
        phase = [Signal(range(stages), name=f"phase{b}") for b in range(banks)]
        ptr = [Signal(range(banks), name=f"ptr{s}") for s in range(stages)]
        active = [Array(phase)[ptr[s]] == s for s in range(stages)]
        chan = [Signal(range(n), name=f"chan{s}") for s in range(stages)]

        m.submodules.buf = buf = Memory(shape=self.in_data.shape(), depth=banks * n, init=[])
        wr = buf.write_port()

        # per-row registers, one per bank, for every row sum and latched value
        widths: dict[int, int] = {}
        for rs in graph.sums:
            if rs.result is not None and rs.result.iv is not None:
                widths[rs.slot] = rs.width(0)
        for slot, v in graph.latched.items():
            assert v.iv is not None  # the op recorded mult, offset, z_shift
            widths[slot] = rs_bits(v)
        rows: dict[int, list[Signal]] = {}

        def slot_regs(slot: int, width: int) -> list[Signal]:
            if slot not in rows:
                rows[slot] = [Signal(signed(width), name=f"row{slot}_b{b}") for b in range(banks)]
            return rows[slot]

        def finish(s: int) -> None:
            """The stage's last element (or its one clock): hand the bank on."""
            m.d.sync += Array(phase)[ptr[s]].eq((s + 1) % stages)
            with m.If(ptr[s] == banks - 1):
                m.d.sync += ptr[s].eq(0)
            with m.Else():
                m.d.sync += ptr[s].eq(ptr[s] + 1)

        # ---- statistic passes
        for p in range(self.passes):
            if p == 0:
                x = self.in_data
                step = self.in_valid & self.in_ready
                m.d.comb += self.in_ready.eq(active[0])
                m.d.comb += [wr.addr.eq(ptr[0] * n + chan[0]), wr.data.eq(self.in_data), wr.en.eq(step)]
            else:
                rd = buf.read_port(domain="comb")
                m.d.comb += rd.addr.eq(ptr[p] * n + chan[p])
                x, step = rd.data, active[p]
            ctx = Ctx(m, x, chan[p], ptr[p], rows)
            for rs in [s for s in graph.sums if s.term.pass_ == p]:
                term = signed_value(rs.term.value(ctx))
                width = widths.setdefault(rs.slot, rs.width(len(term)))
                acc = Signal(signed(width), name=f"acc{rs.slot}")
                regs = slot_regs(rs.slot, width)
                with m.If(step):
                    with m.If(chan[p] == n - 1):
                        m.d.sync += [Array(regs)[ptr[p]].eq(acc + term), acc.eq(0)]
                    with m.Else():
                        m.d.sync += acc.eq(acc + term)
            self._advance(m, p, step, chan, finish)

        # ---- the per-row chain, one clock
        for slot in graph.latched:
            slot_regs(slot, widths[slot])
        ctx = Ctx(m, self.in_data, chan[row_stage], ptr[row_stage], rows)
        with m.If(active[row_stage]):
            for slot, v in graph.latched.items():
                m.d.sync += Array(rows[slot])[ptr[row_stage]].eq(v.value(ctx))
            finish(row_stage)

        # ---- output pass
        rd = buf.read_port(domain="comb")
        m.d.comb += rd.addr.eq(ptr[out_stage] * n + chan[out_stage])
        ctx = Ctx(m, rd.data, chan[out_stage], ptr[out_stage], rows)
        y = self.y.value(ctx)
        step = active[out_stage] & (~self.out_valid | self.out_ready)
        with m.If(step):
            m.d.sync += [self.out_data.eq(y), self.out_valid.eq(1)]
        with m.Elif(self.out_ready):
            m.d.sync += self.out_valid.eq(0)
        self._advance(m, out_stage, step, chan, finish)
        return m

    def _advance(self, m: Module, s: int, step: Signal, chan: list[Signal], finish: object) -> None:
        """Count the stage's elements; the last one hands the bank on."""
        with m.If(step):
            with m.If(chan[s] == self.n - 1):
                m.d.sync += chan[s].eq(0)
                finish(s)  # type: ignore[operator]
            with m.Else():
                m.d.sync += chan[s].eq(chan[s] + 1)


def rs_bits(v: Hdl) -> int:
    """The width of a recorded per-row value (its proven interval)."""
    assert v.iv is not None
    return bits_for(v.iv.lo, v.iv.hi)
