"""A deployed RTL unit's self-checking Verilog testbench and its golden vectors.

:func:`layer_vectors` picks a layer's test inputs (edge codes of the input format,
then seeded random ones from the range the layer was calibrated on), runs the
golden op on them and puts both in the unit's stream order
(:func:`~compilers.rtl.stream.stream_order`).  :func:`hex_words` writes them as
``$readmemh`` files, :func:`testbench` the Verilog that streams ``input.hex``
through the unit and compares every output with ``expected.hex``.

The testbench is plain Verilog plus ``$fatal`` (Verilator ``--binary --timing``;
Icarus ``-g2005``: the unit's Verilog starts its combinational blocks with an event
on a register initialised in its declaration, which Verilog-2005 semantics give and
Icarus' SystemVerilog modes do not): it prints ``mismatch at output i: got g, expected e`` for the
first ten differences, then one line, ``PASS: n of n outputs equal the golden
op's (c cycles)`` or ``FAIL: k of n outputs differ from the golden op's`` (or a
stall), and a failure ends the simulation with ``$fatal`` (a non-zero exit).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compilers.rtl.stream import stream_order
from compilers.rtl.unit import RtlUnit
from qnorm.ops._normcore import NormOp
from qnorm.ops.activation import IntActivation
from qnorm.ops.base import IntOp
from qnorm.ops.softmax import IntSoftmax
from qnorm.ops.spiking import _LIFNeuron

RANDOM_VECTORS = 32  # random rows (samples, for a neuron) after the edge ones
NEURON_STEPS = 16  # time steps of a neuron's samples (at most its analysis horizon)
ACTIVATION_ELEMENTS = 16  # elements per vector of an activation (it has no row or channels of its own)
SHOWN_MISMATCHES = 10  # mismatch lines the testbench prints before its summary
INPUT_HEX, EXPECTED_HEX = "input.hex", "expected.hex"


@dataclass(frozen=True)
class Vectors:
    """A unit's test stream: inputs, start-of-sample flags (neurons; else None) and the
    golden op's outputs, all in stream order."""

    inputs: np.ndarray
    first: np.ndarray | None
    expected: np.ndarray

    @property
    def count(self) -> int:
        return int(self.inputs.size)


def _vector_shape(op: IntOp) -> tuple[int, ...]:
    """The op-layout shape of one test vector: a row of a norm or a softmax (a causal
    softmax's rows are the query rows in turn, as the unit counts them), one row of
    channels of a BN unit, one sample's (T, channels) of a neuron, a few elements of
    an activation."""
    if isinstance(op, (NormOp, IntSoftmax)):
        return (op.config.n,)
    if isinstance(op, IntActivation):
        return (ACTIVATION_ELEMENTS,)
    if isinstance(op, _LIFNeuron):
        return (min(NEURON_STEPS, op.bounds.steps or op.cfg.max_steps), *op.params.bn.shape)
    return tuple(op.bn.shape)


def layer_inputs(op: IntOp, code_range: tuple[int, int], random_count: int = RANDOM_VECTORS,
                 seed: int = 0) -> np.ndarray:  # fmt: skip
    """Op-layout inputs: vectors constant at the format's ends, at zero and at the ends of
    ``code_range`` (the calibrated codes), one alternating the format's ends, then
    ``random_count`` seeded vectors uniform over ``code_range``."""
    lo, hi = op.in_fmt.lo, op.in_fmt.hi
    c_lo, c_hi = code_range
    if not lo <= c_lo <= c_hi <= hi:
        raise ValueError(f"code range {code_range} is not within the input format's [{lo}, {hi}]")
    shape = _vector_shape(op)
    size = int(np.prod(shape))
    alternating = np.where(np.arange(size) % 2 == 0, lo, hi)
    edges = np.stack([np.full(size, v) for v in (lo, hi, 0, c_lo, c_hi)] + [alternating])
    rng = np.random.default_rng(seed)
    vectors = np.concatenate([edges, rng.integers(c_lo, c_hi + 1, (random_count, size))]).astype(np.int64)
    vectors = vectors.reshape(len(vectors), *shape)
    if isinstance(op, _LIFNeuron):  # (samples, T, ...) -> the op's time-major (T, samples, ...)
        return np.ascontiguousarray(np.moveaxis(vectors, 0, 1))
    return vectors


def layer_vectors(op: IntOp, code_range: tuple[int, int]) -> Vectors:
    """:func:`layer_inputs` and the golden op's outputs, in the unit's stream order."""
    x = layer_inputs(op, code_range)
    stream, first, _ = stream_order(op, x)
    expected, _, _ = stream_order(op, op.forward(x))
    return Vectors(stream, first, expected)


