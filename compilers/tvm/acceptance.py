"""A built model run against the program it was compiled from, before anyone gets it.

The compile proves the exported graph exact (:mod:`qnorm.deploy.exactness`), and every
qnorm kernel is the op's own fixedpoint code on TIR; what nothing proves is the machine
code a compiler backend emits from them.  LLVM 22's AArch64 backend, for one, stored a
``<3 x i8>`` vector's lanes 0 and 2 at offsets 0 and 1 (see :mod:`compilers.tvm.cpu`).
So :func:`compilers.tvm.graph.compile_model` runs each artifact it builds, where this
machine can run it (natively, under qemu-user, on PoCL), on :func:`check_inputs` and
compares its float32 outputs bit for bit with the frozen program's in torch (the QAT
model's integers, proven equal by the tests).  A difference is a :class:`MiscompileError`
naming the sample, the output and both values; the artifact is then not served.
``model.json`` records the outcome under ``"acceptance"``.

The inputs follow ``qnorm verify``'s row styles over the first quantizer's range: the
caller's example, uniform values reaching 25 % past the range on both sides (saturation),
Gaussian samples of random mean and spread, near-constant samples (a variance of a few
LSBs, where ε matters) and sparse samples (zeros with a few extremes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from qnorm.errors import DeployError

STYLE_SAMPLES = 32  # per input style: 4 styles, plus up to EXAMPLE_SAMPLES of the example
EXAMPLE_SAMPLES = 32
SEED = 20261203


class MiscompileError(DeployError):
    """A built model's outputs differ from those of the program it was compiled from."""


class Runnable(Protocol):
    metadata: dict[str, Any]

    def __call__(self, x: np.ndarray) -> np.ndarray: ...

    def unavailable(self) -> str | None: ...


def input_amplitude(metadata: dict[str, Any], example: torch.Tensor) -> tuple[float, float]:
    """The float range the model's first quantizer covers (else the example's own range)."""
    fmt = metadata["input"]["format"]
    if fmt is None:
        lo, hi = float(example.min()), float(example.max())
        return (lo, hi) if hi > lo else (lo - 1.0, hi + 1.0)
    top = (1 << (fmt["bits"] - fmt["signed"])) - 1
    return (-(top + 1) * fmt["scale"] if fmt["signed"] else 0.0, top * fmt["scale"])


def check_inputs(example: torch.Tensor, lo: float, hi: float) -> np.ndarray:
    """Float32 samples shaped like ``example``'s (see the module docstring), seeded."""
    rng = np.random.default_rng(SEED)
    shape = (STYLE_SAMPLES, *example.shape[1:])
    half = (hi - lo) / 2
    per_sample = (STYLE_SAMPLES,) + (1,) * (len(shape) - 1)
    uniform = rng.uniform(lo - half / 4, hi + half / 4, shape)
    # means up to half an end of the range from 0, spreads 1-100 % of half the range (some saturate)
    gaussian = rng.normal(rng.uniform(lo, hi, per_sample) / 2, rng.uniform(0.01, 1.0, per_sample) * half, shape)
    lsb = (hi - lo) / 256
    near_constant = rng.uniform(lo, hi, per_sample) + lsb * rng.choice([-1, 0, 0, 0, 1], shape)
    sparse = np.where(rng.random(shape) < 0.05, rng.choice([lo, hi], shape), 0.0)
    styles = [example[:EXAMPLE_SAMPLES].detach().cpu().numpy(), uniform, gaussian, near_constant, sparse]
    return np.concatenate([s.astype(np.float32) for s in styles])


def accept(built: Runnable, program: Callable[[torch.Tensor], torch.Tensor], example: torch.Tensor) -> dict[str, Any]:
    """Run ``built`` and ``program`` on the check inputs: the record for ``model.json``;
    :class:`MiscompileError` when any output differs."""
    why = built.unavailable()
    if why is not None:
        return {"status": "not run", "why": why}
    x = check_inputs(example, *input_amplitude(built.metadata, example))
    with torch.no_grad():
        want = program(torch.from_numpy(x)).numpy()
    got = np.asarray(built(x))
    if got.shape != want.shape or not np.array_equal(got, want):
        raise MiscompileError(_difference(built, got, want))
    return {"status": "passed", "samples": len(x), "seed": SEED}


def _difference(built: Runnable, got: np.ndarray, want: np.ndarray) -> str:
    target = built.metadata["target"]["name"]
    head = f"the model compiled for {target} differs from the program it was compiled from"
    if got.shape != want.shape:
        return f"{head}: output shape {got.shape}, expected {want.shape}"
    bad = np.argwhere(got != want)
    where = tuple(int(i) for i in bad[0])
    return (f"{head} on {len(bad)} of {want.size} outputs of the acceptance inputs (seed {SEED}); first at "
            f"sample {where[0]}, output {where[1:]}: {got[where]!r}, expected {want[where]!r}. This is a "
            "compiler bug, not a property of the model: the artifact was not kept; please report it with "
            "the model and target")  # fmt: skip
