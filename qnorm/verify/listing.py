"""``qnorm verify --list``: the cases and the columns, without running anything.

Each column says whether it runs here, only builds its kernels here (its cells
will be ``compiled``), or cannot run (its cells will be ``skip``), with the
reason, from the backends' availability checks alone: no kernel is built and
neither torch nor tvm is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qnorm.verify import backends, golden_store
from qnorm.verify.cases import Case
from qnorm.verify.harness import column_state, error_text

RUNS, BUILDS_ONLY, CANNOT_RUN = "runs here", "builds only", "cannot run"


@dataclass(frozen=True)
class ColumnPlan:
    """What a verify run would do with one column on this machine."""

    name: str
    state: str  # RUNS, BUILDS_ONLY or CANNOT_RUN
    reason: str | None  # why it does not run here (None when it runs)
    description: str | None  # the backend's description (None: no backend registered)

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "reason": self.reason, "description": self.description}


def column_plan(name: str) -> ColumnPlan:
    backend = backends.get(name)
    description = None if backend is None else backend.description
    state = column_state(name)
    if state is not None:
        return ColumnPlan(name, CANNOT_RUN, state.reason, description)
    try:
        why = backend.not_run()
    except Exception as err:  # noqa: BLE001 - a crashing check is reported, like column_state does
        why = f"checking for the hardware failed: {error_text(err)}"
    return ColumnPlan(name, RUNS if why is None else BUILDS_ONLY, why, description)


def listing_text(cases: list[Case], plans: list[ColumnPlan]) -> str:
    """The cases (name, op, config) and the columns (state, reason, description) as aligned text."""
    name_w = max(len(c.name) for c in cases)
    op_w = max(len(c.op) for c in cases)
    lines = [f"{len(cases)} cases:"]
    lines += [f"  {c.name.ljust(name_w)}  {c.op.ljust(op_w)}  {c.summary()}" for c in cases]
    col_w = max(len(p.name) for p in plans)
    lines += ["", f"{len(plans)} columns:"]
    for p in plans:
        state = p.state if p.reason is None else f"{p.state} ({p.reason})"
        lines.append(f"  {p.name.ljust(col_w)}  {state}" + ("" if p.description is None else f": {p.description}"))
    return "\n".join(lines)


def listing_json(cases: list[Case], plans: list[ColumnPlan]) -> dict[str, Any]:
    return {
        "cases": [{"case": c.name, "op": c.op, "config": golden_store.config_json(c)} for c in cases],
        "columns": {p.name: p.to_json() for p in plans},
    }
