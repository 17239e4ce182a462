"""MPBN LIF neuron: folded threshold == exact unfolded BN, every step, every trace."""

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qnorm import fixedpoint as fp
from qnorm.analysis import OverflowRiskError
from qnorm.fixedpoint import Dyadic
from qnorm.ops.bnfold import RationalBN
from qnorm.ops.spiking import (
    MAX_STEPS,
    FoldedLIFNeuron,
    LIFConfig,
    MPBNNeuron,
    MPBNParams,
    quantize_threshold,
    spike_agreement,
)
from qnorm.qformat import QFormat

# --------------------------------------------------------------------------- independent references


def bn_z(bn: RationalBN, c: int, u: int) -> Fraction:
    """BN(u) straight from the quantized fields: G (2^F u - M) / (D 2^S) + B / 2^Fo."""
    g, m, d, b = (int(a.ravel()[c]) for a in (bn.gamma_m, bn.mean_q, bn.std_q, bn.beta_q))
    return Fraction(g * ((u << bn.frac_bits) - m), d << bn.gamma_shift) + Fraction(b, 1 << bn.out_frac_bits)


def fires(bn: RationalBN, c: int, u: int, v_th: Fraction, comparator: str) -> bool:
    z = bn_z(bn, c, u)
    return z >= v_th if comparator == ">=" else z > v_th