def hex_words(values: np.ndarray, bits: int, flags: np.ndarray | None = None) -> str:
    """One ``$readmemh`` word per value: its two's complement in ``bits`` bits, and with
    ``flags`` each flag as bit ``bits`` (a neuron's ``in_first`` beside its data)."""
    values = np.asarray(values, dtype=np.int64).reshape(-1)
    words = [int(v) & ((1 << bits) - 1) for v in values]
    if flags is not None:
        words = [w | (int(f) << bits) for w, f in zip(words, np.asarray(flags).reshape(-1), strict=True)]
        bits += 1
    digits = (bits + 3) // 4
    return "".join(f"{w:0{digits}x}\n" for w in words)


def input_bits(unit: RtlUnit) -> int:
    """Bits of one ``input.hex`` word: the data, and ``in_first`` above it for a neuron."""
    return unit.in_bits + int(unit.has_first)


def stall_limit(unit: RtlUnit, count: int) -> int:
    """Cycles after which a run of ``count`` elements counts as stalled (as the
    Verilator harness of :mod:`compilers.rtl.verilator` counts them)."""
    return unit.latency + 4 * unit.cycles_per_element * count + 64


_TEMPLATE = """\
// Self-checking testbench of {module}, the RTL unit of qnorm layer {layer} ({op}).
// Streams {input_hex} through the unit and compares every output with {expected_hex}
// (the golden op's outputs for the same inputs). Prints one PASS or FAIL line with
// the counts; a mismatch or a stall ends the run with $fatal (a non-zero exit).
module {module}_tb;
  localparam integer COUNT = {count};  // elements streamed in, and out
  localparam integer LIMIT = {limit};  // cycles after which the unit counts as stalled
  // out_ready is low one cycle in STALL_EVERY (0: always high), to exercise back-pressure.
  parameter integer STALL_EVERY = 0;

  reg clk = 1'b0;
  reg rst = 1'b1;
  reg [{word_msb}:0] inputs [0:COUNT-1];{first_note}
  reg [{out_msb}:0] expected [0:COUNT-1];
  integer sent = 0;
  integer got = 0;
  integer errors = 0;
  integer cycles = 0;

  wire in_valid = !rst && sent < COUNT;
  wire [{word_msb}:0] word = inputs[sent < COUNT ? sent : 0];
  wire out_ready = !rst && !(STALL_EVERY > 0 && cycles % STALL_EVERY == STALL_EVERY - 1);
  wire in_ready;
  wire out_valid;
  wire [{out_msb}:0] out_data;

  {module} dut (
    .clk(clk), .rst(rst),
    .in_valid(in_valid), .in_ready(in_ready), .in_data(word[{in_msb}:0]),{first_port}
    .out_valid(out_valid), .out_ready(out_ready), .out_data(out_data)
  );

  always #5 clk = ~clk;

  initial begin
    $readmemh("{input_hex}", inputs);
    $readmemh("{expected_hex}", expected);
    @(posedge clk);
    @(posedge clk);
    rst <= 1'b0;
  end

  always @(posedge clk) begin
    if (!rst) begin
      cycles <= cycles + 1;
      if (in_valid && in_ready) sent <= sent + 1;
      if (out_valid && out_ready && got < COUNT) begin
        if (out_data !== expected[got]) begin
          if (errors < {shown}) $display("mismatch at output %0d: got %0d, expected %0d", got, {got_value}, {want_value});
          errors <= errors + 1;
        end
        got <= got + 1;
      end
      if (got == COUNT) begin
        if (errors == 0) begin
          $display("PASS: %0d of %0d outputs equal the golden op's (%0d cycles)", COUNT, COUNT, cycles);
          $finish;
        end else begin
          $display("FAIL: %0d of %0d outputs differ from the golden op's", errors, COUNT);
          $fatal(1, "{module}: outputs differ from {expected_hex}");
        end
      end else if (cycles > LIMIT) begin
        $display("FAIL: stalled: %0d of %0d outputs after %0d cycles", got, COUNT, cycles);
        $fatal(1, "{module}: stalled");
      end
    end
  end
endmodule
"""


def testbench(unit: RtlUnit, module: str, layer: str, count: int) -> str:
    """The Verilog testbench (module ``<module>_tb``) of ``unit`` exported as ``module``,
    for ``count`` elements of :data:`INPUT_HEX` / :data:`EXPECTED_HEX`."""
    signed = "$signed({})" if unit.out_signed else "{}"
    return _TEMPLATE.format(
        module=module,
        layer=layer,
        op=unit.op.name,
        count=count,
        limit=stall_limit(unit, count),
        word_msb=input_bits(unit) - 1,
        in_msb=unit.in_bits - 1,
        out_msb=unit.out_bits - 1,
        first_note=f"  // bit {unit.in_bits}: in_first" if unit.has_first else "",
        first_port=f"\n    .in_first(word[{unit.in_bits}])," if unit.has_first else "",
        shown=SHOWN_MISMATCHES,
        got_value=signed.format("out_data"),
        want_value=signed.format("expected[got]"),
        input_hex=INPUT_HEX,
        expected_hex=EXPECTED_HEX,
    )
