"""Interleaved, median-of-repeats timing for ratio benchmarks on a noisy shared box.

Each sample times a loop of at least ``min_loop_s`` (short timings here jump in
~8 ms steps under load), and the sides alternate sample by sample so load changes
hit both equally; the reported ratio is the median of per-round ratios.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Timing:
    name: str
    median_s: float  # seconds per call


def _calls_for(fn: Callable[[], object], min_loop_s: float) -> int:
    fn()  # warm-up (compilation, allocator, caches)
    calls, elapsed = 1, 0.0
    while elapsed < min_loop_s:
        calls *= 2
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
    return calls


def interleaved(sides: dict[str, Callable[[], object]], rounds: int = 5, min_loop_s: float = 0.5) -> dict[str, Timing]:
    """Per-call median time of each side, measured in alternating loops."""
    calls = {name: _calls_for(fn, min_loop_s) for name, fn in sides.items()}
    samples: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            samples[name].append((time.perf_counter() - start) / calls[name])
    return {name: Timing(name, statistics.median(s)) for name, s in samples.items()}