def reference_run(cfg: LIFConfig, params: MPBNParams, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Python-int LIF with the Fraction firing rule: (spikes, membrane, membrane_reset)."""
    lo, hi = cfg.membrane_range
    shape = params.bn.shape
    n_par = int(np.prod(shape))
    flat = x.reshape(x.shape[0], x.size // max(x.shape[0] * n_par, 1), n_par)
    spikes, pre_all, post_all = (np.zeros(flat.shape, dtype=np.int64) for _ in range(3))
    v_th = params.v_th
    for n in range(flat.shape[1]):
        for c in range(flat.shape[2]):
            u = cfg.u_rest
            for t in range(flat.shape[0]):
                if cfg.leak is not None:  # round half up of u m / 2^s, as Python ints
                    u = (u * cfg.leak.m + ((1 << cfg.leak.s) >> 1)) >> cfg.leak.s
                u += int(flat[t, n, c])
                u = min(max(u, lo), hi) if cfg.saturate else u
                fire = fires(params.bn, c, u, v_th[c], cfg.comparator)
                pre_all[t, n, c] = u
                if fire:
                    u = cfg.u_rest if cfg.reset == "hard" else u - int(params.reset_sub.ravel()[c])
                    u = min(max(u, lo), hi) if cfg.saturate else u
                spikes[t, n, c], post_all[t, n, c] = int(fire), u
    return tuple(a.reshape(x.shape) for a in (spikes, pre_all, post_all))


# --------------------------------------------------------------------------- parameter strategies


@st.composite
def channel(draw, kind: str, f: int, fo: int, s: int) -> tuple[int, int, int, int, int]:
    """(G, M, D, B, V); 'grid': the threshold (V - B) D 2^S / (G 2^Fo) + M / 2^F is an integer."""
    d = draw(st.integers(1, 1 << 10))
    b = draw(st.integers(-(1 << 10), 1 << 10))
    g = 0 if kind == "zero" else draw(st.integers(1, 1 << 12)) * draw(st.sampled_from([1, -1]))
    if kind == "grid":  # M = theta 2^F - j D 2^S, V = B + j G 2^Fo  =>  threshold = theta exactly
        theta, j = draw(st.integers(-16, 16)), draw(st.integers(-4, 4))
        return g, (theta << f) - j * (d << s), d, b, b + j * (g << fo)
    if kind == "zero":  # V near B so both constant outcomes (and V == B) occur
        return g, draw(st.integers(-100, 100)), d, b, b + draw(st.integers(-1, 1))
    return g, draw(st.integers(-(1 << 10), 1 << 10)), d, b, draw(st.integers(-(1 << 10), 1 << 10))


@st.composite
def mpbn_params(draw, shape: tuple[int, ...], soft: bool) -> MPBNParams:
    f, fo, s = draw(st.integers(0, 6)), draw(st.integers(0, 6)), draw(st.integers(0, 12))
    n = int(np.prod(shape))
    kinds = draw(st.lists(st.sampled_from(["grid", "grid", "random", "zero"]), min_size=n, max_size=n))
    rows = [draw(channel(k, f, fo, s)) for k in kinds]
    g, m, d, b, v = (np.array(col, dtype=np.int64).reshape(shape) for col in zip(*rows, strict=True))
    r = draw(st.lists(st.integers(-64, 64), min_size=n, max_size=n)) if soft else [0] * n
    return MPBNParams(RationalBN(g, s, m, d, f, b, fo), v, np.array(r, dtype=np.int64).reshape(shape))


@st.composite
def neuron_case(draw):
    per_neuron = draw(st.booleans())
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 3))) if per_neuron else (draw(st.integers(1, 5)),)
    batch = draw(st.sampled_from([(), (2,)]))
    t = draw(st.integers(0, 14))
    saturate = draw(st.booleans())
    leak = draw(st.sampled_from([None, Dyadic(15, 4), Dyadic(7, 3), Dyadic(29491, 15), Dyadic(0, 0)]))
    reset = draw(st.sampled_from(["hard", "soft"]))
    cfg = LIFConfig(
        QFormat(6, 0.125),
        membrane_bits=8 if saturate else 16,
        leak=leak,
        reset=reset,
        u_rest=draw(st.integers(-20, 20)),
        comparator=draw(st.sampled_from([">=", ">"])),
        saturate=saturate,
        max_steps=16,
    )
    params = draw(mpbn_params(shape, reset == "soft"))
    lo, hi = draw(st.sampled_from([(-3, 3), (-32, 31)]))  # small steps walk through every u
    x = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(lo, hi, (t, *batch, *shape), endpoint=True)
    return cfg, params, x


@given(neuron_case())
@settings(max_examples=150, deadline=None)
def test_folded_equals_unfolded_every_step(case):
    cfg, params, x = case
    unfolded = MPBNNeuron(cfg, params)
    folded = unfolded.fold()
    tu, tf = {}, {}
    su, sf = unfolded(x, tu), folded(x, tf)
    assert su.dtype == np.int8 and su.shape == x.shape
    assert np.array_equal(su, sf)
    for name in ("membrane", "membrane_reset"):
        assert np.array_equal(tu[name], tf[name]), name
    spikes, pre, post = reference_run(cfg, params, x)
    assert np.array_equal(su, spikes)
    assert np.array_equal(tu["membrane"], pre) and np.array_equal(tu["membrane_reset"], post)


@pytest.mark.parametrize("comparator", [">=", ">"])
@given(params=mpbn_params((6,), soft=False))
@settings(max_examples=25, deadline=None)
def test_firing_predicate_exhaustive_over_membrane(comparator, params):
    """One step from u_rest = 0 with current u: spike == [BN(u) ⋈ V_th] for every 10-bit u."""
    cfg = LIFConfig(QFormat(10, 1.0), membrane_bits=10, comparator=comparator, saturate=True)
    lo, hi = cfg.membrane_range
    x = np.repeat(np.arange(lo, hi + 1, dtype=np.int64)[None, :, None], 6, axis=2)
    unfolded = MPBNNeuron(cfg, params)
    su, sf = unfolded(x), unfolded.fold()(x)
    assert np.array_equal(su, sf)
    v = params.v_th
    for c in range(6):
        want = [int(fires(params.bn, c, u, v[c], comparator)) for u in range(lo, hi + 1)]
        assert su[0, :, c].tolist() == want, c


def grid_neuron(gamma: float, beta: float, v_th: float, comparator: str, **kw) -> MPBNNeuron:
    # mean 3, sigma 2 (var 4, eps 0), unit current scale: threshold 3 + (v_th - beta) 2 / gamma
    cfg = LIFConfig(QFormat(8, 1.0), membrane_bits=12, comparator=comparator, max_steps=8, **kw)
    return MPBNNeuron.from_float(gamma, beta, 3.0, 4.0, 0.0, v_th, cfg)


@pytest.mark.parametrize(
    "gamma,beta,v_th,comparator,theta,negative",
    [
        (0.5, 0.25, 1.25, ">=", 7, False),  # on the grid: u >= 7
        (0.5, 0.25, 1.25, ">", 8, False),  # on the grid, strict: floor + 1
        (0.5, 0.25, 1.3, ">=", 8, False),  # off the grid: ceil(7.2)
        (0.5, 0.25, 1.3, ">", 8, False),  # off the grid: floor(7.2) + 1 == ceil
        (-0.5, 0.25, 1.25, ">=", -1, True),  # gamma < 0 flips: u <= -1
        (-0.5, 0.25, 1.25, ">", -2, True),  # strict and flipped: u <= ceil(-1) - 1
        (0.0, 1.0, 1.0, ">=", -2048, False),  # gamma = 0, beta == V_th: always fires
        (0.0, 1.0, 1.0, ">", 2048, False),  # gamma = 0, strict: never fires
        (0.0, 0.5, 1.0, ">=", 2048, False),  # gamma = 0, beta < V_th: never
    ],
)
def test_fold_traps_from_float(gamma, beta, v_th, comparator, theta, negative):
    n = grid_neuron(gamma, beta, v_th, comparator)
    assert n.event.theta.shape == ()  # scalar parameters: one set shared by every neuron
    assert n.event.theta.item() == theta and n.event.negative.item() == negative
    folded = n.fold()
    u = np.arange(-128, 128, dtype=np.int64)[None, :, None]  # one step from rest 0
    assert np.array_equal(n(u), folded(u))
    fired = u[0, n(u)[0, :, 0] == 1, 0]
    if negative:
        assert fired.max() == theta
    elif fired.size:
        assert fired.min() == max(theta, -128)


def test_on_grid_membrane_actually_visits_the_threshold():
    """Dynamics: u reaches exactly 7; '>=' fires there, '>' does not, and they diverge."""
    x = np.array([3, 4, 1, 2, 5], dtype=np.int64)[:, None]
    ge, gt = grid_neuron(0.5, 0.25, 1.25, ">="), grid_neuron(0.5, 0.25, 1.25, ">")
    tr = {}
    assert ge(x, tr)[:, 0].tolist() == [0, 1, 0, 0, 1]
    assert tr["membrane"][:, 0].tolist() == [3, 7, 1, 3, 8]  # 7 fires and resets to 0
    assert gt(x, tr)[:, 0].tolist() == [0, 0, 1, 0, 0]
    assert tr["membrane"][:, 0].tolist() == [3, 7, 8, 2, 7]  # 7 does not fire, 8 does
    for n in (ge, gt):
        assert np.array_equal(n(x), n.fold()(x))


def test_soft_reset_amount_is_the_rounded_threshold():
    cfg = LIFConfig(QFormat(8, 1.0), membrane_bits=12, reset="soft", max_steps=8)
    n = MPBNNeuron.from_float([0.5, -0.5, 0.0, 0.5], 0.25, 3.0, 4.0, 0.0, [1.25, 1.25, 1.25, 1.3], cfg)
    assert n.params.reset_sub.tolist() == [7, -1, 0, 7]  # 7, -1, none (gamma = 0), round(7.2)
    custom = MPBNNeuron.from_float(0.5, 0.25, 3.0, 4.0, 0.0, 1.25, cfg, reset_sub=5)
    x = np.array([[9], [0]], dtype=np.int64)
    tr = {}
    custom(x, tr)
    assert tr["membrane_reset"][:, 0].tolist() == [4, 4]


# --------------------------------------------------------------------------- range analysis


def worst_case_neuron() -> MPBNNeuron:
    """No leak, hard reset to 0, fires at u >= 7 (the on-grid neuron), 32 analysed steps."""
    cfg = LIFConfig(QFormat(8, 1.0), membrane_bits=16, max_steps=32)
    return MPBNNeuron.from_float(0.5, 0.25, 3.0, 4.0, 0.0, 1.25, cfg)


def test_membrane_bound_reached_by_constructed_input():
    n = worst_case_neuron()
    rep = n.ranges()
    assert (rep["membrane"].lo, rep["membrane"].hi) == (-128 * 32, 6 + 127)
    assert n.bounds.steps == 32  # the lower bound grows every step: only 32 steps are proven
    tr = {}
    n(np.full((32, 1), -128, dtype=np.int64), tr)  # push down every step
    assert int(tr["membrane"].min()) == rep["membrane"].lo
    n(np.array([[6], [127]], dtype=np.int64), tr)  # sit just below the threshold, then jump
    assert int(tr["membrane"].max()) == rep["membrane"].hi
    with pytest.raises(ValueError, match="max_steps"):
        n(np.zeros((33, 1), dtype=np.int64))


@pytest.mark.parametrize("leak", [None, Dyadic(15, 4), Dyadic(1, 1)])
@pytest.mark.parametrize("reset", ["hard", "soft"])
def test_random_runs_stay_inside_every_bound(leak, reset):
    rng = np.random.default_rng(7)
    cfg = LIFConfig(QFormat(8, 0.05), membrane_bits=16, leak=leak, reset=reset, max_steps=64)
    c = 5
    n = MPBNNeuron.from_float(rng.normal(0, 1, c), rng.normal(0, 0.3, c), rng.normal(0, 1, c),
                              rng.uniform(0.2, 2, c), 1e-5, 0.5, cfg)  # fmt: skip
    rep = n.ranges()
    for _ in range(20):
        tr = {}
        n(rng.integers(-128, 128, (64, 8, c)), tr)
        for name, values in tr.items():
            assert rep[name].lo <= int(values.min()) and int(values.max()) <= rep[name].hi, name


def reachable_pre_hull(cfg: LIFConfig, params: MPBNParams, c: int, steps: int | None) -> tuple[int, int]:
    """Exact min/max of the membrane over every input sequence (set iteration)."""
    v = params.v_th[c]
    states, seen_pre, seen_states = {cfg.u_rest}, set(), set()
    for _ in range(steps if steps is not None else 1 << 16):
        pres = set()
        for u in states:
            base = u if cfg.leak is None else (u * cfg.leak.m + ((1 << cfg.leak.s) >> 1)) >> cfg.leak.s
            pres.update(base + i for i in range(cfg.in_fmt.lo, cfg.in_fmt.hi + 1))
        seen_pre |= pres
        fire = {p for p in pres if fires(params.bn, c, p, v, cfg.comparator)}
        if cfg.reset == "hard":
            states = (pres - fire) | ({cfg.u_rest} if fire else set())
        else:
            states = (pres - fire) | {p - int(params.reset_sub.ravel()[c]) for p in fire}
        if steps is None and states <= seen_states:
            break
        seen_states |= states
    return min(seen_pre), max(seen_pre)


@given(
    params=mpbn_params((2,), soft=True),
    leak=st.sampled_from([None, Dyadic(3, 2), Dyadic(1, 1)]),
    reset=st.sampled_from(["hard", "soft"]),
    comparator=st.sampled_from([">=", ">"]),
)
@settings(max_examples=40, deadline=None)
def test_membrane_analysis_is_exact_on_small_configs(params, leak, reset, comparator):
    cfg = LIFConfig(QFormat(3, 1.0), membrane_bits=24, leak=leak, reset=reset, comparator=comparator, max_steps=12)
    n = MPBNNeuron(cfg, params)
    for c in range(2):
        lo, hi = reachable_pre_hull(cfg, params, c, n.bounds.steps)
        assert (int(n.bounds.pre_lo[c]), int(n.bounds.pre_hi[c])) == (lo, hi)


def test_overflow_prone_config_refused_naming_the_intermediate():
    cfg = LIFConfig(QFormat(8, 1.0), membrane_bits=8, max_steps=4)
    with pytest.raises(OverflowRiskError, match="'membrane'.*time step 2"):
        MPBNNeuron.from_float(1.0, 0.0, 0.0, 1.0, 0.0, 1000.0, cfg)
    soft = LIFConfig(QFormat(4, 1.0), membrane_bits=8, reset="soft", max_steps=4)
    with pytest.raises(OverflowRiskError, match="'membrane_reset'"):
        MPBNNeuron.from_float(1.0, 0.0, 0.0, 1.0, 0.0, 0.0, soft, reset_sub=200)
    saturating = LIFConfig(QFormat(8, 1.0), membrane_bits=8, saturate=True, max_steps=4)
    n = MPBNNeuron.from_float(1.0, 0.0, 0.0, 1.0, 0.0, 1000.0, saturating)
    assert n.bounds.steps is None  # saturation makes every T safe
    tr = {}
    n(np.full((50, 1), 127, dtype=np.int64), tr)
    assert tr["membrane"].max() == 127


def test_leak_converges_and_allows_any_length():
    cfg = LIFConfig(QFormat(8, 1.0), membrane_bits=12, leak=Dyadic(7, 3), max_steps=200)
    n = MPBNNeuron.from_float(1.0, 0.0, 0.0, 1.0, 0.0, 1000.0, cfg)  # never fires in range
    assert n.bounds.steps is None
    assert n(np.full((500, 1), -128, dtype=np.int64)).shape == (500, 1)


# --------------------------------------------------------------------------- backends, float reference


def test_same_body_on_torch_int64():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    c = 6
    for reset in ("hard", "soft"):
        cfg = LIFConfig(QFormat(8, 0.05), leak=Dyadic(15, 4), reset=reset, comparator=">", max_steps=64)
        gamma = rng.normal(0, 1, c)
        gamma[0] = 0.0
        beta, mean, var = rng.normal(0, 0.3, c), rng.normal(0, 1, c), rng.uniform(0.2, 2, c)
        n = MPBNNeuron.from_float(gamma, beta, mean, var, 1e-5, 0.5, cfg)
        x = rng.integers(-128, 128, (40, 3, c))
        for op in (n.fold(), n):
            tr_np, tr_t = {}, {}
            want = op(x, tr_np)
            got = op._forward(torch.from_numpy(x), tr_t)  # the body a QAT layer runs
            assert isinstance(got, torch.Tensor) and got.dtype == torch.int64
            assert np.array_equal(got.numpy(), want)
            for name, value in tr_np.items():  # a torch body's trace stays torch (CUDA-safe)
                assert isinstance(tr_t[name], torch.Tensor), name
                assert np.array_equal(tr_t[name].numpy(), value), name


@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("reset", ["hard", "soft"])
def test_public_step_is_the_body_on_numpy_and_torch(reset, saturate):
    """charge / fires / reset, looped by hand, == _forward (spikes and both traces), per backend."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    c = 5
    cfg = LIFConfig(QFormat(8, 0.05), membrane_bits=10 if saturate else 16, leak=Dyadic(7, 3), reset=reset,
                    u_rest=2, saturate=saturate, max_steps=64)  # fmt: skip
    gamma = rng.normal(0, 1, c)
    gamma[0] = 0.0
    n = MPBNNeuron.from_float(gamma, rng.normal(0, 0.3, c), rng.normal(0, 1, c), rng.uniform(0.2, 2, c), 1e-5, 0.5, cfg)
    x = rng.integers(-128, 128, (30, 4, c))
    for op in (n, n.fold()):
        want_trace = {}
        want = op(x, want_trace)
        for xs in (x, torch.from_numpy(x)):
            state, spikes, pres, posts = None, [], [], []
            for t in range(xs.shape[0]):
                pre = op.charge(cfg.rest_like(xs[t]) if state is None else state, xs[t])
                fire = op.fires(pre)
                state = op.reset(pre, fire)
                spikes.append(fp.select(fire, 1, 0)), pres.append(pre), posts.append(state)
            stack = torch.stack if isinstance(xs, torch.Tensor) else np.stack
            assert np.array_equal(np.asarray(stack(spikes)), want)
            assert np.array_equal(np.asarray(stack(pres)), want_trace["membrane"])
            assert np.array_equal(np.asarray(stack(posts)), want_trace["membrane_reset"])
            assert op.charge(xs[0], xs[0]).dtype == xs.dtype  # the operand's own backend


def test_from_rational_is_from_float_of_the_same_integers():
    cfg = LIFConfig(QFormat(8, 0.05), membrane_bits=12, reset="soft", max_steps=8)
    args = ([0.5, -0.5, 0.0], 0.25, 3.0, 4.0, 1e-5, [1.25, 0.7, 1.3])
    ref = MPBNNeuron.from_float(*args, cfg)
    bn, vq = ref.params.bn, ref.params.v_th_q
    for with_reference in (False, True):
        fbn = ref.reference.bn if with_reference else None
        v_th = ref.reference.v_th if with_reference else None
        for cls in (MPBNNeuron, FoldedLIFNeuron):
            op = cls.from_rational(cfg, bn, vq, reference=fbn, v_th=v_th)
            assert isinstance(op, cls)
            assert np.array_equal(op.params.reset_sub, ref.params.reset_sub)  # the default soft-reset R
            assert np.array_equal(op.event.theta, ref.event.theta)
            if with_reference:
                assert np.array_equal(op.reference.reset_sub, ref.reference.reset_sub)
                assert np.array_equal(op.reference.v_th, ref.reference.v_th)
    custom = MPBNNeuron.from_rational(cfg, bn, vq, reset_sub=3)
    assert custom.params.reset_sub.tolist() == [3, 3, 3]
    assert np.array_equal(quantize_threshold(np.array([1.25, 0.7, 1.3]), bn.out_frac_bits), vq)
    with pytest.raises(ValueError, match="v_th_q must be integers"):
        MPBNNeuron.from_rational(cfg, bn, np.array([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="v_th_q shape"):
        MPBNNeuron.from_rational(cfg, bn, np.array([1, 2], dtype=np.int64))


def test_saturating_bounds_are_the_membrane_width_without_iteration(monkeypatch):
    """With saturation the analysis is the width itself (no step loop: a cheap per-step neuron)."""
    from qnorm.ops import spiking

    cfg = LIFConfig(QFormat(8, 1.0), membrane_bits=10, leak=Dyadic(1, 1), saturate=True, max_steps=MAX_STEPS)
    monkeypatch.setattr(spiking, "_leak", lambda *a: pytest.fail("saturating bounds must not iterate"))
    n = MPBNNeuron.from_float([1.0, -1.0], 0.0, 0.0, 1.0, 0.0, 0.5, cfg)
    b = n.bounds
    assert b.steps is None
    for lo, hi in ((b.pre_lo, b.pre_hi), (b.post_lo, b.post_hi)):
        assert lo.tolist() == [-512, -512] and hi.tolist() == [511, 511]


def test_float_agreement_is_measured():
    rng = np.random.default_rng(0)
    c = 32
    cfg = LIFConfig(QFormat(8, 0.02), membrane_bits=16, leak=Dyadic.from_float(0.9, 16), reset="soft", max_steps=256)
    n = MPBNNeuron.from_float(rng.normal(1, 0.3, c), rng.normal(0, 0.2, c), rng.normal(0, 0.5, c),
                              rng.uniform(0.5, 2, c), 1e-5, 1.0, cfg)  # fmt: skip
    x = cfg.in_fmt.quantize(rng.normal(0.1, 0.6, (100, 16, c)))
    rate = spike_agreement(n, x)
    spikes = n(x)
    assert 0.05 < spikes.mean() < 0.95  # a non-trivial spike train
    assert rate > 0.95  # measured (parameter quantization flips a few decisions), not equal


# --------------------------------------------------------------------------- bad input


def simple_neuron(**kw) -> MPBNNeuron:
    cfg = LIFConfig(QFormat(8, 1.0), membrane_bits=16, max_steps=16, **kw)
    return MPBNNeuron.from_float([1.0, -1.0], 0.0, 0.0, 1.0, 1e-5, 1.0, cfg)


def test_bad_inputs():
    n = simple_neuron()
    for op in (n, n.fold()):
        with pytest.raises(ValueError, match="integer"):
            op(np.zeros((3, 2)))
        with pytest.raises(ValueError, match="outside the declared"):
            op(np.array([[0, 128]]))
        with pytest.raises(ValueError, match=r"must be \(T, \.\.\."):
            op(np.zeros((3, 3), dtype=np.int64))
        with pytest.raises(ValueError, match=r"must be \(T, \.\.\."):
            op(np.zeros((2,), dtype=np.int64))
        tr = {}
        empty = op(np.zeros((0, 4, 2), dtype=np.int64), tr)  # T = 0: a defined empty train
        assert empty.shape == (0, 4, 2) and empty.dtype == np.int8 and tr["membrane"].shape == (0, 4, 2)


@pytest.mark.parametrize("name", ["gamma", "beta", "mean", "var", "eps", "v_th"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_inf_parameter_named(name, bad):
    args = dict(gamma=[1.0, 1.0], beta=0.0, mean=0.0, var=1.0, eps=1e-5, v_th=1.0)
    args[name] = bad
    with pytest.raises(ValueError, match=f"^{name} contains NaN or Inf"):
        MPBNNeuron.from_float(**args, cfg=LIFConfig(QFormat(8, 1.0)))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(var=[-1.0, 1.0]), "var must be >= 0"),
        (dict(gamma=[1.0, 1.0, 1.0], beta=[0.0, 0.0]), "broadcast"),
        (dict(reset_sub=0.5), "reset_sub must be integers"),
        (dict(reset_sub=[1, 2, 3]), "reset_sub shape"),
    ],
)
def test_bad_parameters(kwargs, match):
    args = dict(gamma=[1.0, 1.0], beta=0.0, mean=0.0, var=1.0, eps=1e-5, v_th=1.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MPBNNeuron.from_float(**args, cfg=LIFConfig(QFormat(8, 1.0), reset="soft"))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(reset="partial"), "reset must be"),
        (dict(comparator="<"), "comparator must be"),
        (dict(leak=Dyadic(17, 4)), "leak"),
        (dict(leak=0.9), "leak must be a Dyadic"),
        (dict(u_rest=40000), "u_rest"),
        (dict(membrane_bits=40), "membrane_bits"),
        (dict(max_steps=0), "max_steps"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LIFConfig(QFormat(8, 1.0), **kwargs)


def test_params_validated():
    ones, zeros = np.ones(2, dtype=np.int64), np.zeros(2, dtype=np.int64)
    bn = RationalBN(ones, 0, zeros, ones, 0, zeros, 0)
    with pytest.raises(ValueError, match="v_th_q"):
        MPBNParams(bn, np.zeros(3, dtype=np.int64), zeros)
    with pytest.raises(ValueError, match="reset_sub"):
        MPBNParams(bn, zeros, zeros.astype(np.float64))
    folded = FoldedLIFNeuron(LIFConfig(QFormat(8, 1.0)), MPBNParams(bn, zeros, zeros))
    assert folded.event.theta.tolist() == [0, 0]  # BN(u) = u >= 0
