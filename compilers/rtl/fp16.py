"""An FP16 LayerNorm unit: the floating-point reference the integer norms' resources are
compared with (issue 12, P5: "L1 vs FP16" measured on our own units, not quoted).

Interface: the integer units' plain stream signals (:class:`~compilers.rtl.stream.StreamUnit`),
``in_valid``/``in_ready``/``in_data`` and ``out_valid``/``out_ready``/``out_data``, the data
16-bit fp16 words: rows of ``n`` elements in back to back, the fp16 results out.

Arithmetic (:mod:`compilers.rtl.fparith`: IEEE round to nearest even, subnormals
flushed to zero, no infinities or NaNs):

1. **Load** (one element per clock): the element is kept in a row buffer (block RAM),
   widened to fp32 and squared; the next clock ``S += x`` and ``Q += x·x`` in fp32.
2. **Per row** (:data:`PROGRAM`, one fp32 multiply or add per clock on the same two
   units): ``μ = S/n``, ``σ² = max(Q/n − μ², 0)``, ``v = σ² + ε``; ``r = 1/√v`` from a
   table seed (the exponent's parity and :data:`SEED_BITS` mantissa bits; relative
   error ≤ 2^-8) and :data:`NEWTON_STEPS` Newton steps ``r ← r·(1.5 − (v/2)·r²)``.
3. **Out** (one element per clock, one operation per pipeline stage): ``z = (x − μ)·r``
   in fp32, rounded to fp16, then ``y = z·γ_c + β_c`` in fp16 (γ, β: per-channel fp16
   ROMs).

Error against LayerNorm computed exactly on the same fp16 inputs and fp16 γ, β
(:func:`error_bound`): with u = 2^-11 (fp16's unit roundoff), three fp16 roundings
(z, the product, the sum) and the reference's own rounding of y give
``|y − y_ref| ≤ (1 + 4u)·2u·(|γ·z| + |y|)``; the fp32 part adds at most ``|γ|·e_z``,
``e_z = (n + 8)·2^-24·(|z|·(σ² + μ²)/(σ² + ε) + max|x|/√(σ² + ε))`` (recursive fp32
sums of x and x², then a few per-row operations): small while |μ| is a few σ, growing
with (μ/σ)² as every one-pass ``Q/n − μ²`` variance does.

Simplifications, stated: the unit loads, computes and emits one row at a time, so a
row takes :meth:`FP16LayerNorm.cycles_per_row` = ``2n + len(PROGRAM) + 6`` clocks, not
``n``; it holds one set of fp units and one row buffer, less than a line-rate unit
would need (the resource comparison is conservative in FP16's favour).  The load's
multiply and the output chain are pipelined (:data:`OUT_STAGES`), but each fp32 sum is
one adder in a one-clock loop and each per-row step one fp32 operation per clock, so a
whole fp32 add bounds the clock.
"""

from __future__ import annotations

import math

import numpy as np
from amaranth import Array, Cat, Const, Module, Mux, Signal, signed, unsigned
from amaranth.lib import memory

from compilers.rtl.fparith import FP16, FP32, FloatAdd, FloatConvert, FloatMul
from compilers.rtl.stream import StreamUnit

OUT_STAGES = 4  # registers from the row buffer's read to out_data: x − μ, ·r, ·γ, +β
SEED_BITS = 6  # mantissa bits indexing the 1/sqrt seed table
NEWTON_STEPS = 2  # 2^-8 → ~2^-15 → fp32 rounding
UNIT_ROUNDOFF = 2.0**-11  # fp16

# One step per clock: (operation, destination, first operand, second operand).
# "sub" is first − second; "seed" reads the 1/sqrt table for its operand.
PROGRAM: tuple[tuple[str, ...], ...] = (
    ("mul", "mean", "S", "inv_n"),
    ("mul", "t", "Q", "inv_n"),  # E[x²]
    ("mul", "v", "mean", "mean"),
    ("sub", "v", "t", "v"),  # σ² = E[x²] − μ²
    ("add", "v", "v_nonneg", "eps"),  # rounding can leave σ² slightly negative
    ("mul", "h", "v", "half"),
    ("seed", "r", "v", ""),
    *(
        step
        for _ in range(NEWTON_STEPS)
        for step in (
            ("mul", "t", "r", "r"),
            ("mul", "t", "t", "h"),
            ("sub", "t", "three_halves", "t"),
            ("mul", "r", "r", "t"),
        )
    ),
)
_REGISTERS = ("S", "Q", "mean", "t", "v", "h", "r")


