"""P1 and P2 at the AVX2 level, measured on a host with AVX-512.

P1's speedup goal (>= 4x torch float32) is set for AVX2 hosts, where torch's float
LayerNorm is bound by its arithmetic; on an AVX-512 host both sides run their
512-bit code.  This section measures the same kernels and references with both
sides limited to AVX2 (``bench_kernels --isa avx2``), in a child process, because
torch picks its kernels' instruction set once, when it starts, from
``ATEN_CPU_CAPABILITY``.  On a host without AVX-512 the kernel section already ran
at the AVX2 level (or below), and this one says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_kernels import AVX2, AVX2_TITLE, TORCH_AVX2, host_has_avx512

REPO = Path(__file__).resolve().parent.parent
NOT_NEEDED = f"{AVX2_TITLE}\n\nThis host has no AVX-512: the kernel section above ran at its own level."


def section() -> str:
    """The AVX2-level P1/P2 section, measured now in a child process (or why not)."""
    if not host_has_avx512():
        return NOT_NEEDED
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "avx2.md"
        subprocess.run(
            [sys.executable, "-m", "benchmarks.bench_kernels", "--isa", AVX2, "--out", str(out)],
            cwd=REPO, env={**os.environ, **TORCH_AVX2}, check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        return out.read_text().strip()
