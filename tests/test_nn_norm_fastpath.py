"""The QAT norms' fast path: the exact forward (qnorm.nn.elementchain, and its compiled
loop qnorm.nn.jitchain) against the golden body, on rows that reach the range analysis'
extremes, in every lane width and tie rule, and on drawn configs; the in-graph surrogate's gradients against the backward-pass surrogate's;
no stale constants after a parameter or scale change; mult_shift's bisection against
the linear search."""

import sys

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from qnorm import nn as qnn
from qnorm import ops
from qnorm.analysis import Interval, OverflowRiskError, RangeReport
from qnorm.fixedpoint import Round
from qnorm.nn import jitchain
from qnorm.nn.elementchain import ElementChain
from qnorm.nn.surrogate import exact_forward
from qnorm.ops._normcore import (
    DEFAULT_OUT,
    add_eps_ranges,
    exponent_segments,
    mantissa_range,
    mult_shift,
    row_affine_parts,
    xa_bound,
)
from qnorm.qformat import QFormat

OPS = {
    "int_ln": (ops.IntLayerNorm, {}),
    "l1": (ops.L1LayerNorm, {}),
    "shift2": (ops.ShiftLayerNorm, {"mantissa_terms": 2}),
    "shift1": (ops.ShiftLayerNorm, {"mantissa_terms": 1}),
    "rms": (ops.IntRMSNorm, {}),
    "prms": (ops.IntRMSNorm, {"partial": 0.25}),
}
FORMATS = {
    "int8": (QFormat(8, 0.03), DEFAULT_OUT),
    "int4": (QFormat(4, 0.4), QFormat(4, 0.5)),
    "int16": (QFormat(16, 2.0**-12), QFormat(16, 2.0**-12)),
}


def make_op(kind: str, n: int, fmts: str, seed: int = 0, eps: float = 1e-5, **kw) -> ops.IntLayerNorm:
    cls, options = OPS[kind]
    rng = np.random.default_rng(seed)
    gamma, beta = rng.normal(1.0, 0.5, n), rng.normal(0.0, 0.5, n)
    gamma[1:2], gamma[2:3] = -0.7, 0.0
    in_fmt, out_fmt = FORMATS[fmts]
    return cls.from_float(gamma, beta, eps, in_fmt, out_fmt, **options, **kw)


def extreme_rows(fmt: QFormat, n: int, seed: int) -> np.ndarray:
    """Random rows, [lo, hi, ..., hi] and [hi, lo, ..., lo] (the bound of |z|), constant
    rows, rows of tiny variance (one step off a constant: the multiplier's left shift)
    and rows pinned at the format's ends."""
    rng = np.random.default_rng(seed)
    lo, hi = fmt.lo, fmt.hi
    random = rng.integers(lo, hi + 1, (40, n))
    spread = (rng.normal(0, 1, (40, n)) * rng.uniform(0.5, hi / 2, (40, 1))).round().clip(lo, hi)
    special = [np.full(n, hi), np.full(n, lo), np.zeros(n), np.full(n, 3).clip(lo, hi)]
    for a, b in ((lo, hi), (hi, lo), (0, 1), (hi, hi - 1), (lo, lo + 1), (-1, 0)):
        row = np.full(n, b)
        row[0] = a
        special.append(row)
        row = np.full(n, b)
        row[-1] = a
        special.append(row)
    return np.concatenate([random, spread, np.stack(special)]).astype(np.int64)


def chain_on(op: ops.IntLayerNorm, path: str) -> ElementChain:
    """The op's chain on ``path``: "compiled" (the numba loop, which every fused chain
    takes with the ``fast`` extra installed, as ``make test`` has it) or "numpy" (the
    golden op's per-row functions and the numpy element chain)."""
    chain = ElementChain(op)
    if path == "numpy":
        chain._compiled = None
    else:
        assert (chain._compiled is not None) == chain.fused
    return chain


@pytest.mark.parametrize("path", ["compiled", "numpy"])
@pytest.mark.parametrize("n", [1, 7, 64, 768])
@pytest.mark.parametrize("fmts", FORMATS)
@pytest.mark.parametrize("kind", OPS)
def test_chain_equals_the_golden_body(kind, fmts, n, path):
    op = make_op(kind, n, fmts, seed=n)
    x = extreme_rows(op.in_fmt, n, seed=n)
    got = chain_on(op, path)(torch.from_numpy(x))
    assert np.array_equal(got.numpy(), op.forward(x))


