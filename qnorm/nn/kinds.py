"""The norm and neuron kinds: one registry of the layers models and conversions choose by name.

A :class:`Kind` names a layer for one *role*: a norm (``(..., dim) -> (..., dim)``
over the last axis) or a spiking neuron (multi-step, ``(T, B, C, *spatial)`` currents
to spikes of the same shape).  Everything that enumerates kinds reads this registry:

* the model zoo (:func:`qnorm.train.models.norm_factory` / ``neuron_factory`` and
  ``qnorm train``'s families) builds ``kind.build(size)``, or ``kind.build(size,
  pow2=True)`` for a deployable model (the layer then calibrates a power-of-two input
  scale, which only ``deployable`` kinds can);
* :func:`qnorm.passes.convert` swaps a float norm for a kind's layer: ``centered``
  kinds subtract the mean and take ``nn.LayerNorm``'s place, the others
  ``nn.RMSNorm``'s (a kind registered with its own ``convert`` constructor uses that);
* ``qnorm verify``'s ``qat`` column finds the layer of a golden op by ``golden``
  (:func:`for_golden`), and ``make demo`` and the benchmarks list the integer kinds.

A kind with fixed ``options`` is a *variant* of its layer (``shift1``: ShiftLayerNorm
with a one-term mantissa); the families train the main kinds by default.

Built in (registered on import): the float references ``float`` (``nn.LayerNorm``)
and ``float_rms`` (``nn.RMSNorm``), the integer norms ``int_ln``, ``l1``, ``shift1``,
``shift``, ``int_rms`` and the integer neuron ``int_mpbn_lif``.  Upper layers add
theirs with :func:`register` (the model zoo registers its float neuron
``float_mpbn_lif``).  A name means one thing: registering the very same kind again is
harmless (a re-import), a different one under a known name is refused unless
``replace``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from qnorm import ops
from qnorm.nn.norms import IntLayerNorm, IntRMSNorm, L1LayerNorm, ShiftLayerNorm
from qnorm.nn.spiking import MPBNLIF
from qnorm.ops.base import IntOp
from qnorm.ops.spiking import MPBNNeuron

NORM, NEURON = "norm", "neuron"
ROLES = (NORM, NEURON)

LayerCtor = Callable[..., nn.Module]


@dataclass(frozen=True)
class Kind:
    """A named layer for a role.

    ``layer(size, **options, **arguments)`` builds it (norms take ``nn.LayerNorm``'s
    leading arguments: ``eps``, ``elementwise_affine``, ``bias``, ``device``,
    ``dtype``); None for a kind registered for conversion only.  ``deployable``:
    ``pow2=True`` is accepted.  ``golden``: the golden op class the layer's forward
    runs (None: a float layer).  ``centered`` (norms): whether it subtracts the mean;
    None: not a conversion target.  ``convert(spec, **options)``: a conversion
    constructor of its own (:class:`qnorm.passes.NormSpec`), used instead of ``layer``.
    ``title``: what tables call it.
    """

    name: str
    role: str
    layer: LayerCtor | None = None
    options: tuple[tuple[str, Any], ...] = ()
    deployable: bool = False
    golden: type[IntOp] | None = None
    centered: bool | None = None
    convert: LayerCtor | None = None
    title: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"kind {self.name!r}: role must be one of {ROLES}, got {self.role!r}")
        if self.layer is None and self.convert is None:
            raise ValueError(f"{self.role} kind {self.name!r} has neither a layer nor a convert constructor")
        if self.role != NORM and (self.centered is not None or self.convert is not None):
            raise ValueError(f"{self.role} kind {self.name!r}: only norm kinds are conversion targets")
        if self.layer is None and (self.golden is not None or self.deployable or self.options):
            raise ValueError(f"{self.role} kind {self.name!r}: golden, deployable and options describe a layer")

    @property
    def integer(self) -> bool:
        """Whether the layer computes with a golden integer op (else it is a float layer)."""
        return self.golden is not None

    @property
    def variant(self) -> bool:
        """Whether the kind fixes some of its layer's options (a variant of the layer's main kind)."""
        return bool(self.options)

    def build(self, size: int, **arguments: Any) -> nn.Module:
        """``layer(size, **options, **arguments)``."""
        if self.layer is None:
            raise ValueError(f"{self.role} kind {self.name!r} is registered for conversion only: it has no layer")
        return self.layer(size, **dict(self.options), **arguments)

    def describe(self) -> str:
        made = self.layer if self.layer is not None else self.convert
        options = "".join(f", {k}={v!r}" for k, v in self.options)
        return f"{getattr(made, '__qualname__', repr(made))}{options}"


_KINDS: dict[str, Kind] = {}


def register(kind: Kind, *, replace: bool = False) -> Kind:
    """Add ``kind`` under its name (see the module docstring for re-registration)."""
    known = _KINDS.get(kind.name)
    if known is not None and known != kind and not replace:
        raise ValueError(f"{known.role} kind {kind.name!r} is already registered to {known.describe()}")
    _KINDS[kind.name] = kind
    return kind


def kinds(role: str) -> list[Kind]:
    """The kinds of ``role``, in registration order."""
    return [k for k in _KINDS.values() if k.role == role]


def names(role: str, *, deployable: bool = False) -> list[str]:
    """Sorted names of the kinds of ``role`` that build a layer (``deployable``: with ``pow2=True``)."""
    return sorted(k.name for k in kinds(role) if k.layer is not None and (k.deployable or not deployable))


def get(name: str, role: str) -> Kind:
    """The kind ``name`` of ``role``; a ValueError listing the registered ones otherwise."""
    found = _KINDS.get(name)
    if found is None or found.role != role:
        other = "" if found is None else f" (it is a {found.role} kind)"
        known = ", ".join(sorted(k.name for k in kinds(role))) or "none"
        raise ValueError(f"unknown {role} kind {name!r}{other}; registered: {known}")
    return found


def build(name: str, role: str, size: int, *, pow2: bool = False) -> nn.Module:
    """The layer of kind ``name`` over ``size`` features / channels; ``pow2``: for a deployable model."""
    kind = get(name, role)
    if not pow2:
        return kind.build(size)
    if not kind.deployable:
        raise ValueError(
            f"{role} kind {name!r} cannot calibrate a power-of-two input scale, so a deployable model cannot "
            f"use it; deployable {role} kinds: {', '.join(names(role, deployable=True))}"
        )
    return kind.build(size, pow2=True)


def integer_kinds(role: str, *, variants: bool = True) -> list[Kind]:
    """The kinds of ``role`` whose layer runs a golden op, in registration order (``variants``: with them)."""
    return [k for k in kinds(role) if k.integer and (variants or not k.variant)]


def for_golden(op_cls: type[IntOp]) -> Kind | None:
    """The main (not variant) kind whose layer runs golden ops of class ``op_cls``, if any."""
    return next((k for k in _KINDS.values() if k.golden is op_cls and not k.variant), None)


BUILTIN = (
    Kind("float", NORM, nn.LayerNorm, centered=True, title="nn.LayerNorm (float)"),
    Kind("float_rms", NORM, nn.RMSNorm, centered=False, title="nn.RMSNorm (float)"),
    Kind("int_ln", NORM, IntLayerNorm, deployable=True, golden=ops.IntLayerNorm, centered=True,
         title="IntLayerNorm (L2)"),
    Kind("l1", NORM, L1LayerNorm, deployable=True, golden=ops.L1LayerNorm, centered=True, title="L1LayerNorm"),
    Kind("shift1", NORM, ShiftLayerNorm, (("mantissa_terms", 1),), deployable=True, golden=ops.ShiftLayerNorm,
         centered=True, title="ShiftLayerNorm, 1 term"),
    Kind("shift", NORM, ShiftLayerNorm, deployable=True, golden=ops.ShiftLayerNorm, centered=True,
         title="ShiftLayerNorm, 2 terms"),
    Kind("int_rms", NORM, IntRMSNorm, deployable=True, golden=ops.IntRMSNorm, centered=False, title="IntRMSNorm"),
    Kind("int_mpbn_lif", NEURON, MPBNLIF, deployable=True, golden=MPBNNeuron, title="MPBNLIF (integer MPBN LIF)"),
)  # fmt: skip


def register_training_kinds() -> None:
    """Register the built-in kinds (done on import; calling it again changes nothing)."""
    for kind in BUILTIN:
        register(kind)


register_training_kinds()
