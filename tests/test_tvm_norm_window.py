"""The norm kernels' output stage with one clamp window for every channel, or none,
or on 16-bit lanes, and rows that skip the clamp.

``norm_kernel`` replaces the op's per-channel clamp windows by one shared window
(or no clamp where z's range allows) where :func:`_shared_window` proves the sums
stay in the lanes, and runs the stage on 16-bit lanes (the high half of zc·m_c)
where :func:`_high_half` proves that exact.  Checked here: the shared and the 16-bit
constants give the op's ``_output`` on every z of the proven range (each z inside
the window, a stride beyond it, where the output is saturated or constant), the
kernels pick the cheapest form that is proven, and the compiled kernels stay
bit-exact.  Rows whose z keeps every sum in the lanes run without the clamp
(:func:`_row_reach`): the unclamped sums give the op's outputs on every z of the
reach, and a kernel given rows of both kinds is bit-exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from compilers.tvm.kernels import kernel_for
from compilers.fpga.kernel_c import HLS
from compilers.tvm.kernels.norms import HIGH_HALF, _high_half, _row_reach, _shared_window
from qnorm.fixedpoint import Round, clamp, rshift_round, saturate
from qnorm.ops import IntLayerNorm, IntRMSNorm, L1LayerNorm, ShiftLayerNorm
from qnorm.qformat import QFormat
from tests.test_tvm_kernels import check_kernel, edge_rows, random_rows

INT8 = QFormat(8, 0.05)
BEYOND_STRIDE = 97  # z beyond the window: a stride (the clamp holds them all at an end)


def trained_op(cls: type, n: int, rounding: Round = Round.HALF_UP, bias: bool = True) -> Any:
    """γ ≈ 1 with some negative and one zero, β ≈ 0 with two channels that saturate
    (no β for RMSNorm or ``bias=False``)."""
    rng = np.random.default_rng(n)
    gamma = rng.normal(1.0, 0.1, n)
    gamma[::17] *= -1.0
    gamma[5] = 0.0
    beta = rng.normal(0.0, 0.1, n)
    beta[7], beta[9] = 40.0, -40.0  # constant channels: their whole range saturates
    return cls.from_float(gamma, beta if bias and cls is not IntRMSNorm else None, 1e-5, in_fmt=INT8, rounding=rounding)


def form(op: Any) -> str:
    kernel = kernel_for(op)
    names = {p.name for p in kernel.mod["main"].params}
    if "lo" in names:
        return "per channel"
    if "window" in names:
        return "shared"
    return "16-bit" if {str(c.dtype) for c in kernel.consts} == {HIGH_HALF} else "no clamp"


CASES = [
    (IntLayerNorm, 256, Round.HALF_UP, "no clamp"),
    (ShiftLayerNorm, 384, Round.HALF_UP, "no clamp"),
    (IntLayerNorm, 768, Round.HALF_UP, "shared"),
    (IntRMSNorm, 768, Round.HALF_UP, "16-bit"),  # no β: every B_c is the rounding half
    (IntLayerNorm, 768, Round.HALF_EVEN, "shared"),
    (L1LayerNorm, 768, Round.HALF_UP, "per channel"),  # its sign-flipped gains leave the lanes
]
IDS = [f"{c.__name__}-{n}-{r.value}" for c, n, r, _ in CASES]


@pytest.mark.parametrize("cls, n, rounding, expected", CASES, ids=IDS)
def test_kernel_takes_the_cheapest_proven_output_form(cls, n, rounding, expected):
    assert form(trained_op(cls, n, rounding)) == expected


@pytest.mark.parametrize("cls, n, rounding, expected", CASES[:-1], ids=IDS[:-1])
def test_shared_constants_give_the_ops_output_on_every_z(cls, n, rounding, expected):
    op = trained_op(cls, n, rounding)
    cfg, z_range = op.config, op.ranges()["z"]
    bounds, gain, bias = _shared_window(op, z_range)
    lo, hi = bounds if bounds is not None else (z_range.lo, z_range.hi)
    inside = np.arange(max(lo - 2, z_range.lo), min(hi + 2, z_range.hi) + 1)
    beyond = np.arange(z_range.lo, z_range.hi + 1, BEYOND_STRIDE)
    zs = np.unique(np.concatenate([inside, beyond, [z_range.lo, z_range.hi]]))
    g = np.asarray(gain, dtype=np.int64)
    b = np.asarray(bias, dtype=np.int64) - ((1 << cfg.shift) >> 1 if rounding is Round.HALF_UP else 0)
    limit = 1 << (cfg.lanes - 1)
    for chunk in np.array_split(zs, max(1, len(zs) // 4096)):
        z = np.repeat(chunk[:, None], n, axis=1)
        acc = clamp(z, lo, hi) * g + b
        assert acc.min() >= -limit and acc.max() < limit
        got = saturate(rshift_round(acc, cfg.shift, cfg.rounding), cfg.out_fmt.bits, cfg.out_fmt.signed)
        np.testing.assert_array_equal(got, op._output(z, None))


@pytest.mark.parametrize("cls", [IntLayerNorm, IntRMSNorm])
def test_shared_window_kernels_are_bit_exact(cls):
    op = trained_op(cls, 768)
    rng = np.random.default_rng(768)
    check_kernel(op, edge_rows(INT8, 768, 768), random_rows(INT8, 768, 32, rng))


@pytest.mark.parametrize("cls", [IntLayerNorm, IntRMSNorm, L1LayerNorm])
def test_the_16_bit_stage_gives_the_ops_output_on_every_z(cls):
    """Without β the output stage runs on 16-bit lanes: z saturated to int16, the high half
    of zc·m_c, plus B_c / 2^16, shifted by s − 16: the op's own outputs on every z; with β
    (B_c not on the 2^16 grid) the kernel keeps the int32 stage."""
    op = trained_op(cls, 768, bias=False)
    cfg, z_range = op.config, op.ranges()["z"]
    high = _high_half(cfg, z_range, _shared_window(op, z_range))
    assert high is not None and form(op) == "16-bit"
    assert (form(trained_op(cls, 768)) == "16-bit") == (cls is IntRMSNorm)  # RMSNorm has no β
    m, b_high = (np.asarray(v, dtype=np.int64) for v in high)
    inside = np.arange(-(1 << 15) - 2, (1 << 15) + 2)
    beyond = np.arange(z_range.lo, z_range.hi + 1, BEYOND_STRIDE)
    zs = np.unique(np.concatenate([inside, beyond, [z_range.lo, z_range.hi]]))
    zs = zs[(zs >= z_range.lo) & (zs <= z_range.hi)]
    for chunk in np.array_split(zs, max(1, len(zs) // 2048)):
        z = np.repeat(chunk[:, None], cfg.n, axis=1)
        zc = np.clip(z, -(1 << 15), (1 << 15) - 1)
        acc = ((zc * m) >> 16) + b_high
        assert np.abs(acc).max() < 1 << 15
        got = saturate(acc >> (cfg.shift - 16), cfg.out_fmt.bits, cfg.out_fmt.signed)
        np.testing.assert_array_equal(got, op._output(z, None))
    rng = np.random.default_rng(7)
    check_kernel(op, edge_rows(INT8, 768, 768), random_rows(INT8, 768, 32, rng))


def shared_constants(op: Any) -> tuple[np.ndarray, np.ndarray]:
    """(g_c, B_c) of the kernel's sum ``clamp(z, L, H)·g_c + B_c`` under one shared window."""
    shared = _shared_window(op, op.ranges()["z"])
    assert shared is not None and shared[0] is not None
    return shared[1], shared[2]


