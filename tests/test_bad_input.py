"""The issue's bad-input list, checked for every op family in one place.

Each case either has a defined exact result or raises a ValueError that names the
problem; none may return a silently wrong answer.
"""

import numpy as np
import pytest

from qnorm.fixedpoint import Dyadic
from qnorm.ops import IntLayerNorm, IntRMSNorm, L1LayerNorm, ShiftLayerNorm
from qnorm.ops.multithreshold import BNActConfig, BNQuant, MultiThreshold
from qnorm.ops.spiking import FoldedLIFNeuron, LIFConfig, MPBNNeuron
from qnorm.qformat import QFormat

N = 16
IN8 = QFormat(8, 0.05)
NORMS = [IntLayerNorm, L1LayerNorm, ShiftLayerNorm, IntRMSNorm]


def make_norm(cls):
    return cls.from_float(np.ones(N), np.zeros(N), 1e-5, IN8)


def make_bn_op(cls):
    return cls.from_float(1.5, 0.1, 0.0, 1.0, 1e-5, cfg=BNActConfig(IN8, QFormat(4, 0.25, signed=False)))


def make_lif(cls):
    cfg = LIFConfig(IN8, membrane_bits=16, leak=Dyadic.from_float(0.9, 12), saturate=True)
    return cls.from_float(np.ones(N), 0.0, 0.0, 1.0, 1e-5, 1.0, cfg=cfg)


ALL_OPS = (
    [pytest.param(lambda c=c: make_norm(c), (4, N), id=c.__name__) for c in NORMS]
    + [pytest.param(lambda c=c: make_bn_op(c), (4, N), id=c.__name__) for c in (BNQuant, MultiThreshold)]
    + [pytest.param(lambda c=c: make_lif(c), (3, 2, N), id=c.__name__) for c in (MPBNNeuron, FoldedLIFNeuron)]
)


@pytest.mark.parametrize("make,shape", ALL_OPS)
def test_float_input_is_refused(make, shape):
    with pytest.raises(ValueError, match="integer"):
        make().forward(np.zeros(shape, dtype=np.float32))


@pytest.mark.parametrize("make,shape", ALL_OPS)
def test_values_outside_the_declared_width_are_refused(make, shape):
    x = np.zeros(shape, dtype=np.int64)
    x.flat[0] = 128
    with pytest.raises(ValueError, match=r"outside the declared 8-bit signed range"):
        make().forward(x)


@pytest.mark.parametrize("make,shape", ALL_OPS)
def test_all_extreme_inputs_give_a_defined_in_range_result(make, shape):
    op = make()
    for v in (-128, 127):
        y = op.forward(np.full(shape, v, dtype=np.int8))
        assert y.shape == shape
        assert y.min() >= op.out_fmt.lo and y.max() <= op.out_fmt.hi
        assert np.array_equal(y, op.forward(np.full(shape, v, dtype=np.int64)))  # dtype-independent


@pytest.mark.parametrize("cls", NORMS)
def test_norms_on_empty_batches_rows_of_one_and_constant_rows(cls):
    op = make_norm(cls)
    assert op.forward(np.zeros((0, N), dtype=np.int8)).shape == (0, N)
    with pytest.raises(ValueError, match=f"rows of {N} elements"):
        op.forward(np.zeros((2, 0), dtype=np.int8))
    one = cls.from_float(np.ones(1), np.full(1, 0.5), 1e-5, IN8)
    beta_q = one.out_fmt.quantize(np.array([0.5]))
    # N = 1: LN-type norms centre the row to 0 and give beta; RMSNorm gives sign(x) + beta
    want = [[-0.5], [0.5], [1.5]] if cls is IntRMSNorm else [[0.5]] * 3
    assert np.array_equal(one.forward(np.array([[-128], [0], [127]])), one.out_fmt.quantize(np.array(want)))
    if cls is not IntRMSNorm:  # a constant row has sigma = 0: LN-type norms give beta exactly
        const = cls.from_float(np.ones(N), np.full(N, 0.5), 1e-5, IN8).forward(np.full((2, N), 37))
        assert np.array_equal(const, np.broadcast_to(beta_q, (2, N)))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("cls", NORMS)
def test_norm_parameters_nan_inf_are_refused_by_name(cls, bad):
    gamma = np.ones(N)
    gamma[3] = bad
    with pytest.raises(ValueError, match="gamma"):
        cls.from_float(gamma, np.zeros(N), 1e-5, IN8)
    with pytest.raises(ValueError, match="eps"):
        cls.from_float(np.ones(N), np.zeros(N), bad, IN8)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_bn_and_lif_parameters_nan_inf_are_refused_by_name(bad):
    cfg = BNActConfig(IN8, QFormat(4, 0.25, signed=False))
    with pytest.raises(ValueError, match="var"):
        MultiThreshold.from_float(1.0, 0.0, 0.0, bad, 1e-5, cfg=cfg)
    lif = LIFConfig(IN8, saturate=True)
    with pytest.raises(ValueError, match="v_th"):
        FoldedLIFNeuron.from_float(1.0, 0.0, 0.0, 1.0, 1e-5, bad, cfg=lif)


def test_quantizing_nan_or_inf_floats_is_refused():
    with pytest.raises(ValueError, match="non-finite"):
        IN8.quantize(np.array([0.1, np.nan, 0.3]))
    with pytest.raises(ValueError, match="non-finite"):
        IN8.quantize(np.array([np.inf]))


@pytest.mark.parametrize("cls", NORMS)
def test_unknown_norm_options_are_refused_by_name(cls):
    with pytest.raises(ValueError, match=r"has no option\(s\) \['inv_bitz'\]"):
        cls.from_float(np.ones(N), np.zeros(N), 1e-5, IN8, inv_bitz=3)
