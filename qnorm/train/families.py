"""The model families ``qnorm train`` trains, each once per norm or neuron kind.

Plain data, no torch: ``qnorm train`` checks ``--family`` names against it before
importing the training stack (seconds).  A family's kinds come from the kind registry
(:mod:`qnorm.nn.kinds`), so :attr:`Family.defaults` and :meth:`Family.kinds` import
it (and :mod:`qnorm.train.models`, which adds its float neuron) when called.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qnorm.errors import UsageError


@dataclass(frozen=True)
class Family:
    """A model trained once per kind: ``build_model(model, **{slot: kind}, **options)``.

    `deployable`: only kinds whose layers calibrate power-of-two scales (every
    checkpoint compiles); `reference`: the float kind the family's rows are compared
    with (None: none), trained in this family or, for a deployable family whose float
    baseline is another family's reference, in `reference_family`.  The kinds trained
    when none are named (:attr:`defaults`): the reference, then `main` if given, else
    every registered integer kind of the slot that is no variant.
    """

    model: str
    slot: str  # "norm" or "neuron" (a role of qnorm.nn.kinds): the config field the kind fills
    reference: str | None
    deployable: bool = False
    options: tuple[tuple[str, Any], ...] = ()
    main: tuple[str, ...] = ()
    reference_family: str | None = None

    def config(self, kind: str) -> dict[str, Any]:
        return {self.slot: kind, **dict(self.options)}

    @property
    def defaults(self) -> tuple[str, ...]:
        """The reference (if any), then the main integer kinds this family can train, in registration order."""
        from qnorm.nn.kinds import integer_kinds

        integer = self.main or [
            k.name for k in integer_kinds(self.slot, variants=False) if k.deployable or not self.deployable
        ]
        own_reference = self.reference if self.reference and self.reference_family is None else None
        return (*([own_reference] if own_reference else []), *integer)

    def kinds(self) -> list[str]:
        """The registered kinds this family trains."""
        from qnorm.train.models import neuron_kinds, norm_kinds

        listing = norm_kinds if self.slot == "norm" else neuron_kinds
        return listing(deployable=self.deployable)

    def describe(self) -> str:
        return f"{'deployable ' if self.deployable else ''}{self.slot} kinds"


FAMILIES = {
    "transformer": Family("transformer", "norm", "float"),
    "snn": Family("snn", "neuron", "float_mpbn_lif"),
    "mixer": Family("mixer", "norm", None, deployable=True),
    "snn-pow2": Family("snn", "neuron", None, deployable=True, options=(("pow2", True),)),
    # The integer transformer (IntSoftmax attention, IntGELU MLP), compared with the float
    # transformer of "transformer"; and the LLaMA-style one: pre-RMSNorm, gated IntSiLU MLP.
    "transformer-int": Family(
        "transformer", "norm", "float", deployable=True, options=(("integer", True),), reference_family="transformer"
    ),
    "llama": Family(
        "transformer", "norm", "float", deployable=True, options=(("integer", True), ("mlp", "swiglu")),
        main=("int_rms",), reference_family="transformer",
    ),
}
DEFAULT_FAMILIES = ("transformer", "snn")


def family_names(families: Sequence[str]) -> list[str]:
    """``families`` in order without repeats; a UsageError for none or an unknown one."""
    if not families:
        raise UsageError("no model families to train")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise UsageError(f"unknown model family {unknown[0]!r}; known: {', '.join(FAMILIES)}")
    return list(dict.fromkeys(families))
