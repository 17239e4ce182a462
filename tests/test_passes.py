"""Folding passes: BN into Conv/Linear, LN -> CRMSNorm, PowerNorm -> channel affine,
MPBNLIF/BNQuantAct -> integer thresholds.

What is asserted is what each pass guarantees exactly (bitwise weights, equal
integers, torch.equal outputs); float deviations that are exact only in real
arithmetic are measured and printed (``pytest -s tests/test_passes.py``), never
checked with a tolerance."""

from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from qnorm import fixedpoint as fp
from qnorm.nn import MPBNLIF, BNQuantAct, FoldedMPBNLIF, MultiThresholdAct
from qnorm.passes import (
    ChannelAffine,
    CRMSNorm,
    PowerNorm,
    center_linear,
    fold_bn,
    fold_bn_into,
    fold_powernorm,
    fold_thresholds,
    ln_to_rms,
    quantize_per_channel,
)
from qnorm.qformat import QFormat

FAST = settings(max_examples=40, deadline=None)


def ulp_stats(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    """Deviation in float ulp: per element (ulp of the reference value) and at full scale
    (ulp of the largest reference magnitude), as ``max`` and ``mean``."""
    g, w = got.detach().numpy(), want.detach().numpy()
    err = np.abs(g.astype(np.float64) - w.astype(np.float64))
    per = err / np.spacing(np.abs(w))
    full = err / np.spacing(np.abs(w).max())
    return {"max_ulp": float(per.max()), "mean_ulp": float(per.mean()), "max_ulp_full_scale": float(full.max())}


def report(what: str, stats: dict) -> None:
    print(
        f"[measured] {what}: "
        + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items())
    )


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_untouched(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


# --------------------------------------------------------------------------- BN into Conv/Linear


def random_bn(bn: nn.modules.batchnorm._BatchNorm, rng: np.random.Generator) -> nn.Module:
    """Random statistics; channel 0 has gamma < 0 and channel 1 (if any) gamma = 0."""
    c = bn.num_features
    gamma = rng.normal(0.0, 1.0, c)
    gamma[0] = -abs(gamma[0]) - 0.1
    if c > 1:
        gamma[1] = 0.0
    with torch.no_grad():
        bn.weight.copy_(torch.from_numpy(gamma))
        bn.bias.copy_(torch.from_numpy(rng.normal(0, 1, c)))
        bn.running_mean.copy_(torch.from_numpy(rng.normal(0, 1, c)))
        bn.running_var.copy_(torch.from_numpy(rng.uniform(0.05, 3, c)))
    return bn.eval()


LAYERS = {
    "linear": (lambda c, bias: nn.Linear(5, c, bias=bias), nn.BatchNorm1d, (7, 5)),
    "conv1d": (lambda c, bias: nn.Conv1d(3, c, 3, bias=bias), nn.BatchNorm1d, (2, 3, 9)),
    "conv2d_groups": (lambda c, bias: nn.Conv2d(2 * c, c, 3, groups=c, bias=bias), nn.BatchNorm2d, None),
    "depthwise": (lambda c, bias: nn.Conv2d(c, c, 3, groups=c, bias=bias), nn.BatchNorm2d, None),
}


def make_pair(kind: str, c: int, bias: bool, seed: int) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    ctor, bn_ctor, shape = LAYERS[kind]
    layer = ctor(c, bias)
    bn = random_bn(bn_ctor(c), np.random.default_rng(seed))
    if shape is None:
        shape = (2, layer.in_channels, 6, 5)
    return layer, bn, torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1))


