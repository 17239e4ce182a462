"""IntSoftmax: the golden op against an exact Python-int reference, its ranges, masks,
error against float64 softmax, the QAT layer (torch.equal) and the x86 kernel."""

from __future__ import annotations

import decimal
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qnorm.analysis import OverflowRiskError
from qnorm.ops.softmax import (
    IntSoftmax,
    SoftmaxConfig,
    exp_table,
    mask_padding,
    measure_error,
)
from qnorm.qformat import QFormat

UINT8_P = QFormat(8, 2.0**-8, False)
INT16_P = QFormat(16, 2.0**-15)


def _exact_entry(scale: float, d: int, frac_bits: int) -> int:
    """round(2^F exp(−scale d)) half up, in 80-digit decimals (independent of the op's float path)."""
    with decimal.localcontext() as ctx:
        ctx.prec = 80
        v = (-(decimal.Decimal(scale) * d)).exp() * (1 << frac_bits)
        return int((v + decimal.Decimal("0.5")).to_integral_value(decimal.ROUND_FLOOR))


def _reference_row(op: IntSoftmax, row: list[int], q: int) -> list[int]:
    """The module docstring's definition in Python ints and Fractions, row q of its matrix."""
    cfg = op.config
    s, f_bits, r_bits, fo, guard = cfg.in_fmt.scale, cfg.exp_bits, cfg.inv_bits, cfg.out_frac_bits, cfg.sum_guard
    fs, mant_bits = f_bits + guard, r_bits + 2
    keep = [
        (not cfg.padding or v != cfg.in_fmt.lo) and (not cfg.causal or c <= q % cfg.query_len + cfg.causal_offset)
        for c, v in enumerate(row)
    ]
    if not any(keep):
        return [0] * len(row)
    top = max(v for v, k in zip(row, keep, strict=True) if k)

    def half_up(q: Fraction) -> int:
        return math.floor(q + Fraction(1, 2))

    def exp(d: int) -> tuple[int, int]:
        """(the sum's term in units of 2^-(F+G), the output's e in units of 2^-F)."""
        if cfg.digits == 1:
            return _exact_entry(s, d, fs), _exact_entry(s, d, f_bits)
        prod = _exact_entry(s, d % 256, fs) * _exact_entry(s, 256 * (d // 256), fs)
        return half_up(Fraction(prod, 1 << fs)), half_up(Fraction(prod, 1 << (fs + guard)))

    terms = [exp(top - v) if k else (0, 0) for v, k in zip(row, keep, strict=True)]
    total = sum(t for t, _ in terms)
    lead = total.bit_length()
    mant = half_up(Fraction(total, 1 << (lead - mant_bits)))
    r = half_up(Fraction(1 << (mant_bits - 1 + r_bits), mant))
    shift = lead - 1 + r_bits - fo - guard
    ys = [half_up(Fraction(e * r, 1 << shift)) for _, e in terms]
    return [min(max(y, cfg.out_fmt.lo), cfg.out_fmt.hi) for y in ys]


def _reference(op: IntSoftmax, x: np.ndarray) -> np.ndarray:
    rows = x.reshape(-1, op.config.n).tolist()
    return np.array([_reference_row(op, r, q) for q, r in enumerate(rows)], dtype=np.int64).reshape(x.shape)


def _logits(rng: np.random.Generator, fmt: QFormat, rows: int, n: int) -> np.ndarray:
    """Gaussian logits of random spread (attention scores), a quarter uniform over the format."""
    x = rng.normal(0.0, 1.0, (rows, n)) * rng.uniform(0.3, 6.0, (rows, 1)) / fmt.scale
    x[: rows // 4] = rng.integers(fmt.lo, fmt.hi + 1, (rows // 4, n))
    return np.clip(np.rint(x), fmt.lo, fmt.hi).astype(np.int64)


# --------------------------------------------------------------------------- the definition


@pytest.mark.parametrize(
    "n, in_fmt, out_fmt, options",
    [
        (7, QFormat(8, 0.05), UINT8_P, {}),
        (33, QFormat(8, 2.0**-4), UINT8_P, {"causal": True, "query_len": 11, "causal_offset": 2}),
        (9, QFormat(8, 0.1), UINT8_P, {"padding": True}),
        (12, QFormat(16, 2.0**-10), INT16_P, {}),
        (5, QFormat(12, 0.003), QFormat(10, 2.0**-9, False), {"padding": True, "causal": True}),
    ],
)
def test_golden_equals_the_exact_python_int_reference(n, in_fmt, out_fmt, options):
    op = IntSoftmax.build(n, in_fmt, out_fmt, **options)
    x = _logits(np.random.default_rng(n), in_fmt, 66, n)
    x[::5, ::2] = in_fmt.lo  # padding codes (masked only with padding=True)
    x[7] = in_fmt.lo  # a fully masked row with padding
    assert np.array_equal(op.forward(x), _reference(op, x))


def test_every_int8_row_of_two_against_the_reference():
    op = IntSoftmax.build(2, QFormat(8, 0.07), UINT8_P)
    v = np.arange(-128, 128)
    x = np.stack(np.meshgrid(v, v, indexing="ij"), axis=-1).reshape(-1, 2)
    y = op.forward(x)
    # by symmetry the row [a, b] depends on a − b only: one reference row per difference
    for d in range(-255, 256):
        row = [max(d, 0) - 128, max(-d, 0) - 128]
        want = _reference_row(op, row, 0)
        got = y[(x[:, 0] - x[:, 1]) == d]
        assert (got == want).all(), d


@pytest.mark.parametrize(
    "scale, step, frac_bits", [(0.05, 1, 15), (2.0**-4, 1, 15), (2.0**-10, 256, 24), (0.0371, 1, 30)]
)
def test_exp_tables_are_exactly_rounded(scale, step, frac_bits):
    table = exp_table(scale, step, 256, frac_bits)
    assert table.tolist() == [_exact_entry(scale, step * j, frac_bits) for j in range(256)]


def test_masked_columns_are_zero_and_a_fully_masked_row_is_zero():
    fmt = QFormat(8, 0.1)
    op = IntSoftmax.build(6, fmt, UINT8_P, causal=True, padding=True)
    x = np.full((2, 6, 6), 20, dtype=np.int64)
    x[1, :, 0] = fmt.lo
    y = op.forward(x)
    causal = np.tril(np.ones((6, 6), dtype=bool))
    assert (y[0][~causal] == 0).all() and (y[0][causal] > 0).all()
    assert (y[1][:, 0] == 0).all()
    assert (y[1][0] == 0).all()  # row 0 keeps only column 0, which is padding
    assert y[0, 0, 0] == UINT8_P.hi  # p = 1 saturates to 255/256


def test_mask_padding_sets_the_code_from_lengths_or_a_key_mask():
    fmt = QFormat(8, 0.1)
    x = np.array([[fmt.lo, 3, 4, 5], [1, 2, 3, 4]])
    by_length = mask_padding(x, fmt, lengths=np.array([2, 4]))
    assert by_length.tolist() == [[fmt.lo + 1, 3, fmt.lo, fmt.lo], [1, 2, 3, 4]]
    key = np.array([True, False, True, True])
    assert mask_padding(x, fmt, key_mask=key).tolist() == [[fmt.lo + 1, fmt.lo, 4, 5], [1, fmt.lo, 3, 4]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"in_fmt": QFormat(8, 0.1, False)}, "signed"),
        ({"out_fmt": QFormat(8, 0.01, False)}, "2\\^-f"),
        ({"n": 0}, "n must be"),
        ({"causal": 1}, "causal must be a bool"),
        ({"inv_bits": 4}, "inv_bits"),
        ({"lanes": 16}, "lanes"),
        ({"causal": True, "causal_offset": -64}, "masks every column"),
        # the defaults cannot hold this output's precision in 32-bit lanes: the output is named
        ({"out_fmt": QFormat(8, 2.0**-15)}, r"output LSB of 2\^-15 needs exp_bits >= 17 .* or lanes=64"),
        ({"out_fmt": QFormat(16, 2.0**-22)}, r"2\^-22 needs exp_bits >= 24, above the default 22 of 64-bit"),
    ],
)
def test_bad_configs_are_refused_naming_the_problem(kwargs, message):
    base = {"n": 64, "in_fmt": QFormat(8, 0.1), "out_fmt": UINT8_P}
    with pytest.raises(ValueError, match=message):
        SoftmaxConfig(**{**base, **kwargs})


