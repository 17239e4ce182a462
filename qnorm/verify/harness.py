"""Run every case on every backend, compare bit for bit, and report the matrix.

Per case: the golden op is built from the catalogue; the stored golden vectors
are loaded (every integrity check of :mod:`.golden_store`); then every backend
runs the stored vectors (expected: the stored outputs) and the run vectors of
:func:`.vectors.run_batches` (expected: the current golden model's outputs),
compared with ``np.array_equal`` on integer outputs — equality only.  A backend
stops at its first mismatch, which is recorded with its input vector.  The
golden outputs are also measured against the op's float reference
(``qnorm.metrics.error_in_lsb``): max and mean error in output LSB.
"""

from __future__ import annotations

import itertools
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qnorm.errors import UnknownTargetError
from qnorm.metrics import error_in_lsb
from qnorm.ops.base import IntOp
from qnorm.targets import known_targets
from qnorm.verify import backends, golden_store
from qnorm.verify.cases import Case
from qnorm.verify.vectors import Batch, as_vectors, run_batches, vector_location

ALWAYS = ("golden", "qat")  # columns every run has: the reference and the training path
OK, FAIL, SKIP = "ok", "FAIL", "skip"
COMPILED = "compiled"  # built for a target this machine cannot run: neither a pass nor a skip
REFUSED = "refused"  # the target's declared widths cannot run the op exactly: the contract, not a FAIL
LEGEND = (
    (
        "ok (N vectors): bit-exact on N vectors (a row of N for a norm, a row of C channels for a BN op, "
        "one neuron's T-step series)."
    ),
    (
        "golden: the stored vectors of qnorm/data/golden reproduced by the current golden model; other columns: "
        "those and this run's edge, exhaustive and random vectors, against the golden outputs."
    ),
    "err: the golden outputs against the float op, in output LSB.",
)


# --------------------------------------------------------------------------- columns


def resolve_columns(targets: list[str] | None) -> list[str]:
    """golden, qat, then the chosen targets (default: every known target and other backend).

    A name must be a known target (``qnorm/data/targets/*.toml``) or a registered backend.
    """
    known = known_targets()
    extra = [n for n in backends.registered() if n not in ALWAYS and n not in known]
    if not targets:
        chosen = known + extra
    else:
        unknown = [t for t in targets if t not in known and backends.get(t) is None]
        if unknown:
            others = ", ".join(n for n in backends.registered() if n not in known)
            raise UnknownTargetError(
                f"unknown target {', '.join(map(repr, unknown))}; known targets: {', '.join(known)}"
                + (f"; other backends: {others}" if others else "")
            )
        chosen = list(dict.fromkeys(targets))
    return list(ALWAYS) + [c for c in chosen if c not in ALWAYS]


def column_state(name: str) -> Cell | None:
    """None if the column can run here, else the cell every case gets: SKIP with the
    reason it is unavailable, or FAIL if asking the backend itself crashed."""
    backend = backends.get(name)
    if backend is None:
        return Cell(SKIP, reason=backends.NOT_IMPLEMENTED)
    try:
        reason = backend.unavailable()
    except Exception as err:  # noqa: BLE001 - e.g. a kernel module that exists but does not import
        return Cell(FAIL, reason=f"checking availability failed: {error_text(err)}")
    return None if reason is None else Cell(SKIP, reason=reason)


# --------------------------------------------------------------------------- results


@dataclass
class Mismatch:
    """The first vector whose output differs, with everything needed to reproduce it."""

    source: str  # which batch: golden, edge, exhaustive, random
    vector: int  # index of the vector within its batch
    location: str  # where it sits in the batch's op-layout input
    positions: list[int]  # indices within the vector where outputs differ
    input: list[int]
    expected: list[int]
    got: list[int]

    def describe(self) -> str:
        more = " …" if len(self.positions) > 16 else ""
        head = f"first mismatch in {self.source} vector {self.vector}, {self.location}, at positions "
        return "\n".join(
            [
                f"{head}{self.positions[:16]}{more}:",
                f"  input    {self.input}",
                f"  expected {self.expected}",
                f"  got      {self.got}",
            ]
        )