@st.composite
def drawn_op_and_rows(draw: st.DrawFn) -> tuple[ops.IntLayerNorm, np.ndarray]:
    """A norm of any kind, row length, input and output width, ε and γ, β scale, and rows
    of random values, pinned ends, near-constants and narrow spreads."""
    kind = draw(st.sampled_from(sorted(OPS)))
    n = draw(st.sampled_from([1, 2, 3, 5, 16, 33, 100, 257]))
    in_bits, out_bits = draw(st.sampled_from([4, 6, 8, 12, 16])), draw(st.sampled_from([4, 8, 16]))
    in_fmt = QFormat(in_bits, draw(st.sampled_from([2.0**-6, 0.01, 0.3, 1.0, 3.7])))
    out_fmt = QFormat(out_bits, draw(st.sampled_from([2.0**-3, 0.3, 4 / 2 ** (out_bits - 1)])))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0, -1.0]))
    gamma, beta = rng.normal(1.0, 0.5, n) * scale, rng.normal(0.0, 1.0, n) * draw(st.sampled_from([0.0, 1.0, 100.0]))
    gamma[rng.random(n) < 0.1] = 0.0
    cls, options = OPS[kind]
    eps = draw(st.sampled_from([0.0, 1e-9, 1e-5, 1.0]))
    try:
        op = cls.from_float(gamma, beta, eps, in_fmt, out_fmt, **options)
    except OverflowRiskError:
        assume(False)
    lo, hi = in_fmt.lo, in_fmt.hi
    x = rng.integers(lo, hi + 1, (12, n))
    x[0], x[1], x[2] = lo, hi, rng.integers(lo, hi + 1)
    x[3, ::2], x[3, 1::2] = lo, hi
    x[4, 1:], x[5, :-1] = hi, lo
    x[6:] = np.clip(np.round(rng.normal(0, rng.uniform(0.5, 4), (6, n))) + x[6:, :1] // 2, lo, hi)
    return op, x


@given(drawn_op_and_rows())
@settings(max_examples=60, deadline=None)
def test_compiled_chain_equals_the_golden_body_on_drawn_configs(case):
    op, x = case
    chain = chain_on(op, "compiled")
    assert np.array_equal(chain(torch.from_numpy(x)).numpy(), op.forward(x))


def test_the_compiled_loop_needs_numba_and_an_op_that_describes_its_own_stages(monkeypatch):
    """Without numba the chain runs on numpy; a subclass that overrides the statistic
    without describing it keeps the numpy stages (its form would be its parent's)."""
    assert jitchain.available()  # the fast extra: make test installs it
    op = make_op("int_ln", 64, "int8")
    x = extreme_rows(op.in_fmt, 64, seed=3)

    class Centered(ops.IntLayerNorm):
        def _statistic(self, x, trace):
            return super()._statistic(x, trace)

    other = Centered(op.config, op.params)
    assert jitchain.describes_itself(op) and not jitchain.describes_itself(other)
    assert ElementChain(other)._compiled is None
    assert np.array_equal(ElementChain(other)(torch.from_numpy(x)).numpy(), op.forward(x))
    monkeypatch.setattr(jitchain, "available", lambda: False)
    assert ElementChain(op)._compiled is None
    assert np.array_equal(ElementChain(op)(torch.from_numpy(x)).numpy(), op.forward(x))


def test_a_numba_that_does_not_import_counts_as_missing(monkeypatch):
    """Installed but unimportable (built for another numpy, say): the numpy paths run."""
    op = make_op("rms", 32, "int8")
    monkeypatch.setitem(sys.modules, "numba", None)  # what a failing import looks like
    jitchain._numba.cache_clear()
    try:
        assert not jitchain.available() and ElementChain(op)._compiled is None
        layer = qnn.IntRMSNorm(32, in_fmt=op.in_fmt)
        x = torch.randn(6, 32)
        q = layer.quantize_input(x)
        assert torch.equal(q.ints, torch.from_numpy(op.in_fmt.quantize(x.numpy())))
    finally:
        monkeypatch.undo()
        jitchain._numba.cache_clear()
    assert jitchain.available()


@pytest.mark.parametrize("rounding", [r for r in Round if r is not Round.HALF_UP])
@pytest.mark.parametrize("kind", ["int_ln", "l1", "shift2", "prms"])
def test_other_tie_rules_run_the_golden_body(kind, rounding):
    op = make_op(kind, 64, "int8", rounding=rounding)
    chain = ElementChain(op)
    assert not chain.fused and jitchain.row_kernel(op) is None
    x = extreme_rows(op.in_fmt, 64, seed=1)
    assert np.array_equal(chain(torch.from_numpy(x)).numpy(), op.forward(x))


def test_lanes_are_int32_only_where_proven():
    """int8 rows of 32: every stage below 2^31.  Rows of 768: x·a0 alone needs more
    (a0 = N·r reaches ~2^25 in rows with j_r = 0), so the chain stays int64; int16
    formats take the 64-bit datapath."""
    assert ElementChain(make_op("int_ln", 32, "int8")).dtype == torch.int32
    assert ElementChain(make_op("int_ln", 768, "int8")).dtype == torch.int64
    assert ElementChain(make_op("rms", 32, "int16")).dtype == torch.int64


def test_tiny_variance_rows_take_the_left_shift():
    """With ε = 0 and a fine z (F_z = 24), a row one LSB off a constant has K0 < 0: the
    chain multiplies by a0 and shifts z left by up (row_affine_parts), and still
    equals the golden body."""
    op = make_op("int_ln", 64, "int8", eps=0.0, frac_bits=24)
    row = np.zeros((1, 64), dtype=np.int64)
    row[0, 0] = 1
    _, _, up, k = row_affine_parts(*op.row_inverse(row), op.config, op._mult_shift, op._offset_split)
    assert int(up.max()) > 0 and int(k.max()) == 0
    assert np.array_equal(ElementChain(op)(torch.from_numpy(row)).numpy(), op.forward(row))


LAYERS = {
    "int_ln": (qnn.IntLayerNorm, {}),
    "l1": (qnn.L1LayerNorm, {}),
    "shift2": (qnn.ShiftLayerNorm, {}),
    "prms": (qnn.IntRMSNorm, {"partial": 0.25}),
}


@pytest.mark.parametrize("calibrated", [False, True])
@pytest.mark.parametrize("kind", LAYERS)
def test_in_graph_surrogate_gradients_equal_the_backward_pass_surrogate(kind, calibrated):
    """The layer's gradients (surrogate in the forward's graph) are bit for bit those of
    :func:`exact_forward` (the surrogate re-run inside the backward), input clipping
    included; the L1 and RMS norms' compiled gradients (:mod:`qnorm.nn.jitsurrogate`, sums
    in float64) to float32 rounding."""
    cls, options = LAYERS[kind]
    layer = cls(32, in_fmt=None if calibrated else QFormat(8, 0.02), **options)
    with torch.no_grad():
        layer.weight.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(1))
        if layer.bias is not None:
            layer.bias.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(2))
    x = (torch.randn(6, 32, generator=torch.Generator().manual_seed(3)) * 1.5).requires_grad_()
    target = torch.randn(6, 32, generator=torch.Generator().manual_seed(4))
    params = [p for p in (layer.weight, layer.bias) if p is not None]
    y = layer(x)
    got = torch.autograd.grad((y - target).square().sum(), [x, *params])
    layer.eval()  # the calibration the forward above made, frozen
    q = layer.quantize_input(x)
    op = layer.golden(q.fmt)
    want_y = exact_forward(torch.from_numpy(op.forward(q.ints.numpy())), op.out_fmt.scale, layer._surrogate(op), q, params)
    want = torch.autograd.grad((want_y - target).square().sum(), [x, *params])
    assert torch.equal(y, want_y)
    if not calibrated:  # a calibrated range covers the batch; the fixed one clips some inputs
        assert not bool(q.pass_mask.all())
    compiled = kind in ("l1", "prms") and jitchain.available()
    for g, w in zip(got, want, strict=True):
        if compiled:
            assert float((g - w).abs().max()) <= 1e-5 * float(w.abs().max())
        else:
            assert torch.equal(g, w)