def test_a_config_beyond_the_lanes_is_refused():
    with pytest.raises(OverflowRiskError, match="prob_product"):
        IntSoftmax.build(64, QFormat(8, 0.1), UINT8_P, exp_bits=20, lanes=32)
    with pytest.raises(OverflowRiskError, match="exp_sum"):
        IntSoftmax.build(1 << 33, QFormat(16, 2.0**-10), INT16_P)


def test_row_max_subtraction_makes_the_op_shift_invariant():
    op = IntSoftmax.build(16, QFormat(8, 0.1), UINT8_P)
    x = _logits(np.random.default_rng(3), QFormat(8, 0.1), 40, 16) // 2
    assert np.array_equal(op.forward(x), op.forward(x + 50))


# --------------------------------------------------------------------------- ranges, torch body


_FORMATS = st.sampled_from(
    [
        (QFormat(8, 0.05), UINT8_P),
        (QFormat(8, 2.0**-3), QFormat(8, 2.0**-7)),
        (QFormat(16, 2.0**-9), INT16_P),
        (QFormat(16, 2.0**-8), UINT8_P),
        (QFormat(4, 0.5), QFormat(16, 2.0**-16, False)),
    ]
)


@settings(max_examples=25, deadline=None)
@given(
    fmts=_FORMATS,
    n=st.integers(1, 40),
    query_len=st.integers(1, 8),
    causal=st.booleans(),
    padding=st.booleans(),
    offset=st.integers(0, 3),
    rounding=st.sampled_from(["half_up", "half_even", "floor", "trunc"]),
    guard=st.sampled_from([4, 8]),  # 0 is refused for the wide outputs (too short a mantissa)
    seed=st.integers(0, 2**16),
)
def test_numpy_and_torch_bodies_agree_and_stay_in_their_ranges(
    fmts, n, query_len, causal, padding, offset, rounding, guard, seed
):
    in_fmt, out_fmt = fmts
    options = {"causal": causal, "padding": padding, "causal_offset": offset, "query_len": query_len}
    op = IntSoftmax.build(n, in_fmt, out_fmt, rounding=rounding, sum_guard=guard, **options)
    rng = np.random.default_rng(seed)
    x = _logits(rng, in_fmt, 3 * query_len, n).reshape(3, query_len, n)
    x[rng.random(x.shape) < 0.2] = in_fmt.lo
    trace: dict[str, np.ndarray] = {}
    y = op.forward(x, trace)
    assert np.array_equal(op._forward(torch.from_numpy(x), None).numpy(), y)
    rep = op.ranges()
    for name, value in trace.items():
        assert rep[name].lo <= int(np.min(value)) and int(np.max(value)) <= rep[name].hi, name
    assert list(trace) == [k for k in rep.items if k in trace]
    # probabilities of a row never sum past 1 by more than the rounding of each element
    assert (y.sum(axis=-1) <= (1 << op.config.out_frac_bits) + n).all()


