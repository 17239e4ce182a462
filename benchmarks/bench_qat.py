"""QAT training step with each integer norm vs the same model with float LayerNorm.

The model is the digits transformer (Brevitas int8 linears, 2 pre-norm blocks,
5 norm layers); one step = forward + backward + AdamW update on a batch of 64.
Reports ratios measured in one run (goal: <= 1.2x the float-LN step).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks._timing import Timing, interleaved, ratio
from qnorm.train.data import load_digits_data
from qnorm.train.families import FAMILIES
from qnorm.train.models import build_model

# What `qnorm train` trains the transformer with by default: float LayerNorm, then every main integer norm kind.
KINDS = FAMILIES["transformer"].defaults
REFERENCE = FAMILIES["transformer"].reference
GOAL = 1.2  # at most this many times the float-LN step


def make_step(kind: str, xb: torch.Tensor, yb: torch.Tensor):
    torch.manual_seed(0)
    model = build_model("transformer", norm=kind)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(3):  # calibrate the input quantizers before timing
        loss_fn(model(xb), yb).backward()

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
    return "\n".join(lines)


def section(rounds: int = 5, min_loop_s: float = 0.5) -> str:
    """The QAT-step markdown section, measured now (one torch thread).  The clock is the
    calling thread's CPU time: with one torch thread the forward, the backward (CPU
    autograd runs on the calling thread) and the numpy work all run there, so the
    time other processes hold the core is left out (a shared machine's load doubled
    wall-clock step times between runs)."""
    torch.set_num_threads(1)
    data = load_digits_data("tokens", seed=0)
    xb, yb = data.train.tensors[0][:64], data.train.tensors[1][:64]
    return qat_markdown(interleaved({k: make_step(k, xb, yb) for k in KINDS}, rounds, min_loop_s, time.thread_time))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-loop", type=float, default=0.5, help="seconds per timed loop")
    parser.add_argument("--out", default="out/bench_qat.md")
    args = parser.parse_args()
    text = section(args.rounds, args.min_loop)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
