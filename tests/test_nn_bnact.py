"""BNQuantAct: forward == golden BNQuant x scale (train/eval, float32/64), fold ==
exhaustively, gradients vs the float op, and the Brevitas sandwich."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from qnorm.fixedpoint import Round
from qnorm.nn import BNQuantAct, MultiThresholdAct
from qnorm.nn._qat import batch_stats
from qnorm.ops.multithreshold import BNActConfig, BNQuant
from qnorm.qformat import QFormat

IN_FMT = QFormat(8, 0.05)
OUT_FMT = QFormat(4, 0.25, signed=False)
C = 6


def make_layer(seed: int = 0, dtype: torch.dtype = torch.float32, **kw) -> BNQuantAct:
    """Random gamma (one channel negative, one zero), beta and running statistics."""
    rng = np.random.default_rng(seed)
    layer = BNQuantAct(C, kw.pop("out_fmt", OUT_FMT), in_fmt=kw.pop("in_fmt", IN_FMT), **kw)
    gamma = rng.normal(1.0, 0.5, C)
    gamma[1], gamma[2] = -0.8, 0.0
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(gamma))
        layer.bias.copy_(torch.from_numpy(rng.normal(0.8, 0.5, C)))
        layer.running_mean.copy_(torch.from_numpy(rng.normal(0, 1, C)))
        layer.running_var.copy_(torch.from_numpy(rng.uniform(0.3, 3, C)))
    return layer.to(dtype)


def golden_output(op: BNQuant, x_int: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The numpy golden op on channel-last integers, back in (B, C, ...) times the output scale."""
    y = np.moveaxis(op.forward(np.moveaxis(x_int, 1, -1)), -1, 1)
    return torch.from_numpy(y).to(dtype) * op.out_fmt.scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(64, C), (8, C, 3, 2)])
@pytest.mark.parametrize("train", [True, False])
def test_forward_equals_golden_times_scale(dtype, shape, train):
    layer = make_layer(1, dtype).train(train)
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 2 + 0.3).to(dtype)
    x_int = IN_FMT.quantize(x.numpy())  # the numpy spec quantizer, independent of the layer's
    stats = batch_stats(torch.from_numpy(np.moveaxis(x_int, 1, -1)), IN_FMT.scale) if train else None
    op = layer.golden(IN_FMT, stats)
    y = layer(x)
    assert y.dtype == dtype and torch.equal(y, golden_output(op, x_int, dtype))
    assert len(set(y.flatten().tolist())) > 4  # several levels, not a constant


@pytest.mark.parametrize("mode", [Round.HALF_EVEN, Round.FLOOR, Round.TRUNC])
def test_other_rounding_modes(mode):
    layer = make_layer(3, rounding=mode, out_fmt=QFormat(4, 0.25)).eval()
    x = torch.randn(128, C) * 3
    assert torch.equal(layer(x), golden_output(layer.golden(), IN_FMT.quantize(x.numpy()), torch.float32))


def test_golden_equals_the_ops_own_from_float():
    layer = make_layer(4)
    layer(torch.randn(32, C))  # moves the running statistics
    op = layer.golden()
    named = {"gamma": layer.weight, "beta": layer.bias, "mean": layer.running_mean, "var": layer.running_var}
    p = {k: v.detach().double().numpy() for k, v in named.items()}
    ref = BNQuant.from_float(**p, eps=layer.eps, cfg=BNActConfig(IN_FMT, OUT_FMT))
    for name in ("gamma_m", "mean_q", "std_q", "beta_q"):
        assert np.array_equal(getattr(op.bn, name), getattr(ref.bn, name)), name
    assert (op.bn.gamma_shift, op.bn.frac_bits, op.bn.out_frac_bits) == (ref.bn.gamma_shift, 8, 8)
    assert np.array_equal(op.reference.var, ref.reference.var)


