"""Integer GELU and SiLU: every input code against the exact function, the segment bound,
the exact tails, the range analysis, the QAT layers and the x86 kernel, bit for bit."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from qnorm.analysis import OverflowRiskError, check_target, products
from qnorm.fixedpoint import Round
from qnorm.nn.activation import IntGELU as GELULayer
from qnorm.nn.activation import IntSiLU as SiLULayer
from qnorm.ops.activation import (
    MAX_TABLE_BITS,
    SEGMENT_TOLERANCE,
    ActivationConfig,
    IntGELU,
    IntSiLU,
)
from qnorm.qformat import QFormat
from qnorm.targets import load_target

OPS = (IntGELU, IntSiLU)
NEAREST = (Round.HALF_UP, Round.HALF_EVEN, Round.HALF_AWAY)
S8, S16 = QFormat.power_of_two(8, -4), QFormat.power_of_two(16, -11)
D8, D8_OUT, D16, D16_OUT = QFormat(8, 0.05), QFormat(8, 3 / 128), QFormat(16, 0.0005), QFormat(16, 0.0007)
INT8_CONFIGS = [(S8, S8), (D8, D8_OUT), (D8, QFormat(4, 0.25, signed=False))]
INT16_CONFIGS = [(S16, S16), (D16, D16_OUT), (S16, S8)]

mpmath.mp.dps = 40


def exact_lsb(op_cls: type, x: np.ndarray, out: QFormat) -> list[mpmath.mpf]:
    """f(x) / s_out with 40 digits (x: the float64 input values, exact binary fractions)."""
    def f(v: float) -> mpmath.mpf:
        v = mpmath.mpf(v)
        return v * mpmath.erfc(-v / mpmath.sqrt(2)) / 2 if op_cls is IntGELU else v / (1 + mpmath.exp(-v))

    return [f(float(v)) / mpmath.mpf(out.scale) for v in x]


def codes(fmt: QFormat) -> np.ndarray:
    return np.arange(fmt.lo, fmt.hi + 1, dtype=np.int64)


def error_lsb(op, q: np.ndarray) -> np.ndarray:
    """|y − clip(f / s_out)| per code, against the float64 reference."""
    ref = op.float_reference(op.in_fmt.dequantize(q)) / op.out_fmt.scale
    return np.abs(op.forward(q) - np.clip(ref, op.out_fmt.lo, op.out_fmt.hi))


# --------------------------------------------------------------------------- tables (<= 12 bits)


@pytest.mark.parametrize("op_cls", OPS, ids=lambda c: c.name)
@pytest.mark.parametrize("in_fmt, out_fmt", INT8_CONFIGS, ids=["pow2", "dyadic", "uint4-out"])
def test_an_int8_table_is_the_correctly_rounded_function_on_every_code(op_cls, in_fmt, out_fmt):
    op = op_cls.of(in_fmt, out_fmt)
    assert op.algorithm == "table" and op.table.size == 256
    q = codes(in_fmt)
    exact = exact_lsb(op_cls, in_fmt.dequantize(q), out_fmt)
    y = op.forward(q)
    # half up of the exact value, saturated; a value within 1e-9 LSB of a tie is left out
    # (the float64 reference may land on either side of it)
    want = [min(max(int(mpmath.floor(e + mpmath.mpf(1) / 2)), out_fmt.lo), out_fmt.hi) for e in exact]
    clear = [abs(e - mpmath.floor(e) - mpmath.mpf(1) / 2) > 1e-9 for e in exact]
    assert sum(clear) >= 250
    assert [int(v) for v, c in zip(y, clear, strict=True) if c] == [w for w, c in zip(want, clear, strict=True) if c]
    worst = max(abs(int(v) - min(max(e, out_fmt.lo), out_fmt.hi)) for v, e in zip(y, exact, strict=True))
    assert worst <= 0.5 + 1e-9


@pytest.mark.parametrize("mode", list(Round), ids=lambda m: m.value)
def test_every_tie_rule_bounds_the_table_error(mode):
    op = IntGELU.of(D8, D8_OUT, mode)
    err = error_lsb(op, codes(D8))
    assert err.max() <= (0.5 if mode in NEAREST else 1.0)
    assert err.max() > 0.4  # the bound is reached, not vacuous


# --------------------------------------------------------------------------- segments (13-16 bits)


@pytest.mark.parametrize("op_cls", OPS, ids=lambda c: c.name)
@pytest.mark.parametrize("in_fmt, out_fmt", INT16_CONFIGS, ids=["pow2", "dyadic", "int8-out"])
def test_int16_segments_stay_within_the_asserted_bound_on_every_code(op_cls, in_fmt, out_fmt):
    op = op_cls.of(in_fmt, out_fmt)
    assert op.algorithm == "segments"
    seg = op.segments
    assert seg.error <= SEGMENT_TOLERANCE
    assert op.cost()["constants"]["words"] == 3 * (65536 >> seg.bits) < 65536 // 64
    err = error_lsb(op, codes(in_fmt))
    assert err.max() <= 0.5 + seg.error + 1e-12
    assert err.max() <= 0.5 + SEGMENT_TOLERANCE


def test_directed_rounding_of_segments_is_within_one_lsb_and_the_deviation():
    op = IntSiLU.of(D16, D16_OUT, Round.FLOOR)
    err = error_lsb(op, codes(D16))
    assert err.max() <= 1.0 + op.segments.error + 1e-12
    assert err.max() > 0.9


@pytest.mark.parametrize("op_cls", OPS, ids=lambda c: c.name)
def test_saturating_tails_are_exact(op_cls):
    op = op_cls.of(S16, S16)
    q = codes(S16)
    x, y = S16.dequantize(q), op.forward(q)
    assert np.array_equal(y[x <= -12], np.zeros(int(np.sum(x <= -12)), dtype=np.int64))
    if op_cls is IntGELU:  # x Φ(−x) < 1e-14 LSB beyond 8: GELU(x) = x on the grid
        assert np.array_equal(y[x >= 8], q[x >= 8])


def test_the_segment_products_fit_the_fpga_and_a_table_has_none():
    fpga = load_target("fpga-hls")
    seg_op, table_op = IntGELU.of(S16, S16), IntGELU.of(S8, S8)
    assert [p.formula for p in products(seg_op)] == ["C·(t−h)", "t·slope"]
    assert products(table_op) == []
    for op in (seg_op, table_op):
        check_target(op, fpga)


@pytest.mark.parametrize("in_fmt, out_fmt", [(S16, S16), (D16, D16_OUT), (S16, S8)], ids=["pow2", "dyadic", "int8-out"])
def test_the_numerator_range_is_the_exact_extremum_of_every_segment_quadratic(in_fmt, out_fmt):
    """Independently of the exhaustive evaluation: N(t) = C t² + (B − C h) t + A on [0, W) has its
    extremes at the ends or the integers next to the vertex, in exact Python ints."""
    op = IntSiLU.of(in_fmt, out_fmt)
    seg = op.segments
    w, h = 1 << seg.bits, 1 << (seg.bits - 1)
    values = []
    for a, b, c in zip(seg.a.tolist(), seg.b.tolist(), seg.c.tolist(), strict=True):
        linear = b - c * h
        ts = {0, w - 1}
        if c != 0:
            vertex = -linear / (2 * c)
            ts |= {t for t in (math.floor(vertex), math.ceil(vertex)) if 0 <= t < w}
        values += [a + linear * t + c * t * t for t in ts]
    rep = op.ranges()
    assert (rep["numerator"].lo, rep["numerator"].hi) == (min(values), max(values))
    assert rep.max_bits <= 47  # the FPGA target's accumulator, less its rounding bit


def test_torch_int64_runs_the_same_body():
    for op in (IntGELU.of(S16, S16), IntSiLU.of(D8, D8_OUT)):
        q = codes(op.in_fmt)
        assert np.array_equal(op._forward(torch.from_numpy(q), None).numpy(), op.forward(q))


@settings(max_examples=12, deadline=None)
@given(
    op_cls=st.sampled_from(OPS),
    bits=st.integers(4, MAX_TABLE_BITS),
    in_scale=st.floats(1 / 256, 1.0),
    out_bits=st.sampled_from([8, 12, 16]),
    out_exp=st.integers(-10, -2),
    mode=st.sampled_from(list(Round)),
)
def test_forced_segments_agree_with_the_table_away_from_rounding_boundaries(
    op_cls, bits, in_scale, out_bits, out_exp, mode
):
    in_fmt, out_fmt = QFormat(bits, in_scale), QFormat.power_of_two(out_bits, out_exp)
    table = op_cls(ActivationConfig(in_fmt, out_fmt, mode))
    try:
        seg = op_cls(ActivationConfig(in_fmt, out_fmt, mode, algorithm="segments"))
    except OverflowRiskError:  # an output grid far finer than the input's: refused, named
        return
    q = codes(in_fmt)
    ref = op_cls.function(in_fmt.dequantize(q)) / out_fmt.scale
    # the table's output is f rounded; the segments' is f moved by at most segments.error, then
    # rounded: they agree unless f lies that close to a rounding boundary (n or n + 1/2)
    edge = 0.0 if mode in (Round.FLOOR, Round.CEIL, Round.TRUNC) else 0.5
    frac = ref - np.floor(ref)
    near = np.abs(frac - edge) <= seg.segments.error + 1e-12
    if edge == 0.0:
        near |= np.abs(frac - 1.0) <= seg.segments.error + 1e-12
    same = seg.forward(q) == table.forward(q)
    assert np.all(same | near)


def test_bad_configs_are_refused_by_name():
    with pytest.raises(ValueError, match="at most 16 bits"):
        ActivationConfig(QFormat(17, 1.0), S8)
    with pytest.raises(ValueError, match="tables are limited to 12-bit inputs"):
        ActivationConfig(S16, S16, algorithm="table")
    with pytest.raises(ValueError, match="unknown activation algorithm 'spline'"):
        ActivationConfig(S8, S8, algorithm="spline")
    with pytest.raises(ValueError, match="in_fmt must be a QFormat"):
        ActivationConfig(8, S8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside the declared 8-bit"):
        IntGELU.of(S8, S8).forward(np.array([200]))


# --------------------------------------------------------------------------- QAT layers


@pytest.mark.parametrize("layer_cls, op_cls", [(GELULayer, IntGELU), (SiLULayer, IntSiLU)], ids=["gelu", "silu"])
@pytest.mark.parametrize("fmt", [S8, D16], ids=["int8", "int16"])
def test_the_qat_forward_is_the_golden_integers_times_the_scale(layer_cls, op_cls, fmt):
    layer = layer_cls(in_fmt=fmt, out_fmt=fmt)
    x = (torch.linspace(-20, 20, 4001, dtype=torch.float32) * (fmt.hi * fmt.scale / 16)).reshape(1, 4001)
    x.requires_grad_(True)
    y = layer(x)
    ints = op_cls.of(fmt, fmt).forward(fmt.quantize(x.detach()).numpy())
    assert torch.equal(y.detach(), torch.from_numpy(ints).to(torch.float32) * fmt.scale)
    assert layer.golden() is op_cls.of(fmt, fmt)
    # straight-through backward: the float activation's derivative, 0 where input or output clip
    y.sum().backward()
    probe = (fmt.quantize(x.detach()).to(torch.float32) * fmt.scale).requires_grad_(True)  # the layer's dequant
    (F.gelu(probe) if op_cls is IntGELU else F.silu(probe)).sum().backward()
    inside = (x.detach().abs() <= fmt.hi * fmt.scale) & (probe.detach().abs() < fmt.hi * fmt.scale)
    assert torch.equal(x.grad[inside], probe.grad[inside])
    assert torch.all(x.grad[x.detach() > fmt.hi * fmt.scale * 1.01] == 0)


def test_a_calibrated_layer_takes_any_shape_and_describes_its_golden_op():
    layer = SiLULayer(in_bits=8)
    layer.train()
    layer(torch.randn(4, 3, 5) * 3)
    layer.eval()
    x = torch.randn(2, 7)
    q = layer.input_quant.fmt.quantize(x)
    ints = layer.golden().forward(q.numpy())
    assert torch.equal(layer(x), torch.from_numpy(ints).to(torch.float32) * layer.out_fmt.scale)
    meta = layer.qnorm_metadata()["golden"]
    assert meta["op"] == "int_silu" and meta["constants"]["algorithm"] == "table"
    assert meta["constants"]["table"] == layer.golden().table.tolist()


# --------------------------------------------------------------------------- the x86 kernel


@pytest.mark.parametrize("op", [IntGELU.of(D8, D8_OUT, Round.HALF_EVEN), IntSiLU.of(S16, S16)], ids=["gelu-table", "silu-segments"])
def test_the_x86_kernel_is_bit_exact_on_every_code(op):
    pytest.importorskip("tvm")
    from compilers.tvm.kernels import kernel_for
    from compilers.tvm.kernels.activation import ELEMENT_ROW

    compiled = kernel_for(op).build(load_target("x86_64"))
    q = codes(op.in_fmt).reshape(-1, ELEMENT_ROW)
    assert np.array_equal(compiled(q), op.forward(q))
    with pytest.raises(ValueError, match="takes rows of shape"):
        compiled(q.reshape(-1, ELEMENT_ROW // 2))


def test_the_kernel_takes_rows_of_any_length():
    pytest.importorskip("tvm")
    from compilers.tvm.kernels import kernel_for

    op = IntGELU.of(D8, D8_OUT, Round.HALF_EVEN)
    compiled = kernel_for(op, row=24).build(load_target("x86_64"))  # not a multiple of ELEMENT_ROW
    q = codes(op.in_fmt).reshape(-1, 32)[:, :24]
    assert np.array_equal(compiled(q), op.forward(q))
    with pytest.raises(ValueError, match="at least one element"):
        kernel_for(op, row=0)