def test_no_graph_without_gradients():
    layer = qnn.IntLayerNorm(16, in_fmt=QFormat(8, 0.02))
    with torch.no_grad():
        y = layer(torch.randn(3, 16))
    assert y.grad_fn is None


@pytest.mark.parametrize("kind", LAYERS)
def test_a_changed_parameter_or_scale_gives_a_fresh_ops_integers(kind):
    """No derived constant goes stale: after γ, β or the calibrated scale change (in
    place, as an optimizer step does), the forward equals an op built from scratch."""
    cls, options = LAYERS[kind]
    layer = cls(32, **options)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(5))
    layer(x)  # calibrates, derives and caches

    def fresh() -> torch.Tensor:
        fmt = layer.input_quant.fmt
        beta = None if layer.bias is None else layer.bias.detach().double().numpy()
        op = type(layer).op_cls.from_float(layer.weight.detach().double().numpy(), beta, layer.eps, fmt,
                                           layer.out_fmt, **options)  # fmt: skip
        return torch.from_numpy(op.forward(fmt.quantize(x.numpy()))).float() * op.out_fmt.scale

    layer.eval()
    before = layer(x)
    assert torch.equal(before, fresh())
    with torch.no_grad():
        layer.weight[3] += 0.5
    changed = layer(x)
    assert not torch.equal(changed, before) and torch.equal(changed, fresh())
    if layer.bias is not None:
        with torch.no_grad():
            layer.bias[5] -= 0.25
        assert torch.equal(layer(x), fresh())
    layer.input_quant.set_range(1.25 * float(layer.input_quant.format_max_abs))
    assert torch.equal(layer(x), fresh())


