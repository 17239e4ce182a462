"""The ``qnorm`` command itself: argument errors answered before torch or tvm load, one
line per error with its exit status, ``--debug``, ``verify --list``, ``verify --strict``
and progress lines on a non-terminal stderr."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from qnorm.cli import main
from qnorm.errors import CheckpointError, CheckpointNotFoundError, QnormError, UnknownTargetError, UsageError
from qnorm.targets import known_targets
from qnorm.train.checkpoint import load_checkpoint
from qnorm.verify import backends
from qnorm.verify.backends import Backend, Runner
from qnorm.verify.cases import CASES

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "tvm")  # each takes seconds to import: an argument error must not wait for them
CASE = "bn_quant.int8.c16.relu4"  # a quick case


def run_cli(*argv: str) -> tuple[int, str, str, set[str]]:
    """``python -X importtime -m qnorm.cli ARGV`` from the repository root: exit status,
    stdout, stderr without the import lines, and the top-level packages it imported."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "qnorm.cli", *argv],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    lines = done.stderr.splitlines()
    imported = {ln.rsplit("|", 1)[1].strip().split(".")[0] for ln in lines if ln.startswith("import time:")}
    err = "\n".join(ln for ln in lines if not ln.startswith("import time:"))
    return done.returncode, done.stdout, err, imported


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli")
    corrupt = root / "corrupt"
    corrupt.mkdir()
    (corrupt / "meta.json").write_text("{")
    (root / "a-file").write_text("not a directory\n")
    return {"missing": root / "missing", "corrupt": corrupt, "file": root / "a-file", "out": root / "out"}


# (argv with {missing}/{corrupt}/{file}/{out} placeholders, exit status, the error line)
BAD_ARGS = [
    (["verify", "--bogus"], 2, "qnorm verify: error: unrecognized arguments: --bogus"),
    (["verify", "--target", "vax"], 2, "qnorm verify: error: unknown target 'vax'; known targets: aarch64, cuda"),
    (["verify", "--target", "x86_64", "--case", "int_*", "nope*"], 2,
     f"qnorm verify: error: no case matches 'nope*' (qnorm verify --list shows the {len(CASES)} cases)"),
    (["verify", "--elements", "0"], 2, "qnorm verify: error: argument --elements: must be >= 1, got 0"),
    (["compile", "{missing}", "-o", "{out}"], 2, "qnorm compile: error: checkpoint directory {missing} does not exist"),
    (["compile", "{file}", "-o", "{out}"], 2, "qnorm compile: error: checkpoint {file} is a file"),
    (["compile", "{corrupt}", "-o", "{out}"], 1,
     "qnorm compile: error: checkpoint {corrupt}: {corrupt}/meta.json is not valid JSON"),
    (["compile", "{corrupt}", "--target", "vax", "-o", "{out}"], 2, "qnorm compile: error: unknown target 'vax'"),
    (["compile", "{corrupt}", "--target", "opencl", "--c-api", "-o", "{out}"], 2,
     "qnorm compile: error: --c-api builds the C API for x86_64, aarch64, riscv64, not opencl"),
    (["compile", "{corrupt}", "--target", "fpga-hls", "--skip-unsupported", "-o", "{out}"], 2,
     "qnorm compile: error: --skip-unsupported leaves layers out of the fpga-rtl RTL, not of fpga-hls"),
    (["compile", "{corrupt}", "-o", "{file}"], 2,
     "qnorm compile: error: argument -o/--out: {file} exists and is not a directory"),
    (["golden", "--case", "nope"], 2, "qnorm golden: error: no case matches 'nope'"),
    (["demo", "--out", "{file}"], 2, "qnorm demo: error: argument --out: {file} exists and is not a directory"),
    (["train", "--family", "mlp", "--out", "{out}"], 2,
     "qnorm train: error: unknown model family 'mlp'; known: transformer, snn, mixer, snn-pow2, transformer-int, llama"),
    ([], 2, "qnorm: error: the following arguments are required: command"),
]  # fmt: skip


@pytest.mark.parametrize("argv, status, message", BAD_ARGS, ids=[" ".join(a[0]) or "nothing" for a in BAD_ARGS])
def test_bad_arguments_fail_at_once_with_one_line(paths, argv, status, message) -> None:
    rc, out, err, imported = run_cli(*(a.format(**paths) for a in argv))
    assert rc == status and out == ""
    assert err.splitlines()[-1].startswith(message.format(**paths)), err
    assert "Traceback" not in err
    assert not imported & set(HEAVY), f"imported {imported & set(HEAVY)} before the error"


