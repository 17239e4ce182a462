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
