"""The compiled per-channel derivation (qnorm.nn.jitderive) against ChannelRule.op's numpy part.

``channel_ints`` is a second writing of the per-channel part of ``from_float``: γ's
multipliers and shift, β in accumulator units, the output window and stage 4's hulls.
Where it forms them, the op must be the numpy part's in every integer (config, window
arrays and their dtype, range report); where it declines (None), the numpy part runs
and refuses or forms what it always did.  Drawn here over every norm kind, formats
with power-of-two and other output scales, γ from tiny to huge (zeros and negatives
among them), β on and next to the rounding grid's ties and far outside the output.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qnorm import nn as qnn
from qnorm import ops
from qnorm.analysis import OverflowRiskError
from qnorm.nn import jitderive
from qnorm.nn.elementchain import ElementChain
from qnorm.ops._normcore import ChannelRule, FloatParams, NormOp
from qnorm.qformat import QFormat
from test_nn_norm_derivation import LAYERS, cold_op
from test_nn_norm_fastpath import OPS as KINDS

OUT_FORMATS = [QFormat.power_of_two(8, -5), QFormat(8, 0.0371), QFormat(4, 0.25), QFormat(16, 2.0**-12),
               QFormat(16, 1.3e-4), QFormat(8, 1.0, signed=False)]  # fmt: skip


def outcome(fn):  # noqa: ANN001, ANN201
    """What ``fn()`` returns, or the type and message of what it raises."""
    try:
        return fn()
    except (ValueError, OverflowRiskError) as err:
        return type(err), str(err)


def assert_same_op(got: NormOp, want: NormOp) -> None:
    assert got.config == want.config
    for name in ("lo", "hi", "off", "bias"):
        a, b = getattr(got._window, name), getattr(want._window, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert got.ranges().items == want.ranges().items


def both(rule: ChannelRule, params: FloatParams) -> tuple[object, object]:
    return outcome(lambda: rule.op(params, jitderive.channel_ints)), outcome(lambda: rule.op(params))


def assert_same(rule: ChannelRule, params: FloatParams) -> None:
    got, want = both(rule, params)
    if isinstance(want, NormOp):
        assert isinstance(got, NormOp), got
        assert_same_op(got, want)
    else:
        assert got == want


def beta_ties(rng: np.random.Generator, n: int, shift: int, scale: float) -> np.ndarray:
    """β whose β 2^s / s_out lies on a half-integer, or one float step beside one."""
    k = rng.integers(-300, 300, n) + 0.5
    beta = k * scale / 2.0**shift
    return np.nextafter(beta, rng.choice([-np.inf, np.inf], n)) if rng.random() < 0.5 else beta


@given(
    kind=st.sampled_from(sorted(KINDS)),
    n=st.sampled_from([1, 3, 32, 97]),
    in_bits=st.sampled_from([4, 8, 16]),
    out=st.sampled_from(OUT_FORMATS),
    eps=st.sampled_from([0.0, 1e-5, 0.3]),
    gamma_scale=st.sampled_from([0.0, 1e-9, 1e-3, 1.0, 30.0, 1e6]),
    beta_kind=st.sampled_from(["none", "small", "ties", "huge", "mixed"]),
    zeros=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=300, deadline=None)
def test_the_compiled_derivation_is_the_numpy_one(kind, n, in_bits, out, eps, gamma_scale, beta_kind, zeros, seed):
    op_cls, options = KINDS[kind]
    rng = np.random.default_rng(seed)
    in_fmt = QFormat(in_bits, float(rng.uniform(0.01, 2.0)))
    rule = outcome(lambda: op_cls.channel_rule(n, eps, in_fmt, out, **options))
    if not isinstance(rule, ChannelRule):
        return  # refused before any γ: nothing per channel to compare
    gamma = gamma_scale * rng.standard_normal(n) * rng.choice([1.0, -1.0], n)
    if zeros:
        gamma[rng.random(n) < 0.3] = 0.0
    shift = 20 if out.bits <= 8 else 30
    beta = {
        "none": None,
        "small": rng.standard_normal(n),
        "ties": beta_ties(rng, n, shift, out.scale),
        "huge": rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(3, 30, n),
        "mixed": np.concatenate([beta_ties(rng, n, shift, out.scale)[: n // 2], rng.standard_normal(n - n // 2)]),
    }[beta_kind]
    if op_cls is ops.IntRMSNorm:
        beta = None
    assert_same(rule, FloatParams.checked(gamma, beta, eps))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_typical_layers_take_the_compiled_road(kind):
    """γ ~ N(1, 0.1), small β at the default formats: the writer forms the integers itself."""
    op_cls, options = KINDS[kind]
    rng = np.random.default_rng(3)
    rule = op_cls.channel_rule(64, 1e-5, QFormat(8, 0.05), **options)
    beta = None if op_cls is ops.IntRMSNorm else 0.1 * rng.standard_normal(64)
    params = FloatParams.checked(1 + 0.1 * rng.standard_normal(64), beta, 1e-5)
    real = params.gamma * rule.gain_factor / rule.out_scale
    op = rule.op(params)
    frac_bits = op.config.frac_bits
    ints = jitderive.channel_ints(rule.structure(frac_bits), np.ldexp(real, -frac_bits), params.beta)
    assert ints is not None and ints.window is not None and ints.hulls is not None
    assert ints.gain == op.config.gain and ints.bias == op.config.bias and ints.shift == op.config.shift
    assert_same_op(rule.op(params, jitderive.channel_ints), op)


def test_near_ties_against_another_output_scale_are_left_to_exact_rationals():
    """β 2^s / s_out one float step from a half-integer, s_out not a power of two: the
    division's rounding could move it across, so the writer declines and the exact
    rational rule of the numpy part decides."""
    out = QFormat(8, 0.0371)
    rule = ops.IntLayerNorm.channel_rule(8, 1e-5, QFormat(8, 0.05), out)
    op = rule.op(FloatParams.checked(np.ones(8), np.zeros(8), 1e-5))
    shift = op.config.shift
    beta = np.nextafter((np.arange(8) + 0.5) * out.scale / 2.0**shift, np.inf)
    params = FloatParams.checked(np.ones(8), beta, 1e-5)
    st_ = rule.structure(op.config.frac_bits)
    scaled = np.ldexp(params.gamma * rule.gain_factor / rule.out_scale, -op.config.frac_bits)
    assert jitderive.channel_ints(st_, scaled, beta) is None
    assert_same(rule, params)


def test_refusals_are_the_numpy_parts():
    """A γ no multiplier holds is refused by the numpy part with its own message."""
    rule = ops.ShiftLayerNorm.channel_rule(4, 1e-5, QFormat(8, 1.0), frac_bits=0, mult_bits=4)
    got, want = both(rule, FloatParams.checked(np.full(4, 1e6), None, 1e-5))
    assert got == want and want[0] is ValueError


def test_an_op_whose_gain_rule_is_not_its_forms_is_left_to_numpy():
    class Rounder(ops.IntLayerNorm):
        @classmethod
        def _quantize_gain(cls, gains, mult_bits, max_shift):  # noqa: ANN001, ANN206
            m, s = super()._quantize_gain(gains, mult_bits, max_shift)
            return tuple(v & ~1 for v in m), s

    assert jitderive.describes_its_gains(ops.ShiftLayerNorm) and not jitderive.describes_its_gains(Rounder)
    rule = Rounder.channel_rule(16, 1e-5, QFormat(8, 0.05))
    params = FloatParams.checked(np.linspace(0.5, 1.5, 16), None, 1e-5)
    op = rule.op(params, jitderive.channel_ints)
    assert all(v % 2 == 0 for v in op.config.gain)
    assert_same_op(op, rule.op(params))


def test_without_numba_the_writer_declines(monkeypatch):
    rule = ops.IntLayerNorm.channel_rule(16, 1e-5, QFormat(8, 0.05))
    params = FloatParams.checked(np.linspace(0.5, 1.5, 16), None, 1e-5)
    op = rule.op(params)
    monkeypatch.setattr(jitderive, "_numba", lambda: None)  # as jitchain.available() reads it
    scaled = np.ldexp(params.gamma * rule.gain_factor / rule.out_scale, -op.config.frac_bits)
    assert jitderive.channel_ints(rule.structure(op.config.frac_bits), scaled, params.beta) is None
    assert_same_op(rule.op(params, jitderive.channel_ints), op)


def test_a_rule_refuses_parameters_of_another_size_or_eps():
    rule = ops.IntLayerNorm.channel_rule(16, 1e-5)
    with pytest.raises(ValueError, match="derives 16 channels at eps = 1e-05"):
        rule.op(FloatParams.checked(np.ones(8), None, 1e-5))
    with pytest.raises(ValueError, match="derives 16 channels at eps = 1e-05"):
        rule.op(FloatParams.checked(np.ones(16), None, 1e-4))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_chain_like_an_earlier_one_shares_only_a_common_structure(kind):
    """Successive ops of one structure: the second chain reuses the first's structural
    part and gives the second op's integers; an op of another structure forms its own."""
    op_cls, options = KINDS[kind]
    rng = np.random.default_rng(5)
    rule = op_cls.channel_rule(32, 1e-5, QFormat(8, 0.05), **options)
    beta = None if op_cls is ops.IntRMSNorm else 0.1 * rng.standard_normal(32)
    gamma = 1 + 0.1 * rng.standard_normal(32)
    moved = np.where(np.arange(32) % 2 == 0, 0.5, 1.0) * gamma
    moved[np.argmax(gamma)] = gamma.max()  # the same largest gain: the same F_z, so the same structure
    first = rule.op(FloatParams.checked(gamma, beta, 1e-5), jitderive.channel_ints)
    second = rule.op(FloatParams.checked(moved, beta, 1e-5), jitderive.channel_ints)
    assert second.structure is first.structure and second.config.gain != first.config.gain
    chain = ElementChain(first)
    x = rng.integers(-128, 128, (40, 32))
    like = ElementChain(second, like=chain)
    assert like._plan is chain._plan
    assert np.array_equal(like(torch.from_numpy(x)).numpy(), second.forward(x))
    other = op_cls.channel_rule(32, 1e-5, QFormat(8, 0.5), **options).op(second.params)
    assert other.structure is not first.structure
    assert ElementChain(other, like=chain)._plan is not chain._plan
    assert ElementChain(op_cls(other.config, other.params), like=chain)._plan is not chain._plan  # no structure