REACH_CASES = [
    (IntLayerNorm, 768, Round.HALF_UP),
    (IntLayerNorm, 768, Round.HALF_EVEN),
    (ShiftLayerNorm, 1024, Round.HALF_UP),
]
REACH_IDS = [f"{c.__name__}-{n}-{r.value}" for c, n, r in REACH_CASES]


@pytest.mark.parametrize("cls, n, rounding", REACH_CASES, ids=REACH_IDS)
def test_unclamped_sums_give_the_ops_output_on_every_z_of_the_reach(cls, n, rounding):
    op = trained_op(cls, n, rounding)
    cfg, z_range = op.config, op.ranges()["z"]
    gain, bias = shared_constants(op)
    lo, hi = _row_reach(gain, bias, cfg.lanes)
    limit = 1 << (cfg.lanes - 1)
    g = np.asarray(gain, dtype=np.int64)
    b = np.asarray(bias, dtype=np.int64)
    # the widest such range: one step past either end some channel's sum leaves the lanes
    for end in (lo - 1, hi + 1):
        sums = end * g + b
        assert sums.min() < -limit or sums.max() >= limit
    # it holds the shared window with room to spare: most rows need no clamp
    window = _shared_window(op, z_range)[0]
    assert lo < 2 * window[0] and hi > 2 * window[1]
    inside = np.arange(max(window[0] - 2, lo, z_range.lo), min(window[1] + 2, hi, z_range.hi) + 1)
    beyond = np.arange(max(lo, z_range.lo), min(hi, z_range.hi) + 1, BEYOND_STRIDE)
    zs = np.unique(np.concatenate([inside, beyond, [max(lo, z_range.lo), min(hi, z_range.hi)]]))
    half = (1 << cfg.shift) >> 1 if rounding is Round.HALF_UP else 0
    for chunk in np.array_split(zs, max(1, len(zs) // 4096)):
        z = np.repeat(chunk[:, None], n, axis=1)
        acc = z * g + b
        assert acc.min() >= -limit and acc.max() < limit
        got = saturate(rshift_round(acc - half, cfg.shift, cfg.rounding), cfg.out_fmt.bits, cfg.out_fmt.signed)
        np.testing.assert_array_equal(got, op._output(z, None))


def rows_within_reach(op: Any, rows: np.ndarray) -> np.ndarray:
    """Which rows the kernel runs unclamped: z at both ends of the input format (the
    row's multiplier, offset and shift from the golden op) within :func:`_row_reach`.
    Every norm here has a ≥ 0, so z is monotone in x."""
    cfg, trace = op.config, {}
    op.forward(rows, trace)
    a, k = (np.asarray(trace[name], dtype=np.int64).reshape(-1) for name in ("mult", "z_shift"))
    c = np.asarray(trace["offset"], dtype=np.int64).reshape(-1) if "offset" in trace else 0
    lo, hi = _row_reach(*shared_constants(op), cfg.lanes)
    z_lo, z_hi = (rshift_round(v * a - c, k, cfg.rounding) for v in (cfg.in_fmt.lo, cfg.in_fmt.hi))
    return (z_lo >= lo) & (z_hi <= hi)


@pytest.mark.parametrize("cls, n, rounding", REACH_CASES, ids=REACH_IDS)
def test_rows_with_and_without_the_clamp_are_bit_exact(cls, n, rounding):
    op = trained_op(cls, n, rounding)
    kernel = kernel_for(op)
    assert "unclamped" in kernel.mod.script()  # the per-row choice is built
    rows = np.concatenate([edge_rows(INT8, n, n), random_rows(INT8, n, 32, np.random.default_rng(n))])
    within = rows_within_reach(op, rows)
    assert within.any() and not within.all()  # both kinds of rows are run
    check_kernel(op, rows)


def test_fabric_keeps_the_clamp_on_every_row():
    """HLS builds what the kernel computes as hardware: one datapath, always clamped."""
    op = trained_op(IntLayerNorm, 768)
    assert "unclamped" in kernel_for(op).mod.script()
    assert "unclamped" not in kernel_for(op, HLS).mod.script()
