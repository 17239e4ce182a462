"""convert(): norm kinds and quantized activations from the registry, parameters copied.

Stand-in kinds compute the float op itself, so a correct conversion (parameters, eps,
which module goes where) leaves the model's output bit-identical.  BN + quantized
activation becomes a BNQuantAct whose state equals the BN's; its deviation from the
float pair (it quantizes its input) is measured (``pytest -s``)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qnorm.fixedpoint import Round
from qnorm.metrics import error_in_lsb
from qnorm.nn import (
    BNQuantAct,
    IntLayerNorm,
    IntRMSNorm,
    L1LayerNorm,
    MultiThresholdAct,
    ShiftLayerNorm,
)
from qnorm.passes import (
    CRMSNorm,
    NormSpec,
    PermutedNorm,
    QuantActSpec,
    convert,
    fold_thresholds,
    norm_kinds,
    register_norm_kind,
    register_quant_act,
)
from qnorm.qformat import QFormat


def report(what: str, stats: dict) -> None:
    print(f"[measured] {what}: " + ", ".join(f"{k}={v:.4g}" for k, v in stats.items()))


class StandInLN(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight, self.bias = nn.Parameter(torch.ones(n)), nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class StandInRMS(StandInLN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps) + self.bias


def make_ln(spec: NormSpec) -> nn.Module:
    return StandInLN(spec.channels, spec.eps)


def make_rms(spec: NormSpec) -> nn.Module:
    return StandInRMS(spec.channels, spec.eps)


class UniformQuantAct(nn.Module):
    """A stand-in quantized activation: round half up to ``fmt``'s grid, saturate."""

    def __init__(self, fmt: QFormat) -> None:
        super().__init__()
        self.fmt = fmt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.double() / self.fmt.scale
        return (torch.floor(t + 0.5).clamp(self.fmt.lo, self.fmt.hi) * self.fmt.scale).to(x.dtype)


def act_spec(m: UniformQuantAct) -> QuantActSpec:
    return QuantActSpec(m.fmt, Round.HALF_UP)


register_norm_kind("standin_ln", make_ln, centered=True)
register_norm_kind("standin_rms", make_rms, centered=False)
register_quant_act(UniformQuantAct, act_spec)


