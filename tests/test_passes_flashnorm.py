"""FlashNorm: the float gain fold (bitwise weights, measured output deviation) and the
integer form (1/rms after the matmul) against the normalize-first pipelines: identical
integers when the quantization points are the same, measured LSB when they are not.
Measurements print with ``pytest -s tests/test_passes_flashnorm.py``."""

import math
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from qnorm import fixedpoint as fp
from qnorm.analysis import OverflowRiskError
from qnorm.metrics import error_in_lsb
from qnorm.ops import IntRMSNorm
from qnorm.ops import flashnorm as ops_flashnorm
from qnorm.passes import (
    IntFlashNorm,
    IntFlashNormLinear,
    flashnorm,
    quantize_per_channel,
)
from qnorm.qformat import QFormat

FAST = settings(max_examples=40, deadline=None)
OUT = QFormat(8, 0.05)


def report(what: str, stats: dict) -> None:
    print(
        f"[measured] {what}: "
        + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items())
    )


class QKV(nn.Module):
    """One RMSNorm feeding three projections (an attention block's input side)."""

    def __init__(self, d: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.q, self.k, self.v = nn.Linear(d, 8), nn.Linear(d, 8, bias=False), nn.Linear(d, 4)
        with torch.no_grad():
            self.norm.weight.copy_(torch.randn(d) * 0.5 + 1)
            self.norm.weight[0] = -0.7  # a negative gain folds like any other

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return torch.cat([self.q(h) * self.k(h), self.v(h)], dim=-1)


@FAST
@given(d=st.integers(1, 32), seed=st.integers(0, 2**16))
def test_flashnorm_weights_are_the_correctly_rounded_products(d, seed):
    model = QKV(d, seed)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = flashnorm(model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert type(out) is QKV and out.norm.weight is None and out.norm.eps == model.norm.eps
    for name in ("q", "k", "v"):
        a, b = getattr(model, name), getattr(out, name)
        # float64 product of two float32s is exact, so one rounding == the float32 multiply
        assert torch.equal(b.weight, a.weight * model.norm.weight)
        assert (a.bias is None and b.bias is None) or torch.equal(a.bias, b.bias)


def test_flashnorm_float_deviation():
    model = QKV(64, 0)
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(1)) * 2
    with torch.no_grad():
        got, want = flashnorm(model)(x), model(x)
    err = (got.double() - want.double()).abs().numpy()
    full_scale = float((err / np.spacing(want.abs().max().numpy())).max())
    report("flashnorm float32 output vs RMSNorm(gamma)->Linear",
           {"max_ulp_full_scale": full_scale, "max_ulp": float((err / np.spacing(want.abs().numpy())).max())})  # fmt: skip
    assert full_scale <= 4  # float rounding of the reordered products (measured 2.5 ulp)


class NormFeedsAdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.RMSNorm(4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return self.fc(h) + h


def test_flashnorm_refuses_non_linear_consumers_and_skips_weightless_norms():
    with pytest.raises(ValueError, match="operator.add|'add'"):
        flashnorm(NormFeedsAdd())
    plain = nn.Sequential(nn.RMSNorm(4, elementwise_affine=False), nn.Linear(4, 2))
    out = flashnorm(plain)
    assert torch.equal(out[1].weight, plain[1].weight)
    with pytest.raises(ValueError, match="ReLU"):
        flashnorm(nn.Sequential(nn.RMSNorm(4), nn.ReLU()))


# --------------------------------------------------------------------------- integer form


def random_op(n: int, o: int, seed: int, in_fmt: QFormat, eps: float, out_fmt: QFormat = OUT) -> IntFlashNorm:
    g = torch.Generator().manual_seed(seed)
    gamma = torch.randn(n, generator=g) * 0.4 + 1
    norm, lin = nn.RMSNorm(n, eps=eps), nn.Linear(n, o)
    with torch.no_grad():
        norm.weight.copy_(gamma)
        lin.weight.copy_(torch.randn(o, n, generator=g) / n**0.5)
        lin.bias.copy_(torch.randn(o, generator=g) * 0.3)
    return IntFlashNorm.from_modules(norm, lin, in_fmt, out_fmt)


def random_rows(rows: int, n: int, fmt: QFormat, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (rows, n)) * rng.uniform(0.05, 1.5, (rows, 1))  # rows of very different rms
    q = fmt.quantize(x * (fmt.hi / 3) * fmt.scale)  # about +-3 sigma spans the format
    q[0] = 0  # an all-zero row
    q[1] = fmt.lo  # a saturated row
    return q


def spec_forward(op: IntFlashNorm, x: np.ndarray) -> tuple[np.ndarray, list[int], list[int]]:
    """The module docstring's formulas in Python integers, independent of fixedpoint:
    r = round(2^30 / sqrt(M)) is the largest r with M (2r - 1)^2 <= 2^62.
    Returns the outputs, M and r per row."""
    out = np.empty((x.shape[0], op.weight.shape[0]), dtype=np.int64)
    mants, inverses = [], []
    for i, row in enumerate(x.tolist()):
        v = sum(t * t for t in row) + op.eps or 1
        e = (v.bit_length() - 30) >> 1
        m = v >> (2 * e) if e > 0 else v << (-2 * e)
        j = math.isqrt((1 << 62) // m)
        r = (j + 1) // 2  # the largest odd value <= j is 2r - 1
        mants.append(m)
        inverses.append(r)
        for o, (w, mult, b) in enumerate(zip(op.weight.tolist(), op.mult.tolist(), op.bias.tolist(), strict=True)):
            acc = sum(a * c for a, c in zip(row, w, strict=True))
            y = math.floor(Fraction(acc * r * mult + b * 2 ** (30 + e), 2 ** (30 + e + op.shift)) + Fraction(1, 2))
            out[i, o] = min(max(y, op.out_fmt.lo), op.out_fmt.hi)
    return out, mants, inverses


@FAST
@given(
    n=st.integers(1, 48),
    o=st.integers(1, 6),
    bits=st.sampled_from([4, 8, 16]),
    eps=st.sampled_from([0.0, 1e-5, 0.1]),
    seed=st.integers(0, 2**16),
)
def test_matmul_first_equals_normalize_first_with_the_same_rounding_points(n, o, bits, eps, seed):
    """The golden op equals its specification in Python integers; ``(x w^T) r`` and
    ``(x r) w^T`` are the same integers; every traced intermediate stays inside the
    static ranges.  (16-bit rows reach V >= 2^31, where M drops bits: e > 0.)"""
    fmt = QFormat(bits, 0.03)
    op = random_op(n, o, seed, fmt, eps)
    x = random_rows(16, n, fmt, seed)
    trace: dict = {}
    y = op.forward(x, trace)
    want, mants, inverses = spec_forward(op, x)
    assert np.array_equal(y, want)
    assert trace["mant"].ravel().tolist() == mants and trace["rsqrt"].ravel().tolist() == inverses
    assert np.array_equal(y, op.normalize_first(x))
    ranges = op.ranges()
    for name, value in trace.items():
        assert ranges[name].lo <= value.min() and value.max() <= ranges[name].hi, name
    b_int = [fp.round_fraction(Fraction(float(v)) / Fraction(op.out_fmt.scale)) for v in op.b_float]
    assert np.array_equal(y[0], np.clip(b_int, op.out_fmt.lo, op.out_fmt.hi))  # zero row: the bias alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_module_equals_golden(dtype):
    fmt, out = QFormat(8, 0.02), QFormat(8, 0.05)
    g = torch.Generator().manual_seed(0)
    norm, lin = nn.RMSNorm(24), nn.Linear(24, 10)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(24, generator=g) + 0.5)
    layer = IntFlashNormLinear.from_modules(norm, lin, fmt, out)
    x = (torch.randn(3, 7, 24, generator=g) * 0.8).to(dtype)
    y = layer(x)
    want = torch.from_numpy(layer.op.forward(fmt.quantize(x.numpy()))).to(dtype) * out.scale
    assert y.dtype == dtype and y.shape == (3, 7, 10) and torch.equal(y, want)
    assert layer.qnorm_metadata()["golden"]["op"] == "flashnorm_linear"


def int_linear(z: np.ndarray, w_int: np.ndarray, mult: np.ndarray, bias: np.ndarray, out: QFormat) -> np.ndarray:
    """int8 matmul + per-output dyadic requantization (one rounding, saturation)."""
    m, s = fp.dyadic_vector(mult, 16)
    b = np.array([fp.round_fraction(Fraction(float(v)) * (1 << s)) for v in bias], dtype=np.int64)
    return fp.saturate(fp.rshift_round((z @ w_int.T) * m + b, s), out.bits)


def test_measured_difference_to_the_int8_normalize_first_pipeline():
    """The usual integer pipeline rounds twice: IntRMSNorm(gamma) to int8, then the int8
    Linear(W).  FlashNorm rounds once.  Both against the float op, and against each other."""
    n, o, rows = 64, 32, 1024
    fmt, out, z_fmt = QFormat(8, 0.03), QFormat(8, 0.04), QFormat.power_of_two(8, -5)
    g = torch.Generator().manual_seed(7)
    norm, lin = nn.RMSNorm(n, eps=1e-5), nn.Linear(n, o)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(n, generator=g) * 0.8 + 0.6)
        lin.weight.copy_(torch.randn(o, n, generator=g) / n**0.5)
        lin.bias.copy_(torch.randn(o, generator=g) * 0.2)
    op = IntFlashNorm.from_modules(norm, lin, fmt, out)
    x = random_rows(rows, n, fmt, 3)
    y_flash = op.forward(x)
    rms = IntRMSNorm.from_float(norm.weight.detach().double().numpy(), None, 1e-5, fmt, z_fmt)
    z = rms.forward(x)
    w_int, s_w = quantize_per_channel(lin.weight)
    y_first = int_linear(z, w_int, z_fmt.scale * s_w / out.scale, lin.bias.detach().double().numpy() / out.scale, out)
    ref = op.float_reference(x * fmt.scale)
    for name, y in (("flashnorm (1 rounding)", y_flash), ("int8 normalize-first (2 roundings)", y_first)):
        e = error_in_lsb(y, out, ref)
        report(
            f"{name} vs float RMSNorm->Linear",
            {"max_lsb": e.max_lsb, "mean_lsb": e.mean_lsb, "within_1lsb": e.within_1lsb},
        )
    diff = np.abs(y_flash - y_first)
    report(
        "flashnorm vs int8 normalize-first", {"max_lsb": int(diff.max()), "share_differing": float((diff > 0).mean())}
    )
    assert np.array_equal(y_flash, op.normalize_first(x))


def test_ranges_refuse_what_int64_cannot_hold():
    with pytest.raises(OverflowRiskError, match="num"):
        random_op(1 << 15, 1, 0, QFormat(16, 1e-3), 0.0)


def test_golden_op_takes_numpy_parameters_as_torch_ones():
    """The golden op lives in qnorm.ops (numpy only): numpy float parameters give the very
    op torch tensors give, and qnorm.passes still hands out that class."""
    fmt = QFormat(8, 0.03)
    op = random_op(24, 5, 7, fmt, 1e-5)
    again = ops_flashnorm.IntFlashNorm.from_float(op.w_float, op.b_float, op.eps_float, fmt, OUT)
    assert IntFlashNorm is ops_flashnorm.IntFlashNorm
    for name in ("weight", "mult", "bias"):
        assert np.array_equal(getattr(again, name), getattr(op, name)), name
    assert (again.shift, again.eps) == (op.shift, op.eps)
    x = random_rows(64, 24, fmt, 8)
    assert np.array_equal(again.forward(x), op.forward(x))


def test_golden_module_imports_no_torch():
    code = "import sys, qnorm.ops.flashnorm; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
