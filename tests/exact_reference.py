"""Exact-rational references shared by the tests, written independently of qnorm."""

import math
from fractions import Fraction

from qnorm.fixedpoint import Round

ALL_MODES = list(Round)


def exact_round(x: Fraction, mode: Round) -> int:
    """Round an exact rational by ``mode`` (Python's Fraction semantics, no qnorm code)."""
    fl = math.floor(x)
    frac = x - fl
    if mode is Round.FLOOR:
        return fl
    if mode is Round.CEIL:
        return math.ceil(x)
    if mode is Round.TRUNC:
        return int(x)  # int() truncates a Fraction toward zero
    if frac != Fraction(1, 2):
        return fl + (frac > Fraction(1, 2))
    if mode is Round.HALF_UP:
        return fl + 1
    if mode is Round.HALF_EVEN:
        return fl + (fl % 2)
    return fl + 1 if x > 0 else fl  # HALF_AWAY