@pytest.mark.parametrize("kind", OPS)
def test_mult_shift_bisection_is_the_linear_search(kind):
    """mult_shift's bisection returns the first j in 0, 1, 2, … whose xa bound fits the
    lanes, over row lengths, formats and ε (which move the exponents and the bound)."""
    cls = OPS[kind][0]
    for n in (1, 7, 64, 768, 4096):
        for fmts in ("int8", "int4", "int16"):
            for eps in (0.0, 1e-5, 0.3):
                try:
                    op = make_op(kind, n, fmts, eps=eps)
                except OverflowRiskError:
                    continue
                cfg = op.config
                row = cls.row_analysis(cfg)
                stat = add_eps_ranges(RangeReport(cls.name), cls._statistic_ranges(cfg, RangeReport(cls.name)), cfg)
                segs = exponent_segments(stat.w, cfg)
                mants = [mantissa_range(e, seg, cfg) for e, seg in segs.items()]
                m_iv = Interval(min(m.lo for m in mants), max(m.hi for m in mants))
                products = cls._products(cfg, stat, segs, cls._inverse_range(cfg, m_iv))
                limit = 1 << (cfg.lanes - 2)
                linear = next(j for j in range(63) if xa_bound(cfg, products, j) < limit)
                assert mult_shift(cfg, products) == linear == row.mult_shift, (n, fmts, eps)


@pytest.mark.parametrize("path", ["compiled", "numpy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [2.0**-5, 0.0371, 1.3e-4, 3.0])
@pytest.mark.parametrize("fmts", ["int8", "int16"])
@pytest.mark.parametrize("kind", ["int_ln", "shift2", "rms"])
def test_the_chains_values_are_the_integers_times_the_scale_as_torch_forms_them(kind, fmts, scale, dtype, path):
    """``values``: the compiled loop writes ``y · scale`` in the float dtype itself; bit for
    bit torch's ``ints.to(dtype) * scale`` (int16's largest integers included)."""
    op = make_op(kind, 64, fmts)
    chain = chain_on(op, path)
    x = torch.from_numpy(extreme_rows(op.in_fmt, 64, seed=2))
    got = chain.values(x, scale, dtype)
    want = chain(x).to(dtype) * scale
    assert got.dtype == dtype and torch.equal(got.view(torch.int32 if dtype == torch.float32 else torch.int64),
                                              want.view(torch.int32 if dtype == torch.float32 else torch.int64))
