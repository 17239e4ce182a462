"""Whole-model compilation through TVM Relax: compiled == QAT model bit for bit on the whole
test set (norm model and SNN), tie rounding at both float -> int boundaries, the cache,
byte-identical libraries from cold compiles."""

from dataclasses import replace

import brevitas.nn as qnn
import numpy as np
import pytest
import torch
from brevitas.quant import Int8WeightPerTensorFixedPoint
from torch import nn
from torch.utils.data import TensorDataset

from compilers.tvm.graph import compile_model, compile_target, model_key, to_relax
from compilers.tvm.schedules import CPU
from qnorm.deploy import export, freeze
from qnorm.fixedpoint import Round
from qnorm.nn import BNQuantAct, IntLayerNorm
from qnorm.passes import fold_thresholds
from qnorm.qformat import QFormat
from qnorm.train.data import load_digits_data
from qnorm.train.loop import seed_everything, train
from qnorm.train.models import Int8ActPerTensorPow2MinMaxInit, build_model

TINY_MIXER = {"dim": 16, "depth": 1, "token_hidden": 8, "channel_hidden": 16}
TINY_SNN = {"neuron": "int_mpbn_lif", "pow2": True, "channels": (4, 8), "time_steps": 2}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("compile-cache")
        patch.setenv("QNORM_CACHE", str(path))
        yield path


def briefly_trained(kind: str, **config) -> tuple[nn.Module, torch.Tensor]:
    """Two training steps (bit-exactness does not need accuracy), in eval mode; test inputs."""
    seed_everything(0)
    model = build_model(kind, **config)
    data = load_digits_data(model.input_layout, seed=0)
    x, y = data.train.tensors
    train(model, replace(data, train=TensorDataset(x[:128], y[:128])), 1, 5e-3, 0, progress=False)
    return model.eval(), data.test.tensors[0]


@pytest.fixture(scope="module")
def mixer(cache):
    model, x = briefly_trained("mixer", **TINY_MIXER)
    return model, x, compile_model(model, model.example_input())


@pytest.fixture(scope="module")
def snn(cache):
    model, x = briefly_trained("snn", **TINY_SNN)
    return model, x, compile_model(model, model.example_input())


def test_mixer_compiled_equals_qat_on_the_test_set(mixer):
    model, x, compiled = mixer
    with torch.no_grad():
        want = model(x).numpy()
    got = compiled(x.numpy())
    assert got.dtype == np.float32 and got.shape == (360, 10) and np.array_equal(got, want)
    meta = compiled.metadata
    fmt = meta["input"]["format"]
    assert meta["input"]["shape"] == [None, 8, 8] and QFormat(**fmt).is_power_of_two
    assert fmt["scale"] == model.embed.input_quant.scale().item()  # Brevitas' learned 2^k
    assert len(meta["exactness"]["int_ops"]) == 3  # norm1, norm2, final norm
    grid = meta["output"]["format"]
    k = got / grid["scale"]  # every output is an integer on the proven grid, within its bound
    assert np.array_equal(k, np.round(k)) and np.abs(k).max() <= grid["max_abs_int"]


def test_snn_compiled_equals_qat_and_folded_on_the_test_set(snn):
    model, x, compiled = snn
    with torch.no_grad():
        want, folded = model(x).numpy(), fold_thresholds(model)(x).numpy()
    got = compiled(x.numpy())
    assert np.array_equal(got, want) and np.array_equal(got, folded)
    assert [name.split(" ")[1] for name in compiled.metadata["exactness"]["int_ops"]] == ["(FoldedMPBNLIF)"] * 2


def test_compiled_model_refuses_bad_input(mixer):
    _, x, compiled = mixer
    with pytest.raises(ValueError, match=r"float32 input of shape \(batch, 8, 8\)"):
        compiled(x.numpy()[:, :4])
    with pytest.raises(ValueError, match="NaN or Inf"):
        compiled(np.full((1, 8, 8), np.nan, np.float32))


def test_second_compile_is_a_cache_hit_and_fast(mixer, monkeypatch):
    model, _, first = mixer
    assert not first.cache_hit

    def no_export(*args):
        raise AssertionError("a cache hit must not export the model again")

    monkeypatch.setattr("compilers.tvm.graph.export", no_export)  # the model key finds it first
    again = compile_model(model, model.example_input())
    assert again.cache_hit and again.seconds < 1.0 and again.library == first.library


def test_cold_compiles_into_two_empty_caches_give_the_same_library(mixer, tmp_path, monkeypatch):
    model, _, first = mixer
    monkeypatch.setenv("QNORM_CACHE", str(tmp_path))
    again = compile_model(model, model.example_input())
    assert not again.cache_hit and again.library.is_relative_to(tmp_path)
    assert again.library.read_bytes() == first.library.read_bytes()


def test_model_key_follows_weights_buffers_and_code_origin(mixer):
    model, _, _ = mixer
    target, example = compile_target("x86_64"), model.example_input()
    key = model_key(model, example, target)
    other = build_model("mixer", **TINY_MIXER)
    other.load_state_dict(model.state_dict())
    assert model_key(other.eval(), example, target) == key
    with torch.no_grad():
        other.head.weight[0, 0] += 1.0
    assert model_key(other, example, target) != key
    other.load_state_dict(model.state_dict())
    quant = other.blocks[0].norm1.input_quant
    quant.set_range(2 * float(quant.format_max_abs))  # calibration is part of the model
    assert model_key(other, example, target) != key
    assert model_key(nn.Sequential(model), example, target) is None  # not described by model_spec


