"""HLS projects: what they contain, and their C simulation bit-exact against the golden ops.

A project is written for one op (compilers.fpga.hls.write_hls_project); its
testbench, top and TVM-generated kernel are compiled with gcc and run on the
golden vectors.  Bit-exactness is checked twice: the testbench's own
comparison (exit 0, "PASS") and the outputs it writes against ``op.forward``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cache_damage import DAMAGES

pytest.importorskip("tvm")

from compilers.cache import sha256_file
from compilers.fpga import csource
from compilers.fpga.csim import build_csim, run_testbench
from compilers.fpga.hls import top_spec, write_hls_project, write_hls_projects
from compilers.fpga.kernel_c import HLS, HLSError, kernel_source
from compilers.fpga.vectors import HAS_EXPECTED, as_units, read_outputs, write_vectors
from compilers.tvm.kernels import kernel_for
from compilers.tvm.schedules import SERIAL
from qnorm.analysis import TargetLimitError
from qnorm.targets import load_target
from qnorm.verify.cases import CASES, case_named
from qnorm.verify.vectors import golden_inputs

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not on PATH: no C simulation")

ONE_PER_FAMILY = (
    "int_layernorm.int8.n768",  # a 768-wide row: 6 KiB of static per-row scratch
    "l1_layernorm.int4.n7.trunc",  # int4 in an int8 port, truncating rounding
    "shift_layernorm.int8.n64.m2",
    "int_rmsnorm.int8.n64.p025",
    "bn_quant.int8.c16.s8.half_away",  # int64 constants, a per-element division
    "multithreshold.int8.c16.s3.floor",  # 2-D constants (levels x channels)
    "mpbn_lif.int8.c16.hard.ge.leak0875",  # time-major: steps is a port
    "folded_lif.int4.c8.soft.ge.leak05",
    "softmax.int8.n32.padding",  # exp table as a constant array, masks in the data
)
# The two exp-table digits of int16 probabilities multiply to 62 bits: beyond the 48-bit accumulator
REFUSED_CASE = "softmax.int16.n64"
# Every case the HLS target refuses, with the intermediate its refusal names.
REFUSED_CASES = {REFUSED_CASE: "exp_product"}


@pytest.fixture(scope="module")
def target():
    return load_target("fpga-hls")


class _Projects(dict):
    """Case name -> its project on the case's stored golden inputs, written on first use
    (each xdist worker writes only the projects its tests read)."""

    def __init__(self, root: Path, target) -> None:
        super().__init__()
        self.root, self.target = root, target

    def __missing__(self, name: str) -> Path:
        case = case_named(name)
        self[name] = write_hls_project(case.build(), self.root / name, vectors=golden_inputs(case), target=self.target)
        return self[name]


@pytest.fixture(scope="module")
def projects(tmp_path_factory, target) -> dict[str, Path]:
    return _Projects(tmp_path_factory.mktemp("hls"), target)


def simulate_project(project: Path, target, tmp_path: Path, op, x: np.ndarray) -> subprocess.CompletedProcess:
    """Build and run the testbench on the project's vectors; check its outputs file too."""
    built = build_csim(project, target)
    outputs = tmp_path / f"{project.name}.out"
    done = run_testbench(built.binary, project / csource.VECTORS, outputs)
    spec = top_spec(op, kernel_for(op, HLS))
    units = as_units(spec, x)
    want = as_units(spec, op.forward(x))
    assert np.array_equal(read_outputs(outputs, *units.shape), want)
    return done


# --------------------------------------------------------------------------- contents


def test_tcl_names_the_top_and_every_file(projects, target) -> None:
    project = projects["int_layernorm.int8.n768"]
    lines = (project / csource.TCL).read_text().splitlines()
    commands = [line for line in lines if line and not line.startswith("#")]
    assert commands[0] == "open_project -reset qnorm_int_layernorm"
    assert "set_top qnorm_top" in commands
    design = [line.split()[1] for line in commands if line.startswith("add_files ") and "-tb" not in line]
    bench = [line.split()[2] for line in commands if line.startswith("add_files -tb")]
    assert design == list(csource.DESIGN_SOURCES) and bench == [csource.TESTBENCH_C, csource.VECTORS]
    assert all((project / f).is_file() for f in design + bench)
    assert f"set_part {{{target.build.part}}}" in commands
    assert f"create_clock -period {target.build.clock_period_ns} -name default" in commands
    order = [c.split()[0] for c in commands]
    assert order.index("open_solution") < order.index("set_part") < order.index("csim_design")
    assert order[-3:] == ["csim_design", "csynth_design", "exit"]
    assert "vitis_hls -f run_hls.tcl" in (project / csource.README).read_text()