def randomized(module: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return module


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8, eps=1e-3)
        self.fc = nn.Linear(8, 8)
        self.rms = nn.RMSNorm(8)  # eps None: the dtype's epsilon
        self.crms = CRMSNorm(8, eps=1e-4)
        self.plain = nn.LayerNorm(8, elementwise_affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.plain(self.crms(self.rms(self.fc(self.ln(x)))))


def test_convert_norms_copies_parameters_exactly():
    model = randomized(Net(), 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = convert(model, "standin_ln", rms_norm="standin_rms")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert type(out.ln) is StandInLN and type(out.plain) is StandInLN
    assert type(out.rms) is StandInRMS and type(out.crms) is StandInRMS and type(out.fc) is nn.Linear
    assert out.ln.eps == 1e-3 and out.crms.eps == 1e-4 and out.rms.eps == torch.finfo(torch.float32).eps
    assert torch.equal(out.ln.weight, model.ln.weight) and torch.equal(out.crms.bias, model.crms.bias)
    assert torch.equal(out.plain.weight, torch.ones(8)) and torch.equal(out.rms.bias, torch.zeros(8))
    x = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(out(x), model(x))


def test_convert_with_an_rms_kind_converts_rms_norms_and_refuses_layer_norms():
    seq = randomized(nn.Sequential(nn.RMSNorm(4), nn.Linear(4, 4), CRMSNorm(4)), 2)
    out = convert(seq, "standin_rms")
    assert type(out[0]) is StandInRMS and type(out[2]) is StandInRMS
    with pytest.raises(ValueError, match="does not subtract the mean"):
        convert(nn.Sequential(nn.LayerNorm(4)), "standin_rms")
    with pytest.raises(ValueError, match="subtracts the mean"):
        convert(nn.Sequential(nn.RMSNorm(4)), "standin_ln", rms_norm="standin_ln")


def test_registry_rules():
    with pytest.raises(ValueError, match="unknown norm kind 'nope'"):
        convert(nn.Sequential(nn.LayerNorm(4)), "nope")
    register_norm_kind("standin_ln", make_ln, centered=True)  # the same entry again: harmless
    with pytest.raises(ValueError, match="already registered"):
        register_norm_kind("standin_ln", make_rms, centered=True)
    assert {"standin_ln", "standin_rms"} <= set(norm_kinds())
    with pytest.raises(ValueError, match="already registered"):
        register_quant_act(UniformQuantAct, lambda m: act_spec(m))


def test_convert_refuses_a_layer_that_cannot_hold_the_parameters():
    register_norm_kind(
        "standin_biasless", lambda spec: nn.RMSNorm(spec.channels, eps=spec.eps), centered=False, replace=True
    )
    src = randomized(CRMSNorm(4), 3)
    with pytest.raises(ValueError, match="no bias"):
        convert(nn.Sequential(src), "standin_biasless")
    assert torch.equal(convert(nn.Sequential(CRMSNorm(4)), "standin_biasless")[0].weight, torch.ones(4))


def random_bn(c: int, seed: int) -> nn.BatchNorm2d:
    rng = np.random.default_rng(seed)
    bn = nn.BatchNorm2d(c, momentum=0.2, eps=1e-4)
    gamma = rng.normal(1, 0.5, c)
    gamma[0] = -0.6
    with torch.no_grad():
        bn.weight.copy_(torch.from_numpy(gamma))
        bn.bias.copy_(torch.from_numpy(rng.normal(1.0, 0.5, c)))
        bn.running_mean.copy_(torch.from_numpy(rng.normal(0, 0.3, c)))
        bn.running_var.copy_(torch.from_numpy(rng.uniform(0.3, 2, c)))
        bn.num_batches_tracked.fill_(17)
    return bn


def test_convert_bn_followed_by_quantized_activation():
    torch.manual_seed(0)
    act_fmt, in_fmt = QFormat(4, 0.25, signed=False), QFormat(8, 0.02)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3), random_bn(6, 1), UniformQuantAct(act_fmt),  # -> BNQuantAct
        nn.Conv2d(6, 6, 1), random_bn(6, 2), nn.ReLU(),  # not a quantized activation: stays
    ).eval()  # fmt: skip
    out = convert(model, "standin_ln", bn_act=True, bn_act_options={"in_fmt": in_fmt})
    assert isinstance(out[1], BNQuantAct) and isinstance(out[2], nn.Identity) and isinstance(out[4], nn.BatchNorm2d)
    bn, layer = model[1], out[1]
    for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(layer, name), getattr(bn, name)), name
    assert layer.eps == bn.eps and layer.momentum == bn.momentum and not layer.training
    assert layer.out_fmt == act_fmt and layer.rounding is Round.HALF_UP
    x = torch.randn(8, 3, 9, 9, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        h = model[0](x)
        got, want = layer(h), model[2](bn(h))
        levels = ((got - want) / act_fmt.scale).abs()
        stats = {"max_level_diff": float(levels.max()), "share_differing": float((levels > 0).float().mean())}
        report("BNQuantAct (int8 input) vs float BN + quantized act", stats)
        folded = fold_thresholds(out)
        assert isinstance(folded[1], MultiThresholdAct) and torch.equal(folded(x), out(x))


def test_convert_bn_act_refusals():
    bn = nn.BatchNorm2d(2, momentum=None)
    with pytest.raises(ValueError, match="momentum=None"):
        convert(nn.Sequential(bn, UniformQuantAct(QFormat(4, 0.25, False))), "standin_ln", bn_act=True)
    kept = convert(BNFeedsActAndSkip(), "standin_ln", bn_act=True)
    assert isinstance(kept.bn, nn.BatchNorm2d) and isinstance(kept.act, UniformQuantAct)


class BNFeedsActAndSkip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn, self.act = nn.BatchNorm2d(2), UniformQuantAct(QFormat(4, 0.25, False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(x)
        return self.act(h) + h


def ref_layer_norm(ln: nn.LayerNorm, x: torch.Tensor) -> np.ndarray:
    return F.layer_norm(x.double(), ln.normalized_shape, ln.weight.double(), ln.bias.double(), ln.eps).numpy()


@pytest.mark.parametrize("kind, cls", [("int_ln", IntLayerNorm), ("l1", L1LayerNorm), ("shift", ShiftLayerNorm)])
def test_convert_to_qat_layer_norms(kind, cls):
    """gamma, beta, eps copied into the QAT layer; its deviation from the float LayerNorm
    of the same (quantized) input is measured in output LSB."""
    in_fmt, out_fmt = QFormat(8, 0.02), QFormat.power_of_two(8, -5)
    model = nn.Sequential(nn.Linear(6, 32), randomized(nn.LayerNorm(32, eps=1e-4), 4)).eval()
    with torch.no_grad():
        model[1].weight.mul_(0.5)  # keep gamma * normalized inside the +-4 output range
    out = convert(model, kind, norm_options={"in_fmt": in_fmt, "out_fmt": out_fmt})
    layer = out[1]
    assert type(layer) is cls and layer.eps == 1e-4 and not layer.training
    assert torch.equal(layer.weight, model[1].weight) and torch.equal(layer.bias, model[1].bias)
    x = torch.randn(256, 6, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        h = model[0](x)
        h = h * (in_fmt.hi * in_fmt.scale) / h.abs().max()  # fills the input format
        h_q = torch.from_numpy(in_fmt.dequantize(in_fmt.quantize(h.numpy())))  # what the layer sees
        e = error_in_lsb(
            (layer(h) / out_fmt.scale).round().numpy().astype(np.int64), out_fmt, ref_layer_norm(model[1], h_q)
        )
    stats = {"max_lsb": e.max_lsb, "mean_lsb": e.mean_lsb, "within_1lsb": e.within_1lsb}
    report(f"convert {kind}: {cls.__name__} vs float LayerNorm of its quantized input", stats)


def test_convert_to_qat_rms_norm():
    model = nn.Sequential(randomized(nn.RMSNorm(16, eps=1e-6), 5), nn.Linear(16, 16), CRMSNorm(16))
    out = convert(model, "int_ln", norm_options={"in_fmt": QFormat(8, 0.05)})
    assert type(out[0]) is IntRMSNorm and type(out[2]) is IntRMSNorm and out[0].eps == 1e-6
    assert torch.equal(out[0].weight, model[0].weight) and out[0].bias is None
    with torch.no_grad():
        model[2].bias.fill_(0.25)
    with pytest.raises(ValueError, match="no bias"):
        convert(model, "int_rms")


# ---- norms convert() must not swap blindly ------------------------------------------


class LayerNorm2d(nn.LayerNorm):
    """The ConvNeXt / timm channels-first LayerNorm: NCHW -> NHWC, stock forward, back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class RMSNorm2d(nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.transpose(1, -1).contiguous()).transpose(1, -1)


class MovedimLN(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.movedim(1, -1), self.normalized_shape, self.weight, self.bias, self.eps).movedim(-1, 1)


def conv_then(norm: nn.Module, seed: int) -> nn.Sequential:
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), randomized(norm, seed)).eval()
    with torch.no_grad():
        model[1].weight.mul_(0.5)  # keep gamma * normalized inside the +-4 output range
    return model


@pytest.mark.parametrize("hw", [16, 7])  # H = W = C = 16: the blind swap ran, 3.0 off; H = 7: it failed
@pytest.mark.parametrize("source, kind, cls", [
    (LayerNorm2d, "int_ln", IntLayerNorm), (RMSNorm2d, "int_rms", IntRMSNorm), (MovedimLN, "int_ln", IntLayerNorm),
])  # fmt: skip
def test_channels_first_norm_is_converted_on_its_channel_axis(hw, source, kind, cls):
    model = conv_then(source(16, eps=1e-4), 6)
    x = torch.randn(8, 3, hw, hw, generator=torch.Generator().manual_seed(7))
    out = convert(model, kind, example_input=x)
    wrapper = out[1]
    assert type(wrapper) is PermutedNorm and (wrapper.dim, wrapper.ndim) == (1, 4) and type(wrapper.norm) is cls
    assert torch.equal(wrapper.norm.weight, model[1].weight)
    out.train()(x)  # calibrate the input scale
    out.eval()
    with torch.no_grad():
        got, h, want_float = out(x), model[0](x), model(x)
    layer = wrapper.norm
    fmt, op = layer.input_quant.fmt, layer.golden()
    ints = fmt.quantize(h.permute(0, 2, 3, 1).numpy())  # the channel axis last: what the golden op normalizes
    golden = op.forward(ints)
    assert torch.equal(got, torch.from_numpy(golden * op.out_fmt.scale).float().permute(0, 3, 1, 2))
    # Against the float model: on the same quantized input (only the op's own error), and on the raw input.
    with torch.no_grad():
        same_input = model[1](torch.from_numpy(fmt.dequantize(ints)).float().permute(0, 3, 1, 2))
    e_op = error_in_lsb(golden, op.out_fmt, same_input.permute(0, 2, 3, 1).double().numpy())
    e_model = error_in_lsb(golden, op.out_fmt, want_float.permute(0, 2, 3, 1).double().numpy())
    report(f"{source.__name__} H=W={hw} -> PermutedNorm({cls.__name__}) vs float, same quantized input", vars(e_op))
    report(f"{source.__name__} H=W={hw} -> PermutedNorm({cls.__name__}) vs the float model", vars(e_model))
    assert e_op.max_lsb <= 0.51  # the output rounding alone; the wrong axis is ~100 LSB off
    assert e_model.max_lsb < 3  # plus the int8 input quantization


def test_channels_first_norm_without_example_input_is_refused():
    with pytest.raises(ValueError, match=r"'1' \(LayerNorm2d\) overrides LayerNorm.forward.*example_input"):
        convert(conv_then(LayerNorm2d(16), 0))


class ScaledLN(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


class OtherEpsLN(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, 1e-3)


class TransposedOutLN(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1))  # leaves the output channels-last


@pytest.mark.parametrize("source, reason", [
    (ScaledLN, r"also computes aten.mul.Tensor|computes aten.mul.Tensor"),
    (OtherEpsLN, r"eps=0.001, the module's eps is 1e-05"),
    (TransposedOutLN, r"output's axes are the input's \[0, 2, 3, 1\]"),
])  # fmt: skip
def test_an_overridden_forward_that_is_not_a_permuted_norm_is_refused_by_name(source, reason):
    model = nn.Sequential(nn.Identity(), source(16))
    with pytest.raises(ValueError, match=rf"'1' \({source.__name__}\) overrides LayerNorm.forward: .*({reason})"):
        convert(model, example_input=torch.randn(2, 16, 4, 16))


class FunctionalBlock(nn.Module):
    def __init__(self, function: str) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.weight = nn.Parameter(torch.ones(16))
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = F.layer_norm if self.function == "layer_norm" else F.rms_norm
        return norm(self.fc(x), (16,), self.weight)


@pytest.mark.parametrize("function", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("example", [None, torch.randn(2, 5, 16)])  # found in the fx graph / by running it
def test_a_functional_norm_in_a_custom_module_is_refused_by_name(function, example):
    model = nn.Sequential(nn.LayerNorm(16), FunctionalBlock(function))
    with pytest.raises(ValueError, match=rf"'1' \(FunctionalBlock\) calls torch.nn.functional.{function}"):
        convert(model, example_input=example)


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x) if bool(x.sum() > -1e9) else x  # data-dependent: torch.fx cannot trace it


def test_an_untraceable_custom_model_needs_example_input():
    with pytest.raises(ValueError, match=r"cannot trace Untraceable.*pass example_input="):
        convert(Untraceable(), "standin_ln")
    out = convert(Untraceable(), "standin_ln", example_input=torch.randn(2, 16))
    assert type(out.ln) is StandInLN


def test_norms_of_a_transformer_encoder_layer_are_refused():
    """Its inference fast path computes norm1/norm2 from their weights, bypassing a swapped module."""
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
    with pytest.raises(ValueError, match=r"'0.norm1' \(LayerNorm\) belongs to TransformerEncoderLayer"):
        convert(nn.Sequential(layer))


class CountingLN(nn.LayerNorm):
    """Overrides forward but normalizes the last axis of its input as the stock one does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.contiguous())


def test_an_overridden_forward_on_the_last_axis_is_swapped_plainly():
    out = convert(nn.Sequential(CountingLN(16)), "standin_ln", example_input=torch.randn(2, 3, 16))
    assert type(out[0]) is StandInLN
