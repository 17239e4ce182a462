"""`qnorm export CHECKPOINT --format qonnx -o FILE`: the exported models, run by qonnx's
executor, give the QAT models' outputs bit for bit on the digits test set (the mixer with an
integer LayerNorm; the SNN with MPBN LIF neurons, gamma < 0 and gamma = 0 channels
included), qonnx's cleanup and inference transformations accept the files, and what has no
QONNX form is refused by name."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

pytest.importorskip("qonnx", reason="QONNX export needs the qonnx extra (pip install -e '.[qonnx]')")

from qonnx.core.modelwrapper import ModelWrapper
from qonnx.core.onnx_exec import execute_onnx
from qonnx.transformation.fold_constants import FoldConstants
from qonnx.transformation.infer_datatypes import InferDataTypes
from qonnx.transformation.infer_shapes import InferShapes
from qonnx.util.cleanup import cleanup_model

from qnorm.cli import main
from qnorm.export.qonnx import export_qonnx
from qnorm.nn import MPBNLIF, IntLayerNorm
from qnorm.qformat import QFormat
from qnorm.train.checkpoint import load_checkpoint, save_checkpoint
from qnorm.train.data import load_digits_data
from qnorm.train.loop import seed_everything, train
from qnorm.train.models import build_model

TEST_SET = 360  # the digits test split


def trained(kind: str, layout: str, **config) -> tuple[torch.nn.Module, torch.Tensor]:
    """A model trained briefly, as `qnorm train` trains it; the model, the test inputs."""
    seed_everything(1)
    model = build_model(kind, **config)
    data = load_digits_data(layout, seed=0)
    x, y = data.train.tensors
    train(model, replace(data, train=TensorDataset(x[:128], y[:128])), 1, 5e-3, 1, progress=False)
    return model, data.test.tensors[0]


def export_cli(path, out) -> ModelWrapper:
    assert main(["export", str(path), "--format", "qonnx", "-o", str(out), "--batch", str(TEST_SET)]) == 0
    return ModelWrapper(str(out))


def run(model: ModelWrapper, x: torch.Tensor) -> np.ndarray:
    return execute_onnx(model, {model.graph.input[0].name: x.numpy()})[model.graph.output[0].name]


@pytest.fixture(scope="module")
def mixer(tmp_path_factory):
    model, x = trained("mixer", "tokens", norm="int_ln", dim=16, depth=1, token_hidden=8, channel_hidden=16)
    path = save_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "mixer")
    return path, x, export_cli(path, tmp_path_factory.mktemp("onnx") / "mixer.onnx")


@pytest.fixture(scope="module")
def snn(tmp_path_factory):
    """The deployable SNN with channel 0 and 1 of each neuron layer at gamma < 0, channel 2 at gamma = 0."""
    model, x = trained("snn", "image", neuron="int_mpbn_lif", pow2=True, channels=(4, 8))
    with torch.no_grad():
        for neuron in model.neurons:
            neuron.weight[:2] = -neuron.weight[:2].abs()
            neuron.weight[2] = 0.0
            neuron.bias[2] = 2.0  # BN(u) = beta >= v_th: fires at every step
    path = save_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "snn")
    return path, x, export_cli(path, tmp_path_factory.mktemp("onnx") / "snn.onnx")


def checkpoint_outputs(path, x: torch.Tensor) -> np.ndarray:
    model, _ = load_checkpoint(path)
    with torch.no_grad():
        return model(x).numpy()


def test_mixer_runs_bit_exact_on_the_test_set(mixer):
    path, x, model = mixer
    assert len(x) == TEST_SET
    assert np.array_equal(run(model, x), checkpoint_outputs(path, x))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("IntLayerNorm") == 3 and ops.count("Quantize") == 3 and "Quant" in ops
    meta = {p.key: p.value for p in model.model.metadata_props}
    assert json.loads(meta["qnorm.model"])["kind"] == "mixer"


def test_snn_with_negative_and_zero_gamma_runs_bit_exact_on_the_test_set(snn):
    path, x, model = snn
    loaded, _ = load_checkpoint(path)
    for neuron in loaded.neurons:
        event = neuron.fold().golden().event
        assert event.negative[:2].all() and not event.negative[2:].any() and event.direction[2] == 0
    assert np.array_equal(run(model, x), checkpoint_outputs(path, x))
    ops = [n.op_type for n in model.graph.node]
    steps = loaded.config.time_steps
    assert ops.count("MultiThreshold") == 2 * steps and ops.count("Conv") == 2
    negations = [n for n in model.graph.node if n.op_type == "Mul" and n.name.endswith("fire_negate")]
    assert len(negations) == 2 * steps


@pytest.mark.parametrize("which", ["mixer", "snn"])
def test_qonnx_cleanup_and_inference_accept_the_file_and_keep_the_outputs(which, request):
    path, x, model = request.getfixturevalue(which)
    clean = cleanup_model(ModelWrapper(model.model))
    clean = clean.transform(InferShapes()).transform(FoldConstants()).transform(InferDataTypes())
    assert clean.check_all_tensor_shapes_specified()
    assert np.array_equal(run(clean, x), checkpoint_outputs(path, x))
    types = {n.op_type: clean.get_tensor_datatype(n.output[0]).name for n in clean.graph.node}
    assert types["Quantize"] == "INT8"
    assert types["MultiThreshold" if which == "snn" else "IntLayerNorm"] == ("BINARY" if which == "snn" else "INT8")


def test_cli_refuses_a_missing_checkpoint_and_a_bad_batch(tmp_path, mixer, capsys):
    assert main(["export", str(tmp_path / "nothing"), "-o", str(tmp_path / "m.onnx")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["export", str(mixer[0]), "-o", str(tmp_path / "m.onnx"), "--batch", "0"]) == 2
    assert "--batch: must be >= 1" in capsys.readouterr().err
    assert main(["export", str(mixer[0]), "--format", "onnx", "-o", str(tmp_path / "m.onnx")]) == 2
    assert not (tmp_path / "m.onnx").exists()


def test_uncalibrated_and_quant_tensor_layers_are_refused_by_name():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), IntLayerNorm(4))
    with pytest.raises(ValueError, match=r"^1 \(IntLayerNorm\): IntLayerNorm has no input format yet"):
        export_qonnx(model, torch.zeros(2, 4))
    neuron = MPBNLIF(4, return_quant_tensor=True)
    with pytest.raises(ValueError, match="the model .*returns quant tensors"):
        export_qonnx(neuron, torch.zeros(2, 2, 4))


def test_a_membrane_wider_than_float32_integers_is_refused():
    neuron = MPBNLIF(4, in_fmt=QFormat(8, 0.5), membrane_bits=30).eval()
    with pytest.raises(ValueError, match="the membrane is 30 bits wide; QONNX tensors are float32"):
        export_qonnx(neuron, torch.zeros(2, 2, 4))