def test_running_statistics_follow_the_quantized_batch():
    layer = make_layer(5, momentum=0.25)
    before_mean, before_var = layer.running_mean.double().numpy(), layer.running_var.double().numpy()
    x = torch.randn(40, C, 2)
    layer(x)
    s = batch_stats(torch.from_numpy(np.moveaxis(IN_FMT.quantize(x.numpy()), 1, -1)), IN_FMT.scale)
    want_mean = (0.75 * before_mean + 0.25 * s.mean).astype(np.float32)
    want_var = (0.75 * before_var + 0.25 * s.var_unbiased).astype(np.float32)
    assert np.array_equal(layer.running_mean.numpy(), want_mean)
    assert np.array_equal(layer.running_var.numpy(), want_var)
    assert int(layer.num_batches_tracked) == 1
    layer.eval()
    layer(x)
    assert np.array_equal(layer.running_mean.numpy(), want_mean)  # frozen in eval


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", [Round.HALF_UP, Round.HALF_EVEN])
def test_fold_equals_layer_exhaustively_over_int8(seed, mode):
    """Every int8 input in every channel, gamma < 0 and gamma = 0 channels included."""
    layer = make_layer(10 + seed, rounding=mode, out_fmt=QFormat(3, 0.5, signed=seed == 1)).eval()
    x = torch.arange(-128, 128, dtype=torch.float32)[:, None].repeat(1, C) * IN_FMT.scale
    assert np.array_equal(IN_FMT.quantize(x.numpy()), np.arange(-128, 128)[:, None].repeat(C, 1))
    folded = layer.fold()
    assert isinstance(folded, MultiThresholdAct) and folded.thresholds.shape == (C, 7)
    y = layer(x)
    assert torch.equal(folded(x), y)
    assert torch.equal(y, golden_output(layer.golden(), IN_FMT.quantize(x.numpy()), torch.float32))
    assert len(set(y[:, 0].tolist())) == 8 and len(set(y[:, 2].tolist())) == 1  # all levels; gamma = 0 constant
    spatial = x.T.reshape(1, C, 16, 16)
    assert torch.equal(folded(spatial), layer(spatial))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def test_gradients_are_the_float_ops():
    """Backward == the gradient of BN (batch statistics) + clipped activation at the
    dequantized input (exactly), and close to it at the float input (measured)."""
    layer = make_layer(6)
    x = torch.randn(256, C, generator=torch.Generator().manual_seed(7)) * 1.5
    r = torch.randn(256, C, generator=torch.Generator().manual_seed(8))
    xq = x.clone().requires_grad_()
    (layer(xq) * r).sum().backward()
    q = layer.input_quant(x)
    lo, hi = OUT_FMT.lo * OUT_FMT.scale, OUT_FMT.hi * OUT_FMT.scale
    for point, exact in ((q.dequant, True), (x, False)):
        xf = point.clone().requires_grad_()
        w, b = (p.detach().clone().requires_grad_() for p in (layer.weight, layer.bias))
        (F.batch_norm(xf, None, None, w, b, True, 0.0, layer.eps).clamp(lo, hi) * r).sum().backward()
        pairs = ((xq.grad, xf.grad * q.pass_mask), (layer.weight.grad, w.grad), (layer.bias.grad, b.grad))
        for got, want in pairs:
            assert torch.isfinite(got).all() and got.abs().sum() > 0
            assert torch.equal(got, want) if exact else cosine(got, want) > 0.99  # measured: >= 0.998


def test_bad_parameters_are_named():
    layer = make_layer(0).eval()
    with torch.no_grad():
        layer.weight[0] = float("nan")
    with pytest.raises(ValueError, match="gamma contains NaN"):
        layer(torch.zeros(2, C))
    with pytest.raises(ValueError, match="out_fmt must be a QFormat"):
        BNQuantAct(C, out_fmt=4)


def test_brevitas_sandwich_forward_backward():
    """QuantIdentity -> BNQuantAct -> QuantLinear: no glue, ints passed through exactly."""
    brevitas_nn = pytest.importorskip("brevitas.nn")
    from brevitas.quant_tensor import IntQuantTensor

    torch.manual_seed(0)
    qi = brevitas_nn.QuantIdentity(return_quant_tensor=True)
    act = BNQuantAct(C, OUT_FMT, return_quant_tensor=True)
    lin = brevitas_nn.QuantLinear(C, 3, bias=True)
    model = torch.nn.Sequential(qi, act, lin)
    seen = {}
    act.register_forward_pre_hook(lambda m, a: seen.__setitem__("act", a[0]))
    lin.register_forward_pre_hook(lambda m, a: seen.__setitem__("lin", a[0]))
    for train in (True, False):
        model.train(train)
        x = torch.randn(32, C, requires_grad=True)
        model(x).square().mean().backward()
        into, out = seen["act"], seen["lin"]
        assert isinstance(into, IntQuantTensor) and isinstance(out, IntQuantTensor)
        ints = into.int().to(torch.int64)
        fmt = QFormat(8, float(into.scale.detach()))
        assert torch.equal(act.input_quant(into).ints, ints)  # the layer computes on Brevitas' ints
        op = act.golden(fmt, batch_stats(ints, fmt.scale) if train else None)
        want = torch.from_numpy(op.forward(ints.numpy()))
        assert torch.equal(out.int().to(torch.int64), want)  # QuantLinear gets the golden ints
        assert torch.equal(out.value, want.float() * OUT_FMT.scale)
        assert float(out.scale) == OUT_FMT.scale and float(out.bit_width) == 4 and out.signed is False
        for g in (x.grad, act.weight.grad, act.bias.grad, lin.weight.grad):
            assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
        model.zero_grad()
