"""Copy the measured tables from the reports in out/ into README.md, or list those that differ.

README.md marks every table it quotes from a report that a command writes:

    <!-- from: out/error_table.md, section "Norms", table 2 (make demo) -->

    | op | rows | N=64 | ...
    |---|---|---|
    ...

    <!-- end -->

The path is relative to the README's directory.  ``section "S"`` selects the one
heading of the report whose text starts with S, down to the next heading of the same
or a higher level (without it: the whole report); ``table N`` the N-th table in that
text (default 1); the parenthesis names the command that writes the report.  Both
marker comments stand on lines of their own.

    python scripts/readme_tables.py --check    # exit 1 when a quoted table differs from its report
    python scripts/readme_tables.py --update   # copy each report's table between its markers

Only the standard library: it runs without qnorm or its dependencies installed.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_README = Path(__file__).resolve().parents[1] / "README.md"
END = "<!-- end -->"
_OPEN = re.compile(
    r'<!-- from: (?P<source>[^\s,()]+)'
    r'(?:, section "(?P<section>[^"]+)")?'
    r"(?:, table (?P<table>[1-9][0-9]*))?"
    r" \((?P<command>[^()]+)\) -->"
)
_HEADING = re.compile(r"(#{1,6})\s+(.*?)\s*$")


class MarkerError(ValueError):
    """README.md's markers are malformed: an unclosed, stray or unreadable comment."""


class SourceError(ValueError):
    """A marker's report is missing, or lacks the section or table the marker names."""


@dataclass(frozen=True)
class Marker:
    """One quoted table: where its report is, and where the quote sits in the README."""

    source: str
    section: str | None
    table: int
    command: str
    start: int  # 0-based index of the opening comment's line
    end: int  # 0-based index of the closing comment's line

    @property
    def line(self) -> int:
        """1-based line number of the opening comment, for messages."""
        return self.start + 1

    def describe(self) -> str:
        section = f', section "{self.section}"' if self.section else ""
        return f"{self.source}{section}, table {self.table} ({self.command})"


def parse_markers(text: str) -> list[Marker]:
    """Every marker of README text, in order; MarkerError names the line of a malformed one."""
    markers: list[Marker] = []
    opened: tuple[int, re.Match[str]] | None = None
    for i, raw in enumerate(text.split("\n")):
        line = raw.strip()
        if line.startswith("<!-- from:"):
            match = _OPEN.fullmatch(line)
            if match is None:
                raise MarkerError(f"line {i + 1}: cannot read the marker {line!r}; expected "
                                  '<!-- from: PATH[, section "HEADING"][, table N] (COMMAND) -->')
            if opened is not None:
                raise MarkerError(f"line {i + 1}: a marker opens before the one on line "
                                  f"{opened[0] + 1} is closed by {END}")
            opened = (i, match)
        elif line == END:
            if opened is None:
                raise MarkerError(f"line {i + 1}: {END} without an opening <!-- from: ... --> marker")
            start, match = opened
            markers.append(Marker(match["source"], match["section"], int(match["table"] or 1),
                                  match["command"].strip(), start, i))
            opened = None
    if opened is not None:
        raise MarkerError(f"line {opened[0] + 1}: the marker is never closed by {END}")
    return markers


def section_lines(text: str, section: str | None) -> list[str]:
    """The lines under the one heading that starts with `section` (all lines for None)."""
    lines = text.split("\n")
    if section is None:
        return lines
    headings = [(i, len(m[1]), m[2]) for i, m in ((i, _HEADING.fullmatch(line)) for i, line in enumerate(lines))
                if m is not None]
    found = [(i, level) for i, level, title in headings if title.startswith(section)]
    if len(found) != 1:
        titles = "; ".join(title for _, _, title in headings) or "none"
        what = "no heading" if not found else f"{len(found)} headings"
        raise SourceError(f'{what} starting with "{section}" (headings: {titles})')
    start, level = found[0]
    end = next((i for i, lvl, _ in headings if i > start and lvl <= level), len(lines))
    return lines[start + 1:end]