@pytest.mark.parametrize(
    ("name", "prototype"),
    [
        (
            "int_layernorm.int8.n768",
            "int32_t qnorm_top(const int8_t x[QNORM_ROWS][QNORM_WIDTH], int8_t y[QNORM_ROWS][QNORM_WIDTH])",
        ),
        (
            "mpbn_lif.int8.c16.hard.ge.leak0875",
            (
                "int32_t qnorm_top(int32_t steps, const int8_t x[QNORM_MAX_STEPS][QNORM_ROWS][QNORM_WIDTH], "
                "int8_t y[QNORM_MAX_STEPS][QNORM_ROWS][QNORM_WIDTH])"
            ),
        ),
    ],
)
def test_ports_are_fixed_width_integers(projects, name: str, prototype: str) -> None:
    header = (projects[name] / csource.TOP_H).read_text()
    assert f"{prototype};" in header
    assert "#define QNORM_WIDTH" in header and "#define QNORM_ROWS 16" in header


@pytest.mark.parametrize(
    ("name", "partitioned"),
    [
        ("l1_layernorm.int4.n7.trunc", []),
        ("multithreshold.int8.c16.s3.floor", ["qnorm_thresholds"]),  # levels x channels
        ("mpbn_lif.int8.c16.hard.ge.leak0875", []),
    ],
)
def test_top_and_kernel_carry_the_hls_directives(projects, name: str, partitioned: list[str]) -> None:
    project = projects[name]
    spec = top_spec(case_named(name).build(), kernel_for(case_named(name).build(), HLS))
    top = (project / csource.TOP_C).read_text()
    body = top[top.index(f"{csource.top_signature(spec)} {{") :]
    depth = spec.block_elements
    for port, bundle in (("x", "gmem_in"), ("y", "gmem_out")):
        assert f"#pragma HLS INTERFACE mode=m_axi port={port} offset=slave bundle={bundle} depth={depth}\n" in body
        assert f"#pragma HLS INTERFACE mode=s_axilite port={port} bundle=control\n" in body
    assert "#pragma HLS INTERFACE mode=s_axilite port=return bundle=control\n" in body
    assert ("port=steps" in body) == spec.time_major
    assert re.findall(r"ARRAY_PARTITION variable=(\w+) type=complete dim=1", body) == partitioned
    # Every loop over the width that is not inside another one is pipelined, nothing else.
    lines = (project / csource.KERNEL_C).read_text().splitlines()
    pipelined = [lines[i - 1].strip() for i, line in enumerate(lines) if "#pragma HLS PIPELINE II=1" in line]
    assert pipelined and all(re.fullmatch(rf"for \(int32_t (\w+) = 0; \1 < {spec.width}; \+\+\1\) \{{", p) for p in pipelined)
    width_loops = [line for line in lines if re.search(rf"< {spec.width}; \+\+", line)]
    assert len(pipelined) <= len(width_loops)


@needs_gcc
def test_the_directives_leave_gcc_silent(projects, target) -> None:
    built = build_csim(projects["multithreshold.int8.c16.s3.floor"], target)
    # (TVM's own C draws an unused-variable warning; the directives draw none.)
    assert "-Wall" in target.build.cflags and "pragma" not in built.compiler_output


def test_int16_input_gets_an_int16_port() -> None:
    op = case_named("int_layernorm.int16.n48").build()
    spec = top_spec(op, kernel_for(op, HLS))
    assert csource.top_signature(spec).startswith("int32_t qnorm_top(const int16_t x[")


_ARRAY = re.compile(r"static const (int\d+)_t qnorm_(\w+)((?:\[\d+\])+) = (\{.*?\});", re.DOTALL)
_VALUE = re.compile(r"INT64_C\((-?\d+)\)|INT(\d+)_MIN|(-?\d+)")


