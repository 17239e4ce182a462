"""Run a compiled model on an array, whatever it was compiled into: output integers.

Every artifact of :func:`compilers.tvm.graph.compile_model` takes either

* integers of the model's input grid (what the C API takes: ``x = k * scale``), or
* float32 values, which the model's own first quantizer maps to those integers;

and give the integers of the proven output grid (``y = k * 2^grid_exp``).  A Relax VM
library (``model.so``) computes on floats, so its integers are ``k * scale`` in and
``y / 2^grid_exp`` out: both exact on power-of-two grids, and the output's checked.
"""

from __future__ import annotations

import numpy as np

from compilers.tvm.graph import CompiledModel, IntegerModel


def output_integers(model: CompiledModel | IntegerModel, x: np.ndarray) -> np.ndarray:
    """The model's output integers (int32, (batch, ...)) for integer or float32 input ``x``."""
    x = np.asarray(x)
    integer = x.dtype.kind in "iu"
    if not integer and x.dtype != np.float32:
        raise ValueError(f"input must be integers of the model's input grid or float32, got {x.dtype}")
    if not isinstance(model, CompiledModel):
        return model.run_ints(x if integer else model.quantize(x))
    fmt = model.metadata["input"]["format"]
    if integer:
        if fmt is None:
            raise ValueError("this model's input meets no quantizer first: give float32 input, not integers")
        x = (x.astype(np.float64) * fmt["scale"]).astype(np.float32)  # exact: a power-of-two scale, |k| < 2^24
    y = model(x)
    grid = model.metadata["output"]["format"]
    if grid is None:
        raise ValueError("this model's output has no proven integer grid: it has no output integers")
    k = y.astype(np.float64) / grid["scale"]
    if not np.array_equal(k, np.rint(k)) or np.abs(k).max(initial=0) > grid["max_abs_int"]:
        raise ValueError("the model's output is off its proven grid: the compiled library is not the model proven")
    return k.astype(np.int32)


def classes(outputs: np.ndarray) -> np.ndarray:
    """Each sample's predicted class: the argmax of its (flattened) outputs."""
    return outputs.reshape(outputs.shape[0], -1).argmax(axis=1)
