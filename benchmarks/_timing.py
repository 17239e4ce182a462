"""Interleaved, median-of-repeats timing for ratio benchmarks on a noisy shared box.

Each sample times a loop of at least ``min_loop_s`` (short timings here jump in
~8 ms steps under load), and the sides alternate sample by sample so load changes
hit both equally; :func:`ratio` is the median of per-round ratios.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

Clock = Callable[[], float]


@dataclass(frozen=True)
class Timing:
    name: str
    samples: tuple[float, ...]  # seconds per call, one per round

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples)


def ratio(num: Timing, den: Timing) -> float:
    """Median over rounds of ``num / den``: both sides of a round share its load."""
    return statistics.median(a / b for a, b in zip(num.samples, den.samples, strict=True))


def _calls_for(fn: Callable[[], object], min_loop_s: float, clock: Clock) -> int:
    fn()  # warm-up (compilation, allocator, caches)
    calls, elapsed = 1, 0.0
    while elapsed < min_loop_s:
        calls *= 2
        start = clock()
        for _ in range(calls):
            fn()
        elapsed = clock() - start
    return calls


def interleaved(
    sides: dict[str, Callable[[], object]],
    rounds: int = 5,
    min_loop_s: float = 0.5,
    clock: Clock = time.perf_counter,
) -> dict[str, Timing]:
    """Per-call time of each side in every round, measured in alternating loops.

    ``clock`` is wall time by default; ``time.thread_time`` (CPU time of the
    calling thread) leaves out the time other processes hold the core, which is
    exact only when all the work runs on the calling thread.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    calls = {name: _calls_for(fn, min_loop_s, clock) for name, fn in sides.items()}
    samples: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            start = clock()
            for _ in range(calls[name]):
                fn()
            samples[name].append((clock() - start) / calls[name])
    return {name: Timing(name, tuple(s)) for name, s in samples.items()}