# --------------------------------------------------------------------------- a training layer's step chains

@given(
    kind=st.sampled_from(sorted(LAYERS)),
    n=st.sampled_from([1, 5, 32, 100]),
    in_fmt=st.sampled_from([QFormat(8, 0.05), QFormat(4, 0.5), QFormat(16, 2.0**-10)]),
    out_fmt=st.sampled_from([QFormat.power_of_two(8, -5), QFormat(8, 0.0371), QFormat(16, 2.0**-12)]),
    moves=st.lists(st.sampled_from(["small", "scale", "flip", "zero", "big_beta"]), min_size=3, max_size=6),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
def test_each_step_chain_gives_the_integers_of_the_op_from_floats(kind, n, in_fmt, out_fmt, moves, seed):
    """A layer with a fixed input format keeps its rule, so after the first step its
    forwards take step chains; every step's integers are those of ``from_float`` on
    that step's floats, whether the step chain formed them or the layer fell back (γ
    asking for another F_z, β no step chain takes), and a step ``from_float`` refuses
    (γ grown past what the lanes hold) is refused by the layer with the same error."""
    cls, options = LAYERS[kind]
    layer = cls(n, 1e-5, in_fmt=in_fmt, out_fmt=out_fmt, **options).train()
    gen = torch.Generator().manual_seed(seed)
    took = []
    for move in ["small", *moves]:
        with torch.no_grad():  # an optimizer step: γ and β move in place
            if move == "small":
                layer.weight.add_(0.05 * torch.randn(n, generator=gen))
            elif move == "scale":
                layer.weight.mul_(4.0)  # γ G / s_out two octaves up: F_z moves
            elif move == "flip":
                layer.weight.neg_()
            elif move == "zero":
                layer.weight[: n // 2] = 0.0
            if layer.bias is not None:
                layer.bias.add_((1e6 if move == "big_beta" else 0.05) * torch.randn(n, generator=gen))
        x = torch.randn(6, n, generator=gen) * in_fmt.scale * 40
        y = outcome(lambda x=x: layer(x))
        want = outcome(lambda: cold_op(layer, options))
        if not isinstance(want, NormOp):  # γ grown past what the op takes: refused alike
            assert isinstance(y, tuple) and y == want
            continue
        took.append(isinstance(layer._derivation.chain, jitderive.StepChain))
        ints = want.forward(in_fmt.quantize(x.numpy()))
        assert torch.equal(y.detach(), torch.from_numpy(ints).to(y.dtype) * want.out_fmt.scale)
        got = layer.golden()  # formed now where the step chain did without it: the same op
        assert got.config == want.config
    assert not took or not took[0]  # the first step forms the op (and the deriver)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_a_training_layer_takes_step_chains_while_its_format_holds(kind, dtype):
    cls, options = LAYERS[kind]
    layer = cls(32, 1e-5, in_fmt=QFormat(8, 0.05), out_fmt=QFormat(8, 0.0371), **options).to(dtype).train()
    took = []
    for step in range(4):
        with torch.no_grad():
            layer.weight.add_(0.01 * (step + 1))
        x = torch.randn(8, 32, dtype=dtype, generator=torch.Generator().manual_seed(step))
        y = layer(x)
        took.append(isinstance(layer._derivation.chain, jitderive.StepChain))
        want = cold_op(layer, options)
        ints = torch.from_numpy(want.forward(want.in_fmt.quantize(x.numpy())))
        assert y.dtype == dtype and torch.equal(y.detach(), ints.to(dtype) * want.out_fmt.scale)
    assert took == [False, True, True, True]
    assert layer._derivation.op is None and layer.golden() is layer._derivation.op


def test_a_step_the_deriver_declines_is_refused_by_the_op_with_its_message():
    """After a step chain, a γ the op refuses (its z no longer fits the lanes at the F_z it
    asks for): the deriver declines, and the layer's forward raises what ``from_float``
    raises for the same floats."""
    layer = qnn.IntLayerNorm(4, in_fmt=QFormat(8, 1.0), out_fmt=QFormat(8, 2.0**-8)).train()
    for _ in range(2):
        with torch.no_grad():
            layer.weight.mul_(0.9)
        layer(torch.randn(3, 4))
    assert isinstance(layer._derivation.chain, jitderive.StepChain)
    with torch.no_grad():
        layer.weight.fill_(1e9)
    want = outcome(lambda: cold_op(layer, {}))
    assert want[0] is OverflowRiskError and "do not fit a 32-bit datapath" in want[1]
    assert outcome(lambda: layer(torch.randn(3, 4))) == want


def test_a_step_chains_floats_on_another_device_take_the_ops_chain():
    """A step chain runs CPU input only: asked for another device with the same floats (a
    layer moved after a CPU step), the layer forms the op and its element chain."""
    layer = qnn.IntLayerNorm(16, in_fmt=QFormat(8, 0.05)).train()
    for _ in range(2):
        with torch.no_grad():
            layer.weight.mul_(0.9)
        layer(torch.randn(4, 16))
    assert isinstance(layer._derivation.chain, jitderive.StepChain)
    chain, config = layer._integers(QFormat(8, 0.05), torch.device("cuda"))  # only the device's type is read
    assert isinstance(chain, ElementChain) and chain.op is layer.golden() and config == chain.op.config