def f32_bits(x: float) -> int:
    return int(np.float32(x).view(np.uint32))


def f16_bits(values: np.ndarray) -> list[int]:
    return [int(v) for v in np.asarray(values, dtype=np.float16).view(np.uint16)]


def rsqrt_seed_table() -> list[int]:
    """fp32 mantissas of 1/√w at the middle of each interval of w = 2^p·1.f (p = the
    exponent's parity, f's top :data:`SEED_BITS` bits): every entry is in (0.5, 1)."""
    table = []
    for parity in (0, 1):
        for i in range(1 << SEED_BITS):
            w = (1 + (i + 0.5) / (1 << SEED_BITS)) * 2**parity
            mantissa, exponent = math.frexp(1 / math.sqrt(w))  # mantissa in [0.5, 1)
            assert exponent == 0
            table.append(f32_bits(mantissa) & ((1 << FP32.mant_bits) - 1))
    return table


class FP16LayerNorm(StreamUnit):
    """LayerNorm over rows of ``n`` fp16 elements, per-channel fp16 ``gamma``, ``beta``."""

    def __init__(self, n: int, gamma: np.ndarray, beta: np.ndarray, eps: float = 1e-5) -> None:
        if n < 2:
            raise ValueError(f"a LayerNorm row needs n >= 2 elements, got {n}")
        gamma, beta = np.asarray(gamma, dtype=np.float16), np.asarray(beta, dtype=np.float16)
        if gamma.shape != (n,) or beta.shape != (n,):
            raise ValueError(f"gamma and beta must have shape ({n},), got {gamma.shape} and {beta.shape}")
        if not (np.isfinite(gamma).all() and np.isfinite(beta).all()):
            raise ValueError("gamma and beta must be finite")
        self.n, self.gamma, self.beta, self.eps = n, gamma, beta, eps
        self._make_stream_ports(unsigned(16), unsigned(16))  # fp16 bit patterns

    @property
    def cycles_per_row(self) -> int:
        """Clocks from one row's first result out to the next row's, rows arriving back to
        back and ``out_ready`` held high: n to load and one to sum the last element, the
        per-row program, n + 1 + :data:`OUT_STAGES` to emit (one clock to read the row
        buffer, then the output pipeline)."""
        return 2 * self.n + len(PROGRAM) + 2 + OUT_STAGES

    def elaborate(self, platform: object) -> Module:
        m = Module()
        n = self.n
        m.submodules.buffer = buffer = memory.Memory(shape=16, depth=n, init=[])
        m.submodules.gamma = gamma = memory.Memory(shape=16, depth=n, init=f16_bits(self.gamma))
        m.submodules.beta = beta = memory.Memory(shape=16, depth=n, init=f16_bits(self.beta))
        write = buffer.write_port()
        reads = [mem.read_port(domain="sync") for mem in (buffer, gamma, beta)]

        m.submodules.widen = widen = FloatConvert(FP16, FP32)
        m.submodules.mul = mul = FloatMul(FP32)
        m.submodules.add = add = FloatAdd(FP32)
        m.submodules.add_q = add_q = FloatAdd(FP32)  # Q's sum, beside S's during the load
        m.submodules.narrow = narrow = FloatConvert(FP32, FP16)
        m.submodules.mul16 = mul16 = FloatMul(FP16)
        m.submodules.add16 = add16 = FloatAdd(FP16)

        regs = {name: Signal(32, name=f"r_{name}") for name in _REGISTERS}
        index = Signal(range(n + 1))

        # The load's pipeline register: an element widened and squared, summed next clock.
        loaded = {"x": Signal(32), "x2": Signal(32), "valid": Signal()}

        with m.FSM():
            with m.State("LOAD"):
                self._load(m, write, widen, mul, loaded, index)
                self._accumulate(m, add, add_q, regs, loaded)
            with m.State("DRAIN"):  # the row's last element into S and Q
                self._accumulate(m, add, add_q, regs, loaded)
                m.d.sync += loaded["valid"].eq(0)
                m.next = "STEP0"
            for step, (op, dst, a, b) in enumerate(PROGRAM):
                with m.State(f"STEP{step}"):
                    self._step(m, op, regs, dst, a, b, mul, add)
                    m.next = f"STEP{step + 1}" if step + 1 < len(PROGRAM) else "OUT"
                    if step + 1 == len(PROGRAM):
                        m.d.sync += index.eq(0)
            with m.State("OUT"):
                self._emit(m, reads, widen, mul, add, narrow, mul16, add16, regs, index)
        return m

    def _load(self, m: Module, write, widen, mul, loaded: dict, index: Signal) -> None:
        """Accept one element per clock: into the row buffer, widened and squared into
        the load's pipeline register."""
        m.d.comb += [
            self.in_ready.eq(1),
            write.addr.eq(index),
            write.data.eq(self.in_data),
            write.en.eq(self.in_valid),
            widen.a.eq(self.in_data),
            mul.a.eq(widen.o),
            mul.b.eq(widen.o),
        ]
        m.d.sync += [loaded["x"].eq(widen.o), loaded["x2"].eq(mul.o), loaded["valid"].eq(self.in_valid)]
        with m.If(self.in_valid):
            m.d.sync += index.eq(index + 1)
            with m.If(index == self.n - 1):
                m.next = "DRAIN"

    def _accumulate(self, m: Module, add, add_q, regs: dict, loaded: dict) -> None:
        """``S += x``, ``Q += x·x`` for the element in the load's pipeline register."""
        m.d.comb += [add.a.eq(regs["S"]), add.b.eq(loaded["x"]), add_q.a.eq(regs["Q"]), add_q.b.eq(loaded["x2"])]
        with m.If(loaded["valid"]):
            m.d.sync += [regs["S"].eq(add.o), regs["Q"].eq(add_q.o)]

    def _step(self, m: Module, op: str, regs: dict, dst: str, a: str, b: str, mul, add) -> None:
        """One step of :data:`PROGRAM` on the shared fp32 multiplier or adder."""
        v = regs["v"]
        sources = {
            **regs,
            "inv_n": Const(f32_bits(1 / self.n), 32),
            "eps": Const(f32_bits(self.eps), 32),
            "half": Const(f32_bits(0.5), 32),
            "three_halves": Const(f32_bits(1.5), 32),
            "v_nonneg": Mux(v[31], 0, v),
        }
        if op == "seed":
            m.d.sync += regs[dst].eq(self._seed(m, regs[a]))
            return
        unit = mul if op == "mul" else add
        m.d.comb += [unit.a.eq(sources[a]), unit.b.eq(sources[b])]
        if op == "sub":
            m.d.comb += add.sub_b.eq(1)
        m.d.sync += regs[dst].eq(unit.o)

    def _seed(self, m: Module, v: Signal) -> Signal:
        """A first 1/√v: the table's mantissa, the exponent halved (v > 0, normal)."""
        exp = v[23:31]
        parity = ~exp[0]  # the unbiased exponent (exp − 127) is odd when exp is even
        index = Cat(v[23 - SEED_BITS : 23], parity)
        table = Array(Const(x, 23) for x in rsqrt_seed_table())
        half = Signal(signed(10))  # (e − parity)/2, e the unbiased exponent: exact
        m.d.comb += half.eq((exp - FP32.bias - parity) >> 1)
        seed = Signal(32)
        m.d.comb += seed.eq(Cat(table[index], (FP32.bias - 1 - half)[:8], Const(0, 1)))
        return seed

    def _emit(self, m: Module, reads, widen, mul, add, narrow, mul16, add16, regs: dict, index: Signal) -> None:
        """Emit one element per clock that the output accepts, through a pipeline of
        :data:`OUT_STAGES` registers that all advance when the output can take a result.

        The row buffer and the γ, β ROMs are read one clock ahead; ``pending`` says the
        read ports hold the next element's data.  ``index`` counts the reads issued."""
        x_read, gamma_read, beta_read = reads
        pending = Signal()
        emitted = Signal(range(self.n + 1))
        centred = {"d": Signal(32), "gamma": Signal(16), "beta": Signal(16), "valid": Signal()}
        scaled = {"z": Signal(32), "gamma": Signal(16), "beta": Signal(16), "valid": Signal()}
        weighted = {"p": Signal(16), "beta": Signal(16), "valid": Signal()}
        advance = ~self.out_valid | self.out_ready
        m.d.comb += [
            *(r.addr.eq(index) for r in reads),
            *(r.en.eq(advance) for r in reads),
            widen.a.eq(x_read.data),
            add.a.eq(widen.o),
            add.b.eq(regs["mean"]),
            add.sub_b.eq(1),
            mul.a.eq(centred["d"]),
            mul.b.eq(regs["r"]),
            narrow.a.eq(scaled["z"]),
            mul16.a.eq(narrow.o),
            mul16.b.eq(scaled["gamma"]),
            add16.a.eq(weighted["p"]),
            add16.b.eq(weighted["beta"]),
        ]
        last_taken = self.out_valid & self.out_ready & (emitted == self.n - 1)
        with m.If(self.out_valid & self.out_ready):
            m.d.sync += emitted.eq(emitted + 1)
        with m.If(last_taken):  # the row's last element is taken; the pipeline is empty
            m.d.sync += [emitted.eq(0), pending.eq(0), index.eq(0), regs["S"].eq(0), regs["Q"].eq(0)]
            m.d.sync += self.out_valid.eq(0)
            m.next = "LOAD"
        with m.Elif(advance):
            m.d.sync += [
                centred["d"].eq(add.o),
                centred["gamma"].eq(gamma_read.data),
                centred["beta"].eq(beta_read.data),
                centred["valid"].eq(pending),
                scaled["z"].eq(mul.o),
                scaled["gamma"].eq(centred["gamma"]),
                scaled["beta"].eq(centred["beta"]),
                scaled["valid"].eq(centred["valid"]),
                weighted["p"].eq(mul16.o),
                weighted["beta"].eq(scaled["beta"]),
                weighted["valid"].eq(scaled["valid"]),
                self.out_data.eq(add16.o),
                self.out_valid.eq(weighted["valid"]),
                pending.eq(index < self.n),
            ]
            with m.If(index < self.n):
                m.d.sync += index.eq(index + 1)


