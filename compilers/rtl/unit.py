"""One generated RTL unit: what :func:`rtl_unit` returns for a golden op instance.

Every unit has the same streaming ports (plain signals; a transfer happens on a
rising edge where valid and ready are both high):

* ``in_valid``, ``in_ready``, ``in_data`` (``in_bits``, ``in_signed``);
* ``out_valid``, ``out_ready``, ``out_data`` (``out_bits``, ``out_signed``);
* neuron units also ``in_first``: high with the first element of a sample
  (time step 0, channel 0), which starts every membrane at u_rest.

The stream order is the op's layout flattened: rows of N for a norm or a softmax
(a causal softmax's rows in order: the unit counts them for the query index); elements
of a (rows, C) array for the BN units; any array flattened for the activations;
for the neurons, per sample the T time steps of C channels (``(T, B, C)`` inputs are streamed sample by sample).
"""

from __future__ import annotations

from dataclasses import dataclass

from amaranth.hdl import Elaboratable

from compilers.rtl.activation import ActivationUnit
from compilers.rtl.elementwise import ElementwiseUnit
from compilers.rtl.neuron import NeuronUnit
from compilers.rtl.norm import NormUnit
from compilers.rtl.softmax import SoftmaxUnit
from qnorm.ops._normcore import NormOp
from qnorm.ops.activation import IntActivation
from qnorm.ops.base import IntOp
from qnorm.ops.multithreshold import BNQuant, MultiThreshold
from qnorm.ops.softmax import IntSoftmax
from qnorm.ops.spiking import _LIFNeuron


@dataclass(frozen=True, eq=False)
class RtlUnit:
    """A generated unit and its timing.

    ``latency``: cycles from the first input accepted to the first output valid.
    ``cycles_per_row``: cycles per row (norms and softmax: N) or per element (elementwise and
    neuron units: 1) in steady state, with input valid and output ready held high.
    ``elements_per_cycle``: the steady-state throughput (1, except norm units of
    rows too short to hide the per-row pipeline behind their banks).
    """

    name: str
    op: IntOp
    elaboratable: Elaboratable
    in_bits: int
    in_signed: bool
    out_bits: int
    out_signed: bool
    latency: int
    cycles_per_row: int
    elements_per_cycle: float
    row_length: int  # elements per row (1 for elementwise and neuron units)
    has_first: bool = False

    def __post_init__(self) -> None:
        # A unit is also built for its timing and ports alone (deploy metadata, the
        # verify catalogue, a report's unselected units): Amaranth's warning that an
        # elaboratable was never elaborated is about forgotten hardware, not these.
        self.elaboratable._MustUse__silence = True  # type: ignore[attr-defined]

    @property
    def cycles_per_element(self) -> int:
        return max(1, -(-self.cycles_per_row // self.row_length))

    @property
    def ports(self) -> list:
        return self.elaboratable.ports  # type: ignore[attr-defined,no-any-return]


def rtl_unit(op: IntOp) -> RtlUnit:
    """The streaming unit of one golden op instance (raises NotImplementedError for
    an op family without one)."""
    if isinstance(op, (NormOp, IntSoftmax)):
        unit: NormUnit | ElementwiseUnit | NeuronUnit | ActivationUnit = (
            SoftmaxUnit(op) if isinstance(op, IntSoftmax) else NormUnit(op))
        n = op.config.n
        masks = [m for m in ("causal", "padding") if getattr(op.config, m, False)]  # a softmax's
        return RtlUnit("_".join([op.name, f"n{n}", *masks]), op, unit, *_ports(op), latency=unit.latency,
                       cycles_per_row=unit.cycles_per_row, elements_per_cycle=n / unit.cycles_per_row, row_length=n)
    if isinstance(op, (MultiThreshold, BNQuant)):
        unit = ElementwiseUnit(op)
        return RtlUnit(f"{op.name}_c{unit.channels}", op, unit, *_ports(op), latency=unit.latency,
                       cycles_per_row=1, elements_per_cycle=1.0, row_length=1)
    if isinstance(op, _LIFNeuron):
        unit = NeuronUnit(op)
        return RtlUnit(f"{op.name}_c{unit.channels}", op, unit, *_ports(op), latency=unit.latency,
                       cycles_per_row=1, elements_per_cycle=1.0, row_length=1, has_first=True)
    if isinstance(op, IntActivation):
        unit = ActivationUnit(op)
        return RtlUnit(f"{op.name}_i{op.in_fmt.bits}", op, unit, *_ports(op), latency=unit.latency,
                       cycles_per_row=1, elements_per_cycle=1.0, row_length=1)
    raise NotImplementedError(f"no RTL unit for {type(op).__name__}")


def _ports(op: IntOp) -> tuple[int, bool, int, bool]:
    return op.in_fmt.bits, op.in_fmt.signed, op.out_fmt.bits, op.out_fmt.signed


def has_rtl_unit(op: IntOp) -> bool:
    """Whether :func:`rtl_unit` has a unit for ``op``'s family (without building it)."""
    return isinstance(op, (NormOp, IntSoftmax, MultiThreshold, BNQuant, _LIFNeuron, IntActivation))
