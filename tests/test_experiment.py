"""`qnorm train`: the accuracy-table run, its checkpoints, the fold check and the CLI."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from torch import nn

import qnorm.nn
import qnorm.passes
from qnorm.train import experiment
from qnorm.train.checkpoint import load_checkpoint, read_metadata
from qnorm.train.cli import add_train_parser
from qnorm.train.data import load_digits_data
from qnorm.train.experiment import run_training
from qnorm.train.loop import eval_loader, evaluate, torch_threads

KINDS = ("float", "int_ln", "int_mpbn_lif")
SEED = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    # Two worker processes: the parallel path must give what an inline run gives
    # (test_worker_results_equal_an_inline_run).
    table = run_training(out, seed=SEED, kinds=KINDS, quick=True, progress=False, jobs=2)
    return out, table


def _training(out, family, kind):
    return read_metadata(out / "checkpoints" / f"{family}-{kind}")["metadata"]["training"]


def test_run_writes_tables_and_checkpoints(run):
    out, table = run
    assert [(r.family, r.label) for r in table.rows] == [
        ("transformer", "float"), ("transformer", "int_ln"),
        ("snn", "int_mpbn_lif"), ("snn", "int_mpbn_lif (folded)"),
    ]
    for family, kind in (("transformer", "float"), ("transformer", "int_ln"), ("snn", "int_mpbn_lif")):
        assert sorted(p.name for p in (out / "checkpoints" / f"{family}-{kind}").iterdir()) == [
            "meta.json", "weights.safetensors"]
    saved = json.loads((out / "accuracy.json").read_text())
    assert saved == json.loads(json.dumps(table.to_json()))
    assert saved["settings"]["seed"] == SEED and saved["settings"]["quick"] is True
    assert saved["settings"]["recipes"]["transformer"]["train_samples"] == 512
    markdown = (out / "accuracy.md").read_text()
    assert markdown == table.to_markdown()
    assert markdown.startswith("| model | norm/neuron | test accuracy | Δ vs float (points) |")
    for row in table.rows:
        assert f"| {row.family} | {row.label} | {100 * row.test_accuracy:.2f} % |" in markdown
        recorded = _training(out, row.family, row.kind)
        assert row.test_accuracy == recorded["folded_test_accuracy" if row.variant else "test_accuracy"]


def test_delta_and_goal_follow_the_recorded_accuracies(run):
    out, table = run
    rows = {r.label: r for r in table.rows}
    ref = _training(out, "transformer", "float")["test_accuracy"]
    acc = _training(out, "transformer", "int_ln")["test_accuracy"]
    assert rows["float"].delta_points is None and rows["float"].within_goal is None
    assert not rows["float"].integer and rows["int_ln"].integer and rows["int_mpbn_lif"].integer
    assert rows["int_ln"].reference == "float"
    assert rows["int_ln"].delta_points == pytest.approx(100 * (acc - ref), abs=1e-6)
    assert rows["int_ln"].within_goal == (100 * (acc - ref) >= -experiment.GOAL_POINTS - 1e-9)
    assert table.goal_met == rows["int_ln"].within_goal
    # The float SNN was not part of this run: nothing to compare the integer SNN with.
    assert rows["int_mpbn_lif"].delta_points is None and rows["int_mpbn_lif"].within_goal is None


def test_goal_counts_integer_norm_rows_only():
    def row(kind: str, integer: bool, delta: float | None) -> experiment.Row:
        within = None if delta is None else delta >= -experiment.GOAL_POINTS
        return experiment.Row("transformer", kind, "", integer, 0.9, None, f"c/{kind}", "float",
                              delta, within)

    settings = {"seed": 0, "quick": False, "recipes": {}, "test_samples": 360, "jobs": 1}
    # A float kind (float_rms) missing the bar is shown but is no integer norm.
    table = experiment.AccuracyTable(
        [row("float", False, None), row("float_rms", False, -2.0), row("int_ln", True, -1.0)],
        [], settings, 1.0)
    assert table.goal_met is True and "(points) |" in table.to_markdown()
    table.rows.append(row("int_rms", True, -1.11))
    assert table.goal_met is False
    assert "| transformer | int_rms | 90.00 % | -1.11 | — | **no** |" in table.to_markdown()
    assert "Goal (every integer norm within 1.0 point of float LN): **missed**" in table.to_markdown()
    assert experiment.AccuracyTable([row("float", False, None)], [], settings, 1.0).goal_met is None


def test_checkpoints_reload_and_reproduce_recorded_predictions(run):
    out, _ = run
    for family, kind in (("transformer", "float"), ("transformer", "int_ln"), ("snn", "int_mpbn_lif")):
        model, meta = load_checkpoint(out / "checkpoints" / f"{family}-{kind}")  # rebuilt from meta
        recorded = meta["metadata"]["training"]
        data = load_digits_data(model.input_layout, seed=SEED)
        with torch_threads(1):
            accuracy, predictions = evaluate(model, eval_loader(data))
        assert predictions.tolist() == recorded["test_predictions"], kind
        assert accuracy == recorded["test_accuracy"]
        assert recorded["seed"] == SEED and len(recorded["history"]) == recorded["recipe"]["epochs"]
        # The Brevitas int8 formats, recorded beside the qnorm layers' own metadata.
        brevitas = meta["metadata"]["brevitas"]
        head = "head" if family == "transformer" else "readout"
        assert brevitas[head]["weight"]["bits"] == 8 and brevitas[head]["weight"]["scale"] > 0
        assert brevitas["input_quant"]["act"]["bits"] == 8
    norms = read_metadata(out / "checkpoints" / "transformer-int_ln")["modules"]
    assert sorted(norms) == ["blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2",
                             "norm"]
    assert all(m["layer"] == "IntLayerNorm" and m["golden"] is not None for m in norms.values())
    neurons = read_metadata(out / "checkpoints" / "snn-int_mpbn_lif")["modules"]
    assert sorted(neurons) == ["neurons.0", "neurons.1"]
    assert read_metadata(out / "checkpoints" / "transformer-float")["modules"] == {}


def test_folded_snn_predicts_exactly_as_unfolded(run):
    out, table = run
    assert [(f.kind, f.samples, f.mismatches) for f in table.folds] == [("int_mpbn_lif", 360, 0)]
    assert table.folds_identical
    recorded = _training(out, "snn", "int_mpbn_lif")
    assert recorded["folded_test_predictions"] == recorded["test_predictions"]
    # Independently of the run: fold the reloaded checkpoint.
    model, _ = load_checkpoint(out / "checkpoints" / "snn-int_mpbn_lif")
    folded = qnorm.passes.fold_thresholds(model)
    assert not any(isinstance(m, qnorm.nn.MPBNLIF) for m in folded.modules())
    loader = eval_loader(load_digits_data("image", seed=SEED))
    with torch_threads(1):
        assert torch.equal(evaluate(folded, loader)[1], evaluate(model, loader)[1])


def test_worker_results_equal_an_inline_run(run, tmp_path):
    out, _ = run
    job = experiment.Job("transformer", "int_ln", experiment.QUICK_RECIPES["transformer"], SEED,
                         tmp_path, progress=False)
    inline = experiment.run_job(job)
    worker = read_metadata(out / "checkpoints" / "transformer-int_ln")
    assert inline["test_predictions"] == worker["metadata"]["training"]["test_predictions"]
    assert inline["history"] == worker["metadata"]["training"]["history"]
    assert read_metadata(tmp_path)["weights"] == worker["weights"]  # the same bytes


def test_unknown_kind_is_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match=r"unknown kind 'int_lnn'; norm kinds \(transformer\): "
                                         r".*int_ln.*neuron kinds \(snn\): .*int_mpbn_lif"):
        run_training(tmp_path / "out", kinds=["float", "int_lnn"], quick=True, progress=False)
    with pytest.raises(ValueError, match="epochs must be >= 1"):
        run_training(tmp_path / "out", kinds=["float"], epochs=0, quick=True, progress=False)
    assert not (tmp_path / "out").exists()


class _Shifted(nn.Module):
    """A 'folded' model that predicts the next class: what a broken fold would do."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).roll(1, dims=1)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qnorm")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_fold_mismatch_fails_the_run_and_is_recorded(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(experiment, "fold_thresholds", _Shifted)
    # A tiny run: the fold check, not the accuracy, is under test.
    monkeypatch.setitem(experiment.QUICK_RECIPES, "snn",
                        replace(experiment.QUICK_RECIPES["snn"], epochs=1, train_samples=128))
    args = _parser().parse_args(["train", "--out", str(tmp_path), "--quick", "--kinds",
                                 "int_mpbn_lif", "--no-progress", "--jobs", "1"])
    assert args.func(args) == 1  # run_training raised FoldMismatchError after writing the tables
    assert re.search(r"FAILED: folded SNN predictions differ from the unfolded model: "
                     r"int_mpbn_lif: [1-9][0-9]*/360 test samples", capsys.readouterr().err)
    saved = json.loads((tmp_path / "accuracy.json").read_text())
    assert saved["folds_identical"] is False and saved["folds"][0]["mismatches"] > 0
    assert "differ** (360 samples)" in (tmp_path / "accuracy.md").read_text()


def test_cli_prints_the_table(tmp_path, capsys):
    args = _parser().parse_args(["train", "--out", str(tmp_path), "--quick", "--epochs", "1",
                                 "--kinds", "float", "--no-progress", "--seed", "5"])
    assert args.jobs is None and args.epochs == 1
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert printed.startswith((tmp_path / "accuracy.md").read_text())
    assert "| transformer | float |" in printed and "Seed 5, quick" in printed
    with pytest.raises(SystemExit):
        _parser().parse_args(["train", "--epochs", "0"])


def test_cli_module_imports_without_torch():
    # `qnorm --help` builds this parser: it must not load torch / brevitas / sklearn.
    code = ("import sys, qnorm.train.cli; "
            "print([m for m in ('torch', 'brevitas', 'sklearn') if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
