"""CUDA: TVM's CUDA source compiled by nvcc (PTX + cubin, sm_80 and sm_90), the harness, the bundle.

Wherever nvcc is installed, every verify case must compile (a representative
case per family, every case under ``slow``); the plan a GPU would run is checked by
running the very same files and launches on PoCL with the OpenCL form of the
kernel; the harness must build.  Running on a GPU is tested where ``nvidia-smi``
lists one, and skipped with that reason elsewhere.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cache_damage import DAMAGES

pytest.importorskip("tvm")

from compilers import toolchains
from compilers.cache import MANIFEST, sha256_file
from compilers.tvm import cuda
from compilers.tvm.gpu import GPU
from compilers.tvm.kernels import kernel_for
from qnorm.targets import load_target
from qnorm.verify.cases import CASES, case_named
from qnorm.verify.vectors import random_inputs

REPO = Path(__file__).resolve().parents[1]
REPRESENTATIVE = (
    "int_layernorm.int8.n768",
    "l1_layernorm.int4.n7.trunc",
    "shift_layernorm.int8.n1.m2",
    "int_rmsnorm.int8.n64.p025",
    "bn_quant.int4.c16.relu4.half_even",
    "multithreshold.int8.c1.relu4.negative_gamma",
    "mpbn_lif.int8.c16.hard.ge.leak0875",
    "softmax.int8.n16.causal",
)

if toolchains.nvcc_unavailable():
    pytest.skip(toolchains.nvcc_unavailable(), allow_module_level=True)


def load_script(name: str):
    """A module of scripts/ or benchmarks/ by path (scripts/ is no package)."""
    path = REPO / name
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_binaries(binaries: cuda.CudaBinaries) -> None:
    assert binaries.archs == ("sm_80", "sm_90")
    for arch in binaries.archs:
        ptx = binaries.stem.with_name(f"kernel.{arch}.ptx").read_text()
        assert f".target {arch}" in ptx and ".entry main_kernel" in ptx
        cubin = binaries.stem.with_name(f"kernel.{arch}.cubin").read_bytes()
        assert cubin[:4] == b"\x7fELF" and b"main_kernel" in cubin


# --------------------------------------------------------------------------- nvcc


@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_nvcc_compiles_ptx_and_cubin_for_sm80_and_sm90(name: str) -> None:
    compiled = cuda.cuda_kernel(case_named(name).build())
    assert 'extern "C" __global__' in compiled.device.source
    check_binaries(compiled.binaries)


@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_nvcc_compiles_every_case(name: str) -> None:
    check_binaries(cuda.cuda_kernel(case_named(name).build()).binaries)


def test_archs_come_from_the_target() -> None:
    target = load_target("cuda")
    assert cuda.archs(target) == ("sm_80", "sm_90") and cuda.nvcc_flags(target) == ()
    bare = dataclasses.replace(target, run=dataclasses.replace(target.run, compile_args=("-O3",)))
    with pytest.raises(ValueError, match="names no -arch=sm_XX"):
        cuda.archs(bare)


def test_compile_cache_hits_on_the_same_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QNORM_CACHE", str(tmp_path))
    source = cuda.device_module(
        kernel_for(case_named("bn_quant.int8.c16.relu4").build(), GPU)
    ).source
    cold = cuda.compile_source(source)
    warm = cuda.compile_source(source)
    assert not cold.cache_hit and warm.cache_hit and warm.stem == cold.stem
    assert warm.stem.parent.parent == tmp_path / "cuda"
    assert sorted(p.name for p in warm.stem.parent.iterdir()) == [
        MANIFEST, "kernel.cu", "kernel.sm_80.cubin", "kernel.sm_80.ptx", "kernel.sm_90.cubin", "kernel.sm_90.ptx"
    ]  # fmt: skip
    assert warm.seconds < cold.seconds


@pytest.fixture(scope="module")
def clean_nvcc_entry(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A kernel's CUDA source and its nvcc cache entry, built once (the damage tests copy it)."""
    source = cuda.device_module(kernel_for(case_named("bn_quant.int8.c16.relu4").build(), GPU)).source
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QNORM_CACHE", str(tmp_path_factory.mktemp("nvcc-cache")))
        return source, cuda.compile_source(source).stem.parent


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_nvcc_outputs_are_compiled_again_never_served(
    clean_nvcc_entry: tuple[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    damage: str,
) -> None:
    source, clean_entry = clean_nvcc_entry
    monkeypatch.setenv("QNORM_CACHE", str(tmp_path))
    entry = shutil.copytree(clean_entry, cuda.cuda_cache_dir() / clean_entry.name)
    clean = {p.name: sha256_file(p) for p in entry.iterdir()}
    spoil, words = DAMAGES[damage]
    spoil(entry, "kernel.sm_90.cubin")
    again = cuda.compile_source(source)
    assert not again.cache_hit and again.stem == entry / "kernel"
    assert {p.name: sha256_file(p) for p in again.files} == {p.name: clean[p.name] for p in again.files}
    assert str(entry) in caplog.text and words in caplog.text
    check_binaries(again)


def test_nvcc_error_carries_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QNORM_CACHE", str(tmp_path))
    with pytest.raises(
        cuda.NvccError, match=r"nvcc failed \(exit \d+\): nvcc -cubin -arch=sm_\d+ .*kernel\.cu"
    ) as err:
        cuda.compile_source("this is not CUDA;")
    assert "error" in str(err.value)


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cuda.build_harness(tmp_path_factory.mktemp("harness"))


def test_harness_builds_here(harness: Path) -> None:
    done = subprocess.run([str(harness)], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "usage:" in done.stderr


def test_a_damaged_harness_is_built_again(
    harness: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """nvcc stands in as a copy of the clean build (a real harness build takes half a minute)."""
    entry = shutil.copytree(harness.parent, tmp_path / harness.parent.name)
    DAMAGES["flipped-byte"][0](entry, harness.name)
    builds = []

    def nvcc(cmd: list[str]) -> None:
        builds.append(cmd)
        shutil.copy2(harness, cmd[cmd.index("-o") + 1])

    monkeypatch.setattr(cuda, "run_nvcc", nvcc)
    exe = cuda.build_harness(tmp_path)
    assert len(builds) == 1 and exe == entry / harness.name and str(entry) in caplog.text
    assert sha256_file(exe) == sha256_file(harness)
    done = subprocess.run([str(exe)], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "usage:" in done.stderr


# --------------------------------------------------------------------------- plans


def read_plan(path: Path) -> list[dict]:
    """The runs of a plan, as the harness reads them (a reference reader for this test)."""
    lines = path.read_text().splitlines()
    assert lines[0] == "qnorm-gpu-plan 1" and lines[1].split()[0] == "module"
    runs: list[dict] = []
    for line in lines[2:]:
        word, *rest = line.split()
        if word == "run":
            runs.append({"label": rest[0], "buffers": {}, "launches": [], "expect": None})
        elif word == "buffer":
            name, dtype, count, src = rest
            data = (
                np.zeros(int(count), dtype) if src == "-" else np.fromfile(path.parent / src, dtype)
            )
            assert data.size == int(count)
            runs[-1]["buffers"][name] = data
        elif word == "launch":
            runs[-1]["launches"].append(rest)
        elif word == "expect":
            runs[-1]["expect"] = (rest[0], path.parent / rest[1])
    return runs


def test_a_plan_runs_on_pocl_to_its_expected_outputs(tmp_path: Path) -> None:
    """Buffers, launches and expected outputs of a plan, replayed with the OpenCL form of the
    same kernel on PoCL: what the harness would do on a GPU, on the CPU instead."""
    opencl = pytest.importorskip("compilers.tvm.opencl")
    if opencl.unavailable():
        pytest.skip(opencl.unavailable())
    case = case_named("int_layernorm.int8.n7.half_even")
    op = case.build()
    compiled = cuda.cuda_kernel(op)
    x = random_inputs(case, np.random.default_rng(1), 37)
    arrays = cuda.kernel_arrays(compiled.kernel, compiled.device, x)
    out = list(arrays)[-1]
    run = cuda.PlanRun("t", arrays, out, expected=op.forward(x).reshape(arrays[out].shape))
    plan = cuda.PlanWriter(tmp_path).write(
        "verify", "kernel", ("sm_80", "sm_90"), compiled.device, [run]
    )
    assert plan.read_text().splitlines()[1] == "module kernel sm_80 sm_90"

    (replay,) = read_plan(plan)
    ocl = opencl.device_module(compiled.kernel)
    assert [(k.params, k.extents.keys()) for k in ocl.kernels] == [
        (k.params, k.extents.keys()) for k in compiled.device.kernels
    ]
    (launch,) = replay["launches"]
    assert launch[:8] == [
        "main_kernel",
        "1",  # a thread per row of 7 columns, 256 rows a block: 37 rows take one, masked past 37
        "1",
        "1",
        "1",
        "256",
        "1",
        str(len(compiled.device.kernels[0].params)),
    ]
    shaped = {n: a.reshape(arrays[n].shape) for n, a in replay["buffers"].items()}
    got = opencl.run(ocl, shaped, out)
    name, expected = replay["expect"]
    assert name == out and np.array_equal(got.reshape(-1), np.fromfile(expected, got.dtype))


# --------------------------------------------------------------------------- bundle and report


def test_gpu_bundle_prepares_plans_and_modules(tmp_path: Path) -> None:
    bundle = load_script("scripts/gpu_bundle.py")
    name = "int_layernorm.int8.n64"
    assert (
        bundle.main(["--out", str(tmp_path), "--case", name, "--elements", "2000", "--no-bench"])
        == 0
    )
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["archs"] == ["sm_80", "sm_90"] and manifest["bench"] == []
    (entry,) = manifest["cases"]
    assert entry["name"] == name and entry["width"] == 64 and entry["vectors"] > 2000 // 64
    case_dir = tmp_path / "cases" / name
    assert {"kernel.cu", "kernel.sm_80.cubin", "kernel.sm_90.ptx", "verify.plan"} <= {
        p.name for p in case_dir.iterdir()
    }
    runs = read_plan(case_dir / "verify.plan")
    assert len(runs) == entry["launches"] and runs[0]["label"] == f"{name}:golden:0"
    assert sum(r["buffers"]["x"].size for r in runs) // 64 == entry["vectors"]

    report = load_script("benchmarks/bench_gpu.py")
    log = "\n".join(f"ok {r['label']} {r['buffers']['out'].size}" for r in runs)
    rows, _ = report.verify_table(manifest, report.parse_harness(log))
    assert rows == [{"case": name, "status": f"ok ({entry['vectors']} vectors)"}]
    failing = log.replace(
        f"ok {runs[0]['label']} ", f"FAIL {runs[0]['label']} out element 3: expected 1, got 2 #"
    )
    rows, _ = report.verify_table(manifest, report.parse_harness(failing))
    assert rows[0]["status"].startswith(
        f"FAIL {runs[0]['label']}: out element 3: expected 1, got 2"
    )


def test_bench_report_without_torch_results() -> None:
    report = load_script("benchmarks/bench_gpu.py")
    manifest = {"bench": [{"label": "int_rmsnorm.1024x4096", "op": "int_rmsnorm", "torch": "rms_norm",
                           "rows": 1024, "n": 4096, "bytes": 8_400_000}]}  # fmt: skip
    runs = report.parse_harness("ok int_rmsnorm.1024x4096 4194304 time_us 8.400 8.100\n")
    rows, text = report.bench_table(
        manifest, runs, {"rms_norm.float16.1024x4096": 16.8}, "torch 2.x"
    )
    assert rows[0]["gb_s"] == pytest.approx(1000.0) and rows[0]["torch_float16_us"] == 16.8
    assert "| int_rmsnorm | 1024x4096 | ok | 8.40 | 1000 | rms_norm 16.80 (2.00x) | - |" in text


@pytest.mark.slow
def test_gpu_check_prepare(tmp_path: Path) -> None:
    """The whole preparation step, as scripts/gpu_check.sh runs it (every case and the benchmarks)."""
    done = subprocess.run(
        [str(REPO / "scripts" / "gpu_check.sh"), "prepare", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert len(manifest["cases"]) == len(CASES) and len(manifest["bench"]) == 12  # 3 shapes x 4 norms
    assert (
        sum(p.stat().st_size for p in tmp_path.rglob("*")) < 48 * 2**20
    )  # a bundle small enough to copy to a GPU host


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_cuda_kernel_on_the_gpu(name: str) -> None:
    if toolchains.gpu_compute_capability() is None:
        pytest.skip("no CUDA GPU (nvidia-smi lists none): the kernels are compiled, not run")
    case = case_named(name)
    op = case.build()
    runner = cuda.gpu_runner(cuda.cuda_kernel(op))
    x = random_inputs(case, np.random.default_rng(2), 257)
    assert np.array_equal(runner(x), op.forward(x))


def test_scripts_run_without_tvm_on_the_gpu_side() -> None:
    """bench_gpu.py runs on the GPU host's own python3: standard library (and torch) only."""
    code = "import sys, runpy; runpy.run_path(sys.argv[1]); print(sorted(m for m in sys.modules if m in ('numpy', 'tvm', 'qnorm')))"
    done = subprocess.run([sys.executable, "-c", code, str(REPO / "benchmarks" / "bench_gpu.py")],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert done.stdout.strip() == "[]"
