"""The error floor of a 16-bit element chain: why the norms' narrow datapath keeps int32 lanes.

A norm's element chain in 16-bit lanes would run twice the lanes of the int32
chain per vector (16 on AVX2), but it must hold the normalized value z and the
output stage's accumulator in int16.  This module measures the best such a chain
can do, as a model that is optimistic everywhere except in what 16-bit lanes
force, on the error table's int8 rows (:mod:`qnorm.report`: the same rows, γ, β
and ε as the norms table):

* ``z = sat16(round(x̂ · Z))`` with x̂ the exact float64 normalized value: no
  per-row constant is rounded, z has one rounding.  ``Z`` is the largest real
  scale that keeps every channel's unsaturated window (|G_c x̂ + B_c| below the
  output range plus half an LSB, G_c = γ_c / s_out and B_c = β_c / s_out in
  output LSB) inside ``fill`` of int16.  A real chain needs headroom here: z
  forms from the raw input and is saturated, so its window cannot fill int16
  (``fill`` = 1/2 models one bit of it).
* The output stage in int16: ``t = round(z · g_c / 2^15)`` (a rounding high
  multiply: ``vpmulhrsw``, ``sqrdmulh``), ``acc = sat16(t + b_c)``,
  ``y = sat8(acc >> s)``, with ``g_c = round(G_c 2^(15+s) / Z)`` in int16 and
  ``b_c = round(B_c 2^s) + 2^(s−1)`` (the output's rounding half).  One shift
  ``s`` for every channel (16-bit lanes shift by one count on AVX2), the largest
  that keeps every |g_c| below 2^15 and the output range times 2^s inside int16
  (s <= 7 for int8 outputs).

So the output stage resolves at best 2^-7 output LSB, and its two roundings (t and
b_c) plus z's cost the rest of the 0.01 LSB that the 0.51 LSB standard leaves above
the output's own rounding.  The int32 definition (the golden op, ``lanes = 32``) is
measured on the same rows beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qnorm.metrics import signed_error_lsb
from qnorm.ops._normcore import NormOp
from qnorm.ops.layernorm import IntLayerNorm
from qnorm.ops.rmsnorm import IntRMSNorm
from qnorm.report import DISTRIBUTIONS, ROW_LENGTHS, run_case

BITS = 8  # int8 in, int8 out: the datapath the 16-bit chain would replace
INT16_MAX = (1 << 15) - 1
MAX_SHIFT = 7  # (2^7 + 1) · 2^s output LSB must fit int16
# The chain's z fills int16 (the floor of any 16-bit chain), or half of it (one bit
# of headroom for a z that is formed from the raw input and saturated).
FILLS = (1.0, 0.5)
OPS: dict[str, type[NormOp]] = {"IntLayerNorm (L2)": IntLayerNorm, "IntRMSNorm": IntRMSNorm}
CORRECTLY_ROUNDED = 0.5 + 1e-9  # |y − ref| within this is the correctly rounded output


@dataclass(frozen=True)
class OutputStage:
    """The 16-bit output stage of one tensor: the shift and every channel's int16 constants."""

    z_scale: float  # Z: z per unit of the normalized value
    shift: int  # s
    gain: np.ndarray  # g_c, |g_c| < 2^15
    bias: np.ndarray  # b_c, the rounding half included


def output_stage(gain_lsb: np.ndarray, bias_lsb: np.ndarray, fill: float) -> OutputStage:
    """Z, s, g_c and b_c for per-channel gains and biases in output LSB (int8 outputs)."""
    top = (1 << (BITS - 1)) + 0.5  # |y| beyond the output range plus half an LSB saturates
    live = gain_lsb != 0
    window = np.max((top + np.abs(bias_lsb[live])) / np.abs(gain_lsb[live])) if live.any() else 1.0
    z_scale = fill * INT16_MAX / window
    fits = [s for s in range(MAX_SHIFT + 1) if np.all(np.abs(np.round(gain_lsb * 2.0 ** (15 + s) / z_scale)) <= INT16_MAX)]
    if not fits:
        raise ValueError("a gain leaves int16 at every output shift: the channels' gains span too wide a range")
    shift = fits[-1]
    gain = np.round(gain_lsb * 2.0 ** (15 + shift) / z_scale).astype(np.int64)
    bias = (np.round(bias_lsb * 2.0**shift) + (1 << shift >> 1)).astype(np.int64)
    if np.any(np.abs(bias) > INT16_MAX):
        raise ValueError("a bias leaves int16: the output stage needs a smaller shift")
    return OutputStage(z_scale, shift, gain, bias)


