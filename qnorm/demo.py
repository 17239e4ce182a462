"""``make demo``: every integer op measured against its float op, written to out/; then the
deployment story (:func:`run_deploy_demo`): train, fold, compile, run, check bit for bit."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qnorm import report_lanes16, report_softmax
from qnorm.fixedpoint import Dyadic
from qnorm.metrics import error_in_lsb
from qnorm.ops import IntRMSNorm
from qnorm.ops.multithreshold import BNActConfig, BNQuant, MultiThreshold
from qnorm.ops.spiking import FoldedLIFNeuron, LIFConfig, MPBNNeuron, spike_agreement
from qnorm.qformat import QFormat
from qnorm.report import (
    CaseResult,
    NormBuilder,
    markdown_table,
    measure_all,
    save_histogram,
)
from qnorm.report_activation import ActivationRow, activation_markdown, measure_activations

# What `qnorm demo --out OUT` writes under OUT; README.md quotes these reports.
ERROR_TABLE, ERROR_HIST = "error_table.md", "error_hist.png"
TRAIN_DIR = "train"  # the `qnorm train` run of the default families
DEPLOY_REPORT, DEPLOY_PLOT, DEPLOY_DIR = "deploy.md", "deploy.png", "deploy"
DEPLOY_CHECKPOINTS = "checkpoints"  # under DEPLOY_DIR, beside the compiled models


def norm_builders() -> dict[str, NormBuilder]:
    """The golden op of every registered integer norm kind (variants included), by its title,
    plus partial RMSNorm (a config of int_rms, no kind of its own)."""
    from qnorm.nn.kinds import NORM, integer_kinds

    builders: dict[str, NormBuilder] = {
        kind.title or kind.name: functools.partial(kind.golden.from_float, **dict(kind.options))
        for kind in integer_kinds(NORM)
    }
    builders["partial RMSNorm p=0.25"] = functools.partial(IntRMSNorm.from_float, partial=0.25)
    return builders


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


def error_table_markdown(
    norms: list[CaseResult],
    spiking: list[SpikingRow],
    mt: list[MultiThresholdRow],
    *,
    activations: list[ActivationRow],
    softmax: list[report_softmax.SoftmaxResult],
    lanes16: list[report_lanes16.FloorRow],
) -> str:
    """The text of ``error_table.md``: one section per kind of op."""
    return "\n\n".join([
        "## Norms: integer op vs float op (same dequantized input), error in output LSB\n\n" + markdown_table(norms),
        "## Membrane-potential BN in spiking neurons\n\n" + spiking_markdown(spiking),
        "## BN + quantized activation folded into multi-thresholds\n\n" + multithreshold_markdown(mt),
        "## GELU and SiLU: integer op vs float op on every input code, error in output LSB\n\n"
        + activation_markdown(activations),
        "## Softmax: integer op vs float64 softmax (same dequantized logits, masks included)\n\n"
        + report_softmax.markdown_table(softmax),
        "## 16-bit element chains: the error floor (a model, not a datapath)\n\n" + report_lanes16.markdown_table(lanes16),
    ])


def run_demo(out: Path, seed: int = 0) -> str:
    """Measure everything, write ``out/error_table.md`` and ``out/error_hist.png``."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    norms = measure_all(norm_builders(), seed)
    spiking = measure_spiking(seed)
    mt = measure_multithreshold(seed)
    softmax = report_softmax.measure_all(seed)
    text = error_table_markdown(
        norms, spiking, mt, activations=measure_activations(), softmax=softmax, lanes16=report_lanes16.measure(seed)
    )
    (out / ERROR_TABLE).write_text(text + "\n")
    save_histogram(norms, out / ERROR_HIST)
    print(text)
    print(f"\nwrote {out / ERROR_TABLE} and {out / ERROR_HIST} in {time.perf_counter() - t0:.1f} s")
    bad = sum(r.folded_mismatches for r in spiking) + sum(r.folded_mismatches for r in mt)
    if bad:
        raise RuntimeError(f"folded and unfolded forms disagree on {bad} outputs")
    return text


# --------------------------------------------------------------------------- deployment story

