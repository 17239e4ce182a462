"""Training infrastructure: digits data, the two host models, seeded loop, checkpoints.

The names below load on first use (PEP 562): `qnorm.train.cli` must be importable by
the `qnorm` command without pulling in torch, brevitas and scikit-learn, which take
seconds to import and are needed only when something actually trains.

`qnorm.train.distributed` (DDP) is deliberately not exported here: it is run as
`python -m qnorm.train.distributed`, and importing it from the package would make
runpy warn that the module was already imported.
"""

from __future__ import annotations

from qnorm._lazy import lazy_exports

_EXPORTS = {
    "load_checkpoint": "checkpoint", "read_metadata": "checkpoint_meta", "save_checkpoint": "checkpoint",
    "DigitsData": "data", "load_digits_data": "data",
    "TrainResult": "loop", "evaluate": "loop", "seed_everything": "loop", "train": "loop",
    "build_model": "models", "model_spec": "models", "neuron_factory": "models",
    "neuron_kinds": "models", "norm_factory": "models", "norm_kinds": "models",
    "register_neuron": "models", "register_norm": "models",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
