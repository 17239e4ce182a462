"""One registry of norm and neuron kinds (qnorm.nn.kinds): what it holds, its rules, and
that the model zoo, ``qnorm train``'s families, convert, ``qnorm verify``, the demo and
the benchmarks all enumerate it rather than lists of their own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.bench_qat import KINDS as BENCH_QAT_KINDS
from qnorm import ops
from qnorm import passes as qpasses
from qnorm.demo import norm_builders
from qnorm.nn import MPBNLIF, IntLayerNorm, IntNorm, ShiftLayerNorm, kinds
from qnorm.nn.kinds import NEURON, NORM, Kind
from qnorm.ops.spiking import MPBNNeuron
from qnorm.train.families import FAMILIES
from qnorm.train.models import neuron_kinds, norm_factory, norm_kinds
from qnorm.verify import qat_layers
from qnorm.verify.cases import CASES


class HalfEvenLayerNorm(IntLayerNorm):
    """A stand-in for a kind another package adds: IntLayerNorm under its own class."""


def test_builtin_kinds_build_the_layer_of_their_golden_op() -> None:
    integer = kinds.integer_kinds(NORM)
    assert [k.name for k in integer] == ["int_ln", "l1", "shift1", "shift", "int_rms"]
    for kind in integer:
        layer = kind.build(16)
        assert isinstance(layer, IntNorm) and layer.op_cls is kind.golden and kind.deployable
        assert kind.build(16, pow2=True).input_quant.pow2
    assert kinds.get("shift1", NORM).build(8).mantissa_terms == 1 and kinds.get("shift", NORM).build(8).mantissa_terms == 2
    assert [k.name for k in kinds.integer_kinds(NORM, variants=False)] == ["int_ln", "l1", "shift", "int_rms"]
    neuron = kinds.get("int_mpbn_lif", NEURON)
    assert type(neuron.build(4)) is MPBNLIF and neuron.golden is MPBNNeuron
    assert type(kinds.get("float", NORM).build(8)) is nn.LayerNorm and not kinds.get("float", NORM).integer


def test_every_golden_norm_and_neuron_op_has_its_kind() -> None:
    """The qat column of verify finds the layer of every norm op (and the neuron) here."""
    for op_cls in (*ops.NORMS, MPBNNeuron):
        kind = kinds.for_golden(op_cls)
        assert kind is not None and not kind.variant and kind.golden is op_cls
    assert kinds.get("shift", NORM) is kinds.for_golden(ops.ShiftLayerNorm)  # the main kind, not shift1


def test_a_name_is_one_kind_of_one_role() -> None:
    with pytest.raises(ValueError, match=r"unknown norm kind 'int_mpbn_lif' \(it is a neuron kind\); registered: .*int_ln"):
        kinds.get("int_mpbn_lif", NORM)
    with pytest.raises(ValueError, match="unknown neuron kind 'nope'"):
        kinds.build("nope", NEURON, 4)
    kinds.register(kinds.get("int_ln", NORM))  # the very same kind again: harmless
    with pytest.raises(ValueError, match="norm kind 'int_ln' is already registered to IntLayerNorm"):
        kinds.register(Kind("int_ln", NORM, HalfEvenLayerNorm))
    with pytest.raises(ValueError, match="norm kind 'float' cannot calibrate a power-of-two input scale.*int_ln"):
        kinds.build("float", NORM, 8, pow2=True)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"role": "activation", "layer": nn.ReLU}, "role must be one of"),
        ({"role": NORM}, "neither a layer nor a convert constructor"),
        ({"role": NEURON, "layer": MPBNLIF, "centered": True}, "only norm kinds are conversion targets"),
        ({"role": NORM, "convert": nn.LayerNorm, "centered": True, "deployable": True}, "describe a layer"),
    ],
)
def test_an_inconsistent_kind_is_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Kind("bad", **fields)


def test_convert_only_kinds_build_no_model_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(kinds._KINDS, "convert_only", Kind("convert_only", NORM, convert=nn.Identity, centered=True))
    with pytest.raises(ValueError, match="'convert_only' is registered for conversion only"):
        norm_factory("convert_only", 8)
    assert "convert_only" in qpasses.norm_kinds() and "convert_only" not in norm_kinds()


def test_a_registered_kind_reaches_every_enumeration(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new main integer kind trains in the families (deployable ones too), converts, and
    appears in the demo's error table; a variant is everywhere but the families' defaults."""
    main = Kind("test_ln", NORM, HalfEvenLayerNorm, deployable=True, golden=ops.IntLayerNorm, centered=True,
                title="IntLayerNorm, own class")  # fmt: skip
    variant = Kind("test_ln_even", NORM, IntLayerNorm, (("rounding", "half_even"),), deployable=True,
                   golden=ops.IntLayerNorm, centered=True, title="IntLayerNorm, half even")  # fmt: skip
    for kind in (main, variant):
        monkeypatch.setitem(kinds._KINDS, kind.name, kind)
    for name in ("test_ln", "test_ln_even"):
        assert name in norm_kinds(deployable=True) and name in qpasses.norm_kinds()
        assert name in FAMILIES["mixer"].kinds() and name in FAMILIES["transformer"].kinds()
    assert FAMILIES["mixer"].defaults == ("int_ln", "l1", "shift", "int_rms", "test_ln")
    assert FAMILIES["transformer"].defaults == ("float", "int_ln", "l1", "shift", "int_rms", "test_ln")
    assert list(norm_builders())[-3:] == ["IntLayerNorm, own class", "IntLayerNorm, half even", "partial RMSNorm p=0.25"]
    assert norm_factory("test_ln_even", 8).rounding.value == "half_even"
    assert kinds.for_golden(ops.IntLayerNorm).name == "int_ln"  # the first main kind stays the op's layer
    converted = qpasses.convert(nn.Sequential(nn.LayerNorm(8, eps=1e-3)), "test_ln")
    assert type(converted[0]) is HalfEvenLayerNorm and converted[0].eps == 1e-3


