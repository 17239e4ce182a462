"""MPBNLIF: forward == golden MPBN neuron (eval) / a step-wise reference with per-step
batch statistics (train), fold == unfolded spike trains, surrogate gradients vs the
float neuron, and the Brevitas sandwich."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from qnorm.analysis import OverflowRiskError
from qnorm.fixedpoint import Dyadic
from qnorm.nn import MPBNLIF, FoldedMPBNLIF
from qnorm.nn._qat import batch_stats
from qnorm.ops.bnfold import RationalBN
from qnorm.ops.spiking import LIFConfig, MPBNNeuron
from qnorm.qformat import QFormat

FMT = QFormat(8, 0.04)
C = 4
CONFIGS = {
    "hard_leak": dict(reset="hard", leak=0.5, comparator=">=", u_rest=-4),
    "soft_strict": dict(reset="soft", leak=None, comparator=">", u_rest=3),
    "soft_unsaturated": dict(reset="soft", leak=Dyadic(15, 4), comparator=">=", saturate=False, max_steps=16),
    "soft_saturating": dict(reset="soft", leak=None, comparator=">=", membrane_bits=8),
}


def make_layer(cfg: str, seed: int = 0, dtype: torch.dtype = torch.float32, **kw) -> MPBNLIF:
    """Random BN parameters and statistics; channel 1 has gamma < 0, channel 2 gamma = 0."""
    rng = np.random.default_rng(seed)
    layer = MPBNLIF(C, in_fmt=kw.pop("in_fmt", FMT), v_th=0.6, **CONFIGS[cfg], **kw)
    gamma = rng.normal(1.0, 0.3, C)
    gamma[1], gamma[2] = -0.7, 0.0
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(gamma))
        layer.bias.copy_(torch.from_numpy(rng.normal(0.3, 0.3, C)))
        layer.bias[2] = 0.6 * (seed % 2)  # gamma = 0: fires always (beta = v_th) or never
        if layer.dynamics["membrane_bits"] == 8:  # beta >> v_th: R < 0, so pre - R saturates
            layer.bias[3] = 3.0
        layer.running_mean.copy_(torch.from_numpy(rng.normal(0.5, 0.5, C)))
        layer.running_var.copy_(torch.from_numpy(rng.uniform(0.2, 1.5, C)))
    return layer.to(dtype)


def currents(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.8 + 0.35).to(dtype)


def golden_spikes(op: MPBNNeuron, x_int: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    y = np.moveaxis(op.forward(np.moveaxis(x_int, 2, -1)), -1, 2)
    return torch.from_numpy(y).to(dtype) * op.out_fmt.scale


# --------------------------------------------------------------------------- eval: the golden op's own body


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(12, 5, C), (6, 2, C, 3, 2)])
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_eval_forward_equals_golden(dtype, shape, cfg):
    layer = make_layer(cfg, 1, dtype).eval()
    x = currents(shape, 2, dtype)
    y = layer(x)
    want = golden_spikes(layer.golden(), FMT.quantize(x.numpy()), dtype)
    assert y.dtype == dtype and torch.equal(y, want)
    assert 0.05 < float(y[:, :, 0].detach().mean()) < 0.95  # a real spike train


def test_golden_equals_the_ops_own_from_float():
    layer = make_layer("soft_strict", 3)
    op = layer.golden()
    named = {"gamma": layer.weight, "beta": layer.bias, "mean": layer.running_mean, "var": layer.running_var}
    p = {k: v.detach().double().numpy() for k, v in named.items()}
    ref = MPBNNeuron.from_float(**p, eps=layer.eps, v_th=0.6, cfg=layer.lif_config(FMT))
    for name in ("gamma_m", "mean_q", "std_q", "beta_q", "gamma_shift"):
        assert np.array_equal(getattr(op.params.bn, name), getattr(ref.params.bn, name)), name
    for name in ("v_th_q", "reset_sub"):
        assert np.array_equal(getattr(op.params, name), getattr(ref.params, name)), name
    assert np.array_equal(op.event.theta, ref.event.theta)
    assert np.array_equal(op.reference.reset_sub, ref.reference.reset_sub, equal_nan=True)


# --------------------------------------------------------------------------- train: per-step batch statistics


def bn_fires(bn: RationalBN, c: int, u: int, v_th: Fraction, strict: bool) -> bool:
    """Fraction BN(u) = G (2^F u - M) / (D 2^S) + B / 2^Fo compared with V_th."""
    g, m, d, b = (int(a[c]) for a in (bn.gamma_m, bn.mean_q, bn.std_q, bn.beta_q))
    z = Fraction(g * ((u << bn.frac_bits) - m), d << bn.gamma_shift) + Fraction(b, 1 << bn.out_frac_bits)
    return z > v_th if strict else z >= v_th


def reference_training_run(layer: MPBNLIF, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Python ints and Fractions: step t fires by MPBNNeuron.from_float of step t's statistics."""
    cfg = layer.lif_config(FMT)
    lo, hi = cfg.membrane_range
    flat = np.moveaxis(x, 2, -1).reshape(x.shape[0], -1, C)
    gamma, beta = (p.detach().double().numpy() for p in (layer.weight, layer.bias))
    rm, rv = (b.detach().double().numpy() for b in (layer.running_mean, layer.running_var))
    buffer = layer.running_mean.numpy().dtype  # the running statistics are stored (rounded) every step
    s, mom = Fraction(FMT.scale), layer.momentum
    state = [[cfg.u_rest] * C for _ in range(flat.shape[1])]
    spikes = np.zeros(flat.shape, dtype=np.int64)
    for t in range(flat.shape[0]):
        pre = []
        for n, row in enumerate(state):
            leaked = row if cfg.leak is None else [(u * cfg.leak.m + (1 << cfg.leak.s >> 1)) >> cfg.leak.s for u in row]
            pre_row = [u + int(i) for u, i in zip(leaked, flat[t, n], strict=True)]
            pre.append([min(max(u, lo), hi) for u in pre_row] if cfg.saturate else pre_row)
        cols = list(zip(*pre, strict=True))
        k = len(pre)
        mean = [Fraction(sum(col), k) for col in cols]
        dev = [sum((u - mu) ** 2 for u in col) for col, mu in zip(cols, mean, strict=True)]
        m64 = np.array([float(mu * s) for mu in mean])
        v64 = np.array([float(d / k * s * s) for d in dev])
        op = MPBNNeuron.from_float(gamma, beta, m64, v64, layer.eps, layer.v_th, cfg)  # the canonical derivation
        v_th = Fraction(int(op.params.v_th_q[0]), 1 << op.params.bn.out_frac_bits)
        for n, row in enumerate(pre):
            for c, u in enumerate(row):
                fire = bn_fires(op.params.bn, c, u, v_th, cfg.comparator == ">")
                spikes[t, n, c] = fire
                if fire:
                    u = cfg.u_rest if cfg.reset == "hard" else u - int(op.params.reset_sub[c])
                state[n][c] = min(max(u, lo), hi) if cfg.saturate else u
        rm = ((1 - mom) * rm + mom * m64).astype(buffer).astype(np.float64)
        rv = ((1 - mom) * rv + mom * np.array([float(d / (k - 1) * s * s) for d in dev])).astype(buffer)
        rv = rv.astype(np.float64)
    y = np.moveaxis(spikes.reshape(*x.shape[:2], *x.shape[3:], C), -1, 2)
    return y, rm, rv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_training_forward_equals_stepwise_reference(dtype, cfg):
    layer = make_layer(cfg, 4, dtype).train()
    x = currents((5, 3, C, 2), 5, dtype)
    want, rm, rv = reference_training_run(layer, FMT.quantize(x.numpy()))
    y = layer(x)
    assert y.dtype == dtype and torch.equal(y, torch.from_numpy(want).to(dtype))
    assert 0.05 < float(y.detach().mean()) < 0.95
    assert np.array_equal(layer.running_mean.double().numpy(), rm)
    assert np.array_equal(layer.running_var.double().numpy(), rv)
    assert int(layer.num_batches_tracked) == 5  # one update per step