def reference(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """LayerNorm of fp16 rows computed in float64 from the same fp16 inputs and γ, β,
    rounded once to fp16 (what the unit approximates)."""
    x64 = np.asarray(x, dtype=np.float16).astype(np.float64)
    mean = x64.mean(axis=-1, keepdims=True)
    var = x64.var(axis=-1, keepdims=True)
    z = (x64 - mean) / np.sqrt(var + eps)
    g, b = np.asarray(gamma, np.float16).astype(np.float64), np.asarray(beta, np.float16).astype(np.float64)
    return (z * g + b).astype(np.float16)


def error_bound(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """The bound the module docstring derives, elementwise, for rows ``x`` of n:
    ``(1 + 4u)·2u·(|γz| + |y|) + |γ|·e_z + 2·tiny``, where the fp32 part
    ``e_z = (n + 8)·2^-24·(|z|·(σ² + μ²)/(σ² + ε) + max|x|/√(σ² + ε))`` bounds what
    recursive fp32 sums of x and x² and the per-row steps can do to z, and tiny (the
    smallest fp16 normal) covers a flushed subnormal."""
    x64 = np.asarray(x, dtype=np.float16).astype(np.float64)
    n = x64.shape[-1]
    mean, var = x64.mean(axis=-1, keepdims=True), x64.var(axis=-1, keepdims=True)
    z = (x64 - mean) / np.sqrt(var + eps)
    g = np.abs(np.asarray(gamma, np.float16).astype(np.float64))
    y = np.abs(reference(x, gamma, beta, eps).astype(np.float64))
    largest = np.abs(x64).max(axis=-1, keepdims=True)
    e_z = (n + 8) * 2.0**-24 * (np.abs(z) * (var + mean**2) / (var + eps) + largest / np.sqrt(var + eps))
    u = UNIT_ROUNDOFF
    return (1 + 4 * u) * 2 * u * (g * np.abs(z) + y) + g * e_z + 2 * float(np.finfo(np.float16).tiny)