def test_enumerations_equal_the_registry() -> None:
    """What the demo, the benchmarks, the families and convert list is what is registered."""
    assert list(norm_builders()) == [k.title for k in kinds.integer_kinds(NORM)] + ["partial RMSNorm p=0.25"]
    assert BENCH_QAT_KINDS == ("float", *[k.name for k in kinds.integer_kinds(NORM, variants=False)])
    assert FAMILIES["snn"].defaults == ("float_mpbn_lif", "int_mpbn_lif") and "float_mpbn_lif" in neuron_kinds()
    assert set(qpasses.norm_kinds()) >= {k.name for k in kinds.kinds(NORM) if k.centered is not None}


def test_convert_builds_a_variant_like_its_source() -> None:
    source = nn.LayerNorm(8, eps=1e-4, dtype=torch.float64)
    with torch.no_grad():
        source.weight.copy_(torch.linspace(-1, 1, 8, dtype=torch.float64))
    layer = qpasses.convert(nn.Sequential(source), "shift1")[0]
    assert type(layer) is ShiftLayerNorm and layer.mantissa_terms == 1 and layer.eps == 1e-4
    assert layer.weight.dtype == torch.float64 and torch.equal(layer.weight, source.weight)


def test_verify_qat_column_takes_the_layer_of_the_kind() -> None:
    """Every norm and neuron case of the catalogue runs the layer of its op's kind."""
    for op_name in sorted({c.op for c in CASES}):
        case = next(c for c in CASES if c.op == op_name)
        op = case.build()
        kind = kinds.for_golden(type(op))
        if kind is None:
            continue
        desc, factory = qat_layers._layer_for(op)
        assert desc == f"qnorm.nn.{kind.layer.__name__}" and isinstance(factory(op), kind.layer)