# The deployable models the demo trains and compiles: name -> (model kind, config).
DEPLOY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixer-int_ln": ("mixer", {"norm": "int_ln"}),
    "snn-int_mpbn_lif-pow2": ("snn", {"neuron": "int_mpbn_lif", "pow2": True}),
    "transformer-int_ln": ("transformer", {"norm": "int_ln", "integer": True}),
    "llama-int_rms": ("transformer", {"norm": "int_rms", "integer": True, "mlp": "swiglu"}),
}


class DeployMismatchError(RuntimeError):
    """The compiled model's outputs differ from the QAT model's (the report is written first)."""


@dataclass(frozen=True)
class DeployRow:
    """One deployed model: accuracy, the bit-exact check, and what compiling it cost."""

    name: str
    epochs: int
    samples: int
    qat_accuracy: float
    compiled_accuracy: float
    integers: int  # output integers compared (samples x classes)
    mismatches: int  # of them, different in the compiled model: must be 0
    train_seconds: float
    compile_seconds: float
    cache_hit: bool
    recompile_seconds: float  # compiling the same model again: a build-cache hit
    run_seconds: float
    directory: str
    library_bytes: int
    sha256: str
    proof: str  # the exactness summary
    headroom: list[float]  # bits below 2^24 of every proven accumulation, in graph order


def deploy_recipes(quick: bool) -> dict[str, Any]:
    """Training recipe per `qnorm train` family: brief, since bit-exactness does not need accuracy."""
    from qnorm.train.experiment import Recipe

    if quick:
        transformer = Recipe(epochs=1, lr=5e-3, train_samples=512)
        return {
            "mixer": Recipe(epochs=2, lr=5e-3, train_samples=512),
            "snn-pow2": Recipe(epochs=1, lr=3e-3, train_samples=512),
            "transformer-int": transformer,
            "llama": transformer,
        }
    # The integer transformers train several times slower per epoch than the mixer
    # (attention, and the integer softmax and activation in every forward): fewer epochs.
    transformer = Recipe(epochs=4, lr=5e-3)
    return {
        "mixer": Recipe(epochs=8, lr=5e-3),
        "snn-pow2": Recipe(epochs=4, lr=3e-3),
        "transformer-int": transformer,
        "llama": transformer,
    }


def deploy_checkpoint(out: Path, name: str) -> Path:
    """Where the demo saves the trained checkpoint of DEPLOY_MODELS[name]."""
    return out / DEPLOY_DIR / DEPLOY_CHECKPOINTS / name


def deploy_library(out: Path, name: str) -> Path:
    """Where the demo saves the compiled model (``model.so`` + ``model.json``) of DEPLOY_MODELS[name]."""
    return out / DEPLOY_DIR / name


def demo_outputs(out: Path) -> list[Path]:
    """Every report, plot and directory `qnorm demo --out OUT` writes under `out`."""
    from qnorm.train.experiment import resolve_kinds, training_outputs

    deployed = [path for name in DEPLOY_MODELS for path in (deploy_checkpoint(out, name), deploy_library(out, name))]
    return [
        out / ERROR_TABLE, out / ERROR_HIST,
        *training_outputs(out / TRAIN_DIR, resolve_kinds()),
        out / DEPLOY_REPORT, out / DEPLOY_PLOT, *deployed,
    ]  # fmt: skip