def test_single_training_step_is_the_golden_op_of_its_batch():
    layer = make_layer("hard_leak", 6).train()
    x = currents((1, 16, C), 7)
    x_int = FMT.quantize(x.numpy())
    leak = layer.lif_config(FMT).leak
    rest = (-4 * leak.m + (1 << leak.s >> 1)) >> leak.s  # the leaked u_rest = -4, rounded half up
    op = layer.golden(FMT, batch_stats(torch.from_numpy(x_int[0] + rest), FMT.scale))  # BN sees the membrane
    assert torch.equal(layer(x), golden_spikes(op, x_int, torch.float32))


@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_training_step_calls_equal_the_golden_body(cfg):
    """The calls the training loop makes (cfg.charge, op.fires, op.reset), for a fixed neuron, == op._forward."""
    layer = make_layer(cfg, 8).eval()
    op = layer.golden()
    u = torch.from_numpy(np.moveaxis(FMT.quantize(currents((9, 4, C), 9).numpy()), 2, -1))
    state, spikes, pres, posts = None, [], [], []
    for t in range(u.shape[0]):
        pre = op.cfg.charge(op.cfg.rest_like(u[t]) if state is None else state, u[t])
        fire = op.fires(pre)
        state = op.reset(pre, fire)
        spikes.append(fire.long()), pres.append(pre), posts.append(state)
    trace = {}
    assert torch.equal(torch.stack(spikes), op._forward(u, trace))
    assert np.array_equal(torch.stack(pres).numpy(), trace["membrane"])
    assert np.array_equal(torch.stack(posts).numpy(), trace["membrane_reset"])
    if cfg == "soft_saturating":
        assert int(trace["membrane_reset"].max()) == op.cfg.membrane_range[1]  # the reset saturated