@dataclass
class Cell:
    status: str
    vectors: int = 0
    elements: int = 0
    via: str | None = None
    reason: str | None = None
    mismatch: Mismatch | None = None

    def label(self) -> str:
        if self.status == OK:
            return f"ok ({self.vectors} vectors)"
        return self.status

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status, "vectors": self.vectors, "elements": self.elements}
        if self.via is not None:
            out["via"] = self.via
        if self.reason is not None:
            out["reason"] = self.reason
        if self.mismatch is not None:
            out["mismatch"] = vars(self.mismatch)
        return out


@dataclass
class FloatError:
    """Golden outputs against the float reference, in output LSB, over every vector run."""

    max_lsb: float = 0.0
    total_lsb: float = 0.0
    within_1lsb: int = 0
    count: int = 0

    def add(self, op: IntOp, x: np.ndarray, y: np.ndarray) -> None:
        stats = error_in_lsb(y, op.out_fmt, op.float_reference(op.in_fmt.dequantize(x)))
        self.max_lsb = max(self.max_lsb, stats.max_lsb)
        self.total_lsb += stats.mean_lsb * stats.count
        self.within_1lsb += round(stats.within_1lsb * stats.count)
        self.count += stats.count

    def to_json(self) -> dict[str, Any]:
        mean = self.total_lsb / self.count if self.count else 0.0
        within = self.within_1lsb / self.count if self.count else 0.0
        return {"max_lsb": self.max_lsb, "mean_lsb": mean, "within_1lsb": within, "elements": self.count}


@dataclass
class CaseReport:
    case: Case
    cells: dict[str, Cell]
    error: FloatError | None
    seconds: float

    @property
    def failed(self) -> bool:
        return any(c.status == FAIL for c in self.cells.values())

    def summary(self) -> str:
        """``FAIL`` or ``ok``, then the cells that ran no vectors: skip, compiled, refused (``ok, 1 compiled``)."""
        counts = [(sum(c.status == s for c in self.cells.values()), s) for s in (SKIP, COMPILED, REFUSED)]
        return ", ".join(["FAIL" if self.failed else "ok", *(f"{n} {s}" for n, s in counts if n)])

    def to_json(self) -> dict[str, Any]:
        return {
            "case": self.case.name,
            "op": self.case.op,
            "config": golden_store.config_json(self.case),
            "seconds": round(self.seconds, 3),
            "error_vs_float": None if self.error is None else self.error.to_json(),
            "results": {name: cell.to_json() for name, cell in self.cells.items()},
        }


