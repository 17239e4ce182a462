"""Whether this machine has the tools a target builds and runs with.

Only checks: PATH lookups, files in a sysroot, one OpenCL platform query and one
``nvidia-smi`` call, never a tvm import.  ``qnorm verify`` asks every column
whether it can run here before any kernel is built, and ``qnorm verify --list``
answers from these checks alone, so they must cost milliseconds, not the
seconds tvm takes to import.  The modules that build and run the kernels
(:mod:`compilers.tvm.cross`, :mod:`compilers.tvm.opencl`, :mod:`compilers.tvm.cuda`,
:mod:`compilers.fpga.csim`, :mod:`compilers.rtl.icarus`) and the built models
(``unavailable()``) use the same checks.
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
import subprocess
from pathlib import Path
from typing import Any

from qnorm.targets import Target

NVCC = "nvcc"


def cross_tools_missing(target: Target) -> str | None:
    """None when this machine can link and emulate a qemu-user ``target``'s kernels,
    else what is missing and the Debian packages that provide it."""
    needs = [
        (target.build.cc, shutil.which(target.build.cc) is not None, target.build.debian_packages),
        (target.run.emulator, shutil.which(target.run.emulator) is not None, target.run.debian_packages),
    ]
    libc = Path(target.run.sysroot, "lib", "libc.a" if "-static" in target.build.cflags else "libc.so.6")
    needs.append((str(libc), libc.exists(), target.build.debian_packages))
    missing = [(what, pkgs) for what, found, pkgs in needs if not found]
    if not missing:
        return None
    what = ", ".join(w for w, _ in missing)
    pkgs = " ".join(dict.fromkeys(p for _, ps in missing for p in ps))
    return f"{what} not found (Debian: apt-get install {pkgs})"


def emulator_unavailable(target: Target) -> str | None:
    """None when ``target``'s qemu-user emulator (what runs its binaries here) is on PATH,
    else what is missing; None too for a target whose binaries run natively."""
    run = target.run
    if run.method != "qemu-user" or shutil.which(run.emulator) is not None:
        return None
    return f"{run.emulator} not found (Debian: apt-get install {' '.join(run.debian_packages)})"


def icarus_unavailable() -> str | None:
    """None when Icarus Verilog (``iverilog``, ``vvp``) runs here, else what is missing."""
    missing = [t for t in ("iverilog", "vvp") if shutil.which(t) is None]
    return f"{', '.join(missing)} not found (Debian: apt-get install iverilog)" if missing else None


def compiler_unavailable(target: Target) -> str | None:
    """None if the target's C compiler is on PATH, else why the C simulation cannot run."""
    if shutil.which(target.build.cc) is None:
        return f"unavailable: C compiler {target.build.cc!r} (build.cc of {target.path.name}) is not on PATH"
    return None


def nvcc_unavailable() -> str | None:
    """None if nvcc runs here, else what is missing."""
    if shutil.which(NVCC) is None:
        return f"{NVCC} not found on PATH (the CUDA toolkit compiles the kernels)"
    return None


@functools.cache
def gpu_compute_capability() -> str | None:
    """The first CUDA GPU's architecture (``sm_90``), or None when this machine has none."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    )
    caps = done.stdout.split() if done.returncode == 0 else []
    return f"sm_{caps[0].replace('.', '')}" if caps else None


def opencl_unavailable(target: Target) -> str | None:
    """None if the OpenCL platform ``target`` runs on (PoCL) has a device here, else what is missing."""
    if importlib.util.find_spec("pyopencl") is None:
        return "pyopencl is not installed (pip install pyopencl)"
    try:
        opencl_device(target)
    except LookupError as err:
        return str(err)
    return None


def opencl_device(target: Target) -> Any:
    """The first device of ``target``'s OpenCL platform; LookupError naming what to install."""
    return _opencl_device(target.run.platform, " ".join(target.run.debian_packages) or "an OpenCL ICD")


@functools.cache
def _opencl_device(platform: str, packages: str) -> Any:
    import pyopencl as cl

    try:
        platforms = cl.get_platforms()
    except cl.Error as err:  # no ICD loader configuration at all
        raise LookupError(f"no OpenCL platform ({err}); install {packages}") from None
    found = [p for p in platforms if p.name == platform]
    if not found:
        names = ", ".join(repr(p.name) for p in platforms) or "none"
        raise LookupError(f"OpenCL platform {platform!r} not found (platforms: {names}); install {packages}")
    devices = found[0].get_devices()
    if not devices:
        raise LookupError(f"OpenCL platform {platform!r} has no device")
    return devices[0]