def numpy_fold(layer: nn.Module, bn: nn.Module) -> tuple[np.ndarray, np.ndarray]:
    """The fold formula evaluated independently in numpy float64, rounded once to float32."""
    g, beta, mu, var = (t.detach().double().numpy() for t in (bn.weight, bn.bias, bn.running_mean, bn.running_var))
    a = g / np.sqrt(var + bn.eps)
    w = layer.weight.detach().double().numpy()
    b = layer.bias.detach().double().numpy() if layer.bias is not None else np.zeros_like(a)
    return (w * a.reshape(-1, *([1] * (w.ndim - 1)))).astype(np.float32), ((b - mu) * a + beta).astype(np.float32)


@FAST
@given(kind=st.sampled_from(sorted(LAYERS)), c=st.integers(1, 8), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_fold_bn_weights_are_the_float64_formula_bitwise(kind, c, bias, seed):
    layer, bn, _ = make_pair(kind, c, bias, seed)
    model = nn.Sequential(layer, bn)
    before = state(model)
    folded = fold_bn(model)
    assert_untouched(model, before)
    assert isinstance(folded, nn.Sequential) and isinstance(folded[1], nn.Identity)
    w_ref, b_ref = numpy_fold(layer, bn)
    assert np.array_equal(folded[0].weight.detach().numpy(), w_ref)
    assert np.array_equal(folded[0].bias.detach().numpy(), b_ref)
    assert getattr(folded[0], "groups", 1) == getattr(layer, "groups", 1)


def test_fold_bn_float_deviation_and_rounding_of_the_weights():
    """Measured: folded float32 weights against the exact rational fold (ulp), and the
    folded layer's output against conv-then-BN (ulp)."""
    layer, bn, x = make_pair("conv1d", 8, True, 7)
    folded = fold_bn_into(layer, bn)
    w = folded.weight.detach().numpy().ravel()
    exact_err = []
    for c, (wi, wf) in enumerate(
        zip(layer.weight.detach().numpy().reshape(8, -1), folded.weight.detach().numpy().reshape(8, -1), strict=True)
    ):
        var_eps = Fraction(float(bn.running_var[c])) + Fraction(bn.eps)
        a2 = Fraction(float(bn.weight.detach()[c])) ** 2 / var_eps  # a^2, exact
        for v, f in zip(wi.tolist(), wf.tolist(), strict=True):
            exact = float(Fraction(v) ** 2 * a2) ** 0.5  # |W a| to float64 accuracy, ample against float32 ulps
            exact_err.append(abs(abs(f) - exact) / np.spacing(np.float32(abs(f))) if f else 0.0)
    report("fold_bn: folded float32 weights vs exact W*a", {"max_ulp": max(exact_err), "count": w.size})
    with torch.no_grad():
        report("fold_bn: conv1d output, folded vs conv->BN (float32)", ulp_stats(folded(x), bn(layer(x))))
    assert max(exact_err) <= 0.5 + 1e-6  # float64 evaluation then one rounding: correctly rounded


def requant(acc: np.ndarray, mult: np.ndarray, bias: np.ndarray, out: QFormat) -> np.ndarray:
    """Per-channel (axis 1) integer requantization: one shared-shift dyadic multiplier, bias
    added at full precision, one half-up rounding, saturation."""
    m, s = fp.dyadic_vector(mult, 16)
    b = np.array([fp.round_fraction(Fraction(float(v)) * (1 << s)) for v in bias], dtype=np.int64)
    shape = (1, -1) + (1,) * (acc.ndim - 2)
    return fp.saturate(fp.rshift_round(acc * m.reshape(shape) + b.reshape(shape), s), out.bits)


def int_conv(x_int: np.ndarray, w_int: np.ndarray, layer: nn.Conv2d) -> np.ndarray:
    """Integer convolution evaluated in float64: exact, every partial sum is below 2^53."""
    y = F.conv2d(
        torch.from_numpy(x_int).double(),
        torch.from_numpy(w_int).double(),
        None,
        layer.stride,
        layer.padding,
        layer.dilation,
        layer.groups,
    )
    return y.numpy().astype(np.int64)


@pytest.mark.parametrize("on_grid", [True, False])
def test_fold_bn_integer_pipeline(on_grid):
    """Per-output-channel int8 weight quantization of the folded conv.

    On the weight grid (W = w_int * s, as after QAT) the folded integer weights are
    exactly sign(gamma) * w_int, so folded and unfolded integer accumulators agree up to
    that sign (asserted); the requantized outputs then differ only where the two float
    derivations of the per-channel multiplier/bias round differently (measured).
    Off the grid the integer weights themselves can differ (measured)."""
    rng = np.random.default_rng(3)
    torch.manual_seed(3)
    c = 64  # 36864 weights: enough for off-grid near-ties to show up
    layer = nn.Conv2d(64, c, 3, padding=1)
    bn = random_bn(nn.BatchNorm2d(c), rng)
    if on_grid:
        ints, scales = quantize_per_channel(layer.weight)
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(ints * scales.reshape(-1, 1, 1, 1)))
    w_int, s_w = quantize_per_channel(layer.weight)
    folded = fold_bn_into(layer, bn)
    wf_int, s_wf = quantize_per_channel(folded.weight)
    a = (bn.weight.detach().double() / torch.sqrt(bn.running_var.double() + bn.eps)).numpy()
    sign = np.sign(a).astype(np.int64).reshape(-1, 1, 1, 1)
    mismatched = int((wf_int != sign * w_int).sum())
    report(f"fold_bn: folded int8 weights != sign(gamma) * unfolded ({'on' if on_grid else 'off'} grid)",
           {"mismatches": mismatched, "of": w_int.size})  # fmt: skip
    x_fmt, out = QFormat(8, 0.02), QFormat(8, 0.05)
    x_int = x_fmt.quantize(rng.normal(0, 1, (4, 64, 10, 10)))
    acc, acc_f = int_conv(x_int, w_int, layer), int_conv(x_int, wf_int, layer)
    b = layer.bias.detach().double().numpy()
    mu, beta = bn.running_mean.double().numpy(), bn.bias.detach().double().numpy()
    y = requant(acc, x_fmt.scale * s_w * a / out.scale, ((b - mu) * a + beta) / out.scale, out)
    y_f = requant(acc_f, x_fmt.scale * s_wf / out.scale, folded.bias.detach().double().numpy() / out.scale, out)
    diff = np.abs(y - y_f)
    report(f"fold_bn: int8 outputs folded vs unfolded pipeline ({'on' if on_grid else 'off'} grid)",
           {"max_lsb": int(diff.max()), "share_differing": float((diff > 0).mean())})  # fmt: skip
    if on_grid:
        assert mismatched == 0
        assert np.array_equal(acc_f, sign.reshape(1, -1, 1, 1) * acc)


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False), nn.BatchNorm2d(4)
        self.fc, self.bn3 = nn.Linear(4, 5), nn.BatchNorm1d(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        h = h + self.bn2(self.conv2(h))
        return self.bn3(self.fc(h.mean((2, 3))))


def test_fold_bn_on_a_traced_model_keeps_its_class():
    torch.manual_seed(0)
    model = Residual()
    rng = np.random.default_rng(0)
    for bn in (model.bn1, model.bn2, model.bn3):
        random_bn(bn, rng)
    model.eval()
    before = state(model)
    folded = fold_bn(model)
    assert_untouched(model, before)
    assert type(folded) is Residual and all(isinstance(getattr(folded, f"bn{i}"), nn.Identity) for i in (1, 2, 3))
    for layer, bn in (("conv1", "bn1"), ("conv2", "bn2"), ("fc", "bn3")):
        w_ref, b_ref = numpy_fold(getattr(model, layer), getattr(model, bn))
        assert np.array_equal(getattr(folded, layer).weight.detach().numpy(), w_ref)
        assert np.array_equal(getattr(folded, layer).bias.detach().numpy(), b_ref)
    x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        report("fold_bn: residual model output, folded vs unfolded (float32)", ulp_stats(folded(x), model(x)))


class Untraceable(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x  # data-dependent: fx cannot trace it


def test_fold_bn_untraceable_sequential_uses_its_chain():
    layer, bn, _ = make_pair("conv1d", 3, True, 5)
    folded = fold_bn(nn.Sequential(layer, bn, Untraceable()))
    assert isinstance(folded[1], nn.Identity) and np.array_equal(
        folded[0].weight.detach().numpy(), numpy_fold(layer, bn)[0]
    )


class SkipUsesConvOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        return self.bn(h) + h


class ConvCalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)) + self.conv(x)


class UntraceableBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x) if x.sum() > 0 else x


@pytest.mark.parametrize(
    "model, match",
    [
        (nn.Sequential(nn.Conv2d(2, 2, 1), nn.ReLU(), nn.BatchNorm2d(2)), "follows '1' \\(ReLU\\), not a Conv"),
        (nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 2)), "model input"),
        (SkipUsesConvOutput(), "also feeds"),
        (ConvCalledTwice(), "called 2 times"),
        (nn.Sequential(nn.Linear(3, 2), nn.BatchNorm2d(2)), "does not match"),
        (nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2, track_running_stats=False)), "running statistics"),
        (UntraceableBlock(), "cannot trace"),
    ],
)
def test_fold_bn_refusals(model, match):
    with pytest.raises(ValueError, match=match):
        fold_bn(model.eval())


# --------------------------------------------------------------------------- LN -> CRMSNorm


def random_ln(n: int, seed: int) -> nn.LayerNorm:
    ln = nn.LayerNorm(n)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ln.weight.copy_(torch.randn(n, generator=g))
        ln.bias.copy_(torch.randn(n, generator=g))
    return ln


@FAST
@given(n_in=st.integers(2, 24), n=st.integers(2, 48), seed=st.integers(0, 2**16))
def test_ln_to_rms_with_centred_producer(n_in, n, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(center_linear(nn.Linear(n_in, n)), random_ln(n, seed))
    before = state(model)
    out = ln_to_rms(model)
    assert_untouched(model, before)
    assert isinstance(out[1], CRMSNorm) and out[1].eps == model[1].eps
    assert torch.equal(out[1].weight, model[1].weight) and torch.equal(out[1].bias, model[1].bias)
    assert torch.equal(out[0].weight, model[0].weight)  # the producer is not touched


def test_ln_to_rms_deviation_is_float_rounding():
    """Measured: CRMSNorm vs LayerNorm on the centred producer's output, and how much
    centring the producer moves the LayerNorm output (zero in real arithmetic)."""
    torch.manual_seed(1)
    raw = nn.Linear(32, 64)
    model = nn.Sequential(center_linear(raw), random_ln(64, 1))
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(2)) * 3
    with torch.no_grad():
        h = model[0](x)
        mean = {"max": float((h.double().mean(-1).abs() / h.double().pow(2).mean(-1).sqrt()).max())}
        crms = ulp_stats(ln_to_rms(model)(x), model(x))
        centring = ulp_stats(model(x), model[1](raw(x)))
    report("crms: mean of centred producer output / its rms", mean)
    report("crms: CRMSNorm vs LayerNorm output (float32)", crms)
    report("crms: LayerNorm after centred vs raw producer (float32)", centring)
    # float rounding only (measured 5e-8 relative mean, 1 and 2 ulp at full scale)
    assert mean["max"] < 1e-6
    assert crms["max_ulp_full_scale"] <= 2 and centring["max_ulp_full_scale"] <= 4


