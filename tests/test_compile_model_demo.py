"""The deployment story of `make demo` and the P4 compile benchmark, end to end (slow:
they train and cold-compile the demo models)."""

import sys
from pathlib import Path

import pytest

from compilers.tvm.graph import load_compiled
from qnorm.demo import DEPLOY_MODELS, run_deploy_demo

# benchmarks/ runs from the checkout (python -m benchmarks) and is not installed
REPO = str(Path(__file__).resolve().parent.parent)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks import bench_compile


@pytest.mark.slow
def test_quick_deploy_demo_is_bit_exact_and_writes_its_report(tmp_path, monkeypatch):
    monkeypatch.setenv("QNORM_CACHE", str(tmp_path / "cache"))
    rows = run_deploy_demo(tmp_path, quick=True, jobs=1)
    assert [r.name for r in rows] == list(DEPLOY_MODELS)
    assert all(r.mismatches == 0 and r.integers == 3600 and r.qat_accuracy == r.compiled_accuracy for r in rows)
    assert (tmp_path / "deploy.md").read_text().count("| **0** of 3600 |") == len(DEPLOY_MODELS)
    assert (tmp_path / "deploy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for r in rows:
        assert load_compiled(r.directory).metadata["source"]["model"]["kind"] == DEPLOY_MODELS[r.name][0]


@pytest.mark.slow
def test_compile_benchmark_measures_cold_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("QNORM_CACHE", str(tmp_path))
    text = bench_compile.section(repeats=2)
    assert "## P4" in text
    for name in DEPLOY_MODELS:
        assert f"| {name} |" in text
