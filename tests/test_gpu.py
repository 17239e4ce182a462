"""The GPU schedule: a warp or a block per row, threads over columns, integer-only, run for real on PoCL.

The schedule's structure is checked on the scheduled module and the generated
source (threads bound, reductions across threads into registers, per-row
scalars in registers, block sizes within every GPU target); its launch
geometry is checked against the shapes it is called with; and its OpenCL form
runs on PoCL (CPU OpenCL, real work-groups and barriers), bit-exact with the
golden model on the verify vectors.  CUDA (nvcc) is tests/test_gpu_cuda.py.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from compilers import toolchains
from compilers.tvm.build import non_integer_dtypes, tvm_target
from compilers.tvm.gpu import (
    GPU,
    LOWERING_CONFIG,
    MAX_BLOCK_THREADS,
    Launch,
    column_threads,
    lower,
    row_geometry,
)
from compilers.tvm.kernels import kernel_for
from qnorm.targets import load_target
from qnorm.verify import backends, golden_store, harness
from qnorm.verify.backends import Backend
from qnorm.verify.cases import CASES, Case, case_named
from qnorm.verify.vectors import run_batches, vector_elements

ONE_PER_FAMILY = (
    "int_layernorm.int8.n768",  # several columns per thread, warp-shuffle reductions
    "int_layernorm.int16.n48",  # int16 rows: the wider datapath
    "l1_layernorm.int4.n7.trunc",
    "shift_layernorm.int8.n64.m2",
    "int_rmsnorm.int8.n64.p025",  # a reduction over a prefix of the row
    "bn_quant.int8.c16.s8.half_away",
    "multithreshold.int8.c16.s3.floor",
    "mpbn_lif.int8.c16.soft.gt.noleak",
    "folded_lif.int4.c8.soft.ge.leak05",
    "softmax.int8.n197",  # reductions across threads, table loads; 16 threads x 13 columns: masked
)
ELEMENTS = 4096  # random elements per case in the normal run (edge/exhaustive sets come on top)


@functools.cache
def gpu_kernel(name: str):
    return kernel_for(case_named(name).build(), GPU)


@functools.cache
def cuda_device(name: str):
    return lower(gpu_kernel(name).mod, tvm_target(load_target("cuda")))


def opencl_or_skip():
    opencl = pytest.importorskip("compilers.tvm.opencl")
    reason = opencl.unavailable()
    if reason is not None:
        pytest.skip(reason)
    return opencl


# --------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_gpu_schedule_is_integer_only_and_binds_threads(name: str) -> None:
    mod = gpu_kernel(name).mod
    assert non_integer_dtypes(mod) == frozenset()
    script = mod.script()
    assert 'thread="blockIdx.x"' in script and 'thread="threadIdx.x"' in script
    assert "T.parallel" not in script and "T.vectorized" not in script
    for target in ("cuda", "opencl"):
        limit = load_target(target).hardware.max_threads
        assert cuda_device(name).max_threads() <= MAX_BLOCK_THREADS <= limit


def test_row_reductions_leave_their_result_in_registers_and_row_scalars_stay_there() -> None:
    # A row of 768 runs on one warp: shuffles alone, no shared memory, no barrier.
    src = cuda_device("int_layernorm.int8.n768").source
    assert "__shfl_down_sync" in src and "__shared__" not in src and "__syncthreads" not in src
    assert "row_sum_local" in src and "stat_local" in src
    # A row of 4096 runs on a block: warps combine through shared memory, the result
    # comes back into every thread's registers.
    wide = case_named("int_layernorm.int8.n768").derived("int_layernorm.int8.n4096", n=4096)
    src = lower(kernel_for(wide.build(), GPU).mod, tvm_target(load_target("cuda"))).source
    shared = re.findall(r"__shared__[^;]*?(\w+)\[", src)
    assert shared and "__syncthreads()" in src and "row_sum_local" in src
    assert not [n for n in shared if n.startswith(("row_sum", "stat", "exp", "mant", "inv", "out"))], shared


def test_column_threads_and_rows_per_block() -> None:
    ns = (1, 7, 16, 17, 48, 64, 65, 256, 257, 768, 1024, 1025, 4096)
    assert [column_threads(n) for n in ns] == [1, 1, 1, 2, 4, 4, 8, 16, 32, 32, 32, 256, 256]
    assert [row_geometry(n) for n in ns] == [
        (1, 256), (1, 256), (1, 256), (2, 128), (4, 64), (4, 64), (8, 32), (16, 16), (32, 8), (32, 8),
        (32, 8), (256, 1), (256, 1),
    ]
    assert all(tx * ty == MAX_BLOCK_THREADS for tx, ty in map(row_geometry, range(1, 5000)))


def test_launch_geometry_follows_the_call_shapes() -> None:
    dev = cuda_device("int_layernorm.int8.n768")
    channel = ("gain", "lo", "hi", "bias")  # the half-up output window's per-channel constants
    shapes = {"x": (5, 768), **{name: (768,) for name in channel}, "out": (5, 768)}
    (launch,) = dev.launches(shapes)
    assert (launch.grid, launch.block, launch.threads) == ((1, 1, 1), (32, 8, 1), 256)
    big = {**shapes, "x": (17, 768), "out": (17, 768)}
    assert dev.launches(big)[0].grid == (3, 1, 1)  # 8 rows a block, the last one partly masked
    params = dev.kernels[0].params
    assert sorted(a for p, a in zip(params, launch.args, strict=True) if p.is_buffer) == sorted([*channel, "out", "x"])
    assert [a for p, a in zip(params, launch.args, strict=True) if not p.is_buffer] == [5]
    with pytest.raises(ValueError, match="rows is 5 and 6"):
        dev.launches({**shapes, "out": (6, 768)})
    with pytest.raises(ValueError, match="has shape"):
        dev.launches({**shapes, "x": (5, 767)})


def test_neuron_launch_is_a_block_per_row_and_a_thread_per_channel() -> None:
    dev = cuda_device("folded_lif.int8.c16.soft.gt.noleak")
    names = list(dev.buffers)
    x_shape = (16, 3, 16)  # steps, rows (batch), channels
    shapes = {n: x_shape if n in (names[0], names[-1]) else (16,) for n in names}
    assert dev.launches(shapes) == [
        Launch(
            "main_kernel",
            (3, 1, 1),
            (16, 1, 1),
            tuple({"rows": 3, "steps": 16}.get(p.name, p.name) for p in dev.kernels[0].params),
        )
    ]
    assert (
        "__shared__" in dev.source and "__syncthreads" not in dev.source
    )  # a thread owns its channel


def test_lowering_is_what_tvm_compile_emits() -> None:
    """:func:`lower` runs tvm.compile's steps; the source must be the one tvm.compile stores."""
    kernel = gpu_kernel("shift_layernorm.int8.n64.m2")
    target = tvm_target(load_target("cuda"))
    with tvm.transform.PassContext(config=LOWERING_CONFIG):
        compiled = tvm.compile(kernel.mod, target=target).mod.imports[0].inspect_source()
    assert lower(kernel.mod, target).source == compiled


