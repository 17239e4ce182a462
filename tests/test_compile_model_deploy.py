"""qnorm.deploy without a compiler: the power-of-two calibration, freezing, and the static
exactness proof with its refusals (non-power-of-two scales, float biases, float ops,
accumulators past 2^24)."""

import math

import brevitas.nn as qnn
import pytest
import torch
from brevitas.quant import (
    Int8ActPerTensorFloatMinMaxInit,
    Int8WeightPerTensorFixedPoint,
    Int32Bias,
)
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from qnorm.deploy import NotDeployableError, export, freeze, input_format, prove_exact
from qnorm.deploy.exactness import EXACT_LIMIT, Grid, scalar_grid, tensor_grid
from qnorm.nn import MPBNLIF, InputQuantizer, IntLayerNorm
from qnorm.nn._qat import power_of_two_ceil
from qnorm.qformat import QFormat
from qnorm.train.models import Int8ActPerTensorPow2MinMaxInit, build_model

POW2_ACT = Int8ActPerTensorPow2MinMaxInit.let(min_val=-4.0, max_val=4.0)  # scale 2^-5


def pow2_linear(n_in: int, n_out: int, **kw) -> qnn.QuantLinear:
    kw = {"bias": True, "bias_quant": Int32Bias, **kw}
    return qnn.QuantLinear(n_in, n_out, input_quant=POW2_ACT, weight_quant=Int8WeightPerTensorFixedPoint,
                           return_quant_tensor=False, **kw)


def proof(model: nn.Module, example: torch.Tensor):
    return prove_exact(export(freeze(model), example))


# --------------------------------------------------------------------------- power-of-two calibration


@given(st.floats(1e-30, 1e30))
def test_power_of_two_ceil_is_the_next_power_of_two(s):
    p = power_of_two_ceil(s)
    assert math.frexp(p)[0] == 0.5 and s <= p < 2 * s


def test_pow2_quantizer_rounds_the_calibrated_scale_up():
    plain, pow2 = InputQuantizer(bits=8), InputQuantizer(bits=8, pow2=True)
    x = torch.tensor([0.0, 3.25, -1.0])
    for q in (plain, pow2):
        q.train()(x)
    assert plain.fmt.scale == 3.25 / 127
    assert pow2.fmt == QFormat(8, 2.0**-5)  # 3.25 / 127 = 0.0256 -> 1/32: max |x| still fits
    assert pow2.eval()(x).ints.tolist() == [0, 104, -32]


def test_deployable_models_calibrate_power_of_two_scales():
    model = build_model("mixer", dim=16, depth=1, token_hidden=8, channel_hidden=16)
    model.train()(torch.randn(4, 8, 8))
    norms = [m for m in model.modules() if isinstance(m, IntLayerNorm)]
    assert norms and all(m.input_quant.pow2 and m.input_quant.fmt.is_power_of_two for m in norms)
    snn = build_model("snn", neuron="int_mpbn_lif", pow2=True)
    assert all(m.input_quant.pow2 for m in snn.modules() if isinstance(m, MPBNLIF))
    legacy = build_model("snn", neuron="int_mpbn_lif")
    assert not any(m.input_quant.pow2 for m in legacy.modules() if isinstance(m, MPBNLIF))


# --------------------------------------------------------------------------- exact grids


def test_scalar_and_tensor_grids_are_exact():
    assert scalar_grid(0.75) == Grid(-2, 3) and scalar_grid(-96) == Grid(5, 3) and scalar_grid(0) == Grid(0, 0)
    t = torch.tensor([0.5, -0.375, 3.0, 0.0])
    assert tensor_grid(t) == Grid(-3, 24)  # multiples of 1/8, up to 24/8
    assert tensor_grid(torch.tensor([0.1])).exp < -26  # 0.1f is a 24-bit odd integer times 2^-27
    assert tensor_grid(torch.tensor([float("nan")])) is None


# --------------------------------------------------------------------------- freezing


def test_frozen_model_equals_brevitas_and_qnorm_in_eval():
    torch.manual_seed(0)
    model = build_model("mixer", dim=16, depth=1, token_hidden=8, channel_hidden=16)
    model.train()(torch.randn(32, 8, 8) * 2)
    model.eval()
    x = torch.randn(64, 8, 8) * 3
    with torch.no_grad():
        assert torch.equal(freeze(model)(x), model(x))
    assert model.training is False and isinstance(model.embed, qnn.QuantLinear)  # the model is untouched


