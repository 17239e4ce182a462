"""Target descriptions: every file loads, the schema rejects what it should, the
host CPU resolves to a level LLVM accepts, and TVM takes every description."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from qnorm import targets as tg
from qnorm.targets import RUN_METHODS, Target, known_targets, load_target, load_target_file

ALL = ["aarch64", "cuda", "fpga-hls", "fpga-rtl", "opencl", "riscv64", "x86_64"]

VALID = """\
name = "t"
description = "a test target"

[tvm]
kind = "llvm"
mcpu = "x86-64-v3"

[hardware]
accumulator_bits = 64
multiplier_bits = 32
has_divider = true
vector_bits = 256

[build]
cc = "gcc"

[run]
method = "native"
"""


def write(tmp_path: Path, text: str, name: str = "t") -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def cpuinfo(*flags: str) -> str:
    return (
        "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: "
        + " ".join(flags)
        + "\n\nprocessor\t: 1\n"
    )


BASE = ("fpu", "lm", "sse", "sse2")
V2 = BASE + ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3")
V3 = V2 + ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
V4 = V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")


# --------------------------------------------------------------------------- the shipped files


def test_known_targets_are_the_shipped_files():
    assert known_targets() == ALL


@pytest.mark.parametrize("name", ALL)
def test_every_description_loads(name):
    t = load_target(name)
    assert isinstance(t, Target) and t.name == name and t.description
    assert t.run.method in RUN_METHODS
    assert t.hardware.multiplier_bits <= t.hardware.accumulator_bits
    assert "host" not in t.tvm.values() and t.hardware.vector_bits != "host"
    assert t.tvm_spec()["kind"] in tg.TVM_KINDS


def test_facts_the_analysis_relies_on():
    hls, cuda, x86 = load_target("fpga-hls"), load_target("cuda"), load_target("x86_64")
    assert (
        hls.hardware.accumulator_bits,
        hls.hardware.multiplier_bits,
        hls.hardware.has_divider,
    ) == (48, 18, False)
    assert cuda.tvm_host_spec() == {"kind": "llvm"} and cuda.hardware.max_threads == 1024
    assert x86.runs_natively and x86.hardware.has_divider
    # TVM's kernels take a norm's per-row constants modulo the lanes; the RTL builds them whole
    assert hls.hardware.wraps_lane_constants and not load_target("fpga-rtl").hardware.wraps_lane_constants
    assert load_target("aarch64").run.emulator == "qemu-aarch64"


def test_import_qnorm_targets_does_not_import_tvm():
    code = "import qnorm.targets as t, sys; t.load_target('x86_64'); print('tvm' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["False", "False"]


def test_unknown_target_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown target 'z80'") as e:
        load_target("z80")
    for name in ALL:
        assert name in str(e.value)


# --------------------------------------------------------------------------- schema errors


def test_valid_template_loads(tmp_path):
    t = load_target_file(write(tmp_path, VALID))
    assert t.tvm_spec() == {"kind": "llvm", "mcpu": "x86-64-v3"} and t.hardware.vector_bits == 256


def test_malformed_toml_names_the_file(tmp_path):
    path = write(tmp_path, VALID.replace('cc = "gcc"', "cc = gcc"))
    with pytest.raises(ValueError, match="malformed TOML") as e:
        load_target_file(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize(
    "line,field",
    [
        ('name = "t"\n', "name"),
        ('description = "a test target"\n', "description"),
        ('kind = "llvm"\n', "tvm.kind"),
        ("accumulator_bits = 64\n", "hardware.accumulator_bits"),
        ("has_divider = true\n", "hardware.has_divider"),
        ("vector_bits = 256\n", "hardware.vector_bits"),
        ('cc = "gcc"\n', "build.cc"),
        ('method = "native"\n', "run.method"),
        ("[build]\n", "build"),
    ],
)
def test_missing_field_is_named(tmp_path, line, field):
    text = VALID.replace(line, "")
    if line == "[build]\n":
        text = text.replace('cc = "gcc"\n', "")
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=f"field '{field}' is missing") as e:
        load_target_file(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize(
    "old,new,field,why",
    [
        (
            "accumulator_bits = 64",
            'accumulator_bits = "64"',
            "hardware.accumulator_bits",
            "must be an integer, got string",
        ),
        (
            "has_divider = true",
            "has_divider = 1",
            "hardware.has_divider",
            "must be a boolean, got integer",
        ),
        (
            "has_divider = true",
            "has_divider = true\nwraps_lane_constants = 1",
            "hardware.wraps_lane_constants",
            "must be a boolean, got integer",
        ),
        (
            "vector_bits = 256",
            "vector_bits = true",
            "hardware.vector_bits",
            "must be an integer, got boolean",
        ),
        (
            "vector_bits = 256",
            "vector_bits = 256.0",
            "hardware.vector_bits",
            "must be an integer, got float",
        ),
        ('mcpu = "x86-64-v3"', 'mattr = "+avx2"', "tvm.mattr", "must be an array, got string"),
        ('mcpu = "x86-64-v3"', "mattr = [1, 2]", "tvm.mattr", "list of strings"),
        ('kind = "llvm"', 'kind = "vulkan"', "tvm.kind", "must be one of"),
        ('mcpu = "x86-64-v3"', 'mcpu = "native"', "tvm.mcpu", "must not be 'native'"),
        (
            "multiplier_bits = 32",
            "multiplier_bits = 72",
            "hardware.multiplier_bits",
            r"must be in \[2, 64\]",
        ),
        (
            "multiplier_bits = 32",
            "multiplier_bits = 64\nmax_threads = 0",
            "hardware.max_threads",
            ">= 1",
        ),
        (
            "accumulator_bits = 64",
            "accumulator_bits = 16",
            "hardware.multiplier_bits",
            "exceeds accumulator_bits",
        ),
        ('method = "native"', 'method = "simulate"', "run.method", "must be one of"),
        ('method = "native"', 'method = "qemu-user"\nsysroot = "/x"', "run.emulator", "needs it"),
        (
            'cc = "gcc"',
            'cc = "gcc"\ncompiler = "clang"',
            "build.compiler",
            "not part of the schema",
        ),
        ('name = "t"', 'name = "other"', "name", "file is t.toml"),
        (
            '"a test target"\n\n[tvm]\nkind = "llvm"\nmcpu = "x86-64-v3"\n',
            '"a test target"\ntvm = "llvm"\n',
            "tvm",
            "must be a table",
        ),
        ('kind = "llvm"', 'kind = "cuda"', "tvm.host", "needs a host target"),
        ('mcpu = "x86-64-v3"', '[tvm.host]\nkind = "cuda"', "tvm.host.kind", "must be llvm or c"),
    ],
)
def test_ill_typed_or_invalid_field_is_named(tmp_path, old, new, field, why):
    assert old in VALID
    path = write(tmp_path, VALID.replace(old, new, 1))
    with pytest.raises(ValueError, match=why) as e:
        load_target_file(path)
    assert f"field '{field}'" in str(e.value) and str(path) in str(e.value)


# --------------------------------------------------------------------------- host CPU


@pytest.mark.parametrize(
    "flags,level,bits",
    [(V4, "x86-64-v4", 512), (V3, "x86-64-v3", 256), (V2, "x86-64-v2", 128), (BASE, "x86-64", 128)],
)
def test_host_level_from_cpuinfo(tmp_path, flags, level, bits):
    path = write(tmp_path, VALID.replace('"x86-64-v3"', '"host"').replace("= 256", '= "host"'))
    t = load_target_file(path, cpuinfo=cpuinfo(*flags))
    assert (t.tvm["mcpu"], t.hardware.vector_bits) == (level, bits)


def test_avx2_without_the_rest_of_v3_is_v2():
    # a CPU that reports avx2 but not bmi2 (some VMs mask flags) must not get v3 code
    assert tg.detect_x86_level(cpuinfo(*[f for f in V3 if f != "bmi2"])) == ("x86-64-v2", 128)


def test_host_on_a_non_x86_machine_is_refused(tmp_path):
    arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32\n"
    with pytest.raises(ValueError, match="x86-64 build machine"):
        load_target_file(write(tmp_path, VALID.replace('"x86-64-v3"', '"host"')), cpuinfo=arm)


def test_host_needs_a_native_target(tmp_path):
    text = VALID.replace('"x86-64-v3"', '"host"').replace(
        'method = "native"', 'method = "qemu-user"\nemulator = "q"\nsysroot = "/"'
    )
    with pytest.raises(ValueError, match="needs run.method = 'native'"):
        load_target_file(write(tmp_path, text))


def test_this_host_resolves_to_a_level():
    assert load_target("x86_64").tvm["mcpu"] in ("x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4")


# --------------------------------------------------------------------------- TVM takes every description


@pytest.mark.parametrize("name", ALL)
def test_tvm_accepts_the_description(name):
    """TVM 0.27 accepts any mcpu string and falls back to a generic CPU for unknown
    ones, so the CPU names are checked against LLVM itself, and each description
    compiles a small kernel to source/assembly (no cross toolchain needed)."""
    tvm = pytest.importorskip("tvm")
    import tvm_ffi
    from tvm import te

    from compilers.tvm.build import tvm_target

    t = load_target(name)
    spec = t.tvm_spec()
    if spec["kind"] == "llvm":
        triple = spec.get("mtriple", "x86_64-linux-gnu")
        assert tvm_ffi.get_global_func("target.llvm_is_valid_cpu")(spec["mcpu"], triple)

    a = te.placeholder((256,), "int64", name="a")
    b = te.compute((256,), lambda i: (a[i] + 4) >> 3, name="b")
    sch = tvm.s_tir.Schedule(te.create_prim_func([a, b]))
    if spec["kind"] in ("cuda", "opencl"):
        bx, tx = sch.split(sch.get_loops(sch.get_sblock("b"))[0], [None, 64])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    lib = tvm.compile(sch.mod, target=tvm_target(t)).mod
    if spec["kind"] in ("cuda", "opencl"):
        src = lib.imports[0].inspect_source()
        assert ("__global__" if spec["kind"] == "cuda" else "__kernel") in src
    elif spec["kind"] == "c":
        assert "int64_t" in lib.inspect_source()
    else:
        # instructions/attributes only that architecture has: the triple took effect
        asm = lib.inspect_source("asm")
        assert {"x86_64": "%rdi", "aarch64": "adrp", "riscv64": "auipc"}[name] in asm
        if name == "riscv64":
            assert "rv64i2p1_m2p0_a2p1_f2p2_d2p2_c2p0" in asm  # mattr = RV64GC honoured


def test_debian_packages_is_the_union_of_build_and_run_packages(tmp_path):
    body = VALID.replace('cc = "gcc"', 'cc = "gcc"\ndebian_packages = ["b-pkg", "shared"]')
    body = body.replace('method = "native"', 'method = "native"\ndebian_packages = ["a-pkg", "shared"]')
    write(tmp_path, body)
    assert tg.debian_packages(tmp_path) == ["a-pkg", "b-pkg", "shared"]