def test_unsaturated_training_leaving_the_membrane_is_refused():
    layer = make_layer("soft_unsaturated", 0, membrane_bits=8, in_fmt=QFormat(8, 0.04))
    with torch.no_grad():
        layer.weight.fill_(-1e-3)  # thresholds far away: the membrane only integrates
    with pytest.raises(OverflowRiskError, match="membrane"):
        layer(torch.full((4, 2, C), 5.0))


def test_eval_beyond_the_analysed_horizon_is_refused():
    layer = make_layer("soft_unsaturated", 0).eval()
    with pytest.raises(ValueError, match="max_steps"):
        layer(currents((17, 2, C), 0))


# --------------------------------------------------------------------------- fold


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_folded_spike_trains_equal_unfolded(seed, cfg):
    layer = make_layer(cfg, 20 + seed).eval()
    folded = layer.fold()
    assert isinstance(folded, FoldedMPBNLIF)
    assert folded.op.event.negative.tolist() == [False, True, False, False]  # gamma < 0 flips channel 1
    x = currents((14, 6, C, 2), 30 + seed) * (1 + seed)
    y = layer(x)
    assert torch.equal(folded(x), y)
    assert len(set(y[:, :, 2].flatten().tolist())) == 1  # gamma = 0: a constant channel
    assert torch.equal(folded(x.double()), y.double())


# --------------------------------------------------------------------------- gradients


class _ATan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z):
        ctx.save_for_backward(z)
        return (z >= 0).to(z.dtype)

    @staticmethod
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        return g / (1 + (math.pi * z) ** 2)  # alpha = 2


