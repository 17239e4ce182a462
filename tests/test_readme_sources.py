"""README.md against the code, without running the demo or the benchmarks: every path it names
exists or is written by a command, and every quoted table's marker names a report that
command writes, with the header row the report's writer produces now."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from readme_script import load_readme_tables

from benchmarks import bench_gpu
from compilers.rtl.report import report_paths
from qnorm.demo import (
    DEPLOY_MODELS,
    DeployRow,
    MultiThresholdRow,
    SpikingRow,
    demo_outputs,
    deploy_markdown,
    error_table_markdown,
)
from qnorm.metrics import ErrorStats
from qnorm.report import BIT_WIDTHS, ROW_LENGTHS, CaseResult
from qnorm.report_activation import ActivationRow
from qnorm.report_lanes16 import FloorCell, FloorRow
from qnorm.report_softmax import ROW_LENGTHS as SOFTMAX_ROW_LENGTHS
from qnorm.report_softmax import SoftmaxResult
from qnorm.train.cli import DEFAULT_OUT as TRAIN_OUT
from qnorm.train.experiment import (
    AccuracyTable,
    FoldCheck,
    Recipe,
    Row,
    resolve_kinds,
    training_outputs,
)
from qnorm.train.families import FAMILIES

REPO = Path(__file__).resolve().parent.parent
README_TEXT = (REPO / "README.md").read_text(encoding="utf-8")
README_LINES = README_TEXT.split("\n")
TOP_LEVEL = ("out", "qnorm", "compilers", "scripts", "benchmarks", "tests")


rt = load_readme_tables()
MARKERS = rt.parse_markers(README_TEXT)


# --------------------------------------------------------------------------- what the commands write


def make_out(target: str) -> Path:
    """The --out a Makefile target passes to its command (what the README's `make X` writes)."""
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", makefile, flags=re.MULTILINE)
    assert recipe, f"Makefile has no target {target!r}"
    out = re.search(r"--out (\S+)", recipe[1])
    assert out, f"`make {target}` passes no --out: the README cannot know where its reports go"
    return Path(out[1])


def gpu_check_outputs() -> list[Path]:
    """The default output directories of scripts/gpu_check.sh (`${VAR:-$repo/PATH}`), and the
    reports benchmarks/bench_gpu.py writes into its results directory (`out="${OUT:-…}"`)."""
    script = (REPO / "scripts" / "gpu_check.sh").read_text()
    results = re.search(r'out="\$\{OUT:-\$repo/([\w./-]+)\}"', script)
    assert results, "scripts/gpu_check.sh names no default results directory"
    reports = [Path(results[1]) / r for r in (bench_gpu.VERIFY_REPORT, bench_gpu.BENCH_REPORT, bench_gpu.RESULTS)]
    return [*(Path(p) for p in re.findall(r":-\$repo/([\w./-]+)\}", script)), *reports]


# The commands README.md names -> the paths they write, from the writers' own path functions.
WRITTEN: dict[str, list[Path]] = {
    "make demo": demo_outputs(make_out("demo")),
    "make bench": [make_out("bench")],
    "make fpga-report": report_paths(make_out("fpga-report")),
    "qnorm train": training_outputs(TRAIN_OUT, resolve_kinds(None, list(FAMILIES))),
    "scripts/gpu_check.sh": gpu_check_outputs(),
}
ALL_WRITTEN = {p for paths in WRITTEN.values() for p in paths}


def is_written(path: Path) -> bool:
    """`path` is written by a command, or is a directory holding something a command writes."""
    return any(path == w or path in w.parents for w in ALL_WRITTEN)


# --------------------------------------------------------------------------- paths in the README


def readme_paths(text: str) -> list[str]:
    """Paths under the checkout's top-level directories that `text` names.

    A path after ``-o`` / ``--out`` is where the user chose to write, not a claim.
    """
    found = []
    for m in re.finditer(rf"(?<![\w./$-])((?:{'|'.join(TOP_LEVEL)})/[\w.*/-]*)", text):
        if text[:m.start()].endswith(("-o ", "--out ")):
            continue
        found.append(m[1].rstrip("."))
    return list(dict.fromkeys(found))


def is_known(path: str) -> bool:
    if "*" in path:
        return any(REPO.glob(path))
    return (REPO / path).exists() or is_written(Path(path.rstrip("/")))


def test_the_readme_names_the_paths_the_writers_write():
    assert WRITTEN["make demo"] and all(WRITTEN.values())
    paths = readme_paths(README_TEXT)
    assert "out/error_table.md" in paths and "qnorm/fixedpoint.py" in paths  # the collector works
    unknown = [p for p in paths if not is_known(p)]
    assert not unknown, f"README.md names paths that neither exist nor are written by a command: {unknown}"


def test_a_stale_path_is_noticed():
    # The README once named out/deploy/mixer; the demo writes out/deploy/checkpoints/mixer-int_ln.
    assert readme_paths("e.g. `out/deploy/mixer` from `make demo`; `qnorm/no_such.py`") == [
        "out/deploy/mixer", "qnorm/no_such.py"
    ]
    assert not is_known("out/deploy/mixer") and not is_known("qnorm/no_such.py")
    assert is_known("out/deploy/checkpoints/mixer-int_ln") and is_known("out/deploy/")
    assert readme_paths("qnorm compile C -o out/mixer; qnorm train --out out/x") == []


# --------------------------------------------------------------------------- the reports, from fake results


def fake_error_table() -> str:
    stats = ErrorStats(max_lsb=0.5, mean_lsb=0.25, within_1lsb=1.0, saturated=0.0, count=1)
    norms = [CaseResult("IntLayerNorm (L2)", "gaussian", n, bits, stats, np.zeros(1))
             for bits in BIT_WIDTHS for n in ROW_LENGTHS]
    softmax = [SoftmaxResult("int8 → uint8", "gaussian", n, stats) for n in SOFTMAX_ROW_LENGTHS]
    return error_table_markdown(norms, [SpikingRow("hard reset", 1.0, 0)],
                                [MultiThresholdRow("uint4 activation", 1.0, 0.0, 0)],
                                activations=[ActivationRow("int_gelu", "int8", "table", 256, 0, 0.5, 0.1, 1.0)],
                                softmax=softmax,
                                lanes16=[FloorRow("IntLayerNorm (L2)", "int32 (the definition)",
                                                  {n: FloorCell(0.5, 0.002) for n in ROW_LENGTHS})])


def fake_accuracy() -> str:
    settings = {"seed": 0, "quick": False, "jobs": 1, "test_samples": 1,
                "recipes": {"transformer": asdict(Recipe(epochs=1, lr=1e-3))}}
    rows = [Row("transformer", "float", "", False, 1.0, 1.0, "checkpoints/transformer-float")]
    return AccuracyTable(rows, [FoldCheck("snn", "int_mpbn_lif", 1, 0)], settings, 1.0).to_markdown()


def fake_deploy() -> str:
    row = DeployRow(name=next(iter(DEPLOY_MODELS)), epochs=1, samples=1, qat_accuracy=1.0, compiled_accuracy=1.0,
                    integers=10, mismatches=0, train_seconds=1.0, compile_seconds=1.0, cache_hit=False,
                    recompile_seconds=0.01, run_seconds=0.01, directory="out/deploy/m", library_bytes=1024,
                    sha256="0" * 64, proof="exact", headroom=[1.0])
    return deploy_markdown([row], quick=False)


def fake_transformer_latency(bt) -> str:
    """The transformer section for made-up times: each model at batch 1 and at the whole test set."""
    from benchmarks._timing import Timing
    from qnorm.train.data import load_digits_data

    test_samples = len(load_digits_data("tokens", seed=0).test)
    shares = bt.Breakdown(dict.fromkeys(bt.GROUPS, 1e-4), dict.fromkeys(bt.GROUPS[:-2], 1))
    results = [bt.ModelResult(name, {b: {w: Timing(w, (1e-3,)) for w in bt.WAYS} for b in (1, test_samples)}, {},
                              {1: shares, test_samples: shares}) for name in bt.MODELS]  # fmt: skip
    return bt.transformer_markdown(results, 1, 0.0, test_samples)


def fake_gpu_bench() -> str:
    manifest = {"bench": [{"label": "l", "op": "int_layernorm", "torch": "layer_norm", "rows": 1, "n": 8, "bytes": 16}]}
    runs = {"l": {"status": "ok", "elements": 8, "time_us": 1.0}}
    _, table = bench_gpu.bench_table(manifest, runs, {"layer_norm.float16.1x8": 2.0}, "torch")
    return bench_gpu.bench_report("a GPU", table)


def fake_bench() -> str:
    pytest.importorskip("tvm")  # the kernel section's writer imports it
    from benchmarks import __main__ as runner
    from benchmarks import bench_compile, bench_kernels, bench_qat, bench_transformer
    from benchmarks._timing import Timing
    from qnorm.targets import load_target

    names = [c.__name__ for c in bench_kernels.OPS] + ["layer_norm", "rms_norm", bench_kernels.TVM_COPY,
                                                       bench_kernels.NP_COPY]
    kernels = {shape: {n: Timing(n, (1e-3,)) for n in names} for shape in bench_kernels.SHAPES}
    sections = {
        "kernels": bench_kernels.render(kernels, 1, 0.0, 1, load_target("x86_64")),
        "kernels-avx2": bench_kernels.render(kernels, 1, 0.0, 1, load_target("x86_64"), bench_kernels.AVX2),
        "qat": bench_qat.qat_markdown({n: Timing(n, (1e-3,)) for n, _, _ in bench_qat.timed_steps()}),
        "compile": bench_compile.compile_markdown(
            [bench_compile.CompileTiming(name, 1.0, 1.0, 0.01) for name in DEPLOY_MODELS], bench_compile.REPEATS),
        "transformer": fake_transformer_latency(bench_transformer),
    }
    assert list(sections) == list(runner.SECTIONS), "a benchmark section has no fake here: add one"
    return runner.report(list(sections.values()))


def fake_fpga() -> str:
    """The FPGA report for made-up counts: an L1, an integer-L2 and an FP16 unit on two families."""
    pytest.importorskip("amaranth")  # the report's module imports the RTL generators
    from compilers.rtl import report
    from compilers.rtl.synth import Resources, SynthResult

    families = report.RATIO_FAMILIES
    units = [report.ReportUnit(op, "int8.n64" if op != report.FP16_OP else "n64", None, 64, 1.0)
             for op in (report.L1, report.L2, report.FP16_OP)]  # fmt: skip
    units += [report.ReportUnit(op, "int8.n64", None, 64, 1.0, datapath=True) for op in (report.L1, report.L2)]
    results = [(u, SynthResult(u.name, fam, Resources(lut=1, ff=1, dsp=1, bram=0, cells={}), 100.0, None, {}, "0",
                               False, 1.0)) for u in units for fam in families]  # fmt: skip
    return report.markdown(results, families)


# Every report a marker may quote -> its writer's text for made-up results.
FAKE_REPORTS: dict[Path, Callable[[], str]] = {
    make_out("demo") / "error_table.md": fake_error_table,
    make_out("demo") / "train" / "accuracy.md": fake_accuracy,
    make_out("demo") / "deploy.md": fake_deploy,
    make_out("bench"): fake_bench,
    make_out("fpga-report"): fake_fpga,
    gpu_check_outputs()[-2]: fake_gpu_bench,
}


# --------------------------------------------------------------------------- the markers


def test_the_readme_quotes_every_report():
    quoted = {Path(m.source) for m in MARKERS}
    assert quoted == set(FAKE_REPORTS), "a report is no longer quoted, or a quoted one has no fake here"


@pytest.mark.parametrize("marker", MARKERS, ids=lambda m: f"line{m.line}")
def test_a_marker_names_a_report_its_command_writes(marker):
    assert marker.command in WRITTEN, f"line {marker.line}: unknown command {marker.command!r}"
    assert Path(marker.source) in WRITTEN[marker.command], (
        f"line {marker.line}: `{marker.command}` does not write {marker.source}")


@pytest.mark.parametrize("marker", MARKERS, ids=lambda m: f"line{m.line}")
def test_a_marker_holds_one_table_of_a_consistent_shape(marker):
    table = rt.quoted(README_LINES, marker)
    assert table and all(line.startswith("|") for line in table), (
        f"line {marker.line}: the text between the markers is not one table")
    cells = [len(re.split(r"(?<!\\)\|", line.strip())) for line in table]
    assert set(cells) == {cells[0]}, f"line {marker.line}: rows with different numbers of columns"


@pytest.mark.parametrize("marker", MARKERS, ids=lambda m: f"line{m.line}")
def test_a_quoted_table_has_the_header_its_writer_produces(marker):
    report = FAKE_REPORTS[Path(marker.source)]()
    written = rt.extract_table(report, marker.section, marker.table)
    assert rt.quoted(README_LINES, marker)[:2] == written[:2], (
        f"line {marker.line}: {marker.describe()}: the README's header differs from the writer's")
