"""``make demo``: every integer op measured against its float op, written to out/."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qnorm.fixedpoint import Dyadic
from qnorm.metrics import error_in_lsb
from qnorm.ops import IntLayerNorm, IntRMSNorm, L1LayerNorm, ShiftLayerNorm
from qnorm.ops.multithreshold import BNActConfig, BNQuant, MultiThreshold
from qnorm.ops.spiking import FoldedLIFNeuron, LIFConfig, MPBNNeuron, spike_agreement
from qnorm.qformat import QFormat
from qnorm.report import NormBuilder, markdown_table, measure_all, save_histogram

NORM_BUILDERS: dict[str, NormBuilder] = {
    "IntLayerNorm (L2)": IntLayerNorm.from_float,
    "L1LayerNorm": L1LayerNorm.from_float,
    "ShiftLayerNorm, 1 term": lambda g, b, e, i, o: ShiftLayerNorm.from_float(g, b, e, i, o, mantissa_terms=1),
    "ShiftLayerNorm, 2 terms": lambda g, b, e, i, o: ShiftLayerNorm.from_float(g, b, e, i, o, mantissa_terms=2),
    "IntRMSNorm": IntRMSNorm.from_float,
    "partial RMSNorm p=0.25": lambda g, b, e, i, o: IntRMSNorm.from_float(g, b, e, i, o, partial=0.25),
}


@dataclass(frozen=True)
class SpikingRow:
    config: str
    agreement: float  # integer vs float neuron, share of (step, neuron) entries
    folded_mismatches: int  # folded vs unfolded integer neuron: must be 0


def measure_spiking(seed: int = 0) -> list[SpikingRow]:
    """MPBN LIF: integer vs float spike agreement, and folded == unfolded."""
    rng = np.random.default_rng(seed)
    channels, steps, batch = 64, 100, 32
    gamma = rng.normal(1.0, 0.5, channels)
    gamma[:4] = -np.abs(gamma[:4])  # gamma < 0 flips the comparison
    gamma[4] = 0.0  # gamma = 0: constant spike decision
    params = dict(
        gamma=gamma,
        beta=rng.normal(0, 0.2, channels),
        mean=rng.normal(0, 2.0, channels),
        var=rng.uniform(1.0, 9.0, channels),
        eps=1e-5,
        v_th=1.0,
    )
    in_fmt = QFormat(8, 0.02)
    x = rng.integers(-40, 120, (steps, batch, channels))
    rows = []
    for reset in ("hard", "soft"):
        for leak_name, leak in (("no leak", None), ("leak 0.9", Dyadic.from_float(0.9, 16))):
            for comparator in (">=", ">"):
                cfg = LIFConfig(in_fmt, membrane_bits=16, leak=leak, reset=reset, comparator=comparator, saturate=True)
                unfolded = MPBNNeuron.from_float(cfg=cfg, **params)
                folded = FoldedLIFNeuron.from_float(cfg=cfg, **params)
                mismatches = int(np.sum(unfolded.forward(x) != folded.forward(x)))
                name = f"{reset} reset, {leak_name}, `{comparator}`"
                rows.append(SpikingRow(name, spike_agreement(unfolded, x), mismatches))
    return rows


@dataclass(frozen=True)
class MultiThresholdRow:
    config: str
    max_lsb: float
    mean_lsb: float
    folded_mismatches: int  # over every input of the declared width: must be 0


def measure_multithreshold(seed: int = 0) -> list[MultiThresholdRow]:
    """BN + quantized activation vs its multi-threshold fold, every int8 input."""
    rng = np.random.default_rng(seed)
    channels = 32
    gamma = rng.normal(1.0, 0.5, channels)
    gamma[:3] = -np.abs(gamma[:3])
    gamma[3] = 0.0
    bn = dict(gamma=gamma, beta=rng.normal(0, 0.3, channels), mean=rng.normal(0, 0.5, channels),
              var=rng.uniform(0.2, 2.0, channels), eps=1e-5)
    x = np.repeat(np.arange(-128, 128)[:, None], channels, axis=1)
    rows = []
    for name, out_fmt in (("uint4 activation", QFormat(4, 0.25, signed=False)),
                          ("int8 activation", QFormat(8, 1 / 32))):
        cfg = BNActConfig(QFormat(8, 1 / 32), out_fmt)
        unfolded = BNQuant.from_float(cfg=cfg, **bn)
        folded = MultiThreshold.from_float(cfg=cfg, **bn)
        stats = error_in_lsb(unfolded.forward(x), out_fmt, unfolded.float_reference(cfg.in_fmt.dequantize(x)))
        mism = int(np.sum(unfolded.forward(x) != folded.forward(x)))
        rows.append(MultiThresholdRow(name, stats.max_lsb, stats.mean_lsb, mism))
    return rows


def spiking_markdown(rows: list[SpikingRow]) -> str:
    out = ["| MPBN LIF config | spike agreement int vs float | folded vs unfolded mismatches |", "|---|---|---|"]
    out += [f"| {r.config} | {100 * r.agreement:.2f} % | {r.folded_mismatches} |" for r in rows]
    return "\n".join(out)


def multithreshold_markdown(rows: list[MultiThresholdRow]) -> str:
    out = ["| BN + quant act (int8 in, all 256 inputs x 32 ch) | max LSB vs float | mean LSB | multi-threshold vs BN+quant mismatches |",
           "|---|---|---|---|"]
    out += [f"| {r.config} | {r.max_lsb:.2f} | {r.mean_lsb:.4f} | {r.folded_mismatches} |" for r in rows]
    return "\n".join(out)


def run_demo(out: Path, seed: int = 0) -> str:
    """Measure everything, write ``out/error_table.md`` and ``out/error_hist.png``."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    norms = measure_all(NORM_BUILDERS, seed)
    spiking = measure_spiking(seed)
    mt = measure_multithreshold(seed)
    text = "\n\n".join([
        "## Norms: integer op vs float op (same dequantized input), error in output LSB\n\n" + markdown_table(norms),
        "## Membrane-potential BN in spiking neurons\n\n" + spiking_markdown(spiking),
        "## BN + quantized activation folded into multi-thresholds\n\n" + multithreshold_markdown(mt),
    ])
    (out / "error_table.md").write_text(text + "\n")
    save_histogram(norms, out / "error_hist.png")
    print(text)
    print(f"\nwrote {out / 'error_table.md'} and {out / 'error_hist.png'} in {time.perf_counter() - t0:.1f} s")
    bad = sum(r.folded_mismatches for r in spiking) + sum(r.folded_mismatches for r in mt)
    if bad:
        raise RuntimeError(f"folded and unfolded forms disagree on {bad} outputs")
    return text
