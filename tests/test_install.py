"""An installed qnorm works outside the repository: the wheel carries the package data
(target descriptions, golden vectors, harness sources), and from another directory,
with only the installed copy importable, `qnorm verify --target x86_64` passes and
`qnorm compile` builds a checkpoint into a library that gives the model's outputs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from compilers.tvm.graph import load_compiled
from qnorm.data import data_dir
from qnorm.train.checkpoint import save_checkpoint
from qnorm.train.models import build_model

REPO = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ("pyproject.toml", "README.md", "qnorm", "compilers")  # what setuptools reads
CASES = ("int_layernorm.int8.n7.half_even", "bn_quant.int8.c16.relu4", "mpbn_lif.int4.c8.soft.ge.leak05")


def pip(*args: str, cwd: Path) -> None:
    """pip of this interpreter, offline: the build backend and every dependency are here already."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", *args, "--no-deps", "--no-index", "--quiet"],
        cwd=cwd, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel of a copy of the sources (the build writes into its source tree), installed
    into a directory of its own."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    pip("wheel", "--no-build-isolation", "-w", str(root / "wheel"), ".", cwd=src)
    (wheel,) = (root / "wheel").glob("qnorm-*.whl")
    pip("install", "--target", str(root / "site"), str(wheel), cwd=root)
    return root / "site"


def run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python ARGS`` in ``cwd`` with only the installed copy of qnorm importable (the venv
    supplies the dependencies), and a cache of its own so nothing built here is reused."""
    env = {**os.environ, "PYTHONPATH": str(site), "QNORM_CACHE": str(cwd / "cache")}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def test_the_wheel_carries_the_package_data(installed: Path) -> None:
    for name in ("targets", "golden"):
        shipped = sorted(p.name for p in data_dir(name).iterdir())
        assert sorted(p.name for p in (installed / "qnorm" / "data" / name).iterdir()) == shipped
    for source in ("tvm/harness/cross_main.c", "tvm/harness/gpu_harness.cu", "fpga/c/qnorm_tb.c"):
        assert (installed / "compilers" / source).read_bytes() == (REPO / "compilers" / source).read_bytes()


def test_the_installed_copy_is_the_one_imported(installed: Path, tmp_path: Path) -> None:
    done = run_installed(installed, tmp_path, "-c", "import qnorm, compilers; print(qnorm.__file__, compilers.__file__)")
    assert done.returncode == 0, done.stderr
    assert all(Path(f).is_relative_to(installed) for f in done.stdout.split())


def test_installed_verify_x86_64_passes_from_another_directory(installed: Path, tmp_path: Path) -> None:
    done = run_installed(
        installed, tmp_path, "-m", "qnorm.cli", "verify", "--target", "x86_64", "--case", *CASES,
        "--elements", "1000", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["failures"] == 0 and Path(report["golden_dir"]).is_relative_to(installed)
    assert [c["case"] for c in report["cases"]] == list(CASES)
    for case in report["cases"]:
        statuses = {name: cell["status"] for name, cell in case["results"].items()}
        assert statuses == dict.fromkeys(("golden", "qat", "x86_64"), "ok")


def test_installed_compile_builds_a_checkpoint_from_another_directory(installed: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model("mixer", dim=16, depth=1, token_hidden=8, channel_hidden=16)
    model.train()(torch.randn(64, 8, 8))  # calibrates the input quantizers, as training does
    model.eval()
    checkpoint = save_checkpoint(model, tmp_path / "mixer")
    done = run_installed(
        installed, tmp_path, "-m", "qnorm.cli", "compile", str(checkpoint), "--target", "x86_64", "-o", "built"
    )
    assert done.returncode == 0, done.stderr
    assert "compiled for x86_64" in done.stdout  # built here, not found in a cache
    x = torch.randn(32, 8, 8)
    with torch.no_grad():
        assert np.array_equal(load_compiled(tmp_path / "built")(x.numpy()), model(x).numpy())
