"""The benchmarks run end to end on a tiny shape and a tiny time budget.

Functionality only: timings on a shared machine are noise, so no test asserts
one.  ``make bench`` runs the real shapes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("tvm")

from benchmarks import __main__ as runner
from benchmarks import bench_kernels, bench_qat
from benchmarks._machine import cpu_model
from benchmarks._timing import Timing, interleaved, ratio
import qnorm.nn as qn
from qnorm.targets import cpu_flags, read_cpuinfo

REPO = Path(__file__).resolve().parent.parent


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


AVX512_CPU = "processor\t: 0\nflags\t\t: fpu lm sse4_2 popcnt avx avx2 bmi1 bmi2 fma movbe abm f16c xsave avx512f avx512bw avx512cd avx512dq avx512vl avx512_vnni\n"


def test_the_avx2_level_drops_every_avx512_flag():
    assert "avx512" not in bench_kernels.without_avx512(AVX512_CPU)
    assert bench_kernels.host_has_avx512(AVX512_CPU)
    assert not bench_kernels.host_has_avx512(bench_kernels.without_avx512(AVX512_CPU))


def test_an_avx2_level_run_needs_torch_at_avx2_and_a_cpu_with_it(monkeypatch):
    """Either would time another instruction set under the AVX2 label."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    with pytest.raises(RuntimeError, match="ATEN_CPU_CAPABILITY=avx2"):
        bench_kernels.isa_target(bench_kernels.AVX2, cpuinfo=AVX512_CPU)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert bench_kernels.isa_target(bench_kernels.AVX2, cpuinfo=AVX512_CPU).tvm["mcpu"] == "x86-64-v3"
    no_avx2 = "processor\t: 0\nflags\t\t: fpu lm cx16 sse4_2 popcnt ssse3 lahf_lm\n"
    with pytest.raises(RuntimeError, match="no AVX2"):
        bench_kernels.isa_target(bench_kernels.AVX2, cpuinfo=no_avx2)
    with pytest.raises(ValueError, match="isa must be"):
        bench_kernels.isa_target("avx10")


def test_the_avx2_level_section_runs_on_a_tiny_shape(tmp_path):
    """The child process bench_avx2 starts, on one small shape: torch at AVX2, kernels for x86-64-v3."""
    if "avx2" not in cpu_flags(read_cpuinfo()):
        pytest.skip("this CPU has no AVX2")
    out = tmp_path / "avx2.md"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_kernels", "--isa", "avx2", "--shapes", "8x64", "--rounds", "1",
         "--min-loop", "0", "--out", str(out)],
        cwd=REPO, env={**os.environ, **bench_kernels.TORCH_AVX2}, check=True, capture_output=True,
    )  # fmt: skip
    text = out.read_text()
    assert text.startswith("## Kernel throughput at the AVX2 level")
    assert "kernels built for `x86-64-v3`" in text and "`ATEN_CPU_CAPABILITY=avx2`" in text
    assert "### AVX2 level, P1" in text and "| IntLayerNorm | 8×64 |" in text
    assert "| 8×64 |" in text.split("### AVX2 level, P2")[1]


def test_shapes_are_rows_x_n():
    assert bench_kernels.parse_shape("4096x768") == (4096, 768)
    for bad in ("4096", "0x8", "ax8", "8x-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="ROWSxN"):
            bench_kernels.parse_shape(bad)


def test_the_avx2_section_says_why_it_did_not_run_on_a_host_without_avx512(monkeypatch):
    from benchmarks import bench_avx2

    monkeypatch.setattr(bench_avx2, "host_has_avx512", lambda: False)
    text = bench_avx2.section()
    assert text.startswith(bench_kernels.AVX2_TITLE) and "has no AVX-512" in text


# --------------------------------------------------------------------------- QAT step bounds


def _trained_norm(bound: str):
    """A calibrated IntLayerNorm in a model, the bound applied, then one optimizer step on γ, β."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(qn.IntLayerNorm(16)).train()
    x = torch.randn(32, 16)
    model(x).sum().backward()  # calibrates the input quantizer
    before = model[0].golden()
    for take_out in bench_qat.BOUNDS[bound]:
        take_out(model)
    with torch.no_grad():
        model[0].weight.mul_(1.5)
        model[0].bias.add_(0.25)
    return model, x, before


def test_reused_derivation_keeps_the_op_of_calibration():
    model, x, before = _trained_norm("derivation reused")
    layer = model[0]
    assert layer.golden() is before
    assert type(layer).golden(layer) is not before  # the layer's own derivation sees the new γ, β
    q = layer.quantize_input(x)
    assert torch.equal(layer(x), torch.from_numpy(before.forward(q.ints.numpy())).float() * before.out_fmt.scale)


def test_no_element_chain_clamps_the_input_integers():
    model, x, before = _trained_norm("derivation reused, no element chain")
    q = model[0].quantize_input(x)
    want = q.ints.clamp(before.out_fmt.lo, before.out_fmt.hi).float() * before.out_fmt.scale
    assert torch.equal(model(x), want)


def test_qat_section_names_every_bound_of_every_integer_kind():
    names = [name for name, _, _ in bench_qat.timed_steps()]
    assert len(names) == len(set(names))
    text = bench_qat.qat_markdown({n: Timing(n, (2e-3,)) for n in names})
    rows = [ln for ln in text.splitlines() if ln.startswith("| int_ln |")]
    assert rows[-1] == "| int_ln | 2.00 ms (1.00×) | 2.00 ms (1.00×) | 2.00 ms (1.00×) |"
