"""The norm kernels' output stage with one clamp window for every channel, or none.

``norm_kernel`` replaces the op's per-channel clamp windows by one shared window
(or no clamp where z's range allows) where :func:`_shared_window` proves the sums
stay in the lanes.  Checked here: the shared constants give the op's
``_output`` on every z of the proven range (each z inside the window, a stride
beyond it, where the output is saturated or constant), the kernels pick the
cheapest form that is proven, and the compiled kernels stay bit-exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from compilers.tvm.kernels import kernel_for
from compilers.tvm.kernels.norms import _shared_window
from qnorm.fixedpoint import Round, clamp, rshift_round, saturate
from qnorm.ops import IntLayerNorm, IntRMSNorm, L1LayerNorm, ShiftLayerNorm
from qnorm.qformat import QFormat
from tests.test_tvm_kernels import check_kernel, edge_rows, random_rows

INT8 = QFormat(8, 0.05)
BEYOND_STRIDE = 97  # z beyond the window: a stride (the clamp holds them all at an end)


def trained_op(cls: type, n: int, rounding: Round = Round.HALF_UP) -> Any:
    """γ ≈ 1 with some negative and one zero, β ≈ 0 with two channels that saturate."""
    rng = np.random.default_rng(n)
    gamma = rng.normal(1.0, 0.1, n)
    gamma[::17] *= -1.0
    gamma[5] = 0.0
    beta = rng.normal(0.0, 0.1, n)
    beta[7], beta[9] = 40.0, -40.0  # constant channels: their whole range saturates
    return cls.from_float(gamma, None if cls is IntRMSNorm else beta, 1e-5, in_fmt=INT8, rounding=rounding)


def form(op: Any) -> str:
    names = {p.name for p in kernel_for(op).mod["main"].params}
    return "per channel" if "lo" in names else "shared" if "window" in names else "no clamp"


CASES = [
    (IntLayerNorm, 256, Round.HALF_UP, "no clamp"),
    (ShiftLayerNorm, 384, Round.HALF_UP, "no clamp"),
    (IntLayerNorm, 768, Round.HALF_UP, "shared"),
    (IntRMSNorm, 768, Round.HALF_UP, "shared"),
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
