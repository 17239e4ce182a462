"""QAT training step with each integer norm vs the same model with float LayerNorm.

The model is the digits transformer (Brevitas int8 linears, 2 pre-norm blocks,
5 norm layers); one step = forward + backward + AdamW update on a batch of 64.
Reports ratios measured in one run (goal: <= 1.2x the float-LN step).

Beside the steps as trained, the same models with part of the integer path taken
out after calibration (:data:`BOUNDS`; timed only, their integers are then not the
golden op's): what a step would cost if that part were free, so the least any
faster derivation or element chain could reach, measured in the same run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from benchmarks._timing import Timing, interleaved, ratio
from qnorm.nn import IntNorm
from qnorm.nn.elementchain import ElementChain
from qnorm.qformat import QFormat
from qnorm.train.data import load_digits_data
from qnorm.train.families import FAMILIES
from qnorm.train.models import build_model

# What `qnorm train` trains the transformer with by default: float LayerNorm, then every main integer norm kind.
KINDS = FAMILIES["transformer"].defaults
REFERENCE = FAMILIES["transformer"].reference
GOAL = 1.2  # at most this many times the float-LN step
# Rounds of the interleaved loops: a step's per-round ratio to the float step moved by
# ±0.1 between rounds on a shared host, so the median is taken over more rounds than the
# kernel sections use.
QAT_ROUNDS = 11


def _norm_layers(model: nn.Module) -> list[IntNorm]:
    return [m for m in model.modules() if isinstance(m, IntNorm)]


def reuse_derivation(model: nn.Module) -> None:
    """Every integer norm layer keeps the golden op it derives now and that op's element
    chain: its forward no longer re-derives the op from the step's γ, β and format (their
    updates go unseen)."""
    for layer in _norm_layers(model):
        op = layer.golden()
        chain = ElementChain(op)
        layer.golden = lambda in_fmt=None, op=op: op  # instance attributes: this model only
        layer._integers = lambda fmt, device, chain=chain, op=op: (chain, op.config)


def drop_element_chain(model: nn.Module) -> None:
    """Every integer norm layer's integers become its input integers clamped to the output
    range (one torch call) instead of the per-row stage and the element chain."""
    for layer in _norm_layers(model):
        op = layer.golden()
        layer._integers = lambda fmt, device, op=op: (_Clamped(op.out_fmt), op.config)


class _Clamped:
    """The input integers clamped to the output range, in place of an op's chain."""

    def __init__(self, fmt: QFormat) -> None:
        self.fmt = fmt

    def values(self, ints: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        return ints.clamp(self.fmt.lo, self.fmt.hi).to(dtype) * scale


# Bound name -> what it takes out of each integer norm layer, in order.
BOUNDS: dict[str, tuple[Callable[[nn.Module], None], ...]] = {
    "derivation reused": (reuse_derivation,),
    "derivation reused, no element chain": (reuse_derivation, drop_element_chain),
}


def timed_name(kind: str, bound: str | None = None) -> str:
    """The name of a timed step: the norm kind, and the bound applied to it."""
    return kind if bound is None else f"{kind}, {bound}"


def make_step(kind: str, xb: torch.Tensor, yb: torch.Tensor, bound: str | None = None):
    torch.manual_seed(0)
    model = build_model("transformer", norm=kind)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(3):  # calibrate the input quantizers before timing
        loss_fn(model(xb), yb).backward()
    for take_out in BOUNDS[bound] if bound is not None else ():
        take_out(model)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(xb), yb).backward()
        opt.step()

    return step


def qat_markdown(times: dict[str, Timing]) -> str:
    """The QAT-step section for a step time per norm kind (KINDS, the float reference among them)."""
    lines = [
        "## QAT training step (digits transformer, batch 64, 1 thread; median of interleaved loops, "
        "CPU time of the calling thread)",
        "",
        f"| norm | step time | ratio vs float LayerNorm | goal ≤ {GOAL:g}× |",
        "|---|---|---|---|",
    ]
    for k in KINDS:
        r = ratio(times[k], times[REFERENCE])
        goal = "—" if k == REFERENCE else ("yes" if r <= GOAL else "no")
        lines.append(f"| {k} | {1e3 * times[k].median_s:.2f} ms | {r:.2f}× | {goal} |")
    lines += [
        "",
        "Bounds, in the same run: the integer models with part of each norm layer's integer path taken "
        "out after calibration (timed only: their integers are then not the golden op's). A cell is the "
        "step time and its ratio to the float-LN step: the least a faster derivation or element chain "
        "could reach.",
        "",
        "| norm | as trained | " + " | ".join(BOUNDS) + " |",
        "|---|---|" + "---|" * len(BOUNDS),
    ]
    for k in KINDS:
        if k == REFERENCE:
            continue
        cells = [times[timed_name(k, b)] for b in (None, *BOUNDS)]
        row = " | ".join(f"{1e3 * t.median_s:.2f} ms ({ratio(t, times[REFERENCE]):.2f}×)" for t in cells)
        lines.append(f"| {k} | {row} |")
    return "\n".join(lines)


def timed_steps() -> list[tuple[str, str, str | None]]:
    """(timed name, norm kind, bound) of every step the section times: each kind as
    trained, then each integer kind under each bound."""
    steps = [(timed_name(k), k, None) for k in KINDS]
    return steps + [(timed_name(k, b), k, b) for k in KINDS if k != REFERENCE for b in BOUNDS]


def section(rounds: int = QAT_ROUNDS, min_loop_s: float = 0.5) -> str:
    """The QAT-step markdown section, measured now (one torch thread).  The clock is the
    calling thread's CPU time: with one torch thread the forward, the backward (CPU
    autograd runs on the calling thread) and the numpy work all run there, so the
    time other processes hold the core is left out (a shared machine's load doubled
    wall-clock step times between runs)."""
    torch.set_num_threads(1)
    data = load_digits_data("tokens", seed=0)
    xb, yb = data.train.tensors[0][:64], data.train.tensors[1][:64]
    steps = {name: make_step(kind, xb, yb, bound) for name, kind, bound in timed_steps()}
    return qat_markdown(interleaved(steps, rounds, min_loop_s, time.thread_time))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=QAT_ROUNDS)
    parser.add_argument("--min-loop", type=float, default=0.5, help="seconds per timed loop")
    parser.add_argument("--out", default="out/bench_qat.md")
    args = parser.parse_args()
    text = section(args.rounds, args.min_loop)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