def tables(lines: Sequence[str]) -> list[list[str]]:
    """The markdown tables among `lines`: each run of consecutive lines starting with '|'."""
    found: list[list[str]] = []
    current: list[str] = []
    for line in [*lines, ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            found.append(current)
            current = []
    return found


def extract_table(text: str, section: str | None, table: int) -> list[str]:
    """The `table`-th table (1-based) of `section` in a report's text."""
    candidates = tables(section_lines(text, section))
    if not 1 <= table <= len(candidates):
        where = f'section "{section}"' if section else "the report"
        raise SourceError(f"{where} has {len(candidates)} table(s), not a table {table}")
    return candidates[table - 1]


def source_table(root: Path, marker: Marker) -> list[str]:
    """The table a marker quotes, read from its report under `root` (the README's directory)."""
    path = root / marker.source
    if not path.is_file():
        raise SourceError(f"{marker.source} does not exist: run `{marker.command}` first")
    try:
        return extract_table(path.read_text(encoding="utf-8"), marker.section, marker.table)
    except SourceError as err:
        raise SourceError(f"{marker.source}: {err}") from None


def quoted(lines: Sequence[str], marker: Marker) -> list[str]:
    """What the README holds between a marker's comments, without the blank lines at its ends."""
    body = list(lines[marker.start + 1:marker.end])
    while body and not body[0].strip():
        body.pop(0)
    while body and not body[-1].strip():
        body.pop()
    return body


@dataclass(frozen=True)
class Outcome:
    """A marker compared with its report: `table` None when the report could not be read."""

    marker: Marker
    current: list[str]
    table: list[str] | None
    problem: str | None = None

    @property
    def differs(self) -> bool:
        return self.table is not None and self.table != self.current


def compare(readme: Path) -> list[Outcome]:
    """Every marker of `readme` next to the table its report holds now."""
    text = readme.read_text(encoding="utf-8")
    lines = text.split("\n")
    outcomes = []
    for marker in parse_markers(text):
        try:
            table: list[str] | None = source_table(readme.parent, marker)
            problem = None
        except SourceError as err:
            table, problem = None, str(err)
        outcomes.append(Outcome(marker, quoted(lines, marker), table, problem))
    return outcomes


def update(readme: Path) -> list[Outcome]:
    """Write every readable report's table between its markers; the comparison made before."""
    outcomes = compare(readme)
    lines = readme.read_text(encoding="utf-8").split("\n")
    # Bottom up, so the line indices of the markers still to be replaced stay valid.
    for o in reversed(outcomes):
        if o.table is not None and o.differs:
            # Blank lines around the table: it renders as a table, apart from the comments.
            lines[o.marker.start + 1:o.marker.end] = ["", *o.table, ""]
    if any(o.differs for o in outcomes):
        readme.write_text("\n".join(lines), encoding="utf-8")
    return outcomes


def _report(readme: Path, outcomes: Sequence[Outcome], updating: bool) -> int:
    """Print what differs or could not be read; the exit status (1 when anything is left to do)."""
    name = readme.name
    for o in outcomes:
        where = f"{name}:{o.marker.line}: {o.marker.describe()}"
        if o.table is None:
            print(f"{where}: {o.problem}")
        elif o.differs and updating:
            print(f"{where}: updated")
        elif o.differs:
            print(f"{where}: differs from the report")
            diff = difflib.unified_diff(o.current, o.table, f"{name} (line {o.marker.line})",
                                        o.marker.source, lineterm="", n=0)
            print("\n".join(f"    {line}" for line in diff))
    changed = sum(o.differs for o in outcomes)
    unreadable = sum(o.table is None for o in outcomes)
    same = len(outcomes) - changed - unreadable
    verb = "updated" if updating else "differ"
    print(f"{len(outcomes)} quoted table(s): {same} as in their reports, {changed} {verb}, "
          f"{unreadable} without a readable report")
    return 1 if unreadable or (changed and not updating) else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="readme_tables.py", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true",
                      help="list the quoted tables that differ from their reports (exit 1 if any)")
    mode.add_argument("--update", action="store_true",
                      help="copy every report's table between its markers")
    parser.add_argument("--readme", type=Path, default=DEFAULT_README,
                        help="the README to check or update; report paths are relative to its "
                             "directory (default: this checkout's README.md)")
    args = parser.parse_args(argv)
    try:
        outcomes = update(args.readme) if args.update else compare(args.readme)
    except (MarkerError, OSError) as err:
        print(f"readme_tables.py: error: {args.readme}: {err}", file=sys.stderr)
        return 2
    return _report(args.readme, outcomes, args.update)


if __name__ == "__main__":
    sys.exit(main())