def test_block_limit_of_the_target_is_enforced() -> None:
    from compilers.tvm import cuda

    small = load_target("cuda")
    small = dataclasses.replace(small, hardware=dataclasses.replace(small.hardware, max_threads=32))
    with pytest.raises(ValueError, match="a block of 256 threads exceeds cuda's 32"):
        cuda.device_module(gpu_kernel("int_layernorm.int8.n768"), small)


# --------------------------------------------------------------------------- OpenCL on PoCL


def check_on_pocl(case: Case, elements: int, with_golden: bool = True) -> int:
    """The case's GPU kernel on PoCL against the golden model; returns the vectors checked."""
    opencl = opencl_or_skip()
    op = case.build()
    compiled = opencl.opencl_kernel(op)
    batches = list(run_batches(case, elements, seed=0))
    if with_golden:
        stored = golden_store.load(golden_store.DEFAULT_DIR, case)
        assert np.array_equal(compiled(stored.x), stored.y)
    for batch in batches:
        got, want = compiled(batch.x), op.forward(batch.x)
        assert got.dtype.kind == "i" and np.array_equal(got, want), (
            f"{case.name}: {batch.source} vectors differ"
        )
    return sum(b.x.size for b in batches) // case.width


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_opencl_on_pocl_is_bit_exact(name: str) -> None:
    assert check_on_pocl(case_named(name), ELEMENTS) > 0