def test_verify_list_names_every_case_and_column_without_running() -> None:
    rc, out, _, imported = run_cli("verify", "--list")
    assert rc == 0 and not imported & set(HEAVY), imported & set(HEAVY)
    lines = out.splitlines()
    assert lines[0] == f"{len(CASES)} cases:"
    for case in CASES:
        assert any(ln.split()[:2] == [case.name, case.op] for ln in lines), case.name
    assert "  int_rmsnorm.int8.n64.p025  " in out and " n=64 eps=1e-05 rounding=half_up partial=0.25" in out
    columns = lines[lines.index(f"{2 + len(known_targets())} columns:") + 1 :]
    assert [ln.split()[0] for ln in columns] == ["golden", "qat", *known_targets()]
    assert all(ln.split(None, 1)[1].startswith(("runs here", "builds only (", "cannot run (")) for ln in columns)


@pytest.fixture
def extra_columns() -> Iterator[None]:
    """A column that only builds here and one whose tools are missing."""

    def not_run(op: object) -> Runner:
        raise backends.NotRun("built for a machine that is not here")

    backends.register(Backend("elsewhere", "builds only (test)", not_run, not_run=lambda: "no such machine here"))
    backends.register(Backend("toolless", "needs a tool (test)", not_run, unavailable=lambda: "tool X is missing"))
    yield
    backends.unregister("elsewhere")
    backends.unregister("toolless")


def test_verify_list_json_says_why_a_column_does_not_run(extra_columns, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--list", "--json", "--target", "elsewhere", "toolless", "--case", "int_rms*"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [c["case"] for c in listing["cases"]] == [c.name for c in CASES if c.name.startswith("int_rms")]
    assert listing["cases"][0]["config"]["n"] == 64
    columns = listing["columns"]
    assert list(columns) == ["golden", "qat", "elsewhere", "toolless"]
    assert columns["golden"]["state"] == "runs here" and columns["golden"]["reason"] is None
    assert columns["elsewhere"] == {
        "state": "builds only", "reason": "no such machine here", "description": "builds only (test)"
    }  # fmt: skip
    assert columns["toolless"]["state"] == "cannot run" and columns["toolless"]["reason"] == "tool X is missing"


def test_strict_fails_on_compiled_and_skip_cells(extra_columns, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["verify", "--target", "elsewhere", "toolless", "--case", CASE, "--elements", "500"]
    assert main(argv) == 0  # compiled and skip are neither a pass nor a failure ...
    capsys.readouterr()
    assert main([*argv, "--strict"]) == 1  # ... unless every column must prove every case
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "qnorm verify: FAILED (--strict): 2 cell(s) not proven here (elsewhere: 1 compiled, toolless: 1 skip)"
    )


def test_strict_passes_when_every_column_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--target", "golden", "--case", CASE, "--elements", "500", "--strict"]) == 0
    assert "FAILED" not in capsys.readouterr().err


def test_progress_is_one_flushed_line_per_case_on_a_non_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    cases = [c.name for c in CASES if c.op == "bn_quant"]
    assert main(["verify", "--target", "golden", "--case", "bn_quant.*", "--elements", "500", "--json"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"qnorm verify: {len(cases)} cases x 2 columns (golden, qat), >= 500 input elements per case"
    assert [ln.split(" (")[0] for ln in err[1:]] == [f"[{i}/{len(cases)}] {n}: ok" for i, n in enumerate(cases, 1)]


def test_debug_shows_the_traceback(paths, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compile", str(paths["corrupt"]), "-o", str(paths["out"])]
    assert main(argv) == 1
    assert "Traceback" not in capsys.readouterr().err
    assert main(["--debug", *argv]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last):" in err and "qnorm.errors.CheckpointError: checkpoint" in err
    assert err.splitlines()[-1].startswith("qnorm compile: error: checkpoint")


def test_user_errors_are_qnorm_errors_and_stay_value_errors(paths) -> None:
    from qnorm.analysis import Interval, OverflowRiskError, RangeReport
    from qnorm.targets import load_target
    from qnorm.verify.golden_store import GoldenStoreError, read_manifest

    with pytest.raises(CheckpointNotFoundError, match="does not exist") as missing:
        load_checkpoint(paths["missing"])
    with pytest.raises(CheckpointError, match="is not valid JSON") as corrupt:
        load_checkpoint(paths["corrupt"])
    with pytest.raises(UnknownTargetError, match="unknown target 'z80'") as target:
        load_target("z80")
    with pytest.raises(GoldenStoreError) as store:
        read_manifest(paths["missing"])
    report = RangeReport("op")
    report.add("sum_sq", Interval(0, 2**40))
    with pytest.raises(OverflowRiskError) as overflow:
        report.check(32)
    raised = [missing.value, corrupt.value, target.value, store.value, overflow.value]
    assert all(isinstance(e, QnormError) and isinstance(e, ValueError) for e in raised)
    assert [isinstance(e, UsageError) for e in raised] == [True, False, True, False, False]
    assert [e.exit_code for e in raised] == [2, 1, 2, 1, 1]  # a usage error exits 2, the rest 1
