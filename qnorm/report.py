"""The measured error table: every norm against its float op on realistic rows."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from qnorm.analysis import OverflowRiskError
from qnorm.metrics import ErrorStats, error_in_lsb, signed_error_lsb
from qnorm.ops.base import IntOp
from qnorm.qformat import QFormat

ROW_LENGTHS = (64, 768, 4096, 65536)
BIT_WIDTHS = (8, 4, 16)
OUT_RANGE = 4.0  # outputs are formatted to cover +-4 (normalized values, gamma ~ 1)
EPS = 1e-5
ELEMENTS_PER_CASE = 1 << 18


def gaussian_rows(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    return rng.normal(rng.normal(0, 1, (rows, 1)), rng.uniform(0.5, 2.0, (rows, 1)), (rows, n))


def heavy_tailed_rows(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """Student-t(3) body plus ~0.5 % outliers 20x larger (activation outliers of LLMs)."""
    x = rng.standard_t(3, (rows, n))
    spikes = rng.random((rows, n)) < 0.005
    return np.where(spikes, 20 * rng.choice([-1.0, 1.0], (rows, n)) * rng.uniform(1, 2, (rows, n)), x)


def near_constant_rows(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """A per-row offset with noise around one input LSB: sigma ~ quantization step."""
    return rng.normal(0, 1, (rows, 1)) + 0.01 * rng.normal(0, 1, (rows, n))


def llm_like_rows(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """Gaussian rows with a few fixed channels (1 in 512, at least one) 100x larger:
    the per-channel activation outliers of large language models."""
    x = rng.normal(0, 1, (rows, n))
    outliers = rng.choice(n, max(1, n // 512), replace=False)
    x[:, outliers] *= 100
    return x


DISTRIBUTIONS: dict[str, Callable[[np.random.Generator, int, int], np.ndarray]] = {
    "gaussian": gaussian_rows,
    "heavy-tailed": heavy_tailed_rows,
    "near-constant": near_constant_rows,
    "llm-like": llm_like_rows,
}

NormBuilder = Callable[[np.ndarray, np.ndarray, float, QFormat, QFormat], IntOp]


@dataclass(frozen=True)
class CaseResult:
    op: str
    dist: str
    n: int
    bits: int
    stats: ErrorStats | None  # None: the config is refused (``refused`` says why)
    errors: np.ndarray  # signed error in LSB, for the histogram
    refused: str | None = None


def input_format(x: np.ndarray, bits: int) -> QFormat:
    """Per-tensor max-abs calibration: nothing saturates, outliers cost resolution."""
    hi = (1 << (bits - 1)) - 1
    return QFormat(bits, float(np.max(np.abs(x))) / hi)


def output_format(bits: int) -> QFormat:
    return QFormat.power_of_two(bits, math.ceil(math.log2(OUT_RANGE)) - (bits - 1))


def _case_rows(dist: str, n: int, bits: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One cell's real-valued rows (about ELEMENTS_PER_CASE values), γ ~ N(1, 0.1) and β ~ N(0, 0.1)."""
    rng = np.random.default_rng([seed, n, bits, list(DISTRIBUTIONS).index(dist)])
    x = DISTRIBUTIONS[dist](rng, max(8, ELEMENTS_PER_CASE // n), n)
    return x, 1.0 + 0.1 * rng.normal(size=n), 0.1 * rng.normal(size=n)


@dataclass(frozen=True)
class CaseRun:
    """One cell's op on its quantized rows, and the float op on the same rows dequantized:
    the float op sees what the integer op sees, which isolates the op's own integer error
    from the input quantization both share."""

    op: IntOp
    x: np.ndarray  # the quantized rows
    real: np.ndarray  # x dequantized
    reference: np.ndarray  # the float op's output on ``real``, in real units


def run_case(build: NormBuilder, dist: str, n: int, bits: int, seed: int = 0) -> CaseRun:
    """The op ``build`` makes for one cell (:func:`_case_rows`, max-abs input calibration,
    outputs covering ±OUT_RANGE); raises OverflowRiskError where the analysis refuses it."""
    x, gamma, beta = _case_rows(dist, n, bits, seed)
    in_fmt = input_format(x, bits)
    op = build(gamma, beta, EPS, in_fmt, output_format(bits))
    xq = in_fmt.quantize(x)
    real = in_fmt.dequantize(xq)
    return CaseRun(op, xq, real, op.float_reference(real))


def measure_norm(name: str, build: NormBuilder, dist: str, n: int, bits: int, seed: int = 0) -> CaseResult:
    try:
        run = run_case(build, dist, n, bits, seed)
    except OverflowRiskError as err:  # a config the analysis refuses is a cell of its own, not a crash
        return CaseResult(name, dist, n, bits, None, np.zeros(0), refused=str(err))
    y, out_fmt = run.op.forward(run.x), run.op.out_fmt
    return CaseResult(
        name, dist, n, bits, error_in_lsb(y, out_fmt, run.reference), signed_error_lsb(y, out_fmt, run.reference)
    )


def measure_all(builders: dict[str, NormBuilder], seed: int = 0) -> list[CaseResult]:
    return [
        measure_norm(name, build, dist, n, bits, seed)
        for bits in BIT_WIDTHS
        for name, build in builders.items()
        for dist in DISTRIBUTIONS
        for n in ROW_LENGTHS
    ]


def markdown_table(results: list[CaseResult]) -> str:
    """One table per bit width; a cell is max LSB / mean LSB / share within 1 LSB."""
    out = []
    for bits in dict.fromkeys(r.bits for r in results):  # in the order measured (BIT_WIDTHS)
        sel = [r for r in results if r.bits == bits]
        ns = sorted({r.n for r in sel})
        out.append(f"**int{bits} in, int{bits} out** (cell: max LSB / mean LSB / within 1 LSB; saturated share in brackets when > 0)\n")
        out.append("| op | rows | " + " | ".join(f"N={n}" for n in ns) + " |")
        out.append("|---|---|" + "---|" * len(ns))
        keys = dict.fromkeys((r.op, r.dist) for r in sel)
        for op, dist in keys:
            cells = [_cell(next(r for r in sel if (r.op, r.dist, r.n) == (op, dist, n))) for n in ns]
            out.append(f"| {op} | {dist} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


_REFUSED = re.compile(r"'([a-z_]+)' spans \[[^\]]*\], which needs (\d+) bits")  # the refusal's intermediate


def _cell(r: CaseResult) -> str:
    if r.stats is None:
        found = _REFUSED.search(r.refused or "")
        return f"refused ({found.group(1)} needs {found.group(2)} bits)" if found else "refused"
    s = r.stats
    sat = f" [{100 * s.saturated:.1f} % sat]" if s.saturated > 0 else ""
    return f"{s.max_lsb:.2f} / {s.mean_lsb:.3f} / {100 * s.within_1lsb:.1f} %{sat}"


def save_histogram(results: list[CaseResult], path: Path) -> None:
    """Signed error histograms per op (int8, all distributions and N pooled)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r.op for r in results))
    fig, axes = plt.subplots(1, len(ops), figsize=(3.2 * len(ops), 3), sharey=True)
    for ax, op in zip(np.atleast_1d(axes), ops, strict=True):
        err = np.concatenate([r.errors.ravel() for r in results if r.op == op and r.bits == 8])
        ax.hist(np.clip(err, -4, 4), bins=np.arange(-4.25, 4.5, 0.25), color="tab:blue")
        ax.set_title(op, fontsize=9)
        ax.set_xlabel("error (output LSB)")
        ax.set_yscale("log")
    fig.suptitle("int8: integer op minus float op, in output LSB (clipped to +-4)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
