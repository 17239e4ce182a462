"""What the artifacts that compute on integers in and out (the C API, OpenCL, CUDA) share:
the input and output grids their metadata records, their fields (:class:`BuiltModel`),
and saving their files."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from compilers.cache import sha256_file
from qnorm.targets import Target


def quantize_input(metadata: Mapping[str, Any], x: np.ndarray) -> np.ndarray:
    """The integers the model's first quantizer makes of float ``x``: ``clamp(round(x / s))``
    in float32, ties to even, as the exported graph computes them."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise ValueError(f"float input must be float32 (as the model takes it), got {x.dtype}")
    if not np.isfinite(x).all():
        raise ValueError("input contains NaN or Inf: no fixed-point value (the QAT model refuses them too)")
    lo, hi = metadata["input"]["range"]
    k = np.clip(np.rint(x / np.float32(metadata["input"]["format"]["scale"])), lo, hi)
    return k.astype(metadata["input"]["dtype"])


def check_input_integers(metadata: Mapping[str, Any], k: np.ndarray) -> np.ndarray:
    """``k`` as the model's input integer type, refused unless it is (batch, ...) integers in range."""
    k = np.asarray(k)
    want = metadata["input"]["shape"][1:]
    if k.ndim != len(want) + 1 or list(k.shape[1:]) != want or k.shape[0] < 1:
        raise ValueError(f"the model takes integers of shape (batch, {', '.join(map(str, want))}), got {k.shape}")
    dtype = np.dtype(metadata["input"]["dtype"])
    if k.dtype.kind not in "iu":
        raise ValueError(f"the model takes {dtype} integers, got {k.dtype}")
    lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
    if k.size and (k.min() < lo or k.max() > hi):
        raise ValueError(f"the model takes {dtype} integers, got values outside [{lo}, {hi}]")
    return k.astype(dtype)


def output_scale(metadata: Mapping[str, Any]) -> float:
    """y = k * this, for the output integers k."""
    return float(metadata["output"]["format"]["scale"])


@dataclass
class BuiltModel:
    """A built model: ``directory`` holds its files (a cache entry or a saved model).
    Subclasses run it (:meth:`run_ints`) where this machine can."""

    directory: Path
    metadata: dict[str, Any]
    target: Target
    cache_hit: bool = False
    seconds: float = 0.0
    digests: Mapping[str, str] = field(default_factory=dict)  # file -> sha256, as checked

    def quantize(self, x: np.ndarray) -> np.ndarray:
        """The integers the model's first quantizer makes of float32 ``x``."""
        return quantize_input(self.metadata, x)

    def run_ints(self, k: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def unavailable(self) -> str | None:
        """None when :meth:`run_ints` can run on this machine, else what it lacks."""
        raise NotImplementedError

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Float32 input to float32 output, like :class:`compilers.tvm.graph.CompiledModel`."""
        out = self.run_ints(self.quantize(x))
        return (out.astype(np.float64) * output_scale(self.metadata)).astype(np.float32)


def save_files(
    built: Path, files: tuple[str, ...], digests: Mapping[str, str], metadata: Mapping[str, Any],
    directory: str | Path, source: dict[str, Any] | None,
) -> Path:
    """Copy ``files`` from ``built`` into ``directory`` (created), each checked against the
    digest it had when it was found or built, and write ``model.json`` recording them;
    ``source`` describes where the model came from."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    records = {}
    for name in files:
        path = directory / name
        shutil.copy2(built / name, path)
        digest = sha256_file(path)
        if digests and digest != digests.get(name):
            path.unlink()
            raise ValueError(f"{built / name} changed since it was checked (sha256 {digest}, expected "
                             f"{digests.get(name)}): compile again")  # fmt: skip
        records[name] = {"bytes": path.stat().st_size, "sha256": digest}
    meta = {**metadata, "files": records}
    if source is not None:
        meta["source"] = source
    (directory / "model.json").write_text(json.dumps(meta, indent=2, allow_nan=False) + "\n")
    return directory
