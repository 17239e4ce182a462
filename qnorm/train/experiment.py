"""`qnorm train`: train every norm and neuron kind on digits and tabulate test accuracy.

One run trains, with the same seed and recipe per model, each requested kind in each
model family (`FAMILIES`) that takes it. By default (families "transformer", "snn"):

* the digits transformer (int8 Brevitas linears) once per norm kind: the float
  ``nn.LayerNorm`` reference and the integer norms (IntLayerNorm, L1, Shift, IntRMSNorm);
* the convolutional SNN with the integer QAT MPBN LIF neuron ("int_mpbn_lif"),
  evaluated as trained (unfolded) and after ``fold_thresholds`` (one integer threshold
  per channel), plus the float MPBN LIF reference ("float_mpbn_lif").

The deployable families, "mixer" (per integer norm kind), "snn-pow2" (per integer
neuron kind), "transformer-int" (the transformer with IntSoftmax attention and an
IntGELU MLP, per integer norm kind) and "llama" (the same attention, pre-RMSNorm and
a gated IntSiLU MLP), train models with power-of-two scales throughout, whose
checkpoints `qnorm compile` turns into libraries that reproduce them bit for bit.
The two integer transformer families are compared with the float transformer of
"transformer" when it trains in the same run (``--family transformer
transformer-int llama``).

Every trained model is saved with `save_checkpoint` (safetensors + meta.json, which
records each qnorm layer's ``qnorm_metadata()``, the Brevitas int8 weight/activation
formats, the training history and the test predictions a reload must reproduce),
and the run writes ``accuracy.md`` / ``accuracy.json``. The goal it reports: every
integer norm within `GOAL_POINTS` of the float-LN transformer's test accuracy.

The folded SNN must predict exactly what the unfolded one predicts; when it does not,
the tables record the mismatch and the run raises `FoldMismatchError` after writing them.

Determinism: one seed fixes the train/test split, every initialization and the data
order; each model trains and evaluates with one intra-op thread, so a model's result
does not depend on whether it ran inline or in a worker process (``jobs``).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset
from tqdm.auto import tqdm

from qnorm.errors import UsageError
from qnorm.nn import BNQATModule, IntModule
from qnorm.passes import fold_thresholds
from qnorm.train.checkpoint import save_checkpoint
from qnorm.train.data import DigitsData, load_digits_data
from qnorm.train.families import DEFAULT_FAMILIES, FAMILIES, family_names
from qnorm.train.loop import eval_loader, evaluate, seed_everything, torch_threads, train
from qnorm.train.models import build_model, neuron_kinds, norm_kinds

DEFAULT_KINDS = tuple(k for f in DEFAULT_FAMILIES for k in FAMILIES[f].defaults)
GOAL_POINTS = 1.0
CHECKPOINTS = "checkpoints"
TABLE_MD = "accuracy.md"
TABLE_JSON = "accuracy.json"


class FoldMismatchError(RuntimeError):
    """The folded SNN's test predictions differ from the unfolded model's."""


@dataclass(frozen=True)
class Recipe:
    """How one model family trains; `train_samples` None means the whole training split."""

    epochs: int
    lr: float
    batch_size: int = 64
    weight_decay: float = 0.01
    train_samples: int | None = None


# The tested recipes of tests/test_train.py (float transformer ~0.97, float SNN ~0.99);
# the deployable families reuse their token / image model's recipe.
FULL_RECIPES = {
    "transformer": Recipe(epochs=20, lr=5e-3),
    "snn": Recipe(epochs=8, lr=3e-3),
    "mixer": Recipe(epochs=20, lr=5e-3),
    "snn-pow2": Recipe(epochs=8, lr=3e-3),
    "transformer-int": Recipe(epochs=20, lr=5e-3),
    "llama": Recipe(epochs=20, lr=5e-3),
}
# Smoke-test size: a few batches, enough to exercise every code path in seconds.
QUICK_RECIPES = {
    "transformer": Recipe(epochs=4, lr=5e-3, train_samples=512),
    "snn": Recipe(epochs=2, lr=3e-3, train_samples=512),
    "mixer": Recipe(epochs=4, lr=5e-3, train_samples=512),
    "snn-pow2": Recipe(epochs=2, lr=3e-3, train_samples=512),
    "transformer-int": Recipe(epochs=4, lr=5e-3, train_samples=512),
    "llama": Recipe(epochs=4, lr=5e-3, train_samples=512),
}


@dataclass(frozen=True)
class Job:
    """One model to train: `kind` in `family` (a key of FAMILIES)."""

    family: str
    kind: str
    recipe: Recipe
    seed: int
    checkpoint: Path
    progress: bool


@dataclass(frozen=True)
class Row:
    """One line of the accuracy table.

    `variant` is "" for a trained model and "folded" for its threshold-folded copy;
    `integer`: the model has qnorm integer layers (the goal is about those rows);
    `reference` is the float kind the row is compared with (None for a reference row),
    `delta_points` / `within_goal` are None when that reference was not part of the run.
    """

    family: str
    kind: str
    variant: str
    integer: bool
    test_accuracy: float
    train_seconds: float | None
    checkpoint: str  # relative to the run's output directory
    reference: str | None = None
    delta_points: float | None = None
    within_goal: bool | None = None

    @property
    def label(self) -> str:
        return f"{self.kind} ({self.variant})" if self.variant else self.kind


@dataclass(frozen=True)
class FoldCheck:
    """Folded vs unfolded test predictions of one SNN kind."""

    family: str
    kind: str
    samples: int
    mismatches: int

    @property
    def identical(self) -> bool:
        return self.mismatches == 0


@dataclass
class AccuracyTable:
    """The run's outcome: table rows, fold checks, the settings it ran with, its wall time
    and (once written) the paths of accuracy.md / accuracy.json."""

    rows: list[Row]
    folds: list[FoldCheck]
    settings: dict[str, Any]
    wall_seconds: float
    files: dict[str, str] = field(default_factory=dict)

    @property
    def goal_rows(self) -> list[Row]:
        """The integer-norm transformer rows the goal is about (those with a reference)."""
        return [r for r in self.rows
                if FAMILIES[r.family].model == "transformer" and r.integer and r.within_goal is not None]

    @property
    def goal_met(self) -> bool | None:
        """Every integer norm within GOAL_POINTS of float LN; None if nothing was compared."""
        rows = self.goal_rows
        return all(r.within_goal for r in rows) if rows else None

    @property
    def folds_identical(self) -> bool:
        return all(f.identical for f in self.folds)

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": [{**asdict(r), "label": r.label} for r in self.rows],
            "folds": [{**asdict(f), "identical": f.identical} for f in self.folds],
            "goal": {"points": GOAL_POINTS, "met": self.goal_met,
                     "rule": f"every integer norm within {GOAL_POINTS} point(s) of float LN"},
            "folds_identical": self.folds_identical,
            "settings": self.settings,
            "wall_seconds": self.wall_seconds,
        }

    def to_markdown(self) -> str:
        header = ("| model | norm/neuron | test accuracy | Δ vs float (points) | train time | "
                  f"within {GOAL_POINTS} point? |")
        lines = [header, "|---|---|---:|---:|---:|---|"]
        for r in self.rows:
            delta = "—" if r.delta_points is None else f"{r.delta_points:+.2f}"
            seconds = "—" if r.train_seconds is None else f"{r.train_seconds:.1f} s"
            within = "—" if r.within_goal is None else ("yes" if r.within_goal else "**no**")
            lines.append(f"| {r.family} | {r.label} | {100 * r.test_accuracy:.2f} % | {delta} | "
                         f"{seconds} | {within} |")
        lines.append("")
        goal = self.goal_met
        verdict = "not evaluated (no integer norm with its float reference in this run)" \
            if goal is None else ("met" if goal else "**missed**")
        if self.settings["quick"]:
            verdict += " (quick smoke-test run: far too short to judge the goal)"
        lines.append(f"Goal (every integer norm within {GOAL_POINTS} point of float LN): {verdict}.")
        for f in self.folds:
            state = "identical" if f.identical else f"**{f.mismatches} differ**"
            lines.append(f"{f.family} {f.kind}: folded vs unfolded test predictions {state} "
                         f"({f.samples} samples).")
        s = self.settings
        recipes = "; ".join(
            f"{family}: {r['epochs']} epochs, lr {r['lr']} (AdamW, cosine), batch {r['batch_size']}, "
            f"{'all' if r['train_samples'] is None else r['train_samples']} training samples"
            for family, r in s["recipes"].items()
        )
        lines.append(f"Seed {s['seed']}{', quick' if s['quick'] else ''}; {recipes}; "
                     f"{s['test_samples']} test samples; {s['jobs']} job(s), "
                     f"wall time {self.wall_seconds:.1f} s.")
        return "\n".join(lines) + "\n"


def resolve_kinds(
    kinds: Sequence[str] | None = None, families: Sequence[str] = DEFAULT_FAMILIES
) -> list[tuple[str, str]]:
    """(family, kind) for each requested kind in each of `families` that trains it, in
    order, duplicates dropped; `kinds` None: every family's default kinds.

    By default a norm kind trains the transformer and a neuron kind the SNN. An unknown
    family, or a kind that none of `families` trains, is a UsageError (a ValueError) listing what is known.
    """
    families = family_names(families)
    if kinds is None:
        kinds = [k for f in families for k in FAMILIES[f].defaults]
    if not kinds:
        raise UsageError("no kinds to train")
    trains = {f: set(FAMILIES[f].kinds()) for f in families}
    resolved: list[tuple[str, str]] = []
    for kind in dict.fromkeys(kinds):
        matched = [(f, kind) for f in families if kind in trains[f]]
        if not matched:
            known = kind in norm_kinds() or kind in neuron_kinds()
            listing = "; ".join(f"{FAMILIES[f].describe()} ({f}): {', '.join(sorted(trains[f]))}"
                                for f in families)
            what = f"kind {kind!r} is trained by none of {', '.join(families)}" if known \
                else f"unknown kind {kind!r}"
            raise UsageError(f"{what}; {listing}")
        resolved.extend(matched)
    return resolved


def family_of(model: str, config: dict[str, Any]) -> tuple[str, str]:
    """The (family, kind) whose job builds ``build_model(model, **config)``."""
    for name, family in FAMILIES.items():
        kind = config.get(family.slot)
        if family.model == model and kind is not None and family.config(kind) == config:
            return name, kind
    raise ValueError(f"no model family trains {model} with config {config}")


def _data(job: Job, layout: str) -> DigitsData:
    data = load_digits_data(layout, seed=job.seed)
    n = job.recipe.train_samples
    if n is None:
        return data
    # The split is already shuffled, so its first n rows are a seeded random subset.
    x, y = data.train.tensors
    return replace(data, train=TensorDataset(x[:n], y[:n]), train_index=data.train_index[:n])


def _quant_format(scale: torch.Tensor, bits: torch.Tensor, signed: bool) -> dict[str, Any]:
    return {"bits": int(bits), "scale": scale.detach().double().tolist(), "signed": bool(signed)}


@torch.no_grad()
def brevitas_metadata(model: nn.Module) -> dict[str, Any]:
    """{qualified name: int8 format} of every Brevitas weight and activation quantizer.

    The qnorm layers publish theirs via ``qnorm_metadata()`` (saved by
    `save_checkpoint`); Brevitas layers have no such hook, so the run records their
    weight / activation scales here, next to the training results.
    """
    import brevitas.nn as qnn

    found: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, (qnn.QuantLinear, qnn.QuantConv2d)):
            w = module.quant_weight()
            found[name] = {"layer": type(module).__name__,
                           "weight": _quant_format(w.scale, w.bit_width, w.signed)}
        elif isinstance(module, qnn.QuantIdentity):
            act = module.act_quant
            found[name] = {"layer": type(module).__name__,
                           "act": _quant_format(act.scale(), act.bit_width(), act.is_signed)}
    return found


def _has(model: nn.Module, types: tuple[type, ...]) -> bool:
    return any(isinstance(m, types) for m in model.modules())


def run_job(job: Job) -> dict[str, Any]:
    """Train, evaluate, checkpoint (and for a foldable SNN, fold and re-evaluate) one model.

    Returns a picklable summary, so it can run in a worker process.
    """
    family = FAMILIES[job.family]
    seed_everything(job.seed)
    model = build_model(family.model, **family.config(job.kind))
    data = _data(job, model.input_layout)
    r = job.recipe
    result = train(model, data, r.epochs, r.lr, job.seed, batch_size=r.batch_size,
                   weight_decay=r.weight_decay, progress=job.progress,
                   desc=f"{job.family} {job.kind}")
    summary: dict[str, Any] = {
        "family": job.family, "kind": job.kind, "seed": job.seed, "recipe": asdict(r),
        "history": result.history, "train_seconds": result.seconds,
        "test_accuracy": result.test_accuracy,
        "test_predictions": result.predictions.tolist(),
        "integer": _has(model, (IntModule,)),
    }
    if _has(model, (BNQATModule,)):
        with torch_threads(1):
            accuracy, predictions = evaluate(fold_thresholds(model), eval_loader(data))
        summary["folded_test_accuracy"] = accuracy
        summary["folded_test_predictions"] = predictions.tolist()
        identical = torch.equal(predictions, result.predictions)
        summary["fold_mismatches"] = 0 if identical else int((predictions != result.predictions).sum())
    save_checkpoint(model, job.checkpoint,
                    metadata={"training": summary, "brevitas": brevitas_metadata(model)})
    return summary


def run_jobs(jobs: list[Job], workers: int, progress: bool) -> list[dict[str, Any]]:
    """`run_job` for each job, in `workers` processes (inline for 1); summaries in order."""
    if workers == 1:
        return [run_job(j) for j in jobs]
    # spawn, not fork: forking a process that has started torch's thread pools can hang.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures = [pool.submit(run_job, j) for j in jobs]
        bar = tqdm(total=len(jobs), desc=f"train ({workers} processes)", disable=not progress)
        results = []
        try:
            # In submission order: the bar moves as the head of the queue finishes.
            for future in futures:
                results.append(future.result())
                bar.update()
                bar.set_postfix(last=f"{results[-1]['kind']} {100 * results[-1]['test_accuracy']:.1f}%")
        except BaseException:
            # The run has failed: do not train the models still queued.
            pool.shutdown(cancel_futures=True)
            raise
        finally:
            bar.close()
    return results


def _compared(row: Row, ref_accuracy: float | None) -> Row:
    if ref_accuracy is None:
        return row
    # Rounded to shed float noise: a gap of exactly GOAL_POINTS counts as within.
    delta = round(100 * (row.test_accuracy - ref_accuracy), 6)
    return replace(row, delta_points=delta, within_goal=delta >= -GOAL_POINTS)


def _rows(results: list[dict[str, Any]], out_dir: Path) -> list[Row]:
    accuracy = {(s["family"], s["kind"]): s["test_accuracy"] for s in results}
    rows = []
    for s in results:
        family, kind = s["family"], s["kind"]
        reference = FAMILIES[family].reference
        ref = reference if kind != reference else None
        ref_family = FAMILIES[family].reference_family or family
        checkpoint = str(_checkpoint_dir(out_dir, family, kind).relative_to(out_dir))
        trained = Row(family, kind, "", s["integer"], s["test_accuracy"], s["train_seconds"],
                      checkpoint, ref)
        entries = [trained]
        if "folded_test_accuracy" in s:
            entries.append(replace(trained, variant="folded",
                                   test_accuracy=s["folded_test_accuracy"], train_seconds=None))
        rows.extend(_compared(row, accuracy.get((ref_family, ref))) for row in entries)
    return rows


def _checkpoint_dir(out_dir: Path, family: str, kind: str) -> Path:
    """Where a run into `out_dir` saves the model of `kind` in `family`."""
    return out_dir / CHECKPOINTS / f"{family}-{kind}"


def training_outputs(out_dir: Path, resolved: Sequence[tuple[str, str]]) -> list[Path]:
    """Every table and checkpoint directory a run of these (family, kind) pairs writes into `out_dir`."""
    return [out_dir / TABLE_MD, out_dir / TABLE_JSON,
            *(_checkpoint_dir(out_dir, family, kind) for family, kind in resolved)]


def default_jobs() -> int:
    """Two processes where two cores are free to us (each trains with one thread)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(2, cpus))


