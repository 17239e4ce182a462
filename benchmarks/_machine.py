"""Facts about the machine a benchmark ran on, for the report headers."""

from __future__ import annotations

import os
import platform

from qnorm.targets import read_cpuinfo


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere),
    with its family and model numbers: a virtual machine may name only the vendor's
    line ("AMD EPYC"), and the numbers tell its generations apart (family 25: Zen 3
    and Zen 4, 26: Zen 5)."""
    if cpuinfo is None:
        cpuinfo = read_cpuinfo()
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


def usable_cpus() -> int:
    """Logical CPUs this process may run on (its affinity mask, not the host's total)."""
    return len(os.sched_getaffinity(0))


def describe() -> str:
    """One line: CPU model, usable logical CPUs, OS."""
    return f"{cpu_model()}, {usable_cpus()} logical CPUs usable, {platform.system()} {platform.release()}"
