"""A training QAT norm's per-step derivation is ``op_cls.from_float``'s, computed cold.

Every training step moves γ, β and the calibrated input scale (so ε_int), and the
layer derives its golden op again with warm caches (the row analyses and the
statistics' ε-free ranges of earlier steps, the config copies that skip
re-validation).  Here each step's op is compared with ``from_float`` on the same
floats after every analysis cache was cleared: the same config, the same derived
constants and report, and the forward is the cold op's integers times the output
scale, bit for bit.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qnorm import nn as qnn
from qnorm.nn.base import param_array
from qnorm.ops._normcore import NormOp, derived_config, row_cache_clear
from qnorm.ops.rmsnorm import IntRMSNorm

LAYERS = {
    "int_ln": (qnn.IntLayerNorm, {}),
    "l1": (qnn.L1LayerNorm, {}),
    "shift2": (qnn.ShiftLayerNorm, {"mantissa_terms": 2}),
    "shift1": (qnn.ShiftLayerNorm, {"mantissa_terms": 1}),
    "int_rms": (qnn.IntRMSNorm, {}),
    "partial_rms": (qnn.IntRMSNorm, {"partial": 0.5}),
}


def cold_op(layer: qnn.IntLayerNorm, options: dict) -> NormOp:
    """``from_float`` on the layer's current floats and input format, every cache empty."""
    row_cache_clear()
    beta = None if layer.bias is None else param_array(layer.bias)
    return type(layer).op_cls.from_float(
        param_array(layer.weight), beta, layer.eps, layer.input_quant.fmt, layer.out_fmt,
        rounding=layer.rounding, **options,
    )  # fmt: skip


def assert_same_op(got: NormOp, want: NormOp) -> None:
    assert got.config == want.config
    assert (got._mult_shift, got._stat_bits) == (want._mult_shift, want._stat_bits)
    for name in ("lo", "hi", "off", "bias"):
        assert np.array_equal(getattr(got._window, name), getattr(want._window, name))
    assert got.ranges().items == want.ranges().items


@given(
    kind=st.sampled_from(sorted(LAYERS)),
    n=st.sampled_from([1, 2, 7, 32, 100]),
    eps=st.sampled_from([0.0, 1e-6, 1e-5, 1e-3, 0.5]),
    in_bits=st.sampled_from([4, 8]),
    pow2=st.booleans(),
    rounding=st.sampled_from(["half_up", "half_even", "floor"]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=40, deadline=None)
def test_each_training_steps_op_is_from_floats_cold(kind, n, eps, in_bits, pow2, rounding, seed):
    cls, options = LAYERS[kind]
    layer = cls(n, eps, in_bits=in_bits, pow2=pow2, rounding=rounding, **options).train()
    gen = torch.Generator().manual_seed(seed)
    for _ in range(4):
        with torch.no_grad():  # an optimizer step: γ and β move in place
            layer.weight.add_(0.05 * torch.randn(n, generator=gen))
            if layer.bias is not None:
                layer.bias.add_(0.05 * torch.randn(n, generator=gen))
        x = torch.randn(6, n, generator=gen) * float(torch.empty(()).uniform_(0.2, 5.0, generator=gen))
        y = layer(x)  # calibrates (the scale moves) and derives with the caches of earlier steps
        want = cold_op(layer, options)
        assert_same_op(layer.golden(), want)  # the op this forward used (the layer's memo)
        ints = want.forward(layer.input_quant.fmt.quantize(x.numpy()))
        assert torch.equal(y.detach(), torch.from_numpy(ints).to(y.dtype) * want.out_fmt.scale)


def test_a_derived_config_keeps_no_cached_property_and_refuses_unknown_fields():
    """``derived_config`` copies fields only: a property cached on the original (RMSNorm's
    prefix k = ceil(p N)) is recomputed from the copy's own fields."""
    cfg = IntRMSNorm.from_float(np.ones(64), None, 1e-5, partial=0.5).config
    assert cfg.prefix == 32
    assert derived_config(cfg, partial=0.25).prefix == 16
    with pytest.raises(TypeError, match="no field"):
        derived_config(cfg, prefix=3)