def test_constant_and_one_hot_rows_reach_the_row_bounds():
    """A constant row has the largest sum (N·2^(F+G), its longest bit length); a one-hot
    row the smallest non-empty sum 2^(F+G), the largest mantissa and r."""
    op = IntSoftmax.build(64, QFormat(8, 0.1), UINT8_P)
    rep = op.ranges()
    trace: dict[str, np.ndarray] = {}
    one_hot = np.full(64, -128)
    one_hot[5] = 127
    op.forward(np.stack([np.full(64, 3), one_hot]), trace)
    for name in ("sum_term", "exp", "exp_sum", "sum_bits", "out_shift", "recip"):
        assert int(trace[name].max()) == rep[name].hi, name
    for name in ("sum_bits", "out_shift"):
        assert int(trace[name].min()) == rep[name].lo, name
    assert int(trace["exp_sum"].min()) == 1 << op.config.sum_frac_bits


def test_the_sum_guard_keeps_many_rounded_up_terms_from_moving_the_max():
    """1023 keys whose exp rounds 0.52 units of 2^-15 up to 1: without guard bits
    the sum grows by 1.5 % and the max column's probability moves by 3.9 LSB."""
    fmt = QFormat(8, 0.05)
    x = np.full((1, 1024), 127 - 221)
    x[0, 0] = 127
    guarded = IntSoftmax.build(1024, fmt, UINT8_P)
    unguarded = IntSoftmax.build(1024, fmt, UINT8_P, sum_guard=0)
    assert measure_error(guarded, x).max_lsb < 0.1
    assert measure_error(unguarded, x).max_lsb > 3.5


# --------------------------------------------------------------------------- error vs float64


def test_float_reference_is_torch_softmax_with_masked_keys_at_minus_infinity():
    fmt = QFormat(8, 0.1)
    op = IntSoftmax.build(12, fmt, UINT8_P, causal=True, padding=True, query_len=4, causal_offset=1)
    x = _logits(np.random.default_rng(5), fmt, 8, 12).astype(np.float64) * fmt.scale
    x[:, 7] = fmt.lo * fmt.scale  # a padded key in every row
    keep = torch.from_numpy((np.arange(12) <= np.arange(8)[:, None] % 4 + 1) & (np.arange(12) != 7))
    want = torch.softmax(torch.from_numpy(x).masked_fill(~keep, -math.inf), dim=-1)
    assert np.array_equal(op.float_reference(x) == 0, ~keep.numpy())
    # two float64 softmaxes, summed in different orders: a few units of 2^-53 apart
    assert np.abs(op.float_reference(x) - want.numpy()).max() <= 2.0**-50