def float_lif(x, w, b, eps, lam, v_th):
    """The unquantized neuron: hard reset to 0, BN with each step's batch statistics."""
    u, out = torch.zeros_like(x[0]), []
    for xt in x:
        h = lam * u + xt
        s = _ATan.apply(F.batch_norm(h, None, None, w, b, True, 0.0, eps) - v_th)
        u = h * (1 - s)
        out.append(s)
    return torch.stack(out)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def test_gradients_are_the_float_neurons():
    """Backward == the float neuron's gradient at the dequantized input (exactly), and
    close to the unquantized float neuron's gradient (measured)."""
    layer = MPBNLIF(C, v_th=0.6, leak=0.5, in_fmt=QFormat(8, 0.03))
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.0, 0.8, 1.2, 0.6]))
        layer.bias.copy_(torch.tensor([0.2, 0.4, 0.0, 0.5]))
    x = currents((6, 64, C), 11)
    r = torch.randn(6, 64, C, generator=torch.Generator().manual_seed(12))
    xq = x.clone().requires_grad_()
    (layer(xq) * r).sum().backward()
    q = layer.input_quant(x)
    for point, exact in ((q.dequant, True), (x, False)):
        xf = point.clone().requires_grad_()
        w, b = (p.detach().clone().requires_grad_() for p in (layer.weight, layer.bias))
        (float_lif(xf, w, b, layer.eps, 0.5, 0.6) * r).sum().backward()
        pairs = ((xq.grad, xf.grad * q.pass_mask), (layer.weight.grad, w.grad), (layer.bias.grad, b.grad))
        for got, want in pairs:
            assert torch.isfinite(got).all() and got.abs().sum() > 0
            assert torch.equal(got, want) if exact else cosine(got, want) > 0.99  # measured: >= 0.9995


# --------------------------------------------------------------------------- Brevitas


def test_brevitas_sandwich_forward_backward():
    """QuantIdentity -> MPBNLIF -> QuantLinear: currents in as ints, spikes out as a 0/1 IntQuantTensor."""
    brevitas_nn = pytest.importorskip("brevitas.nn")
    from brevitas.quant_tensor import IntQuantTensor

    torch.manual_seed(0)
    qi = brevitas_nn.QuantIdentity(return_quant_tensor=True)
    lif = MPBNLIF(C, v_th=0.5, return_quant_tensor=True)
    lin = brevitas_nn.QuantLinear(C, 3, bias=True)
    model = torch.nn.Sequential(qi, lif, lin)
    seen = {}
    lif.register_forward_pre_hook(lambda m, a: seen.__setitem__("lif", a[0]))
    lin.register_forward_pre_hook(lambda m, a: seen.__setitem__("lin", a[0]))
    for train in (True, False):
        model.train(train)
        x = currents((5, 16, C), 13).requires_grad_()
        model(x).square().mean().backward()
        into, out = seen["lif"], seen["lin"]
        assert isinstance(into, IntQuantTensor) and isinstance(out, IntQuantTensor)
        ints = into.int().to(torch.int64)
        assert torch.equal(lif.input_quant(into).ints, ints)  # Brevitas' ints, as they are
        spikes = out.int().to(torch.int64)
        assert set(spikes.unique().tolist()) == {0, 1} and float(out.scale) == 1.0 and out.signed is False
        if not train:
            want = np.moveaxis(lif.golden(QFormat(8, float(into.scale.detach()))).forward(ints.numpy()), -1, 2)
            assert torch.equal(spikes, torch.from_numpy(want))
        for g in (x.grad, lif.weight.grad, lif.bias.grad, lin.weight.grad):
            assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
        model.zero_grad()


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(leak=1.5), "leak"),
        (dict(reset="partial"), "reset must be"),
        (dict(comparator="<"), "comparator must be"),
        (dict(v_th=float("nan")), "v_th must be a finite"),
        (dict(alpha=0.0), "alpha must be"),
        (dict(momentum=0.0), "momentum"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MPBNLIF(C, **kwargs)


def test_config_is_checked_against_the_golden_config():
    assert make_layer("soft_unsaturated").lif_config(FMT) == LIFConfig(
        FMT, leak=Dyadic(15, 4), reset="soft", comparator=">=", saturate=False, max_steps=16
    )