def _c_arrays(source: str) -> dict[str, tuple[str, list[int], list[int]]]:
    """name -> (dtype, shape, values) of every static const array in a C file."""
    out = {}
    for dtype, name, dims, body in _ARRAY.findall(source):
        values = []
        for lit, min_bits, plain in _VALUE.findall(body):
            values.append(int(lit) if lit else -(1 << (int(min_bits) - 1)) if min_bits else int(plain))
        out[name] = (dtype, [int(d) for d in re.findall(r"\d+", dims)], values)
    return out


@pytest.mark.parametrize("name", ["bn_quant.int8.c16.s8.half_away", "multithreshold.int8.c16.s3.floor"])
def test_constants_are_the_kernel_integers_in_their_dtypes(projects, name: str) -> None:
    op = case_named(name).build()
    kernel = kernel_for(op, HLS)
    arrays = _c_arrays((projects[name] / csource.TOP_C).read_text())
    assert len(arrays) == len(kernel.consts) > 0
    for (dtype, shape, values), want in zip(arrays.values(), kernel.consts, strict=True):
        assert dtype == str(want.dtype) and shape == list(want.shape)
        assert np.array_equal(np.array(values, dtype=np.int64), want.ravel().astype(np.int64))


def test_c_int_literals_are_exact() -> None:
    assert csource.c_int(-(1 << 63), "int64") == "INT64_MIN"
    assert csource.c_int(-(1 << 31), "int32") == "INT32_MIN"
    assert csource.c_int(187894507520, "int64") == "INT64_C(187894507520)"
    assert csource.c_int(-5, "int16") == "-5"
    with pytest.raises(ValueError, match="no fixed-width C type for dtype 'float32'"):
        csource.ctype("float32")


def test_kernel_c_is_serial_with_static_scratch_and_no_tvm_runtime() -> None:
    op = case_named("int_layernorm.int8.n768").build()
    kernel = kernel_for(op, HLS)
    script = kernel.mod.script()
    assert "T.parallel" not in script and "T.vectorized" not in script
    source = kernel_source(kernel)
    assert "TVMBackend" not in source and '#include "tvm/' not in source
    assert source.count(f'#include "{csource.ABI_H}"') == 1
    assert re.search(r"int(32|64)_t \w+\[768\];", source)  # a row of scratch, a local array


def test_kernel_c_needing_a_runtime_is_refused() -> None:
    """The unscheduled kernel keeps whole-batch intermediates: scratch of symbolic size."""
    kernel = kernel_for(case_named("int_layernorm.int8.n64").build(), SERIAL)
    with pytest.raises(HLSError, match=r"symbols \['TVMBackendAllocWorkspace', 'TVMBackendFreeWorkspace'\]"):
        kernel_source(kernel)


# --------------------------------------------------------------------------- C simulation


@needs_gcc
@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_csim_is_bit_exact_for_one_op_per_family(projects, target, tmp_path, name: str) -> None:
    case = case_named(name)
    done = simulate_project(projects[name], target, tmp_path, case.build(), golden_inputs(case))
    assert done.returncode == 0, done.stderr
    assert "PASS" in done.stdout and "bit-exact" in done.stdout


@needs_gcc
@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_csim_is_bit_exact_for_every_case(target, tmp_path, name: str) -> None:
    case = case_named(name)
    op = case.build()
    if name in REFUSED_CASES:
        with pytest.raises(TargetLimitError, match=REFUSED_CASES[name]):
            write_hls_project(op, tmp_path / "p", target=target)
        return
    x = golden_inputs(case)
    done = simulate_project(write_hls_project(op, tmp_path / "p", vectors=x, target=target), target, tmp_path, op, x)
    assert done.returncode == 0 and "PASS" in done.stdout, done.stderr


@needs_gcc
def test_our_c_files_compile_without_warnings(projects, tmp_path) -> None:
    """The hand-written and generated C (not TVM's kernel) is clean under strict flags."""
    for name in ("int_layernorm.int8.n768", "mpbn_lif.int8.c16.hard.ge.leak0875", "multithreshold.int8.c16.s3.floor"):
        for source in (csource.TOP_C, csource.TESTBENCH_C, csource.ABI_C):
            cmd = ["gcc", "-std=c11", "-O2", "-Wall", "-Wextra", "-Wpedantic", "-Werror", "-Wno-unknown-pragmas", "-c", source]
            done = subprocess.run(
                [*cmd, "-o", str(tmp_path / "o.o")], check=False, cwd=projects[name], capture_output=True, text=True
            )
            assert done.returncode == 0, f"{name}/{source}: {done.stderr}"