@pytest.mark.parametrize(
    "n, in_fmt, out_fmt, options",
    [
        (64, QFormat(8, 0.05), UINT8_P, {}),
        (197, QFormat(8, 2.0**-4), UINT8_P, {}),
        (16, QFormat(8, 0.1), UINT8_P, {"causal": True}),
        (64, QFormat(16, 2.0**-10), INT16_P, {}),
        (1024, QFormat(8, 2.0**-4), UINT8_P, {"padding": True}),
    ],
)
def test_error_against_float64_softmax_is_at_most_0_52_lsb(n, in_fmt, out_fmt, options):
    """Measured: 0.500–0.509 LSB max (README "Softmax"): the output rounding's 1/2
    plus table, sum and reciprocal errors of ~2^-6 LSB or less."""
    op = IntSoftmax.build(n, in_fmt, out_fmt, **options)
    x = _logits(np.random.default_rng(n), in_fmt, max(16, 96_000 // n), n)
    if options.get("padding"):
        x[::3, n // 2 :] = in_fmt.lo
    stats = measure_error(op, x)
    assert stats.max_lsb <= 0.52
    assert stats.within_1lsb == 1.0


# --------------------------------------------------------------------------- QAT layer


def test_qat_forward_is_golden_ints_times_scale_bit_for_bit():
    from qnorm.nn import IntSoftmax as QATSoftmax

    layer = QATSoftmax(24, causal=True, query_len=6, pow2=True).train()
    x = torch.randn(4, 6, 24, dtype=torch.float32) * 3
    layer(x)  # calibrates the power-of-two input scale
    layer.eval()
    y = layer(x)
    op = layer.golden()
    ints = op.in_fmt.quantize(x.to(torch.float64))
    want = torch.from_numpy(op.forward(ints.numpy())).to(torch.float32) * op.out_fmt.scale
    assert op.in_fmt.is_power_of_two
    assert torch.equal(y, want)


def test_qat_padding_by_lengths_and_key_mask_equals_the_golden_op_on_the_masked_codes():
    from qnorm.nn import IntSoftmax as QATSoftmax

    fmt = QFormat(8, 0.05)
    layer = QATSoftmax(10, in_fmt=fmt, padding=True).eval()
    x = torch.randn(3, 10) * 2
    x[0, 0] = -100.0  # saturates to the lowest code: raised to lo + 1, not padding, when masks are given
    lengths = torch.tensor([10, 4, 0])
    ints = mask_padding(fmt.quantize(x.to(torch.float64)), fmt, lengths)
    want = torch.from_numpy(layer.golden().forward(ints.numpy())).float() * UINT8_P.scale
    assert torch.equal(layer(x, lengths=lengths), want)
    assert (want[1, 4:] == 0).all() and (want[2] == 0).all() and want[0, 0] == 0.0 and (ints[0, 0] == fmt.lo + 1)
    key = torch.arange(10) < 4
    assert torch.equal(layer(x[1:2], key_mask=key), want[1:2])
    with pytest.raises(ValueError, match="padding=True"):
        QATSoftmax(10, in_fmt=fmt)(x, lengths=lengths)


def test_qat_gradient_is_the_float_softmax_gradient_over_kept_columns():
    from qnorm.nn import IntSoftmax as QATSoftmax

    fmt = QFormat(8, 2.0**-4)
    layer = QATSoftmax(8, in_fmt=fmt, causal=True).eval()
    x = (torch.randint(-60, 60, (8, 8)).to(torch.float64) * fmt.scale).requires_grad_()
    g = torch.randn(8, 8, dtype=torch.float64)
    layer(x).backward(g)
    ref = x.detach().clone().requires_grad_()
    keep = torch.tril(torch.ones(8, 8, dtype=torch.bool))
    torch.where(keep, torch.softmax(ref.masked_fill(~keep, -1e300), -1), 0.0).backward(g)
    assert torch.equal(x.grad, ref.grad)


# --------------------------------------------------------------------------- the x86 kernel


_KERNEL_OPS = {
    "masked-int8": lambda: IntSoftmax.build(
        40, QFormat(8, 0.05), UINT8_P, causal=True, padding=True, query_len=8, causal_offset=1
    ),
    "int16-two-digits": lambda: IntSoftmax.build(24, QFormat(16, 2.0**-9), INT16_P, rounding="half_even"),
}


@pytest.mark.parametrize("which", ["masked-int8", pytest.param("int16-two-digits", marks=pytest.mark.slow)])
def test_x86_kernel_is_bit_exact(which):
    """One compile by default (~15 s cold); the int16 tables' product is in verify and the slow run."""
    pytest.importorskip("tvm")
    from compilers.tvm.kernels import kernel_for
    from qnorm.targets import load_target

    op = _KERNEL_OPS[which]()
    x = _logits(np.random.default_rng(op.config.n), op.in_fmt, 400, op.config.n)
    x[::7, ::3] = op.in_fmt.lo
    x[3] = op.in_fmt.lo
    assert np.array_equal(kernel_for(op).build(load_target("x86_64"))(x), op.forward(x))
