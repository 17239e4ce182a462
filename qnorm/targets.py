"""Target descriptions: one TOML file per target in ``qnorm/data/targets/``, validated here.

A target says three things: what TVM should generate (the ``[tvm]`` table, passed
to ``tvm.target.Target`` as a dict), what the hardware can do exactly (``[hardware]``:
the analysis refuses configs a target cannot run, and ops can pick the cheapest
variant), and how a kernel is built and checked on a CPU-only box (``[build]``,
``[run]``).  This module only reads data: it must not import tvm (``import tvm``
takes seconds and ``import qnorm`` must stay fast).

The x86-64 description asks for the build machine's CPU (``mcpu = "host"``,
``vector_bits = "host"``).  Those resolve from ``/proc/cpuinfo`` flags to an
x86-64 micro-architecture level name (``x86-64-v2/v3/v4``), which LLVM accepts as
a CPU: the level, unlike a model name, names exactly the instruction set we may
use, and the compile cache keys on it.  (TVM 0.27 logs an error and silently falls
back to a generic CPU for ``mcpu = "native"`` or an unknown name, so never pass
those.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import tomllib

from qnorm.data import data_dir
from qnorm.errors import TargetError, UnknownTargetError

TARGETS_DIR = data_dir("targets")  # package data: found the same way installed or in a checkout

HOST = "host"  # placeholder resolved from the build machine's CPU at load time

ALIASES = {"x86": "x86_64"}  # other names a command line may use for a target
# What `qnorm compile` makes for each target it supports; any other target is refused.
COMPILE_TARGETS = {
    "x86_64": "the host CPU: the whole model",
    "aarch64": "the whole model as a C library and runner, no TVM runtime",
    "riscv64": "the whole model as a C library and runner, no TVM runtime",
    "opencl": "the whole model as one OpenCL program and launch plan",
    "cuda": "the whole model as CUDA source, PTX and cubins and a launch plan (run by scripts/gpu_check.sh)",
    "fpga-hls": "one HLS project per qnorm layer",
    "fpga-rtl": "one RTL unit per qnorm layer: Verilog, a self-checking testbench, a yosys script",
}

# Where `qnorm compile` builds the C API (a static library, header and runner): always
# for the boards, with --c-api for this CPU.
C_API_TARGETS = ("x86_64", "aarch64", "riscv64")

TVM_KINDS = ("llvm", "c", "cuda", "opencl")
# TVM target attributes a description may set, with their TOML types.
_TVM_KEYS: dict[str, type] = {
    "kind": str,
    "mcpu": str,
    "mtriple": str,
    "mattr": list,
    "mabi": str,
    "arch": str,
    "max_num_threads": int,
}

RUN_METHODS = ("native", "qemu-user", "pocl", "nvcc-compile-only", "gcc-csim", "rtl-sim")
# Fields each run method needs, beyond ``method``.
_RUN_REQUIRED: dict[str, tuple[str, ...]] = {
    "native": (),
    "qemu-user": ("emulator", "sysroot"),
    "pocl": ("platform",),
    "nvcc-compile-only": ("compile_args",),
    "gcc-csim": (),
    "rtl-sim": (),  # HDL simulation: Amaranth's simulator and Verilator (compilers.rtl)
}

# x86-64 psABI micro-architecture levels, highest first: the cpuinfo flags each
# needs (cpuinfo names; "abm" is how Linux reports LZCNT) and its vector width.
_X86_LEVELS: tuple[tuple[str, frozenset[str], int], ...] = (
    ("x86-64-v4", frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}), 512),
    (
        "x86-64-v3",
        frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}),
        256,
    ),
    ("x86-64-v2", frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}), 128),
)
_X86_BASELINE = ("x86-64", 128)  # SSE2 is part of x86-64 itself


@dataclass(frozen=True)
class Hardware:
    """What the target computes exactly, in bits (0 vector bits: no SIMD registers)."""

    accumulator_bits: int
    multiplier_bits: int
    has_divider: bool
    vector_bits: int
    max_threads: int | None = None  # threads per block/work-group; None: no fixed limit
    # The kernels the target runs take a norm's per-row multiplier and offset modulo
    # 2^lanes (TVM's: x·a − c is formed in unsigned lanes), so they hold the values the
    # row accumulates before its exact left shift; False: every value at its full width
    wraps_lane_constants: bool = False


@dataclass(frozen=True)
class Build:
    """How a kernel library is compiled and linked for the target."""

    cc: str  # C compiler driver used to link TVM's objects (a cross gcc for edge CPUs)
    cflags: tuple[str, ...] = ()
    debian_packages: tuple[str, ...] = ()  # what provides ``cc`` on Debian
    part: str | None = None  # FPGA part an HLS project synthesizes for (Vitis ``set_part``)
    clock_period_ns: int | None = None  # HLS clock target (Vitis ``create_clock -period``)


@dataclass(frozen=True)
class Run:
    """How a built kernel is executed and checked on a CPU-only machine."""

    method: str  # one of RUN_METHODS
    emulator: str | None = None  # qemu-user binary
    sysroot: str | None = None  # qemu-user ``-L`` path holding the target's libc
    platform: str | None = None  # OpenCL platform name (PoCL)
    compile_args: tuple[str, ...] = ()  # nvcc arguments for the compile-only check
    debian_packages: tuple[str, ...] = ()


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    tvm: Mapping[str, Any]  # TVM target dict, "host" placeholders resolved
    tvm_host: Mapping[str, Any] | None  # host-side TVM target of a device target
    hardware: Hardware
    build: Build
    run: Run
    path: Path

    @property
    def runs_natively(self) -> bool:
        return self.run.method == "native"

    def tvm_spec(self) -> dict[str, Any]:
        """The TVM target as a plain dict (lists for list attributes), for
        ``tvm.target.Target(spec, host=...)`` and for cache keys."""
        return _plain(self.tvm)

    def tvm_host_spec(self) -> dict[str, Any] | None:
        return None if self.tvm_host is None else _plain(self.tvm_host)


# --------------------------------------------------------------------------- loading


def known_targets(directory: Path = TARGETS_DIR) -> list[str]:
    """Names of the target descriptions in ``directory`` (file stems), sorted."""
    return sorted(p.stem for p in directory.glob("*.toml"))


def target_name(name: str, directory: Path = TARGETS_DIR) -> str:
    """The description ``name`` stands for (``x86`` is ``x86_64``); an unknown name is an
    :class:`UnknownTargetError` listing the known ones.  Reads file names only, so the
    command line checks ``--target`` with it before anything heavy loads."""
    name = ALIASES.get(name, name)
    _require_known(name, directory)
    return name


def _require_known(name: str, directory: Path) -> None:
    known = known_targets(directory)
    if name not in known:
        raise UnknownTargetError(f"unknown target {name!r}; known targets: {', '.join(known) or '(none)'}")


def compile_target_name(name: str, directory: Path = TARGETS_DIR) -> str:
    """The target ``qnorm compile`` builds for ``name``, or :class:`UnknownTargetError`
    for an unknown name or one compile does not support."""
    name = target_name(name, directory)
    if name not in COMPILE_TARGETS:
        raise not_compiled_for(name)
    return name


def not_compiled_for(name: str) -> UnknownTargetError:
    """The error for a known target that ``qnorm compile`` (or a compile path) does not support."""
    supported = " and ".join(f"{n} ({what})" for n, what in COMPILE_TARGETS.items())
    return UnknownTargetError(f"target {name!r} is not supported by compile yet; supported: {supported}")


def load_target(name: str, directory: Path = TARGETS_DIR, cpuinfo: str | None = None) -> Target:
    """Load and validate ``<directory>/<name>.toml``.

    ``cpuinfo`` replaces the text of /proc/cpuinfo when resolving ``"host"``
    fields (tests feed fixed flag sets through it).
    """
    _require_known(name, directory)
    return load_target_file(directory / f"{name}.toml", cpuinfo=cpuinfo)


def debian_packages(directory: Path = TARGETS_DIR) -> list[str]:
    """Every Debian package the targets in ``directory`` build or run with, sorted
    (what ``make toolchains`` installs)."""
    needed: set[str] = set()
    for name in known_targets(directory):
        target = load_target(name, directory)
        needed.update(target.build.debian_packages, target.run.debian_packages)
    return sorted(needed)


def load_target_file(path: Path, cpuinfo: str | None = None) -> Target:
    """Parse and validate one description; every error names the file and field."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise TargetError(f"{path}: malformed TOML: {e}") from None
    r = _Reader(path, doc, "")
    r.only({"name", "description", "tvm", "hardware", "build", "run"})
    name = r.req("name", str)
    if name != path.stem:
        raise TargetError(f"{path}: field 'name' is {name!r} but the file is {path.stem}.toml")
    description = r.req("description", str)
    tvm_table = r.table("tvm")
    tvm, tvm_host = _tvm_spec(tvm_table)
    hw = _hardware(r.table("hardware"))
    build = _build(r.table("build"))
    run = _run(r.table("run"))

    host_fields = [
        f
        for f, v in (("tvm.mcpu", tvm.get("mcpu")), ("hardware.vector_bits", hw.vector_bits))
        if v == HOST
    ]
    if host_fields:
        if run.method != "native":
            raise TargetError(
                f"{path}: {', '.join(host_fields)} = 'host' needs run.method = 'native'"
            )
        level, vbits = detect_x86_level(read_cpuinfo() if cpuinfo is None else cpuinfo, path)
        if tvm.get("mcpu") == HOST:
            tvm["mcpu"] = level
        if hw.vector_bits == HOST:
            hw = replace(hw, vector_bits=vbits)
    return Target(
        name=name,
        description=description,
        tvm=MappingProxyType(tvm),
        tvm_host=None if tvm_host is None else MappingProxyType(tvm_host),
        hardware=hw,
        build=build,
        run=run,
        path=path,
    )


