"""aarch64 and riscv64: TVM kernels cross-compiled, linked with the Debian cross gcc, run under qemu-user.

One case per op family is checked bit for bit (``np.array_equal``) on both
targets on the edge, exhaustive and random vectors of ``qnorm verify``; a
kernel whose rows need a heap workspace exercises the harness's runtime
functions.  A damaged cached executable is linked again, never run.  The error
paths: a target that is not a cross target, an unknown one, missing tools (the
reason names the Debian packages), an executable that does not run and a kernel
that raises.  The whole catalogue on both targets is ``slow``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from cache_damage import DAMAGES
from hypothesis import given, settings

pytest.importorskip("tvm")

from compilers import toolchains
from compilers import cache
from compilers.tvm import cross
from compilers.tvm.kernels import kernel_for
from qnorm.cli import main
from qnorm.fixedpoint import Round
from qnorm.ops import IntLayerNorm
from qnorm.qformat import QFormat
from qnorm.targets import load_target
from qnorm.verify import backends
from qnorm.verify.cases import CASES, _norm, case_named
from qnorm.verify.harness import OK, verify
from qnorm.verify.vectors import run_batches
from tests.test_tvm_kernels import drawn_norm_cases

TARGETS = ["aarch64", "riscv64"]
# One case per family, with a non-default tie rule, int4 inputs or the time-major layout among them.
FAMILY_CASES = [
    "int_layernorm.int8.n64",
    "l1_layernorm.int4.n7.trunc",
    "shift_layernorm.int8.n64.m2",
    "int_rmsnorm.int8.n64.p025",
    "bn_quant.int8.c16.s3.floor",
    "multithreshold.int4.c16.relu4.half_even",
    "mpbn_lif.int8.c16.soft.gt.noleak",
    "folded_lif.int4.c8.soft.ge.leak05",
    "softmax.int8.n16.causal",
]
ELEMENTS = 20_000  # random input elements per case, on top of the edge and exhaustive vectors


def _require_tools(name: str) -> None:
    missing = cross.missing_tools(name)
    if missing:
        pytest.skip(f"{name}: {missing}")


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty build cache, for tests that damage cache entries."""
    monkeypatch.setenv("QNORM_CACHE", str(tmp_path))
    return tmp_path


def _small_kernel():
    return kernel_for(case_named("int_layernorm.int8.n7.half_even").build())


# --------------------------------------------------------------------------- bit-exact


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", FAMILY_CASES)
def test_family_bit_exact(name: str, target: str) -> None:
    _require_tools(target)
    case = case_named(name)
    op = case.build()
    compiled = cross.cross_build(kernel_for(op), target)
    for batch in run_batches(case, ELEMENTS, seed=7):
        got = compiled(batch.x)
        assert got.shape == batch.x.shape
        assert np.array_equal(got, op.forward(batch.x)), f"{name} on {target}: {batch.source} vectors differ"


@pytest.mark.parametrize("target", TARGETS)
def test_workspace_kernel_bit_exact(target: str) -> None:
    """A prime row length has no column tile: the row buffers come from TVMBackendAllocWorkspace."""
    _require_tools(target)
    op = _norm(IntLayerNorm.name, "int8", 131).build()
    x = np.random.default_rng(3).integers(-128, 128, (9, 131))
    x[0] = -128
    x[1, ::2] = 127
    assert np.array_equal(cross.cross_build(kernel_for(op), target)(x), op.forward(x))


def test_input_checks_are_the_cpu_kernels() -> None:
    """Shape and format checks come from CompiledKernel: an int4 op refuses 8 in its int8 container."""
    _require_tools("aarch64")
    op = case_named("l1_layernorm.int4.n7.trunc").build()
    compiled = cross.cross_build(kernel_for(op), "aarch64")
    with pytest.raises(ValueError, match="rows of shape"):
        compiled(np.zeros((2, 6), dtype=np.int64))
    with pytest.raises(ValueError):
        compiled(np.full((2, 7), 8, dtype=np.int64))


# --------------------------------------------------------------------------- targets and tools


def test_non_cross_target_is_refused() -> None:
    with pytest.raises(ValueError, match="'x86_64' is not a cross-compiled CPU target"):
        cross.cross_target("x86_64")
    with pytest.raises(ValueError, match="'opencl' is not a cross-compiled CPU target"):
        cross.missing_tools(load_target("opencl"))


def test_unknown_target_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown target 'sparc64'"):
        cross.cross_build(_small_kernel(), "sparc64")


@pytest.mark.parametrize("target", TARGETS)
def test_missing_tools_name_the_debian_packages(target: str) -> None:
    t = load_target(target)
    gone = dataclasses.replace(t, build=dataclasses.replace(t.build, cc="no-such-gcc"))
    reason = cross.missing_tools(gone)
    assert reason is not None and "no-such-gcc" in reason
    assert all(p in reason for p in t.build.debian_packages)
    gone = dataclasses.replace(t, run=dataclasses.replace(t.run, emulator="no-such-qemu"))
    assert "no-such-qemu" in cross.missing_tools(gone) and "qemu-user" in cross.missing_tools(gone)


def test_key_covers_the_harness_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel, target = _small_kernel(), load_target("aarch64")
    before = cross.executable_key(kernel, target)
    edited = tmp_path / "cross_main.c"
    edited.write_text(cross.HARNESS.read_text() + "\n/* edited */\n")
    monkeypatch.setattr(cross, "HARNESS", edited)
    assert cross.executable_key(kernel, target) != before
    assert cross.executable_key(kernel, load_target("riscv64")) != cross.executable_key(kernel, target)


