"""The model families ``qnorm train`` trains, each once per norm or neuron kind.

Plain data, no torch: ``qnorm train`` checks ``--family`` names against it before
importing the training stack (seconds); listing a family's kinds needs the
registered layers, so :meth:`Family.kinds` imports :mod:`qnorm.train.models` when called.
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
    checkpoint compiles); `defaults`: the kinds trained when none are named;
    `reference`: the float kind the family's rows are compared with (None: none).
    """

    model: str
    slot: str  # "norm" or "neuron": the config field the kind fills
    defaults: tuple[str, ...]
    reference: str | None
    deployable: bool = False
    options: tuple[tuple[str, Any], ...] = ()

    def config(self, kind: str) -> dict[str, Any]:
        return {self.slot: kind, **dict(self.options)}

    def kinds(self) -> list[str]:
        """The registered kinds this family trains."""
        from qnorm.train.models import neuron_kinds, norm_kinds

        listing = norm_kinds if self.slot == "norm" else neuron_kinds
        return listing(deployable=self.deployable)

    def describe(self) -> str:
        return f"{'deployable ' if self.deployable else ''}{self.slot} kinds"


_INTEGER_NORMS = ("int_ln", "l1", "shift", "int_rms")
FAMILIES = {
    "transformer": Family("transformer", "norm", ("float", *_INTEGER_NORMS), "float"),
    "snn": Family("snn", "neuron", ("float_mpbn_lif", "int_mpbn_lif"), "float_mpbn_lif"),
    "mixer": Family("mixer", "norm", _INTEGER_NORMS, None, deployable=True),
    "snn-pow2": Family("snn", "neuron", ("int_mpbn_lif",), None, deployable=True,
                       options=(("pow2", True),)),
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
