"""Input vectors for ``qnorm verify``: edge cases, exhaustive domains, seeded random rows.

A *vector* is what one op evaluation reads: a row of N for a norm, a row of C
channels for a BN op, one neuron's current series of T steps for a spiking
neuron.  Everything is deterministic: edge cases are fixed lists, random inputs
come from ``numpy.random.default_rng([seed, case seed, chunk])``, so a mismatch
found once is found again and its input can be reproduced.

Edge cases (every family): all-min, all-max, zeros and other constant rows,
alternating extremes, a single outlier ``[a, b, …, b]`` at the start, middle and
end, two-level rows ``[a]*k + [b]*(N−k)`` (symmetric ones make the rsqrt exact,
so the rounding stages meet exact ties) and ramps.  Where the whole input domain
is small it is run completely: every row of a norm when levels^N <= 2^16 (so
every tie of its rounding rules), every input value in every channel of a BN op
(which is elementwise: that is its whole domain).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from qnorm.verify.cases import CHANNELS, ROWS, TIME, Case

DEFAULT_ELEMENTS = 10**5  # input elements per case in a default run (CI)
FULL_ELEMENTS = 10**7  # ``qnorm verify --full``
CHUNK_ELEMENTS = 1 << 18  # random inputs are made and checked in chunks of this size
GOLDEN_RANDOM_ELEMENTS = 8192  # random input elements stored per case in qnorm/data/golden
EXHAUSTIVE_LIMIT = 1 << 16  # most rows of a complete norm domain run by default
_GOLDEN_STREAM = 0x901D  # rng stream of the stored random sample (apart from run seeds)


@dataclass(frozen=True, eq=False)
class Batch:
    """Op-layout inputs; ``expected`` holds stored outputs (None: the golden op computes them)."""

    source: str  # "golden", "edge", "exhaustive" or "random"
    x: np.ndarray
    expected: np.ndarray | None = None


# --------------------------------------------------------------------------- layout


def vector_elements(case: Case) -> int:
    """Input elements per unit of the batch axis (a (T, C) slab for a neuron)."""
    return case.width * case.config["channels"] if case.layout == TIME else case.width


def as_vectors(case: Case, a: np.ndarray) -> np.ndarray:
    """(vectors, width) view of an op-layout array: rows, or neuron series for (T, B, C)."""
    if case.layout == TIME:
        return np.moveaxis(a, 0, -1).reshape(-1, case.width)
    return a.reshape(-1, case.width)


def vector_location(case: Case, shape: tuple[int, ...], vector: int) -> str:
    """Where vector number ``vector`` sits in an op-layout array of ``shape``."""
    if case.layout == TIME:
        b, c = divmod(vector, shape[-1])
        return f"x[:, {b}, {c}] (batch {b}, channel {c})"
    return f"x[{vector}]"


def arrange(case: Case, vectors: np.ndarray) -> np.ndarray:
    """Edge vectors (count, width) into op layout; a neuron series drives every channel."""
    if case.layout != TIME:
        return vectors
    c = case.config["channels"]
    return np.ascontiguousarray(np.broadcast_to(vectors.T[:, :, None], (*vectors.T.shape, c)))


# --------------------------------------------------------------------------- edge cases


def _values(case: Case) -> list[int]:
    """Extremes, their neighbours, halves and the small values around zero."""
    f = case.in_fmt
    raw = [f.lo, f.lo + 1, f.lo // 2, -1, 0, 1, f.hi // 2, f.hi - 1, f.hi]
    return sorted({v for v in raw if f.lo <= v <= f.hi})


def _constants(case: Case, complete: bool) -> list[int]:
    """Every value for a complete run of a <= 8-bit input, else the notable ones (plus a spread)."""
    f = case.in_fmt
    if not complete:
        return _values(case)
    if f.hi - f.lo < 256:
        return list(range(f.lo, f.hi + 1))
    return sorted(set(_values(case)) | {int(v) for v in np.linspace(f.lo, f.hi, 257).round()})


def edge_vectors(case: Case, complete: bool) -> np.ndarray:
    """Deterministic edge-case vectors (count, width), duplicates removed, order kept.

    ``complete`` (the streamed run): every constant value and outliers from
    every pair of notable values; otherwise the compact set stored in
    qnorm/data/golden.  Fixed values outside a narrow format are clipped into it.
    """
    f, w = case.in_fmt, case.width
    vals = _values(case)
    rows: list[list[int]] = [[v] * w for v in _constants(case, complete)]
    for a, b in ((f.lo, f.hi), (f.hi, f.lo), (-1, 1), (1, -1), (0, f.hi), (f.lo, 0)):
        rows.append([a if i % 2 == 0 else b for i in range(w)])
    pairs = [(a, b) for a in vals for b in vals if a != b]
    if not complete:
        corners = [v for v in (f.lo, 0, 1, f.hi) if v in vals]
        pairs = [(a, b) for a in corners for b in corners if a != b]
    for pos in sorted({0, w // 2, w - 1}):
        for a, b in pairs:
            row = [b] * w
            row[pos] = a
            rows.append(row)
    for k in sorted({1, w // 4, w // 2} - {0, w}):
        for a, b in ((0, 1), (1, -1), (2, -2), (0, 4), (-3, 3), (f.lo, f.hi)):
            rows.append([a] * k + [b] * (w - k))
    ramp = np.linspace(f.lo, f.hi, w).round().astype(int).tolist()
    rows += [ramp, ramp[::-1]]
    out = np.clip(np.array(rows, dtype=np.int64), f.lo, f.hi)
    _, first = np.unique(out, axis=0, return_index=True)
    return out[np.sort(first)]


def exhaustive_inputs(case: Case) -> np.ndarray | None:
    """The complete input domain in op layout, where it is small enough to run.

    A norm: every row when levels^N <= 2^16.  A BN op: every input value in every
    channel (row r holds lo + (r + c) mod levels in channel c).  A neuron: none
    (levels^T series).
    """
    f = case.in_fmt
    levels = f.hi - f.lo + 1
    if case.layout == ROWS and levels**case.width <= EXHAUSTIVE_LIMIT:
        idx = np.arange(levels**case.width, dtype=np.int64)[:, None]
        return idx // levels ** np.arange(case.width, dtype=np.int64) % levels + f.lo
    if case.layout == CHANNELS and levels <= EXHAUSTIVE_LIMIT:
        r, c = np.arange(levels)[:, None], np.arange(case.width)[None, :]
        return (r + c) % levels + f.lo
    return None


# --------------------------------------------------------------------------- random inputs


def random_inputs(case: Case, rng: np.random.Generator, count: int) -> np.ndarray:
    """``count`` units of the batch axis of seeded random inputs, in op layout.

    Rows come in four styles, a quarter each: uniform over the format; Gaussian
    with a random per-row mean and spread (activations); near-constant rows
    (a base value plus sparse ±1: tiny variance, where ε matters); sparse rows
    (zeros with a few extreme outliers).  A neuron gets per-neuron Gaussian
    currents (and uniform ones for a quarter of the batch).
    """
    f = case.in_fmt
    lo, hi = f.lo, f.hi
    if case.layout == TIME:
        t, c = case.width, case.config["channels"]
        mean = rng.uniform(lo / 4, hi / 2, (1, count, c))
        std = rng.uniform(1.0, (hi - lo) / 4, (1, count, c))
        x = rng.normal(mean, std, (t, count, c))
        x[:, : count // 4] = rng.integers(lo, hi + 1, (t, count // 4, c))
        return np.clip(np.rint(x), lo, hi).astype(np.int64)
    w = case.width
    style = (np.arange(count) % 4)[:, None]
    uniform = rng.integers(lo, hi + 1, (count, w))
    spread = np.exp(rng.uniform(math.log(0.5), math.log((hi - lo) / 4), (count, 1)))
    gauss = np.rint(rng.normal(rng.uniform(lo / 2, hi / 2, (count, 1)), spread, (count, w)))
    near = rng.integers(lo, hi + 1, (count, 1)) + rng.choice([-1, 0, 0, 0, 1], (count, w))
    sparse = np.where(rng.random((count, w)) < 2 / max(w, 2), rng.choice([lo, hi], (count, w)), 0)
    x = np.select([style == 0, style == 1, style == 2], [uniform, gauss, near], sparse)
    return np.clip(x, lo, hi).astype(np.int64)


def random_batches(case: Case, elements: int, seed: int) -> Iterator[Batch]:
    """At least ``elements`` random input elements, in chunks of about CHUNK_ELEMENTS."""
    unit = vector_elements(case)
    remaining = -(-elements // unit)
    per_chunk = max(1, CHUNK_ELEMENTS // unit)
    chunk = 0
    while remaining > 0:
        n = min(per_chunk, remaining)
        yield Batch("random", random_inputs(case, np.random.default_rng([seed, case.seed, chunk]), n))
        remaining -= n
        chunk += 1


def run_batches(case: Case, elements: int, seed: int) -> Iterator[Batch]:
    """Everything a verify run checks beyond the stored golden vectors: the complete
    edge set, the exhaustive domain if small, then random inputs, at least
    ``elements`` in all and at least half of them random (a wide row's edge set
    alone can exceed the budget)."""
    full = exhaustive_inputs(case)
    done = 0
    if full is None or case.layout != ROWS:  # a norm's complete domain holds every edge row
        edge = arrange(case, edge_vectors(case, complete=True))
        yield Batch("edge", edge)
        done += edge.size
    if full is not None:
        yield Batch("exhaustive", full)
        done += full.size
    yield from random_batches(case, max(elements - done, elements // 2), seed)


def golden_inputs(case: Case) -> np.ndarray:
    """What qnorm/data/golden stores for a case: the compact edge set and a small random sample."""
    edge = arrange(case, edge_vectors(case, complete=False))
    rng = np.random.default_rng([_GOLDEN_STREAM, case.seed])
    sample = random_inputs(case, rng, max(1, GOLDEN_RANDOM_ELEMENTS // vector_elements(case)))
    axis = 1 if case.layout == TIME else 0
    return np.concatenate([edge, sample], axis=axis)
