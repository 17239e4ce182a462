"""`qnorm train --family`: the deployable mixer and pow2 SNN train through the experiment
machinery, and what they write is what `qnorm compile` takes; `pow2` as a layer argument."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from compilers.tvm.graph import load_compiled
from qnorm.cli import main
from qnorm.demo import DEPLOY_MODELS
from qnorm.nn import MPBNLIF, BNQuantAct, IntLayerNorm, IntRMSNorm, L1LayerNorm, ShiftLayerNorm
from qnorm.train.checkpoint import load_checkpoint, read_metadata
from qnorm.train.data import load_digits_data
from qnorm.train.experiment import DEFAULT_KINDS, FAMILIES, family_of, resolve_kinds
from qnorm.train.models import build_model, norm_factory

SEED = 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One quick `qnorm train` run of both deployable families (1 epoch on 512 samples)."""
    out = tmp_path_factory.mktemp("train")
    argv = ["train", "--family", "mixer", "snn-pow2", "--kinds", "int_ln", "int_mpbn_lif", "--quick",
            "--epochs", "1", "--seed", str(SEED), "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    return out


@pytest.mark.parametrize("name", ["mixer-int_ln", "snn-pow2-int_mpbn_lif"])
def test_trained_checkpoint_compiles_to_the_checkpoint_models_outputs(trained, tmp_path, monkeypatch, name):
    monkeypatch.setenv("QNORM_CACHE", str(tmp_path / "cache"))
    checkpoint = trained / "checkpoints" / name
    assert main(["compile", str(checkpoint), "--target", "x86_64", "-o", str(tmp_path / "compiled")]) == 0
    model, _ = load_checkpoint(checkpoint)
    x = load_digits_data(model.input_layout, seed=SEED).test.tensors[0]
    with torch.no_grad():
        want = model(x).numpy()
    assert np.array_equal(load_compiled(tmp_path / "compiled")(x.numpy()), want)


def test_run_tabulates_the_deployable_families(trained):
    table = json.loads((trained / "accuracy.json").read_text())
    assert [(r["family"], r["label"]) for r in table["rows"]] == [
        ("mixer", "int_ln"), ("snn-pow2", "int_mpbn_lif"), ("snn-pow2", "int_mpbn_lif (folded)")]
    assert all(r["reference"] is None and r["integer"] for r in table["rows"])
    assert table["settings"]["families"] == ["mixer", "snn-pow2"]
    assert [(f["family"], f["kind"], f["identical"]) for f in table["folds"]] == [("snn-pow2", "int_mpbn_lif", True)]
    mixer = read_metadata(trained / "checkpoints" / "mixer-int_ln")
    assert mixer["model"] == {"kind": "mixer", "config": {**mixer["model"]["config"], "norm": "int_ln"}}
    assert mixer["metadata"]["training"]["recipe"]["epochs"] == 1
    snn, _ = load_checkpoint(trained / "checkpoints" / "snn-pow2-int_mpbn_lif")
    neurons = [m for m in snn.modules() if isinstance(m, MPBNLIF)]
    # The reloaded model calibrates power-of-two scales again: pow2 came back with the config.
    assert neurons and all(m.input_quant.pow2 and m.input_quant.fmt.is_power_of_two for m in neurons)


def test_families_resolve_their_own_kinds():
    assert [k for _, k in resolve_kinds()] == list(DEFAULT_KINDS)
    assert {f for f, _ in resolve_kinds()} == {"transformer", "snn"}
    assert resolve_kinds(families=["mixer"]) == [("mixer", k) for k in ("int_ln", "l1", "shift", "int_rms")]
    assert resolve_kinds(families=["snn-pow2"]) == [("snn-pow2", "int_mpbn_lif")]
    assert resolve_kinds(families=["transformer-int"]) == [
        ("transformer-int", k) for k in ("int_ln", "l1", "shift", "int_rms")]
    assert resolve_kinds(families=["llama"]) == [("llama", "int_rms")]
    assert FAMILIES["llama"].config("int_rms") == {"norm": "int_rms", "integer": True, "mlp": "swiglu"}
    assert resolve_kinds(["int_ln", "int_mpbn_lif"], ["transformer", "mixer", "snn-pow2"]) == [
        ("transformer", "int_ln"), ("mixer", "int_ln"), ("snn-pow2", "int_mpbn_lif")]
    with pytest.raises(ValueError, match=r"kind 'float' is trained by none of mixer; "
                                         r"deployable norm kinds \(mixer\): int_ln, int_rms, l1, shift, shift1$"):
        resolve_kinds(["float"], ["mixer"])
    with pytest.raises(ValueError, match=r"kind 'float_mpbn_lif' is trained by none of snn-pow2; "
                                         r"deployable neuron kinds \(snn-pow2\): int_mpbn_lif$"):
        resolve_kinds(["float_mpbn_lif"], ["snn-pow2"])
    with pytest.raises(ValueError, match="unknown model family 'resnet'; known: transformer, snn, mixer, snn-pow2, transformer-int, llama"):
        resolve_kinds(families=["mixer", "resnet"])


def test_cli_refuses_an_unknown_family_before_training(tmp_path, capsys):
    assert main(["train", "--family", "mlp", "--quick", "--out", str(tmp_path / "out")]) == 2
    assert "qnorm train: error: unknown model family 'mlp'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_demo_models_are_family_jobs():
    for kind, config in DEPLOY_MODELS.values():
        family, member = family_of(kind, config)
        assert FAMILIES[family].deployable and FAMILIES[family].config(member) == config
    with pytest.raises(ValueError, match="no model family trains snn with config"):
        family_of("snn", {"neuron": "int_mpbn_lif", "pow2": True, "time_steps": 2})


@pytest.mark.parametrize(
    "make",
    [
        lambda pow2: IntLayerNorm(8, pow2=pow2),
        lambda pow2: L1LayerNorm(8, pow2=pow2),
        lambda pow2: ShiftLayerNorm(8, mantissa_terms=1, pow2=pow2),
        lambda pow2: IntRMSNorm(8, partial=0.5, pow2=pow2),
        lambda pow2: MPBNLIF(8, pow2=pow2),
        lambda pow2: BNQuantAct(8, pow2=pow2),
    ],
    ids=["IntLayerNorm", "L1LayerNorm", "ShiftLayerNorm", "IntRMSNorm", "MPBNLIF", "BNQuantAct"],
)
def test_pow2_is_a_constructor_argument_outside_the_state(make):
    plain, pow2 = make(False), make(True)
    assert not plain.input_quant.pow2 and pow2.input_quant.pow2
    assert {k: v.shape for k, v in plain.state_dict().items()} == {k: v.shape for k, v in pow2.state_dict().items()}
    pow2.input_quant.set_range(3.25)  # calibrated: 3.25 / 127 rounds up to 2^-5
    assert pow2.input_quant.fmt.scale == 2.0**-5


def test_float_layers_are_refused_where_a_deployable_model_needs_pow2():
    assert norm_factory("shift1", 8, pow2=True).input_quant.pow2
    with pytest.raises(ValueError, match="norm kind 'float' cannot calibrate a power-of-two input scale"):
        build_model("mixer", norm="float")
    with pytest.raises(ValueError, match="neuron kind 'float_mpbn_lif' cannot calibrate a power-of-two"):
        build_model("snn", neuron="float_mpbn_lif", pow2=True)
    assert not any(m.input_quant.pow2 for m in build_model("transformer", norm="int_ln").modules()
                   if isinstance(m, IntLayerNorm))