# --------------------------------------------------------------------------- host CPU


def read_cpuinfo() -> str:
    """The text of /proc/cpuinfo ("" where there is none)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The ``flags`` of the first processor in a /proc/cpuinfo text (x86 only)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def detect_x86_level(cpuinfo: str, path: Path | str = "/proc/cpuinfo") -> tuple[str, int]:
    """(LLVM CPU name, vector bits) of the highest x86-64 level the flags cover."""
    flags = cpu_flags(cpuinfo)
    if not flags or "lm" not in flags:
        raise TargetError(
            f"{path}: 'host' needs an x86-64 build machine, but /proc/cpuinfo lists no x86-64 flags"
        )
    for level, needs, vbits in _X86_LEVELS:
        if needs <= flags:
            return level, vbits
    return _X86_BASELINE


# --------------------------------------------------------------------------- schema


class _Reader:
    """Typed access to one TOML table; errors say file and dotted field name."""

    def __init__(self, path: Path, table: Any, prefix: str) -> None:
        self.path, self.prefix = path, prefix
        if not isinstance(table, dict):
            raise TargetError(
                f"{path}: field '{prefix.rstrip('.')}' must be a table, got {_tname(table)}"
            )
        self.t = table

    def field(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def fail(self, key: str, msg: str) -> TargetError:
        return TargetError(f"{self.path}: field '{self.field(key)}' {msg}")

    def only(self, allowed: set[str]) -> None:
        extra = sorted(set(self.t) - allowed)
        if extra:
            raise self.fail(
                extra[0], f"is not part of the schema (allowed here: {', '.join(sorted(allowed))})"
            )

    def req(self, key: str, typ: type) -> Any:
        if key not in self.t:
            raise self.fail(key, "is missing")
        return self._typed(key, typ)

    def opt(self, key: str, typ: type, default: Any = None) -> Any:
        return self._typed(key, typ) if key in self.t else default

    def table(self, key: str) -> _Reader:
        if key not in self.t:
            raise self.fail(key, "is missing")
        return _Reader(self.path, self.t[key], self.field(key) + ".")

    def strings(self, key: str) -> tuple[str, ...]:
        vals = self.opt(key, list, [])
        if not all(isinstance(v, str) for v in vals):
            raise self.fail(key, "must be a list of strings")
        return tuple(vals)

    def int_in(self, key: str, lo: int, hi: int, allow_host: bool = False) -> Any:
        v = self.t.get(key)
        if allow_host and v == HOST:
            return HOST
        v = self.req(key, int)
        if not lo <= v <= hi:
            raise self.fail(key, f"must be in [{lo}, {hi}], got {v}")
        return v

    def _typed(self, key: str, typ: type) -> Any:
        v = self.t[key]
        # bool is an int subclass in Python; a TOML `true` is never a bit width.
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise self.fail(key, f"must be {_TOML_TYPE[typ]}, got {_tname(v)} {v!r}")
        return v


_TOML_TYPE = {
    int: "an integer",
    bool: "a boolean",
    str: "a string",
    list: "an array",
    dict: "a table",
}


def _tname(v: Any) -> str:
    return {dict: "table", list: "array", str: "string", bool: "boolean", int: "integer"}.get(
        type(v), type(v).__name__
    )


def _tvm_spec(r: _Reader) -> tuple[dict[str, Any], dict[str, Any] | None]:
    r.only(set(_TVM_KEYS) | {"host"})
    spec = _tvm_attrs(r)
    host = None
    if "host" in r.t:
        hr = r.table("host")
        hr.only(set(_TVM_KEYS))
        host = _tvm_attrs(hr)
        if host["kind"] not in ("llvm", "c"):
            raise hr.fail("kind", f"of a host target must be llvm or c, got {host['kind']!r}")
    if spec["kind"] in ("cuda", "opencl") and host is None:
        raise r.fail("host", f"is missing: a {spec['kind']} target needs a host target table")
    return spec, host


def _tvm_attrs(r: _Reader) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    for key, typ in _TVM_KEYS.items():
        if key == "mattr":
            if key in r.t:
                spec[key] = list(r.strings(key))
        elif key == "kind":
            spec[key] = r.req(key, str)
        elif key in r.t:
            spec[key] = r.req(key, typ)
    if spec["kind"] not in TVM_KINDS:
        raise r.fail("kind", f"must be one of {', '.join(TVM_KINDS)}, got {spec['kind']!r}")
    if spec.get("mcpu") == "native":
        raise r.fail("mcpu", "must not be 'native' (TVM falls back to a generic CPU); use 'host'")
    return spec


def _hardware(r: _Reader) -> Hardware:
    r.only({"accumulator_bits", "multiplier_bits", "has_divider", "vector_bits", "max_threads", "wraps_lane_constants"})
    acc = r.int_in("accumulator_bits", 8, 128)
    mul = r.int_in("multiplier_bits", 2, 64)
    if mul > acc:
        raise r.fail("multiplier_bits", f"({mul}) exceeds accumulator_bits ({acc})")
    max_threads = r.opt("max_threads", int)
    if max_threads is not None and max_threads < 1:
        raise r.fail("max_threads", f"must be >= 1, got {max_threads}")
    return Hardware(
        accumulator_bits=acc,
        multiplier_bits=mul,
        has_divider=r.req("has_divider", bool),
        vector_bits=r.int_in("vector_bits", 0, 4096, allow_host=True),
        max_threads=max_threads,
        wraps_lane_constants=r.opt("wraps_lane_constants", bool, False),
    )


def _build(r: _Reader) -> Build:
    r.only({"cc", "cflags", "debian_packages", "part", "clock_period_ns"})
    clock = r.opt("clock_period_ns", int)
    if clock is not None and clock < 1:
        raise r.fail("clock_period_ns", f"must be >= 1, got {clock}")
    return Build(
        cc=r.req("cc", str),
        cflags=r.strings("cflags"),
        debian_packages=r.strings("debian_packages"),
        part=r.opt("part", str),
        clock_period_ns=clock,
    )


def _run(r: _Reader) -> Run:
    r.only({"method", "emulator", "sysroot", "platform", "compile_args", "debian_packages"})
    method = r.req("method", str)
    if method not in RUN_METHODS:
        raise r.fail("method", f"must be one of {', '.join(RUN_METHODS)}, got {method!r}")
    for key in _RUN_REQUIRED[method]:
        if key not in r.t:
            raise r.fail(key, f"is missing (run.method = {method!r} needs it)")
    return Run(
        method=method,
        emulator=r.opt("emulator", str),
        sysroot=r.opt("sysroot", str),
        platform=r.opt("platform", str),
        compile_args=r.strings("compile_args"),
        debian_packages=r.strings("debian_packages"),
    )


def _plain(spec: Mapping[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in spec.items()}
