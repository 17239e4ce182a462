"""A written RTL layer folder's own testbench under Icarus Verilog: the compile's acceptance run.

``qnorm compile --target fpga-rtl`` writes, per layer, the unit's Verilog, a
self-checking testbench and the golden vectors (:mod:`compilers.rtl.testbench`).
Before compile succeeds, each folder's testbench runs here exactly as its README tells
a user to run it (:func:`compilers.rtl.project.icarus_command`, then ``vvp``), the
simulation binary kept out of the folder; its PASS line is the layer's acceptance.
"""

from __future__ import annotations

import shlex
import subprocess
import tempfile
from pathlib import Path

from compilers.rtl.project import icarus_command
from compilers.toolchains import icarus_unavailable

TIMEOUT_S = 600  # a layer's vectors simulate in well under a second; a hung testbench must not hang compile


class RtlSimError(RuntimeError):
    """A written layer's testbench did not build, did not pass, or did not finish."""


def acceptance(folder: Path, module: str) -> str:
    """Build and run ``folder``'s testbench of ``module``: its PASS line, or ``not run: <why>``
    where Icarus is missing; :class:`RtlSimError` with the testbench's output otherwise."""
    why = icarus_unavailable()
    if why is not None:
        return f"not run: {why}"
    folder = Path(folder)
    with tempfile.TemporaryDirectory(prefix="qnorm-icarus-") as tmp:
        binary = str(Path(tmp) / f"{module}_tb.vvp")
        build = shlex.split(icarus_command(module))
        build[build.index("-o") + 1] = binary
        done = _run(build, folder)
        if done.returncode == 0:
            done = _run(["vvp", "-n", binary], folder)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not lines[-1].startswith("PASS: "):
        report = "\n".join([*lines[-12:], *done.stderr.strip().splitlines()[-5:]]) or "(no output)"
        raise RtlSimError(f"{folder}: the testbench of the written unit failed (exit {done.returncode}):\n{report}\n"
                          "do not synthesize it")  # fmt: skip
    return lines[-1]


def _run(command: list[str], folder: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise RtlSimError(f"{folder}: `{shlex.join(command)}` ran longer than {TIMEOUT_S} s") from None
