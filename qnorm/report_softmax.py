"""The measured error table of IntSoftmax against float64 softmax on attention-like logits."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from qnorm.metrics import ErrorStats, error_in_lsb
from qnorm.ops.softmax import IntSoftmax, mask_padding
from qnorm.qformat import QFormat

ROW_LENGTHS = (16, 64, 197, 1024)  # a short causal block, a head of 64 tokens, ViT-B/16, a long context
ELEMENTS_PER_CELL = 1 << 16


def _scores(rng: np.random.Generator, rows: int, n: int, spread: float) -> np.ndarray:
    """Gaussian scores with per-row spread around ``spread``: QKᵀ/sqrt(d) of a trained head."""
    return rng.normal(0.0, 1.0, (rows, n)) * rng.uniform(0.5, 1.5, (rows, 1)) * spread


def _heavy_tailed(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """Student-t(3) scores times 2: a few keys far above the rest (attention sinks)."""
    return 2.0 * rng.standard_t(3, (rows, n))


LOGITS: dict[str, Callable[[np.random.Generator, int, int], np.ndarray]] = {
    "gaussian σ≈1 (flat)": lambda rng, rows, n: _scores(rng, rows, n, 1.0),
    "gaussian σ≈4 (peaked)": lambda rng, rows, n: _scores(rng, rows, n, 4.0),
    "heavy-tailed": _heavy_tailed,
}


@dataclass(frozen=True)
class Config:
    """One table row: logit and probability formats, and the mask."""

    title: str
    in_bits: int
    out_fmt: QFormat
    options: dict[str, Any]
    pad_share: float = 0.0  # share of keys padded (from the end of each row)


CONFIGS = (
    Config("int8 → uint8", 8, QFormat(8, 2.0**-8, False), {}),
    Config("int16 → int16", 16, QFormat(16, 2.0**-15), {}),
    Config("int8 → uint8, causal", 8, QFormat(8, 2.0**-8, False), {"causal": True}),
    Config("int8 → uint8, 25 % padding", 8, QFormat(8, 2.0**-8, False), {"padding": True}, pad_share=0.25),
)


@dataclass(frozen=True)
class SoftmaxResult:
    config: str
    logits: str
    n: int
    stats: ErrorStats


def logit_format(x: np.ndarray, bits: int) -> QFormat:
    """Per-tensor max-abs calibration rounded up to a power of two (what a deployable model feeds)."""
    hi = (1 << (bits - 1)) - 1
    return QFormat.power_of_two(bits, math.ceil(math.log2(float(np.max(np.abs(x))) / hi)))


def measure_softmax(cfg: Config, logits: str, n: int, seed: int = 0) -> SoftmaxResult:
    rng = np.random.default_rng([seed, n, cfg.in_bits, list(LOGITS).index(logits), CONFIGS.index(cfg)])
    rows = max(ELEMENTS_PER_CELL // n, 1)
    if cfg.options.get("causal"):
        rows = -(-rows // n) * n  # whole (n, n) score matrices
    x = LOGITS[logits](rng, rows, n)
    in_fmt = logit_format(x, cfg.in_bits)
    op = IntSoftmax.build(n, in_fmt, cfg.out_fmt, **cfg.options)
    xq = in_fmt.quantize(x)
    if cfg.pad_share:
        xq = mask_padding(xq, in_fmt, lengths=np.full(rows, n - int(n * cfg.pad_share)))
    # the float op sees the same dequantized input (masks included): the op's own error only
    ref = op.float_reference(in_fmt.dequantize(xq))
    return SoftmaxResult(cfg.title, logits, n, error_in_lsb(op.forward(xq), cfg.out_fmt, ref))


def measure_all(seed: int = 0) -> list[SoftmaxResult]:
    return [measure_softmax(cfg, logits, n, seed) for cfg in CONFIGS for logits in LOGITS for n in ROW_LENGTHS]


def markdown_table(results: list[SoftmaxResult]) -> str:
    """One row per config and logit distribution; a cell is max LSB / mean LSB / share within 1 LSB."""
    out = [
        "cell: max LSB / mean LSB / within 1 LSB of the float64 softmax; saturated share in brackets when > 0\n",
        "| softmax | logits | " + " | ".join(f"N={n}" for n in ROW_LENGTHS) + " |",
        "|---|---|" + "---|" * len(ROW_LENGTHS),
    ]
    for key in dict.fromkeys((r.config, r.logits) for r in results):
        cells = [_cell(next(r.stats for r in results if (r.config, r.logits, r.n) == (*key, n))) for n in ROW_LENGTHS]
        out.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _cell(s: ErrorStats) -> str:
    sat = f" [{100 * s.saturated:.1f} % sat]" if s.saturated > 0 else ""
    return f"{s.max_lsb:.2f} / {s.mean_lsb:.3f} / {100 * s.within_1lsb:.1f} %{sat}"