@needs_gcc
def test_partial_blocks_and_short_series_run_exactly(tmp_path, target) -> None:
    """Rows not a multiple of the block (zero-padded), and T below the ports' steps."""
    case = case_named("int_rmsnorm.int8.n2.half_even")
    op = case.build()
    x = golden_inputs(case)[:11]
    project = write_hls_project(op, tmp_path / "rms", vectors=x, rows=4, target=target)
    assert simulate_project(project, target, tmp_path, op, x).returncode == 0
    lif = case_named("folded_lif.int8.c16.soft.gt.noleak")
    op = lif.build()
    x = golden_inputs(lif)[:5]  # 5 of 16 steps
    project = write_hls_project(op, tmp_path / "lif", vectors=x, rows=3, steps=8, target=target)
    assert simulate_project(project, target, tmp_path, op, x).returncode == 0


def test_series_longer_than_the_ports_is_refused(tmp_path, target) -> None:
    lif = case_named("folded_lif.int8.c16.soft.gt.noleak")
    with pytest.raises(ValueError, match=r"steps <= 8"):
        write_hls_project(lif.build(), tmp_path / "lif", vectors=golden_inputs(lif), steps=8, target=target)


@needs_gcc
def test_default_vectors_run_exactly(tmp_path, target) -> None:
    for name in ("multithreshold.int4.c16.relu4.half_even", "mpbn_lif.int4.c8.soft.ge.leak05"):
        project = write_hls_project(case_named(name).build(), tmp_path / name, target=target)
        done = run_testbench(build_csim(project, target).binary, project / csource.VECTORS)
        assert done.returncode == 0 and "PASS: 64 vectors" in done.stdout, done.stderr


def test_several_named_ops_get_one_project_each(tmp_path, target) -> None:
    ops = {"block0.norm": case_named("int_rmsnorm.int8.n1").build(), "act": case_named("multithreshold.int8.c16.relu4").build()}
    paths = write_hls_projects(ops, tmp_path, target=target)
    assert paths == {name: tmp_path / name for name in ops}
    assert all((p / csource.VECTORS).is_file() and (p / csource.KERNEL_C).is_file() for p in paths.values())
    with pytest.raises(ValueError, match="not a safe directory name"):
        write_hls_projects({"../escape": ops["act"]}, tmp_path, target=target)


def test_a_refused_op_in_a_set_writes_no_project(tmp_path, target) -> None:
    ops = {"ok": case_named("int_rmsnorm.int8.n1").build(), "wide": case_named(REFUSED_CASE).build()}
    with pytest.raises(TargetLimitError, match="softmax cannot run exactly on fpga-hls"):
        write_hls_projects(ops, tmp_path, target=target)
    assert not any(tmp_path.iterdir())


# --------------------------------------------------------------------------- the testbench refuses bad files


@pytest.fixture(scope="module")
def small(projects, target):
    """The multithreshold project: its binary, vectors and expected outputs."""
    name = "multithreshold.int8.c16.s3.floor"
    project = projects[name]
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not on PATH: no C simulation")
    case = case_named(name)
    x = golden_inputs(case)
    return build_csim(project, target).binary, project / csource.VECTORS, x, case.build().forward(x)


def _rerun(small, tmp_path: Path, data: bytes) -> subprocess.CompletedProcess:
    path = tmp_path / "v.bin"
    path.write_bytes(data)
    return run_testbench(small[0], path)


def test_a_flipped_byte_fails_the_checksum(small, tmp_path) -> None:
    data = bytearray(small[1].read_bytes())
    data[-1] ^= 0x01
    done = _rerun(small, tmp_path, bytes(data))
    assert done.returncode == 2 and "checksum mismatch: the file is corrupted" in done.stderr


def test_a_truncated_file_is_refused(small, tmp_path) -> None:
    done = _rerun(small, tmp_path, small[1].read_bytes()[:-3])
    assert done.returncode == 2 and "(truncated or padded)" in done.stderr
    done = _rerun(small, tmp_path, b"QNORMVEC")
    assert done.returncode == 2 and "shorter than the 48-byte header" in done.stderr


