"""The vectors file a qnorm HLS testbench reads, and the outputs file it writes.

Layout (little-endian; ``c/qnorm_tb.c`` reads it, its header comment is the
same table):

==========  =======  ===========================================================
offset      type     field
==========  =======  ===========================================================
0           char[8]  magic ``QNORMVEC``
8           uint32   format version (1)
12          uint32   flags: bit 0 set when expected outputs follow the inputs
16          uint64   count: vectors
24          uint64   unit: elements per vector
32, 36      uint32   bytes per input element, per output element
40          uint64   checksum: sum of payload byte i times (i + 1), modulo 2^64
48          payload  count·unit inputs, then count·unit expected outputs
==========  =======  ===========================================================

Elements are two's complement of the top's port widths.  The checksum changes
with any single changed, swapped or shifted byte, so a corrupted file is
refused by name rather than read as different vectors.  A vector is one row,
or for a time-major op one batch element's (steps, channels) slab:
:func:`as_units` and :func:`from_units` convert from and to the op's layout.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from compilers.fpga.csource import TopSpec

MAGIC = b"QNORMVEC"
VERSION = 1
HAS_EXPECTED = 1
_HEADER = struct.Struct("<8sIIQQIIQ")  # 48 bytes, the table above


def checksum(payload: bytes) -> int:
    """Sum of byte i times (i + 1), modulo 2^64 (uint64 arithmetic wraps)."""
    data = np.frombuffer(payload, dtype=np.uint8).astype(np.uint64)
    weights = np.arange(1, data.size + 1, dtype=np.uint64)
    return int(np.sum(data * weights, dtype=np.uint64))


def _fits(values: np.ndarray, nbytes: int) -> bool:
    """Whether every value is a signed integer of ``nbytes`` bytes (writing would wrap it otherwise)."""
    half = 1 << (8 * nbytes - 1)
    return -half <= int(np.min(values)) and int(np.max(values)) < half


def _le_bytes(values: np.ndarray, nbytes: int) -> bytes:
    return np.ascontiguousarray(values, dtype=np.int64).astype(f"<i{nbytes}").tobytes()


def write_vectors(
    path: Path,
    inputs: np.ndarray,
    in_bytes: int,
    out_bytes: int,
    expected: np.ndarray | None = None,
) -> Path:
    """Write ``inputs`` (vectors, unit) and optionally ``expected`` of the same shape."""
    inputs = np.asarray(inputs)
    if inputs.ndim != 2:
        raise ValueError(f"inputs must be (vectors, elements per vector), got shape {inputs.shape}")
    arrays = [("input", inputs, in_bytes)]
    if expected is not None:
        expected = np.asarray(expected)
        if expected.shape != inputs.shape:
            raise ValueError(f"expected outputs of shape {expected.shape} do not match inputs {inputs.shape}")
        arrays.append(("expected output", expected, out_bytes))
    for what, nbytes in (("input", in_bytes), ("output", out_bytes)):
        if nbytes not in (1, 2, 4, 8):
            raise ValueError(f"{what} elements must be 1, 2, 4 or 8 bytes, got {nbytes}")
    for what, values, nbytes in arrays:
        if values.dtype.kind not in "iu":
            raise ValueError(f"{what} values must be integers, got dtype {values.dtype}")
        if values.size and not _fits(values, nbytes):
            raise ValueError(f"{what} values span [{values.min()}, {values.max()}], more than {nbytes} bytes hold")
    payload = _le_bytes(inputs, in_bytes)
    if expected is not None:
        payload += _le_bytes(expected, out_bytes)
    flags = HAS_EXPECTED if expected is not None else 0
    count, unit = inputs.shape
    header = _HEADER.pack(MAGIC, VERSION, flags, count, unit, in_bytes, out_bytes, checksum(payload))
    path = Path(path)
    path.write_bytes(header + payload)
    return path


def read_outputs(path: Path, count: int, unit: int) -> np.ndarray:
    """The testbench's outputs file: count·unit little-endian int64, as (count, unit)."""
    data = Path(path).read_bytes()
    if len(data) != count * unit * 8:
        raise ValueError(f"{path}: {len(data)} bytes, expected {count * unit * 8} ({count} vectors of {unit})")
    return np.frombuffer(data, dtype="<i8").astype(np.int64).reshape(count, unit)


# --------------------------------------------------------------------------- op layout


def as_units(spec: TopSpec, x: np.ndarray) -> np.ndarray:
    """Op-layout array → (vectors, elements per vector) in the vectors file's order."""
    x = np.asarray(x)
    if spec.time_major:
        if x.ndim < 2 or x.shape[0] > spec.max_steps:
            raise ValueError(
                f"a time-major input is (steps <= {spec.max_steps}, ..., {spec.width}); got shape {x.shape}"
            )
        slabs = x.reshape(x.shape[0], -1, spec.width)
        return np.ascontiguousarray(slabs.transpose(1, 0, 2)).reshape(slabs.shape[1], -1)
    if x.size % spec.width:
        raise ValueError(f"input of shape {x.shape} is not rows of {spec.width}")
    return x.reshape(-1, spec.width)


def from_units(spec: TopSpec, units: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of :func:`as_units` for an op-layout ``shape``."""
    if spec.time_major:
        steps = shape[0]
        return np.ascontiguousarray(units.reshape(-1, steps, spec.width).transpose(1, 0, 2)).reshape(shape)
    return units.reshape(shape)
