import numpy as np
import pytest

from qnorm.metrics import error_in_lsb, signed_error_lsb
from qnorm.qformat import QFormat


def test_error_counts_lsb_and_separates_saturation():
    fmt = QFormat(8, 0.5)
    y_int = np.array([0, 1, 10, 127])
    y_float = np.array([0.0, 1.5, 4.0, 100.0])  # refs in LSB: 0, 3, 8, 200 (saturates)
    st = error_in_lsb(y_int, fmt, y_float)
    assert st.max_lsb == 2.0
    assert st.mean_lsb == 1.0
    assert st.within_1lsb == 0.5
    assert st.saturated == 0.25
    assert signed_error_lsb(y_int, fmt, y_float).tolist() == [0.0, -2.0, 2.0, 0.0]


def test_error_rejects_bad_reference():
    fmt = QFormat(8, 1.0)
    with pytest.raises(ValueError, match="shape"):
        error_in_lsb(np.zeros(3, int), fmt, np.zeros(4))
    with pytest.raises(ValueError, match="NaN"):
        error_in_lsb(np.zeros(2, int), fmt, np.array([0.0, np.nan]))
    with pytest.raises(ValueError, match="empty"):
        error_in_lsb(np.zeros(0, int), fmt, np.zeros(0))