@dataclass
class Report:
    columns: list[str]
    states: dict[str, Cell | None]  # per column: None (runs here) or the cell every case got
    elements: int
    seed: int
    golden_dir: Path
    cases: list[CaseReport] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failures(self) -> list[tuple[CaseReport, str, Cell]]:
        return [(r, n, c) for r in self.cases for n, c in r.cells.items() if c.status == FAIL]

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def unproven(self) -> list[tuple[CaseReport, str, Cell]]:
        """Cells that proved nothing here and are not a refusal by contract: ``skip`` and
        ``compiled`` (``qnorm verify --strict`` fails on them)."""
        return [(r, n, c) for r in self.cases for n, c in r.cells.items() if c.status in (SKIP, COMPILED)]

    def to_json(self) -> dict[str, Any]:
        return {
            "qnorm_version": golden_store.qnorm_version(),
            "elements_per_case": self.elements,
            "seed": self.seed,
            "golden_dir": str(self.golden_dir),
            "columns": {
                name: {
                    "description": None if backends.get(name) is None else backends.get(name).description,
                    "available": self.states[name] is None,
                    "reason": None if self.states[name] is None else self.states[name].reason,
                }
                for name in self.columns
            },
            "cases": [r.to_json() for r in self.cases],
            "failures": len(self.failures),
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
        }

    def matrix(self) -> str:
        """The op × backend table, then skip reasons, how each column computed, and failures."""
        header = ["case", *self.columns, "max err (LSB)", "mean err (LSB)"]
        rows = []
        for r in self.cases:
            err = r.error.to_json() if r.error is not None and r.error.count else None
            rows.append(
                [
                    r.case.name,
                    *(r.cells[c].label() for c in self.columns),
                    "-" if err is None else f"{err['max_lsb']:.2f}",
                    "-" if err is None else f"{err['mean_lsb']:.3f}",
                ]
            )
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]]
        lines += self._notes()
        return "\n".join(lines)

    def _notes(self) -> list[str]:
        out = list(LEGEND)
        for name in self.columns:
            reasons = _grouped(self.cases, name, lambda c: c.reason if c.status == SKIP else None)
            out += [f"skip  {name}: {reason} ({cases})" for reason, cases in reasons]
            built = _grouped(self.cases, name, lambda c: c.reason if c.status == COMPILED else None)
            out += [f"built {name}: {reason} ({cases})" for reason, cases in built]
            refused = _grouped(self.cases, name, lambda c: c.reason if c.status == REFUSED else None)
            out += [f"refused {name}: {reason} ({cases})" for reason, cases in refused]
        for name in self.columns:
            vias = _grouped(self.cases, name, lambda c: c.via if c.status != SKIP else None)
            out += [f"via   {name}: {via} ({cases})" for via, cases in vias]
        for report, name, cell in self.failures:
            detail = cell.mismatch.describe() if cell.mismatch is not None else cell.reason
            out.append(f"FAIL  {report.case.name} × {name}: {detail}")
        fails, skips = len(self.failures), sum(c.status == SKIP for r in self.cases for c in r.cells.values())
        built = sum(c.status == COMPILED for r in self.cases for c in r.cells.values())
        refused = sum(c.status == REFUSED for r in self.cases for c in r.cells.values())
        out.append(
            f"{len(self.cases)} cases × {len(self.columns)} columns: {fails} FAIL, {skips} skip"
            + (f", {built} compiled, not run" if built else "")
            + (f", {refused} refused by target limits" if refused else "")
            + "; "
            f">= {self.elements} input elements per case (seed {self.seed}), {self.seconds:.1f} s"
        )
        return ["", *out]


def _grouped(reports: list[CaseReport], column: str, key: Callable[[Cell], str | None]) -> list[tuple[str, str]]:
    """(value, "every case" or "N cases: a, b, …") for each distinct value of ``key`` in a column."""
    groups: dict[str, list[str]] = {}
    for r in reports:
        value = key(r.cells[column])
        if value is not None:
            groups.setdefault(value, []).append(r.case.name)
    out = []
    for value, names in groups.items():
        if len(names) == len(reports):
            scope = "every case"
        else:
            scope = f"{len(names)} cases: {', '.join(names[:4])}{', …' if len(names) > 4 else ''}"
        out.append((value, scope))
    return out


# --------------------------------------------------------------------------- running


def error_text(err: BaseException) -> str:
    """An exception as ``Type: message (at file:line)``, for a cell's reason."""
    where = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    at = f" (at {Path(where.filename).name}:{where.lineno})" if where is not None else ""
    return f"{type(err).__name__}: {err}{at}"


def _compare(case: Case, batch: Batch, expected: np.ndarray, got: Any) -> tuple[bool, str | None, Mismatch | None]:
    """(equal, reason, first mismatch): integer outputs of the expected shape, bit-equal."""
    got = np.asarray(got)
    if got.dtype.kind not in "iu":
        return False, f"returned dtype {got.dtype}, not integers", None
    if got.shape != expected.shape:
        return False, f"returned shape {got.shape}, expected {expected.shape}", None
    if np.array_equal(got, expected):
        return True, None, None
    xv, ev, gv = (as_vectors(case, a) for a in (batch.x, expected, got))
    vector = int(np.flatnonzero((ev != gv).any(axis=1))[0])
    mismatch = Mismatch(
        source=batch.source,
        vector=vector,
        location=vector_location(case, batch.x.shape, vector),
        positions=np.flatnonzero(ev[vector] != gv[vector]).tolist(),
        input=xv[vector].tolist(),
        expected=ev[vector].tolist(),
        got=gv[vector].tolist(),
    )
    return False, None, mismatch