def test_model_key_of_a_model_a_registered_describer_knows(mixer, monkeypatch):
    """The compiler asks qnorm.deploy.model_spec, so a family outside qnorm.train keys its models too."""
    from qnorm.deploy import spec as deploy_spec

    model, _, _ = mixer
    target, example = compile_target("x86_64"), model.example_input()
    wrapped = nn.Sequential(model)
    monkeypatch.setattr(deploy_spec, "_DESCRIBERS", list(deploy_spec._DESCRIBERS))
    deploy_spec.register_spec(lambda m: {"kind": "wrapped mixer"} if isinstance(m, nn.Sequential) else None)
    key = model_key(wrapped, example, target)
    assert key is not None and key != model_key(model, example, target)


def test_ties_round_as_torch_and_qnorm_do(cache):
    """Both boundaries meet exact ties: Brevitas' quantizer (half to even, torch.round; TVM
    legalizes round to nearbyint) and the qnorm layer's input quantizer (half up)."""
    act = Int8ActPerTensorPow2MinMaxInit.let(min_val=-4.0, max_val=4.0)  # scale 2^-5
    norm = IntLayerNorm(16, in_fmt=QFormat.power_of_two(8, -4))
    model = nn.Sequential(qnn.QuantIdentity(act_quant=act, return_quant_tensor=False), norm).eval()
    rng = np.random.default_rng(0)
    odd = 2 * rng.integers(-60, 60, (64, 16)) + 1
    # even columns: odd multiples of 2^-6 (ties for Brevitas); odd columns: odd multiples of
    # 2^-5 (exact for Brevitas, ties for the norm's 2^-4 quantizer); a few saturate.
    x = np.where(np.arange(16) % 2 == 0, odd * 2.0**-6, odd * 2.0**-5).astype(np.float32)
    x[::7, 3] = 9.0
    x[::5, 5] = -9.0

    op = norm.golden()

    def pipeline(brevitas_mode: Round, qnorm_mode: Round) -> np.ndarray:
        y = QFormat(8, 2.0**-5).quantize(x, brevitas_mode) * 2.0**-5
        return (op.forward(op.in_fmt.quantize(y, qnorm_mode)) * op.out_fmt.scale).astype(np.float32)

    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    assert np.array_equal(want, pipeline(Round.HALF_EVEN, Round.HALF_UP))
    # the ties decide outputs: the other tie rule at either boundary changes them
    assert not np.array_equal(want, pipeline(Round.HALF_UP, Round.HALF_UP))
    assert not np.array_equal(want, pipeline(Round.HALF_EVEN, Round.HALF_EVEN))
    compiled = compile_model(model, torch.from_numpy(x[:2]))
    assert np.array_equal(compiled(x), want)


def test_bn_quant_act_compiles_as_its_multithreshold_fold(cache):
    """A conv -> BN + quantized activation model (channels on dim 1 of 4-d input): the BN
    folds into integer thresholds, compiled with the MultiThreshold kernel."""
    torch.manual_seed(0)
    act = Int8ActPerTensorPow2MinMaxInit.let(min_val=-4.0, max_val=4.0)
    model = nn.Sequential(
        qnn.QuantIdentity(act_quant=act, return_quant_tensor=False),
        qnn.QuantConv2d(1, 4, 3, padding=1, bias=False, weight_quant=Int8WeightPerTensorFixedPoint,
                        return_quant_tensor=False),
        BNQuantAct(4, in_fmt=QFormat.power_of_two(16, -10)),
    )
    x = torch.randn(32, 1, 8, 8)
    for _ in range(3):
        model.train()(x)  # running statistics
    model.eval()
    compiled = compile_model(model, x[:2])
    assert compiled.metadata["exactness"]["int_ops"] == ["2 (MultiThresholdAct)"]
    with torch.no_grad():
        want = model(x).numpy()
    assert np.array_equal(compiled(x.numpy()), want) and len(np.unique(want)) > 2


def test_identical_norm_kernels_are_scheduled_and_compiled_once(cache):
    """Two LayerNorms of one configuration with different γ, β share one kernel text (the
    per-channel constants are arguments): it is scheduled once and the Relax module holds
    one function for both, called twice; the compiled model stays bit-exact."""
    torch.manual_seed(0)
    act = Int8ActPerTensorPow2MinMaxInit.let(min_val=-4.0, max_val=4.0)  # scale 2^-5
    fmt = QFormat.power_of_two(8, -5)
    norms = [IntLayerNorm(16, in_fmt=fmt, out_fmt=fmt) for _ in range(2)]
    with torch.no_grad():
        for norm in norms:  # γ in one binade: the gains share their shift, the kernel text
            norm.weight.uniform_(0.6, 0.99)
            norm.bias.uniform_(-0.5, 0.5)
    model = nn.Sequential(qnn.QuantIdentity(act_quant=act, return_quant_tensor=False), *norms).eval()
    gains = [norm.golden().config.gain for norm in norms]
    assert gains[0] != gains[1]
    x = torch.randn(64, 16)
    scheduled = []

    def counting(func, output):
        scheduled.append(func)
        return CPU.rowwise(func, output)

    mod = to_relax(export(freeze(model), x[:2]), replace(CPU, name="counting", rowwise=counting))
    kernels = [gv.name_hint for gv in mod.get_global_vars() if gv.name_hint.startswith("qnorm_")
               and not gv.name_hint.endswith(("_quantize", "_dequantize"))]
    assert len(scheduled) == 1 and kernels == ["qnorm_1"]
    assert mod.script().count("cls.qnorm_1,") == 2
    compiled = compile_model(model, x[:2])
    with torch.no_grad():
        assert np.array_equal(compiled(x.numpy()), model(x).numpy())