@pytest.mark.parametrize(
    "name, change",
    [
        ("int_rmsnorm.int8.n64", {"n": 4096}),  # the benchmark row: 16 columns per thread
        ("folded_lif.int8.c16.soft.gt.noleak", {"channels": 300}),  # channels in turns of a block
    ],
)
def test_opencl_beyond_one_block_of_columns(name: str, change: dict) -> None:
    case = case_named(name).derived(f"{name}.wide", **change)
    assert check_on_pocl(case, 4 * vector_elements(case), with_golden=False) > 0


@pytest.mark.parametrize("name", ["int_layernorm.int8.n768", "l1_layernorm.int8.n64", "l1_layernorm.int4.n7.trunc"])
def test_opencl_rows_that_leave_the_last_block_part_empty(name: str) -> None:
    """Several rows share a block; a call whose rows are not a multiple of them masks the rest."""
    opencl = opencl_or_skip()
    case = case_named(name)
    op = case.build()
    compiled = opencl.opencl_kernel(op)
    n = case.config["n"]
    _, per_block = row_geometry(n)
    rng = np.random.default_rng(3)
    lo, hi = (-128, 128) if ".int8." in name else (-8, 8)
    for rows in (1, per_block - 1, per_block + 1, 2 * per_block + 3):
        x = rng.integers(lo, hi, (rows, n)).astype(np.int8)
        assert np.array_equal(compiled(x), op.forward(x)), rows


@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_opencl_on_pocl_every_case(name: str) -> None:
    from qnorm.verify.vectors import DEFAULT_ELEMENTS

    assert check_on_pocl(case_named(name), DEFAULT_ELEMENTS) > 0


def test_missing_opencl_platform_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    opencl = opencl_or_skip()
    target = opencl.opencl_target()
    other = dataclasses.replace(
        target, run=dataclasses.replace(target.run, platform="No Such Platform")
    )
    monkeypatch.setattr(opencl, "opencl_target", lambda: other)
    reason = opencl.unavailable()
    assert (
        reason is not None
        and "'No Such Platform' not found" in reason
        and "pocl-opencl-icd" in reason
    )


# --------------------------------------------------------------------------- qnorm verify


def test_verify_columns_opencl_runs_cuda_compiles_or_runs() -> None:
    opencl_or_skip()
    if toolchains.nvcc_unavailable():
        pytest.skip(toolchains.nvcc_unavailable())
    columns = harness.resolve_columns(["opencl", "cuda"])
    report = harness.verify([case_named("int_rmsnorm.int8.n64")], columns, 2000)
    cells = report.cases[0].cells
    assert cells["opencl"].status == harness.OK and cells["opencl"].vectors > 0
    assert "PoCL" in cells["opencl"].via
    if toolchains.gpu_compute_capability() is None:
        assert cells["cuda"].status == harness.COMPILED
        assert (
            cells["cuda"].reason
            == "nvcc sm_80/sm_90 PTX+cubin; not run: no CUDA GPU on this machine"
        )
        text = report.matrix()
        assert (
            f"built cuda: {cells['cuda'].reason} (every case)" in text
            and "1 compiled, not run" in text
        )
    else:
        assert cells["cuda"].status == harness.OK and cells["cuda"].vectors > 0
    assert report.ok


def test_not_run_is_neither_pass_nor_failure() -> None:
    def prepare(op: object) -> backends.Runner:
        raise backends.NotRun("built for a machine that is not here")

    backends.register(Backend("elsewhere", "builds only (test)", prepare))
    try:
        report = harness.verify(
            [case_named("bn_quant.int8.c16.relu4")], ["golden", "elsewhere"], 500
        )
    finally:
        backends.unregister("elsewhere")
    cell = report.cases[0].cells["elsewhere"]
    assert (cell.status, cell.vectors, cell.label()) == ("compiled", 0, "compiled")
    assert (
        report.ok and report.to_json()["cases"][0]["results"]["elsewhere"]["status"] == "compiled"
    )
    assert "built elsewhere: built for a machine that is not here (every case)" in report.matrix()


def test_cuda_column_names_missing_nvcc(monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    reason = backends.get("cuda").unavailable()
    assert reason is not None and "nvcc not found on PATH" in reason