class ResidualLN(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.up = nn.Linear(n, 2 * n)
        self.down = center_linear(nn.Linear(2 * n, n))
        self.ln = random_ln(n, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.down(torch.relu(self.up(x)))
        return self.ln(-(0.5 * h))


def test_ln_to_rms_residual_stream_needs_a_declared_zero_mean_input():
    torch.manual_seed(0)
    model = ResidualLN(16)
    with pytest.raises(ValueError, match="model input 'x'"):
        ln_to_rms(model)
    out = ln_to_rms(model, assume_zero_mean={"x"})
    assert type(out) is ResidualLN and isinstance(out.ln, CRMSNorm)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(4))
    x = x - x.mean(-1, keepdim=True)
    with torch.no_grad():
        report("crms: residual stream, CRMSNorm vs LayerNorm (float32)", ulp_stats(out(x), model(x)))


@pytest.mark.parametrize(
    "producer, match",
    [
        (lambda: nn.Linear(8, 8), "columns that do not sum to 0"),
        (lambda: nn.Sequential(center_linear(nn.Linear(8, 8)), nn.ReLU()), "ReLU"),
        (lambda: nn.Sequential(nn.Linear(8, 8, bias=False), nn.Identity()), "columns that do not sum to 0"),
    ],
)
def test_ln_to_rms_refuses_unproven_inputs(producer, match):
    torch.manual_seed(0)
    p = producer()
    model = nn.Sequential(*(p if isinstance(p, nn.Sequential) else [p]), nn.LayerNorm(8))
    with pytest.raises(ValueError, match=match):
        ln_to_rms(model)


def test_ln_to_rms_bias_must_sum_to_zero_and_names_select():
    torch.manual_seed(0)
    lin = center_linear(nn.Linear(8, 8))
    with torch.no_grad():
        lin.bias.add_(1.0)
    model = nn.Sequential(lin, nn.LayerNorm(8), center_linear(nn.Linear(8, 8)), nn.LayerNorm(8))
    with pytest.raises(ValueError, match="bias that does not sum to 0"):
        ln_to_rms(model)
    out = ln_to_rms(model, names=["3"])
    assert isinstance(out[1], nn.LayerNorm) and isinstance(out[3], CRMSNorm)
    assert isinstance(ln_to_rms(model, assume_zero_mean={"0"})[1], CRMSNorm)
    with pytest.raises(ValueError, match="no LayerNorm called"):
        ln_to_rms(model, names=["2"])


# --------------------------------------------------------------------------- PowerNorm


@FAST
@given(
    channel_dim=st.sampled_from([1, -1]),
    c=st.integers(1, 6),
    extra=st.lists(st.integers(1, 4), max_size=2),
    seed=st.integers(0, 2**16),
)
def test_powernorm_fold_equals_eval_bitwise(channel_dim, c, extra, seed):
    g = torch.Generator().manual_seed(seed)
    shape = [3, c, *extra] if channel_dim == 1 else [3, *extra, c]
    pn = PowerNorm(c, channel_dim=channel_dim)
    with torch.no_grad():
        pn.weight.copy_(torch.randn(c, generator=g))
        pn.bias.copy_(torch.randn(c, generator=g))
    x = torch.randn(shape, generator=g) * 2 + 0.5
    pn.train()
    pn(x)
    phi = x.pow(2).mean(dim=[d for d in range(x.dim()) if d != channel_dim % x.dim()])
    assert torch.equal(pn.running_phi, torch.ones(c).mul(0.9).add(0.1 * phi))
    model = nn.Sequential(nn.Identity(), pn).eval()
    before = state(model)
    folded = fold_powernorm(model)
    assert_untouched(model, before)
    assert isinstance(folded[1], ChannelAffine)
    want = (pn.weight.detach().double().numpy() / np.sqrt(pn.running_phi.double().numpy() + pn.eps)).astype(np.float32)
    assert np.array_equal(folded[1].scale.numpy(), want) and torch.equal(folded[1].shift, pn.bias.detach())
    y = torch.randn(shape, generator=g)
    assert torch.equal(folded(y), model(y))


def test_powernorm_training_output_and_measured_inference_rounding():
    g = torch.Generator().manual_seed(0)
    pn = PowerNorm(8, channel_dim=-1)
    with torch.no_grad():
        pn.weight.copy_(torch.randn(8, generator=g))
        pn.bias.copy_(torch.randn(8, generator=g))
    x = torch.randn(16, 5, 8, generator=g) * 3
    y = pn.train()(x)
    phi = x.pow(2).mean(dim=(0, 1))
    assert torch.equal(y, x * torch.rsqrt(phi + pn.eps) * pn.weight + pn.bias)
    pn.eval()
    with torch.no_grad():
        want = (
            x.double() * pn.weight.double() / torch.sqrt(pn.running_phi.double() + pn.eps) + pn.bias.double()
        ).float()
        report("powernorm: folded x*s+beta vs gamma*x/sqrt(phi+eps)+beta (float64, rounded)", ulp_stats(pn(x), want))
    with pytest.raises(ValueError, match="expects 8 channels"):
        pn(torch.randn(4, 7))


# --------------------------------------------------------------------------- thresholds


class SpikingNet(nn.Module):
    """Linear -> MPBN LIF neuron -> spike rates -> BN + quantized activation -> Linear."""

    def __init__(self, c: int = 5) -> None:
        super().__init__()
        self.fc = nn.Linear(6, c)
        self.lif = MPBNLIF(c, in_fmt=QFormat(8, 0.04), v_th=0.6, leak=0.5, reset="soft")
        self.act = BNQuantAct(c, QFormat(3, 0.5, signed=False), in_fmt=QFormat(8, 0.01))
        self.head = nn.Linear(c, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spikes = self.lif(self.fc(x))  # (T, B, C)
        return self.head(self.act(spikes.mean(0) - 0.3))


def randomize_bn_layer(layer: nn.Module, rng: np.random.Generator, mean: float, var: tuple[float, float]) -> None:
    c = layer.channels
    gamma = rng.normal(1.0, 0.4, c)
    gamma[1], gamma[2] = -0.7, 0.0
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(gamma))
        layer.bias.copy_(torch.from_numpy(rng.normal(0.3, 0.3, c)))
        layer.running_mean.copy_(torch.from_numpy(rng.normal(mean, 0.2, c)))
        layer.running_var.copy_(torch.from_numpy(rng.uniform(*var, c)))


@pytest.mark.parametrize("seed", range(3))
def test_fold_thresholds_outputs_identical(seed):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = SpikingNet()
    randomize_bn_layer(model.lif, rng, 0.2, (0.02, 0.5))
    randomize_bn_layer(model.act, rng, -0.1, (0.005, 0.05))
    model.eval()
    before = state(model)
    folded = fold_thresholds(model)
    assert_untouched(model, before)
    assert isinstance(folded.lif, FoldedMPBNLIF) and isinstance(folded.act, MultiThresholdAct)
    for k in range(3):
        x = torch.randn(8, 32, 6, generator=torch.Generator().manual_seed(100 * seed + k))
        with torch.no_grad():
            want = model(x)
            assert torch.equal(folded(x), want)
        levels = model.act(model.lif(model.fc(x)).mean(0) - 0.3)
        assert len(set(levels.flatten().tolist())) > 2  # the activation is not constant


def test_fold_thresholds_shared_layer_stays_shared_and_root_is_folded():
    layer = BNQuantAct(4, in_fmt=QFormat(8, 0.05))
    randomize_bn_layer(layer, np.random.default_rng(0), 0.0, (0.5, 2.0))
    model = nn.Sequential(layer, nn.Identity(), layer).eval()
    folded = fold_thresholds(model)
    assert folded[0] is folded[2] and isinstance(folded[0], MultiThresholdAct)
    assert isinstance(fold_thresholds(layer.eval()), MultiThresholdAct)
    x = torch.rand(16, 4) * 4
    with torch.no_grad():
        assert torch.equal(folded(x), model(x))
