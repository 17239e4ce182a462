"""Training infrastructure: digits data, the two host models, seeded loop, checkpoints.

`qnorm.train.distributed` (DDP) is deliberately not imported here: it is run as
`python -m qnorm.train.distributed`, and importing it from the package would make
runpy warn that the module was already imported.
"""

from qnorm.train.checkpoint import load_checkpoint, read_metadata, save_checkpoint
from qnorm.train.data import DigitsData, load_digits_data
from qnorm.train.loop import TrainResult, evaluate, seed_everything, train
from qnorm.train.models import (
    build_model,
    model_spec,
    neuron_factory,
    neuron_kinds,
    norm_factory,
    norm_kinds,
    register_neuron,
    register_norm,
)

__all__ = [
    "DigitsData", "TrainResult", "build_model", "evaluate", "load_checkpoint",
    "load_digits_data", "model_spec", "neuron_factory", "neuron_kinds", "norm_factory",
    "norm_kinds", "read_metadata", "register_neuron", "register_norm", "save_checkpoint",
    "seed_everything", "train",
]
