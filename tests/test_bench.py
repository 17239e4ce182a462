"""The benchmarks run end to end on a tiny shape and a tiny time budget.

Functionality only: timings on a shared machine are noise, so no test asserts
one.  ``make bench`` runs the real shapes.
"""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("tvm")

from benchmarks import __main__ as runner
from benchmarks import bench_kernels
from benchmarks._machine import cpu_model
from benchmarks._timing import Timing, interleaved, ratio


def test_kernel_section_runs_on_a_tiny_shape():
    text = bench_kernels.section(shapes=((8, 64),), rounds=1, min_loop_s=0.0)
    for needed in ("### P1", "### P2", "x86-64", "**1 thread**", "8×64", "| int8 copy |"):
        assert needed in text
    for cls in bench_kernels.OPS:
        assert f"| {cls.__name__} | 8×64 |" in text
    assert "| 8×64 |" in text.split("### P2")[1]


def test_threads_must_be_positive():
    with pytest.raises(ValueError, match="threads must be >= 1"):
        bench_kernels.use_threads(0)


def test_ratio_is_the_median_of_per_round_ratios():
    slow, fast = Timing("slow", (4.0, 9.0, 2.0)), Timing("fast", (2.0, 3.0, 2.0))
    assert ratio(slow, fast) == 2.0
    times = interleaved({"a": lambda: None, "b": lambda: None}, rounds=3, min_loop_s=0.0)
    assert [len(t.samples) for t in times.values()] == [3, 3]
    with pytest.raises(ValueError, match="rounds"):
        interleaved({"a": lambda: None}, rounds=0)


def test_runner_notes_a_missing_section_and_fails_on_a_broken_one(tmp_path, monkeypatch):
    (tmp_path / "qnorm_bench_ok.py").write_text(
        "def section():\n    return '## ok\\n\\nmeasured'\n"
    )
    (tmp_path / "qnorm_bench_broken.py").write_text("import qnorm_no_such_module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(
        runner,
        "SECTIONS",
        {"ok": "qnorm_bench_ok", "missing": "qnorm_bench_missing", "broken": "qnorm_bench_broken"},
    )
    text = runner.run(["ok", "missing"])
    assert text.startswith("# qnorm benchmarks\n")
    assert "- commit: " in text and "- machine: " in text
    assert "## ok\n\nmeasured" in text
    assert "`qnorm_bench_missing` does not exist yet" in text
    with pytest.raises(ModuleNotFoundError, match="qnorm_no_such_module"):
        runner.run(["broken"])
    sys.modules.pop("qnorm_bench_ok", None)


def test_runner_writes_the_report(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "run", lambda names: f"# qnorm benchmarks\n\n{' '.join(names)}\n")
    out = tmp_path / "sub" / "bench.md"
    runner.main(["--out", str(out), "--only", "qat", "kernels"])
    assert out.read_text() == "# qnorm benchmarks\n\nqat kernels\n"


def test_the_cpu_is_named_with_its_family_and_model():
    """A virtual machine's "AMD EPYC" alone does not say which generation ran."""
    first = "processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n"
    second = "processor\t: 1\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: other\n"
    assert cpu_model(first + "\n" + second) == "AMD EPYC (family 26, model 2)"
    assert cpu_model("processor\t: 0\nmodel name\t: Some CPU\n") == "Some CPU"