def _prepare(
    op: IntOp | None, columns: list[str], states: dict[str, Cell | None], build_error: str | None
) -> tuple[dict[str, Cell], dict[str, backends.Runner]]:
    cells: dict[str, Cell] = {}
    runners: dict[str, backends.Runner] = {}
    for name in columns:
        state = states[name]
        if state is not None:
            cells[name] = Cell(state.status, reason=state.reason)
        elif op is None:
            cells[name] = Cell(FAIL, reason=f"the case's golden op does not build: {build_error}")
        else:
            try:
                runners[name] = backends.get(name).prepare(op)
                cells[name] = Cell(OK, via=runners[name].via)
            except backends.Unsupported as err:
                cells[name] = Cell(SKIP, reason=str(err))
            except backends.NotRun as err:
                cells[name] = Cell(COMPILED, reason=str(err))
            except backends.Refused as err:
                cells[name] = Cell(REFUSED, reason=str(err))
            except Exception as err:  # noqa: BLE001 - any backend fault is that column's FAIL
                cells[name] = Cell(FAIL, reason=f"preparing the backend failed: {error_text(err)}")
    return cells, runners


def run_case(
    case: Case,
    columns: list[str],
    states: dict[str, Cell | None],
    elements: int,
    seed: int,
    golden_dir: Path,
    manifest: dict[str, Any] | None,
) -> CaseReport:
    start = time.perf_counter()
    try:
        op, build_error = case.build(), None
    except ValueError as err:
        op, build_error = None, str(err)
    cells, runners = _prepare(op, columns, states, build_error)
    if op is None:
        return CaseReport(case, cells, None, time.perf_counter() - start)
    batches: list[Batch] = []
    try:
        stored = golden_store.load(golden_dir, case, manifest)
        batches.append(Batch("golden", stored.x, stored.y))
    except golden_store.GoldenStoreError as err:
        if "golden" in runners:  # the regression check cannot run: that is its failure
            cells["golden"] = Cell(FAIL, reason=str(err))
            del runners["golden"]
    error = FloatError()
    for batch in itertools.chain(batches, run_batches(case, elements, seed)):
        expected = batch.expected if batch.expected is not None else op.forward(batch.x)
        error.add(op, batch.x, expected)
        for name, runner in list(runners.items()):
            if batch.source != "golden" and not backends.get(name).stream:
                continue
            cell = cells[name]
            try:
                equal, reason, mismatch = _compare(case, batch, np.asarray(expected), runner.run(batch.x))
            except Exception as err:  # noqa: BLE001 - a crash on some input is that column's FAIL
                equal, reason, mismatch = False, f"{batch.source} vectors: {error_text(err)}", None
            if equal:
                cell.vectors += batch.x.size // case.width
                cell.elements += batch.x.size
            else:
                cell.status, cell.reason, cell.mismatch = FAIL, reason, mismatch
                del runners[name]
    return CaseReport(case, cells, error, time.perf_counter() - start)


def verify(
    cases: list[Case],
    columns: list[str],
    elements: int,
    seed: int = 0,
    golden_dir: Path = golden_store.DEFAULT_DIR,
    progress: Callable[[CaseReport, int, int], None] | None = None,
) -> Report:
    """Run ``cases`` on ``columns``; ``progress(report, i, n)`` is called after each case."""
    start = time.perf_counter()
    states = {name: column_state(name) for name in columns}
    try:
        manifest = golden_store.read_manifest(golden_dir)
    except golden_store.GoldenStoreError:
        manifest = None  # each case then reports the store's error in its golden cell
    report = Report(columns, states, elements, seed, golden_dir)
    for i, case in enumerate(cases):
        report.cases.append(run_case(case, columns, states, elements, seed, golden_dir, manifest))
        if progress is not None:
            progress(report.cases[-1], i + 1, len(cases))
    report.seconds = time.perf_counter() - start
    return report