def chain16(normalized: np.ndarray, stage: OutputStage) -> np.ndarray:
    """The int8 outputs of the 16-bit chain for exact normalized values (rows, N)."""
    z = np.clip(np.round(normalized * stage.z_scale), -INT16_MAX - 1, INT16_MAX).astype(np.int64)
    t = (z * stage.gain + (1 << 14)) >> 15
    acc = np.clip(t + stage.bias, -INT16_MAX - 1, INT16_MAX)
    return np.clip(acc >> stage.shift, -(1 << (BITS - 1)), (1 << (BITS - 1)) - 1)


def normalized_rows(op: NormOp, real: np.ndarray) -> np.ndarray:
    """x̂ in float64: the op's float reference without its γ and β (torch's ``layer_norm``
    or ``rms_norm``, as the references call them)."""
    import torch.nn.functional as F

    t, n, eps = op.float_rows(real), (op.config.n,), op.params.eps
    return (F.rms_norm(t, n, None, eps) if isinstance(op, IntRMSNorm) else F.layer_norm(t, n, None, None, eps)).numpy()


@dataclass(frozen=True)
class FloorCell:
    """Max error (output LSB) and the share of outputs not correctly rounded, over the row kinds."""

    max_lsb: float
    not_rounded: float


@dataclass(frozen=True)
class FloorRow:
    op: str
    datapath: str
    cells: dict[int, FloorCell]  # by N


def _cell(errors: list[np.ndarray]) -> FloorCell:
    err = np.concatenate([e.ravel() for e in errors])
    return FloorCell(float(err.max()), float((err > CORRECTLY_ROUNDED).mean()))


def measure(seed: int = 0, row_lengths: tuple[int, ...] = ROW_LENGTHS) -> list[FloorRow]:
    """Per op: the int32 definition and the 16-bit chain at each fill, on every row kind and N."""
    rows = []
    for title, op_cls in OPS.items():
        errors: dict[str, dict[int, list[np.ndarray]]] = {}
        for n in row_lengths:
            for dist in DISTRIBUTIONS:
                run = run_case(op_cls.from_float, dist, n, BITS, seed)  # the norms table's cell
                op, scale = run.op, run.op.out_fmt.scale
                outputs = {"int32 (the definition)": op.forward(run.x)}
                normalized = normalized_rows(op, run.real)
                for fill in FILLS:
                    stage = output_stage(op.params.gamma / scale, op.params.beta / scale, fill)
                    outputs[_chain_name(fill)] = chain16(normalized, stage)
                for name, y in outputs.items():
                    error = np.abs(signed_error_lsb(y, op.out_fmt, run.reference))
                    errors.setdefault(name, {}).setdefault(n, []).append(error)
        rows += [FloorRow(title, name, {n: _cell(e) for n, e in by_n.items()}) for name, by_n in errors.items()]
    return rows


def _chain_name(fill: float) -> str:
    return "16-bit chain, z fills int16" if fill == 1.0 else f"16-bit chain, z within {fill:g} of int16"


def markdown_table(rows: list[FloorRow]) -> str:
    ns = list(rows[0].cells)
    out = [
        "int8 in, int8 out; cell: max error in output LSB / share of outputs not correctly rounded, "
        "over the four row kinds\n",
        "| op | element chain | " + " | ".join(f"N={n}" for n in ns) + " |",
        "|---|---|" + "---|" * len(ns),
    ]
    for r in rows:
        cells = [f"{c.max_lsb:.4f} / {100 * c.not_rounded:.2f} %" for c in r.cells.values()]
        out.append(f"| {r.op} | {r.datapath} | " + " | ".join(cells) + " |")
    return "\n".join(out)
