"""``python -m benchmarks [--out out/bench.md] [--only NAME ...]``: every benchmark, one run.

The sections run one after the other in this process (their ratios are each
measured within one run) and go into one markdown file under a header saying
when, on what machine and at which commit.  A section module that is not
written yet is noted in the file; one that exists but fails stops the run.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

from benchmarks._machine import describe

# name -> module exposing ``section() -> str``, in the order they run
SECTIONS: dict[str, str] = {
    "kernels": "benchmarks.bench_kernels",  # P1, P2
    "kernels-avx2": "benchmarks.bench_avx2",  # P1, P2 at the AVX2 level on an AVX-512 host
    "qat": "benchmarks.bench_qat",
    "compile": "benchmarks.bench_compile",  # P4
    "transformer": "benchmarks.bench_transformer",  # latency vs torch, per-op share
}
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = "out/bench.md"  # `make bench` writes here; README.md quotes its tables


def load_section(module: str) -> Callable[[], str] | None:
    """The module's ``section``, or None when the module does not exist.

    Import errors inside an existing module propagate: a broken benchmark must
    fail the run, not vanish from the report.
    """
    if importlib.util.find_spec(module) is None:
        return None
    return importlib.import_module(module).section


def commit() -> str:
    """Short hash of HEAD, marked when the working tree differs from it."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head} (with uncommitted changes)" if dirty else head


def header() -> str:
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join(
        [
            "# qnorm benchmarks",
            "",
            f"- date: {date}",
            f"- machine: {describe()}",
            f"- commit: {commit()}",
        ]
    )


def report(sections: Sequence[str]) -> str:
    """The report's text: the header, then the sections' markdown in order."""
    return "\n\n".join([header(), *sections]) + "\n"


def run(names: Sequence[str]) -> str:
    """The report: the header, then each named section, measured now."""
    parts = []
    for name in names:
        section = load_section(SECTIONS[name])
        if section is None:
            parts.append(f"## {name}\n\n`{SECTIONS[name]}` does not exist yet: not measured.")
            continue
        start = time.perf_counter()
        parts.append(section())
        print(f"benchmarks: {name} took {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return report(parts)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(SECTIONS),
        default=list(SECTIONS),
        metavar="NAME",
        help=f"sections to run (default: all of {', '.join(SECTIONS)})",
    )
    args = parser.parse_args(argv)
    text = run(args.only)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"benchmarks: wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
