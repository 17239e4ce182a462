"""Facts about the machine a benchmark ran on, for the report headers."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.processor() or "unknown CPU"


def usable_cpus() -> int:
    """Logical CPUs this process may run on (its affinity mask, not the host's total)."""
    return len(os.sched_getaffinity(0))


def describe() -> str:
    """One line: CPU model, usable logical CPUs, OS."""
    return f"{cpu_model()}, {usable_cpus()} logical CPUs usable, {platform.system()} {platform.release()}"
