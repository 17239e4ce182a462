import numpy as np
import pytest

from qnorm.fixedpoint import Round
from qnorm.fixedpoint import round_float
from qnorm.qformat import QFormat


def test_quantize_half_up_ties_exact():
    fmt = QFormat(8, 0.5)
    x = np.array([0.25, -0.25, 0.75, -0.75, 0.2499999999999999, 1000.0, -1000.0])
    assert fmt.quantize(x).tolist() == [1, 0, 2, -1, 0, 127, -128]


@pytest.mark.parametrize(
    "mode,want",
    [
        (Round.HALF_UP, [3, -2, 1, -1]),
        (Round.HALF_EVEN, [2, -2, 1, -1]),
        (Round.HALF_AWAY, [3, -3, 1, -1]),
        (Round.FLOOR, [2, -3, 0, -2]),
        (Round.CEIL, [3, -2, 1, -1]),
        (Round.TRUNC, [2, -2, 0, -1]),
    ],
)
def test_round_float_modes(mode, want):
    assert round_float(np.array([2.5, -2.5, 0.7, -1.3]), mode).tolist() == want


def test_quantize_refuses_non_finite_and_non_real():
    fmt = QFormat()
    with pytest.raises(ValueError, match="non-finite"):
        fmt.quantize(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="non-finite"):
        fmt.quantize(np.array([np.inf]))
    with pytest.raises(ValueError, match="real-valued"):
        fmt.quantize(np.array(["a"]))


def test_check_refuses_dtype_and_range():
    fmt = QFormat(4)
    assert fmt.check(np.array([-8, 7], dtype=np.int8)).dtype == np.int64
    with pytest.raises(ValueError, match="integer array"):
        fmt.check(np.array([1.0]))
    with pytest.raises(ValueError, match="integer array"):
        fmt.check(np.array([True]))
    with pytest.raises(ValueError, match=r"\[-9, 7\], outside the declared 4-bit signed range \[-8, 7\]"):
        fmt.check(np.array([-9, 7]))
    assert fmt.check(np.zeros((0, 3), dtype=np.int8)).shape == (0, 3)


def test_format_validation():
    with pytest.raises(ValueError, match="bits"):
        QFormat(1)
    with pytest.raises(ValueError, match="scale"):
        QFormat(8, 0.0)
    with pytest.raises(ValueError, match="scale"):
        QFormat(8, float("nan"))
    assert QFormat.power_of_two(8, -5).scale == 1 / 32
    assert QFormat.power_of_two(8, -5).is_power_of_two
    assert not QFormat(8, 0.3).is_power_of_two
    assert (QFormat(8, signed=False).lo, QFormat(8, signed=False).hi) == (0, 255)
    assert QFormat(8, 0.25).real_range == (-32.0, 31.75) and QFormat(4, 0.5, signed=False).real_range == (0.0, 7.5)


TIES = [0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999999999999994, -0.49999999999999994, 0.5000000000000001,
        -0.0, 0.0, 0.7, -1.3, 126.5, -128.5, 2.0**51 + 0.5, -(2.0**51) - 0.5, 1e300, -1e300]  # fmt: skip


@pytest.mark.parametrize("mode", list(Round))
def test_round_float_numpy_and_torch_identical(mode):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    t = np.concatenate([np.array(TIES), rng.normal(0, 100, 2000), np.round(rng.normal(0, 50, 500)) + 0.5])
    want = round_float(t, mode)
    got = round_float(torch.from_numpy(t), mode)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float64
    assert np.array_equal(got.numpy(), want)
    assert round_float(2.5, mode) == want[4]  # a Python float rounds by the same rule


@pytest.mark.parametrize("mode", list(Round))
@pytest.mark.parametrize("fmt", [QFormat(8, 0.5), QFormat(4, 0.25, signed=False), QFormat(16, 0.1)], ids=str)
def test_quantize_numpy_and_torch_identical(fmt, mode):
    """The one quantizer on both backends: the same integers, ties and saturation included."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    k = np.arange(fmt.lo - 3, fmt.hi + 4, dtype=np.float64)
    x = np.concatenate([(k + 0.5) * fmt.scale, (k - 0.5) * fmt.scale, k * fmt.scale,
                        rng.normal(0, fmt.hi * fmt.scale, 3000)])  # fmt: skip
    want = fmt.quantize(x, mode)
    for dtype in (torch.float64, torch.float32):
        t = torch.from_numpy(x).to(dtype)
        got = fmt.quantize(t, mode)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.int64
        assert np.array_equal(got.numpy(), fmt.quantize(t.numpy(), mode))
    assert np.array_equal(fmt.quantize(torch.from_numpy(x), mode).numpy(), want)
    ints = torch.arange(fmt.lo - 2, fmt.hi + 3)  # integer tensors quantize too (as numpy integer arrays do)
    assert np.array_equal(fmt.quantize(ints).numpy(), fmt.quantize(ints.numpy()))
    assert np.array_equal(fmt.in_range(torch.from_numpy(x)).numpy(), fmt.in_range(x))


def test_quantize_torch_refusals():
    torch = pytest.importorskip("torch")
    fmt = QFormat()
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="1 non-finite"):
            fmt.quantize(torch.tensor([1.0, bad]))
    with pytest.raises(ValueError, match="non-finite"):
        QFormat(8, 1e-300).quantize(torch.tensor([1e300], dtype=torch.float64))  # x / scale overflows
    with pytest.raises(ValueError, match="real-valued"):
        fmt.quantize(torch.tensor([True]))
    with pytest.raises(ValueError, match="real-valued"):
        fmt.quantize(torch.tensor([1j]))


def test_quantize_with_mask_is_quantize_and_in_range():
    fmt = QFormat(4, 0.5)
    x = np.array([-5.0, -4.0, -3.75, 0.25, 3.5, 3.75, 9.0])
    q, mask = fmt.quantize_with_mask(x)
    assert np.array_equal(q, fmt.quantize(x))
    assert np.array_equal(mask, fmt.in_range(x))
    assert mask.tolist() == [False, True, True, True, True, False, False]