def run_training(
    out_dir: Path,
    *,
    epochs: int | None = None,
    seed: int = 0,
    kinds: Sequence[str] | None = None,
    families: Sequence[str] = DEFAULT_FAMILIES,
    quick: bool = False,
    progress: bool = True,
    jobs: int = 1,
) -> AccuracyTable:
    """Train every kind in `kinds` (None: the families' defaults) in each of `families` that
    trains it (`resolve_kinds`), write checkpoints and the accuracy tables into `out_dir`.

    `epochs` overrides the recipe's epoch count for every model; `quick` selects the
    smoke-test recipes. Raises UsageError for an unknown kind or bad setting (before
    training anything) and FoldMismatchError, after writing the tables, when a folded
    SNN's predictions differ from the unfolded ones.
    """
    if epochs is not None and epochs < 1:
        raise UsageError(f"epochs must be >= 1, got {epochs}")
    if jobs < 1:
        raise UsageError(f"jobs must be >= 1, got {jobs}")
    resolved = resolve_kinds(kinds, families)
    out_dir = Path(out_dir)
    recipes = QUICK_RECIPES if quick else FULL_RECIPES
    if epochs is not None:
        recipes = {family: replace(r, epochs=epochs) for family, r in recipes.items()}
    workers = min(jobs, len(resolved))
    todo = [Job(family, kind, recipes[family], seed, _checkpoint_dir(out_dir, family, kind),
                progress and workers == 1) for family, kind in resolved]
    start = time.perf_counter()
    results = run_jobs(todo, workers, progress)
    wall = time.perf_counter() - start
    test_samples = len(results[0]["test_predictions"])
    settings = {
        "seed": seed, "quick": quick, "jobs": workers,
        "families": list(dict.fromkeys(f for f, _ in resolved)),
        "kinds": list(dict.fromkeys(k for _, k in resolved)),
        "recipes": {family: asdict(recipes[family]) for family in dict.fromkeys(f for f, _ in resolved)},
        "test_samples": test_samples, "torch": torch.__version__,
    }
    folds = [FoldCheck(s["family"], s["kind"], test_samples, s["fold_mismatches"])
             for s in results if "fold_mismatches" in s]
    table = AccuracyTable(_rows(results, out_dir), folds, settings, wall)
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / TABLE_MD, out_dir / TABLE_JSON
    md.write_text(table.to_markdown())
    js.write_text(json.dumps(table.to_json(), indent=2, allow_nan=False) + "\n")
    table.files = {"markdown": str(md), "json": str(js)}
    broken = [f for f in folds if not f.identical]
    if broken:
        raise FoldMismatchError(
            "folded SNN predictions differ from the unfolded model: "
            + "; ".join(f"{f.kind}: {f.mismatches}/{f.samples} test samples ({f.family})"
                        for f in broken)
            + f" (recorded in {md})"
        )
    return table