def test_freeze_refuses_what_it_cannot_represent():
    with pytest.raises(ValueError, match="QuantReLU has no frozen form"):
        freeze(nn.Sequential(qnn.QuantReLU()))
    with pytest.raises(ValueError, match="returns quant tensors"):
        freeze(nn.Sequential(qnn.QuantIdentity(return_quant_tensor=True)))
    with pytest.raises(ValueError, match=r"^0 \(IntLayerNorm\): IntLayerNorm has no input format yet"):
        freeze(nn.Sequential(IntLayerNorm(8)))


# --------------------------------------------------------------------------- proofs and refusals


def test_input_format_is_read_from_the_first_quantizer():
    model = nn.Sequential(qnn.QuantIdentity(act_quant=POW2_ACT, return_quant_tensor=False), nn.ReLU())
    program = export(freeze(model), torch.zeros(2, 4))
    assert input_format(program) == QFormat(8, 2.0**-5)
    assert prove_exact(program).outputs == [Grid(-5, 128)]


class _AddBuffer(nn.Module):
    """Adds a constant held in a buffer that is not part of the state dict."""

    def __init__(self, value: torch.Tensor, persistent: bool) -> None:
        super().__init__()
        self.register_buffer("offset", value, persistent=persistent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.offset


@pytest.mark.parametrize("persistent", [True, False])
def test_buffers_are_proven_persistent_or_not(persistent):
    quant = qnn.QuantIdentity(act_quant=POW2_ACT, return_quant_tensor=False)
    on_grid = nn.Sequential(quant, _AddBuffer(torch.full((4,), 0.25), persistent))
    assert prove_exact(export(freeze(on_grid), torch.zeros(2, 4))).outputs == [Grid(-5, 136)]
    off_grid = nn.Sequential(quant, _AddBuffer(torch.full((4,), 0.1), persistent))
    with pytest.raises(NotDeployableError, match="not on the accumulator.s grid"):
        proof(off_grid, torch.zeros(2, 4))


def test_non_power_of_two_activation_scale_is_refused():
    act = Int8ActPerTensorFloatMinMaxInit.let(min_val=-3.0, max_val=3.0)  # scale 3/128
    model = nn.Sequential(qnn.QuantIdentity(act_quant=act, return_quant_tensor=False), pow2_linear(4, 2))
    with pytest.raises(NotDeployableError, match=r"0: division by 0\.0234375 \(not a power of two"):
        proof(model, torch.zeros(2, 4))


def test_non_power_of_two_qnorm_input_scale_is_refused():
    model = nn.Sequential(pow2_linear(4, 8), IntLayerNorm(8, in_fmt=QFormat(8, 0.03)))
    with pytest.raises(NotDeployableError, match=r"1 \(IntLayerNorm\): input scale 0\.03 not a power of two"):
        proof(model, torch.zeros(2, 4))


def test_float_bias_is_refused():
    model = nn.Sequential(pow2_linear(4, 3, bias_quant=None))  # bias present, not quantized
    model[0].bias.data = torch.tensor([0.1, -0.2, 0.3])
    with pytest.raises(NotDeployableError, match=r"0: the bias is not on the accumulator's grid .*unquantized float"):
        proof(model, torch.zeros(2, 4))


# Weights all 1.0: Brevitas' power-of-two scale is 2^-7 (1.0 / 128) and the narrow int8
# range clamps them to 127 units; inputs reach 128 units (int8).  So the bound is
# fan_in * 128 * 127 units of 2^-12, which stays within 2^24 up to fan_in = 1032.
@pytest.mark.parametrize("fan_in, exact", [(EXACT_LIMIT // (128 * 127), True), (EXACT_LIMIT // (128 * 127) + 1, False)])
def test_accumulator_bound_is_proven_up_to_two_to_the_24(fan_in, exact):
    layer = pow2_linear(fan_in, 1, bias=False)
    layer.weight.data.fill_(1.0)
    example = torch.zeros(2, fan_in)
    if exact:
        (acc,) = proof(nn.Sequential(layer), example).accumulators
        assert (acc.exp, acc.bound) == (-5 - 7, fan_in * 128 * 127) and acc.bound <= EXACT_LIMIT
    else:
        with pytest.raises(NotDeployableError, match=r"0: aten.mm may reach 2\^24\.00 units of 2\^-12 \(> 2\^24"):
            proof(nn.Sequential(layer), example)


class _MeanOverSix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = qnn.QuantIdentity(act_quant=POW2_ACT, return_quant_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant(x).mean(dim=1)


def test_mean_over_a_non_power_of_two_count_is_refused():
    with pytest.raises(NotDeployableError, match="mean over 6 elements divides by a non-power-of-two"):
        proof(_MeanOverSix(), torch.zeros(2, 6))