# --------------------------------------------------------------------------- cache and failures


def test_cache_hit(private_cache: Path) -> None:
    _require_tools("riscv64")
    kernel = _small_kernel()
    first = cross.executable(kernel, "riscv64")
    assert not first.cache_hit and first.path.is_relative_to(private_cache)
    assert cross.executable(kernel, "riscv64").cache_hit


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_executable_is_linked_again_never_run(private_cache: Path, caplog, damage: str) -> None:
    _require_tools("riscv64")
    case = case_named("int_layernorm.int8.n7.half_even")
    kernel = kernel_for(case.build())
    first = cross.executable(kernel, "riscv64")
    clean = cache.sha256_file(first.path)
    spoil, words = DAMAGES[damage]
    spoil(first.path.parent, first.path.name)
    compiled = cross.cross_build(kernel, "riscv64")
    assert not compiled.built.cache_hit and compiled.built.path == first.path
    assert cache.sha256_file(compiled.built.path) == clean  # the clean link's bytes
    assert str(first.path.parent) in caplog.text and words in caplog.text
    batch = next(iter(run_batches(case, 1000, seed=7)))
    assert np.array_equal(compiled(batch.x), case.build().forward(batch.x))


def test_executable_that_does_not_run_is_an_error(private_cache: Path) -> None:
    _require_tools("aarch64")
    kernel = _small_kernel()
    compiled = cross.cross_build(kernel, "aarch64")
    # a consistent entry (its digests match) whose bytes are no program: qemu fails
    entry = compiled.built.path.parent
    cache.remove(entry)
    cache.publish(entry, lambda d: (d / compiled.built.path.name).write_bytes(b"not an ELF file"))
    again = cross.cross_build(kernel, "aarch64")
    assert again.built.cache_hit
    with pytest.raises(cross.CrossError, match=r"aarch64: `qemu-aarch64 .*` exited with status"):
        again(np.zeros((1, 7), dtype=np.int64))


def test_kernel_error_is_reported() -> None:
    """The kernel's own argument checks (here a constant of the wrong dtype) reach the caller."""
    _require_tools("aarch64")
    kernel = _small_kernel()
    compiled = cross.cross_build(kernel, "aarch64")
    wrong = [c.astype(np.int64) for c in kernel.consts]
    with pytest.raises(cross.CrossError, match=r"status 3: .*kernel raised .*dtype"):
        compiled.run(np.zeros((1, 7), dtype=np.int8), consts=wrong)


def test_harness_rejects_a_malformed_arguments_file(tmp_path: Path) -> None:
    _require_tools("riscv64")
    kernel = _small_kernel()
    compiled = cross.cross_build(kernel, "riscv64")
    args = tmp_path / "args"
    cross.write_args(args, [np.zeros((1, 7), np.int8), *kernel.consts], (1, 7), "int8")
    args.write_bytes(args.read_bytes()[:-1])
    with pytest.raises(cross.CrossError, match="status 2: .*truncated arguments file"):
        compiled.execute(compiled.command(args, tmp_path / "out"), tmp_path / "out", (1, 7))


# --------------------------------------------------------------------------- qnorm verify


def test_verify_columns(capsys: pytest.CaptureFixture[str]) -> None:
    for target in TARGETS:
        _require_tools(target)
        assert backends.get(target) is not None
    rc = main(["verify", "--target", "aarch64", "--target", "riscv64", "--case", "bn_quant.int8.c16.relu4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "0 FAIL, 0 skip" in out
    assert "via   aarch64: TVM llvm -mtriple=aarch64-linux-gnu" in out


def test_verify_column_skips_without_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(toolchains.shutil, "which", lambda name: None)
    reason = backends.get("riscv64").unavailable()
    assert "riscv64-linux-gnu-gcc" in reason and "gcc-riscv64-linux-gnu" in reason


@pytest.mark.parametrize("target", TARGETS)
def test_three_int12_columns_rounded_half_even(target: str) -> None:
    """A row of three columns once ran as one <3 x i64> vector, whose <3 x i8>
    store LLVM's AArch64 backend writes as lanes 0 and 2 at offsets 0 and 1
    (found by the drawn configs below): odd lane counts now stay scalar."""
    _require_tools(target)
    in_fmt = QFormat(12, 0.01)
    op = IntLayerNorm.from_float(
        np.array([1.06, 1.03, 1.11]), None, 0.0, in_fmt, QFormat(8, 2.0**-5), rounding=Round.HALF_EVEN
    )
    x = np.array([[-2048, 2047, -2048], [2047, 2047, -2048], [-1, 0, 1], [700, 1500, -100]])
    assert np.array_equal(cross.cross_build(kernel_for(op), target)(x), op.forward(x))


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@given(case=drawn_norm_cases(lengths=(1, 3, 31, 64, 129, 768)))
@settings(max_examples=15, deadline=None)
def test_norm_kernels_on_drawn_configs(target: str, case) -> None:
    """The drawn configs of the x86 property test, cross-compiled: the op's integers."""
    _require_tools(target)
    if case is None:
        return
    op, inputs = case
    compiled = cross.cross_build(kernel_for(op), target)
    for x in inputs:
        assert np.array_equal(compiled(x), op.forward(x)), f"{op.config} on {target}"


@pytest.mark.slow
def test_whole_catalogue_bit_exact() -> None:
    for target in TARGETS:
        _require_tools(target)
    report = verify(list(CASES), ["golden", *TARGETS], elements=10**5)
    bad = [(r.case.name, n, c.reason) for r in report.cases for n, c in r.cells.items() if c.status != OK]
    assert not bad, bad
