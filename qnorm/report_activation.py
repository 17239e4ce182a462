"""The measured error table of the integer GELU and SiLU (README "GELU and SiLU").

Every row runs every input code of its format (the op's whole domain, so the
numbers are exact maxima, not samples) and compares the integers with the float64
function in output LSB.  Besides the algorithm each op chooses, the table shows
the alternatives the choice was made against: forced segments on int8 inputs
(fewer constants than the table, more error) and I-BERT's second-order erf
polynomial for GELU, evaluated in float64 and rounded once (a lower bound on the
error of its integer form, which rounds more often).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from qnorm.fixedpoint import DEFAULT_ROUND, bits_for
from qnorm.ops.activation import SEGMENTS, ActivationConfig, IntActivation, IntGELU, IntSiLU
from qnorm.qformat import QFormat

# I-BERT (Kim et al., 2021), eq. 8: erf(x) ~ sgn(x) [a (min(|x|, −b) + b)^2 + 1]
IBERT_A, IBERT_B = -0.2888, -1.769

CONFIGS: tuple[tuple[str, QFormat, QFormat], ...] = (
    ("int8 2^-4 → int8 2^-4", QFormat.power_of_two(8, -4), QFormat.power_of_two(8, -4)),
    ("int8 0.05 → int8 3/128", QFormat(8, 0.05), QFormat(8, 3 / 128)),
    ("int16 2^-11 → int16 2^-11", QFormat.power_of_two(16, -11), QFormat.power_of_two(16, -11)),
    ("int16 0.0005 → int16 0.0007", QFormat(16, 0.0005), QFormat(16, 0.0007)),
    ("int16 2^-11 → int8 2^-4", QFormat.power_of_two(16, -11), QFormat.power_of_two(8, -4)),
)


@dataclass(frozen=True)
class ActivationRow:
    op: str
    formats: str
    algorithm: str
    constant_bytes: int  # the tables the op reads, each in its narrowest integer dtype
    multiplies: int  # per element
    max_lsb: float
    mean_lsb: float
    exact_share: float  # share of codes whose output is the correctly rounded one


def ibert_gelu(x: np.ndarray) -> np.ndarray:
    """I-BERT's GELU ``x (1 + L(x/√2)) / 2`` with its erf polynomial L, in float64."""
    v = np.asarray(x, dtype=np.float64) / math.sqrt(2.0)
    erf = np.sign(v) * (IBERT_A * (np.minimum(np.abs(v), -IBERT_B) + IBERT_B) ** 2 + 1.0)
    return 0.5 * np.asarray(x, dtype=np.float64) * (1.0 + erf)


def table_bytes(op: IntActivation) -> int:
    """Bytes of the op's tables, each in the narrowest of int8/16/32/64 holding it (as the kernels store them)."""
    total = 0
    for values in op.tables.values():
        bits = bits_for(int(values.min()), int(values.max()))
        total += values.size * next(b for b in (8, 16, 32, 64) if bits <= b) // 8
    return total


def _row(name: str, formats: str, algorithm: str, constant_bytes: int, muls: int, y: np.ndarray,
         ref: np.ndarray, out: QFormat) -> ActivationRow:  # fmt: skip
    err = np.abs(y - np.clip(ref / out.scale, out.lo, out.hi))
    exact = out.quantize(ref, DEFAULT_ROUND)
    return ActivationRow(name, formats, algorithm, constant_bytes, muls, float(err.max()), float(err.mean()),
                         float(np.mean(y == exact)))  # fmt: skip


def _op_row(op: IntActivation, formats: str, label: str) -> ActivationRow:
    q = np.arange(op.in_fmt.lo, op.in_fmt.hi + 1, dtype=np.int64)
    algorithm = label if op.segments is None else f"{label}: {1 << op.segments.bits}-code segments"
    return _row(op.name, formats, algorithm, table_bytes(op), op.cost()["per_element"].get("mul", 0),
                op.forward(q), op.float_reference(op.in_fmt.dequantize(q)), op.out_fmt)  # fmt: skip


def measure_activations() -> list[ActivationRow]:
    """Every config of :data:`CONFIGS` for GELU and SiLU, with the alternatives (module doc)."""
    rows = []
    for cls in (IntGELU, IntSiLU):
        for formats, in_fmt, out_fmt in CONFIGS:
            op = cls.of(in_fmt, out_fmt)
            rows.append(_op_row(op, formats, f"{op.algorithm} (chosen)"))
            if op.segments is None:
                forced = cls(ActivationConfig(in_fmt, out_fmt, DEFAULT_ROUND, SEGMENTS))
                rows.append(_op_row(forced, formats, "segments (forced)"))
            if cls is IntGELU:
                q = np.arange(in_fmt.lo, in_fmt.hi + 1, dtype=np.int64)
                x = in_fmt.dequantize(q)
                y = out_fmt.quantize(ibert_gelu(x))
                rows.append(_row(cls.name, formats, "I-BERT erf polynomial, float64, rounded once", 0, 3, y,
                                 cls.function(x), out_fmt))  # fmt: skip
    return rows


def activation_markdown(rows: list[ActivationRow]) -> str:
    head = ["| op | input → output | algorithm | constants (bytes) | multiplies / element | max LSB | mean LSB "
            "| correctly rounded |", "|---|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    body = [
        f"| {r.op} | {r.formats} | {r.algorithm} | {r.constant_bytes} | {r.multiplies} | {r.max_lsb:.3f} | "
        f"{r.mean_lsb:.3f} | {100 * r.exact_share:.2f} % |"
        for r in rows
    ]
    return "\n".join(head + body)