def run_deploy_demo(out: Path, seed: int = 0, quick: bool = False, jobs: int = 2) -> list[DeployRow]:
    """Train briefly -> fold -> compile for this CPU -> run the test set -> bit-exact check.

    Writes ``out/deploy.md``, ``out/deploy.png``, the checkpoints and the compiled
    directories (``model.so`` + ``model.json``) under ``out/deploy/``, prints each
    phase's time, and raises DeployMismatchError (after writing) when any output
    integer of a compiled model differs from the QAT model's.
    """
    import torch

    from compilers.tvm.graph import compile_model, load_compiled
    from qnorm.nn import BNQATModule
    from qnorm.passes import fold_thresholds
    from qnorm.train.checkpoint import load_checkpoint
    from qnorm.train.compiled import checkpoint_source
    from qnorm.train.data import load_digits_data
    from qnorm.train.experiment import Job, family_of, run_jobs

    phases: dict[str, float] = {}
    recipes = deploy_recipes(quick)
    checkpoints = {name: deploy_checkpoint(out, name) for name in DEPLOY_MODELS}

    start = time.perf_counter()
    # Trained as `qnorm train --family mixer snn-pow2 transformer-int llama` trains them, with the demo's recipes.
    work = []
    epochs = {}
    for name, (kind, config) in DEPLOY_MODELS.items():
        family, family_kind = family_of(kind, config)
        work.append(Job(family, family_kind, recipes[family], seed, checkpoints[name], progress=False))
        epochs[name] = recipes[family].epochs
    summaries = run_jobs(work, min(jobs, len(work)), progress=False)
    train_seconds = {name: s["train_seconds"] for name, s in zip(DEPLOY_MODELS, summaries, strict=True)}
    phases["train"] = time.perf_counter() - start

    rows = []
    for name in DEPLOY_MODELS:
        model, meta = load_checkpoint(checkpoints[name])
        data = load_digits_data(model.input_layout, seed=seed)
        x, labels = data.test.tensors

        start = time.perf_counter()
        with torch.no_grad():
            want = model(x).numpy()  # the QAT model (eval): the reference
        phases["qat reference"] = phases.get("qat reference", 0.0) + time.perf_counter() - start

        start = time.perf_counter()
        foldable = sum(isinstance(m, BNQATModule) for m in model.modules())
        deployable = fold_thresholds(model) if foldable else model  # BN before thresholds -> integer thresholds
        if foldable:
            with torch.no_grad():
                if not np.array_equal(deployable(x).numpy(), want):
                    raise DeployMismatchError(f"{name}: the folded model's outputs differ from the trained model's")
            print(f"{name}: folded {foldable} BN-before-threshold layer(s); outputs identical on {len(x)} test samples")
        phases["fold"] = phases.get("fold", 0.0) + time.perf_counter() - start

        start = time.perf_counter()
        compiled = compile_model(deployable, deployable.example_input(), "x86_64")
        directory = compiled.save(deploy_library(out, name), source=checkpoint_source(checkpoints[name], meta))
        # What the next `qnorm compile` of this model costs: the model key finds the library.
        again = compile_model(deployable, deployable.example_input(), "x86_64")
        if not again.cache_hit:
            raise RuntimeError(f"{name}: compiling the same model again missed the build cache")
        phases["compile"] = phases.get("compile", 0.0) + time.perf_counter() - start
        print(f"{name}: {compiled.metadata['exactness']['summary']}")
        print(f"{name}: {'cache hit' if compiled.cache_hit else 'compiled'} in {compiled.seconds:.1f} s -> {directory}; "
              f"again: cache hit in {1e3 * again.seconds:.0f} ms")

        start = time.perf_counter()
        loaded = load_compiled(directory)
        got = loaded(x.numpy())
        run_seconds = time.perf_counter() - start
        phases["run"] = phases.get("run", 0.0) + run_seconds

        start = time.perf_counter()
        mismatches = int(np.sum(got != want))
        info = loaded.metadata
        rows.append(DeployRow(
            name=name, epochs=epochs[name], samples=len(x), qat_accuracy=_accuracy(want, labels),
            compiled_accuracy=_accuracy(got, labels), integers=int(got.size), mismatches=mismatches,
            train_seconds=train_seconds[name], compile_seconds=compiled.seconds, cache_hit=compiled.cache_hit,
            recompile_seconds=again.seconds, run_seconds=run_seconds,
            directory=str(directory), library_bytes=info["library"]["bytes"], sha256=info["library"]["sha256"],
            proof=info["exactness"]["summary"],
            headroom=[a["headroom_bits"] for a in info["exactness"]["accumulators"]],
        ))  # fmt: skip
        phases["check"] = phases.get("check", 0.0) + time.perf_counter() - start

    start = time.perf_counter()
    text = deploy_markdown(rows, quick)
    (out / DEPLOY_REPORT).write_text(text)
    save_deploy_plot(rows, out / DEPLOY_PLOT)
    phases["report"] = time.perf_counter() - start
    print(text)
    print("phases: " + " | ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
    print(f"wrote {out / DEPLOY_REPORT}, {out / DEPLOY_PLOT} and {out / DEPLOY_DIR}/")
    bad = [r for r in rows if r.mismatches]
    if bad:
        raise DeployMismatchError(
            "compiled outputs differ from the QAT model: "
            + "; ".join(f"{r.name}: {r.mismatches}/{r.integers} integers" for r in bad)
        )
    return rows


def _accuracy(logits: np.ndarray, labels: Any) -> float:
    return float(np.mean(np.argmax(logits, axis=1) == np.asarray(labels)))


def deploy_markdown(rows: list[DeployRow], quick: bool) -> str:
    """The text of ``deploy.md``: one table row per model (README.md quotes the table), the details below."""
    lines = [
        "## Deployment: trained QAT model vs the model compiled for this CPU (TVM, x86_64)",
        "",
        "| model | accuracy, QAT = compiled | test-set integers differing | compile | cached |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        qat, compiled = f"{100 * r.qat_accuracy:.2f} %", f"{100 * r.compiled_accuracy:.2f} %"
        accuracy = qat if qat == compiled else f"QAT {qat}, compiled {compiled}"
        compile_cell = f"{r.compile_seconds:.1f} s" + (" (cache hit)" if r.cache_hit else "")
        model = f"{r.name}, {r.epochs} epoch{'s' if r.epochs != 1 else ''}"
        lines.append(
            f"| {model} | {accuracy} | **{r.mismatches}** of {r.integers} | {compile_cell} | "
            f"{1e3 * r.recompile_seconds:.0f} ms |"
        )
    lines.append("")
    for r in rows:
        lines.append(
            f"- {r.name}: {r.samples} test samples; trained in {r.train_seconds:.1f} s; the test set runs in "
            f"{1e3 * r.run_seconds:.0f} ms; library {r.library_bytes / 1024:.0f} KiB, `{r.directory}` "
            f"(sha256 {r.sha256[:16]}...); {r.proof}"
        )
    verdict = "bit-exact" if not any(r.mismatches for r in rows) else "**MISMATCH**"
    lines += [
        "",
        f"Compiled vs QAT: {verdict} on every output integer of the whole test set"
        + (" (quick run: briefly trained models)" if quick else "") + ".",
    ]
    return "\n".join(lines) + "\n"


def save_deploy_plot(rows: list[DeployRow], path: Path) -> None:
    """Left: every proven accumulation's headroom below 2^24; right: accuracy QAT vs compiled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qnorm.deploy.exactness import EXACT_BITS

    # the accuracy panel widens with the number of models, so their bars and labels keep apart
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(9 + 0.6 * len(rows), 4), gridspec_kw={"width_ratios": [3, 0.35 * len(rows)]}
    )
    offset = 0
    for r in rows:
        pos = np.arange(offset, offset + len(r.headroom))
        left.bar(pos, [EXACT_BITS - b for b in r.headroom], label=r.name)
        offset += len(r.headroom) + 1
    left.axhline(EXACT_BITS, color="black", linestyle="--", linewidth=1)
    left.text(0, EXACT_BITS + 0.4, f"2^{EXACT_BITS}: float32 stops being exact", fontsize=8)
    left.set_ylabel("proven bound (log2 of grid units)")
    left.set_xlabel("accumulations (linear, conv, add, mean, pool) in graph order")
    left.set_xticks([])
    left.set_ylim(0, 30)
    left.legend(fontsize=8, loc="upper right", ncols=2)
    left.set_title("every float accumulation, proven below 2^24 units", fontsize=10)
    width = 0.38
    pos = np.arange(len(rows))
    right.bar(pos - width / 2, [100 * r.qat_accuracy for r in rows], width, label="QAT (torch)")
    right.bar(pos + width / 2, [100 * r.compiled_accuracy for r in rows], width, label="compiled (TVM)")
    for p, r in zip(pos, rows, strict=True):
        top = 100 * max(r.qat_accuracy, r.compiled_accuracy)
        right.text(p, top + 2, f"{r.mismatches} mismatching\nintegers", ha="center", fontsize=7)
    right.set_xticks(pos, [r.name.split("-")[0] for r in rows], fontsize=8)
    right.set_ylabel("test accuracy (%)")
    right.set_ylim(0, 135)
    right.set_yticks(range(0, 101, 20))
    right.legend(fontsize=8, loc="upper left", ncols=2)
    right.set_title("test set", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