def test_a_foreign_file_is_refused(small, tmp_path) -> None:
    data = small[1].read_bytes()
    done = _rerun(small, tmp_path, b"NOTQNORM" + data[8:])
    assert done.returncode == 2 and "bad magic" in done.stderr


def test_a_wrong_expected_output_is_the_first_mismatch(small, tmp_path) -> None:
    _, _, x, y = small
    bad = y.copy()
    bad[5, 2] += 1
    bad[7, 0] += 1
    path = write_vectors(tmp_path / "v.bin", x, 1, 1, bad)  # a consistent checksum: only the value is wrong
    done = run_testbench(small[0], path)
    assert done.returncode == 1
    assert f"MISMATCH in vector 5, element 2: expected {bad[5, 2]}, got {y[5, 2]}" in done.stderr
    assert "vector 7" not in done.stderr


def test_an_input_outside_the_format_is_refused(tmp_path, target) -> None:
    """int4 values travel in an int8 port: the testbench rejects one out of [-8, 7]."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not on PATH: no C simulation")
    case = case_named("l1_layernorm.int4.n7.trunc")
    project = write_hls_project(case.build(), tmp_path / "p", target=target)
    x = np.zeros((2, 7), dtype=np.int64)
    x[1, 3] = 100
    done = run_testbench(build_csim(project, target).binary, write_vectors(tmp_path / "v.bin", x, 1, 1))
    assert done.returncode == 2 and "input 100 (vector 1, element 3) is outside the input format [-8, 7]" in done.stderr


def test_vectors_writer_refuses_what_it_cannot_store(tmp_path) -> None:
    with pytest.raises(ValueError, match="more than 1 bytes hold"):
        write_vectors(tmp_path / "v.bin", np.array([[200]]), 1, 1)
    with pytest.raises(ValueError, match="must be integers"):
        write_vectors(tmp_path / "v.bin", np.array([[0.5]]), 1, 1)
    with pytest.raises(ValueError, match="do not match inputs"):
        write_vectors(tmp_path / "v.bin", np.zeros((2, 3), int), 1, 1, np.zeros((3, 2), int))
    path = write_vectors(tmp_path / "v.bin", np.zeros((2, 3), int), 1, 2, np.ones((2, 3), int))
    assert int.from_bytes(path.read_bytes()[12:16], "little") == HAS_EXPECTED
    assert len(path.read_bytes()) == 48 + 6 + 12


# --------------------------------------------------------------------------- build cache


@needs_gcc
def test_csim_builds_are_cached_by_content(tmp_path, monkeypatch, target) -> None:
    monkeypatch.setenv("QNORM_CACHE", str(tmp_path / "cache"))
    project = write_hls_project(case_named("multithreshold.int8.c1.relu4.negative_gamma").build(), tmp_path / "p", target=target)
    first, again = build_csim(project, target), build_csim(project, target)
    assert not first.cache_hit and again.cache_hit and again.binary == first.binary
    assert first.binary.is_relative_to(tmp_path / "cache" / "hls")
    with (project / csource.TOP_C).open("a") as f:
        f.write("/* changed */\n")
    changed = build_csim(project, target)
    assert not changed.cache_hit and changed.binary != first.binary
    assert not list((tmp_path / "cache").rglob("*.tmp"))


@needs_gcc
@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_csim_binary_is_compiled_again_never_run(tmp_path, monkeypatch, caplog, target, damage) -> None:
    monkeypatch.setenv("QNORM_CACHE", str(tmp_path / "cache"))
    project = write_hls_project(case_named("multithreshold.int8.c1.relu4.negative_gamma").build(), tmp_path / "p", target=target)
    first = build_csim(project, target)
    clean = sha256_file(first.binary)
    spoil, words = DAMAGES[damage]
    spoil(first.binary.parent, first.binary.name)
    again = build_csim(project, target)
    assert not again.cache_hit and again.binary == first.binary
    assert sha256_file(again.binary) == clean  # the clean build's bytes
    assert str(first.binary.parent) in caplog.text and words in caplog.text
    done = run_testbench(again.binary, project / csource.VECTORS)
    assert done.returncode == 0 and "PASS" in done.stdout, done.stderr
