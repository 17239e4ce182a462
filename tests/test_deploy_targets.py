"""Whole models for boards and OpenCL: `qnorm compile --target aarch64 | riscv64` builds the C API
(static library, header, runner), run under qemu-user on the whole digits test set (360
samples) bit for bit with the QAT model's output integers; `qnorm run`; the refusals of a
model compiled for another target; the README's C example, compiled by gcc and run; the OpenCL
program and launch plan on PoCL, bit for bit on the whole test set."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from deploy_helpers import TINY_MIXER, TINY_SNN, briefly_trained, needs_tools, private_cache, qat_integers

from compilers.tvm import cross
from compilers.tvm.c_api import FILES, CApiModel
from compilers.tvm.graph import compile_model, load_compiled
from qnorm.cli import main
from qnorm.train.checkpoint import save_checkpoint

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    yield from private_cache(tmp_path_factory, "deploy-cache")


@pytest.fixture(scope="module")
def mixer(cache, tmp_path_factory):
    """The tiny mixer as a checkpoint, compiled for aarch64 by `qnorm compile`."""
    needs_tools("aarch64")
    model, x = briefly_trained("mixer", **TINY_MIXER)
    checkpoint = save_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "mixer")
    out = tmp_path_factory.mktemp("compiled") / "mixer-aarch64"
    assert main(["compile", str(checkpoint), "--target", "aarch64", "-o", str(out)]) == 0
    return model, x, out


def test_aarch64_model_equals_qat_on_the_test_set(mixer):
    model, x, out = mixer
    loaded = load_compiled(out, "aarch64")
    assert isinstance(loaded, CApiModel)
    meta = loaded.metadata
    want = qat_integers(model, x, meta["output"]["format"]["scale"])
    k = loaded.quantize(x.numpy())
    assert k.dtype == np.int8 and k.shape == (360, 8, 8)
    assert np.array_equal(loaded.run_ints(k), want)
    assert meta["artifact"] == "c-api" and meta["target"]["name"] == "aarch64"
    assert meta["target"]["tvm"]["mtriple"] == "aarch64-linux-gnu"
    assert meta["input"]["dtype"] == "int8" and meta["input"]["range"] == [-128, 127]
    assert meta["datapath"]["int_ops"]["norm"] == {"op": "IntLayerNorm", "lanes": 32}
    assert meta["exactness"]["summary"].startswith("proven exact")
    assert sorted(meta["files"]) == sorted(FILES)
    runner = (out / "qnorm_run").read_bytes()
    assert runner[:4] == b"\x7fELF" and runner[18] == 0xB7  # e_machine EM_AARCH64 (183)


def test_riscv64_snn_equals_qat_on_the_test_set(cache, tmp_path):
    needs_tools("riscv64")
    model, x = briefly_trained("snn", **TINY_SNN)
    compiled = compile_model(model, model.example_input(), "riscv64")
    assert isinstance(compiled, CApiModel)
    with torch.no_grad():
        want = model(x).numpy()
    assert np.array_equal(compiled(x.numpy()), want)  # float in (quantized as the model does), float out
    loaded = load_compiled(compiled.save(tmp_path / "snn"))
    assert loaded.built_for() == "riscv64"
    assert np.array_equal(loaded.run_ints(loaded.quantize(x[:50].numpy())),
                          qat_integers(model, x[:50], loaded.metadata["output"]["format"]["scale"]))


def test_qnorm_run_writes_the_integers_and_prints_the_classes(mixer, tmp_path, capsys):
    model, x, out = mixer
    loaded = load_compiled(out)
    want = qat_integers(model, x, loaded.metadata["output"]["format"]["scale"])
    np.save(tmp_path / "k.npy", loaded.quantize(x.numpy()))
    assert main(["run", str(out), "--input", str(tmp_path / "k.npy"), "--output", str(tmp_path / "y.npy")]) == 0
    assert np.array_equal(np.load(tmp_path / "y.npy"), want)
    printed = capsys.readouterr().out
    assert "360 sample(s) run under aarch64 emulation" in printed
    assert "  classes: " + " ".join(map(str, want.argmax(axis=1))) in printed

    np.save(tmp_path / "x.npy", x[:3].numpy())  # float32: quantized as the model's first quantizer does
    assert main(["run", str(out), "--input", str(tmp_path / "x.npy")]) == 0
    printed = capsys.readouterr().out
    for i in range(3):
        assert f"  {i}: class {want[i].argmax()}  {' '.join(map(str, want[i]))}" in printed


def test_a_model_for_another_target_is_refused(mixer, tmp_path, capsys):
    _, x, out = mixer
    with pytest.raises(ValueError, match=r"was compiled for aarch64, not riscv64"):
        load_compiled(out, "riscv64")
    np.save(tmp_path / "x.npy", x[:2].numpy())
    assert main(["run", str(out), "--input", str(tmp_path / "x.npy"), "--target", "riscv64"]) == 1
    assert "was compiled for aarch64, not riscv64" in capsys.readouterr().err

    lying = tmp_path / "lying"
    shutil.copytree(out, lying)
    meta = json.loads((lying / "model.json").read_text())
    meta["target"]["name"] = "riscv64"
    (lying / "model.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"model.json says riscv64, but its library was compiled for aarch64"):
        load_compiled(lying)

    run = cross.cross_target("aarch64").run
    done = subprocess.run([run.emulator, "-L", run.sysroot, str(out / "qnorm_run"), "--target", "riscv64",
                           str(tmp_path / "x.npy"), str(tmp_path / "y.npy")], check=False, capture_output=True, text=True)
    assert done.returncode == 2 and "this model was compiled for aarch64, not riscv64" in done.stderr


def test_a_damaged_library_is_refused(mixer, tmp_path):
    _, _, out = mixer
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    data = bytearray((copy / "libqnorm_model.a").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / "libqnorm_model.a").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="libqnorm_model.a is corrupt or not the one model.json describes"):
        load_compiled(copy)


def readme_c_example() -> str:
    section = README.read_text().split("## Deploy to a board", 1)[1]
    return re.findall(r"```c\n(.*?)```", section, flags=re.DOTALL)[0]


def test_readme_c_example_compiles_and_gives_the_qat_integers(cache, mixer, tmp_path):
    model, x, aarch64 = mixer
    compiled = compile_model(model, model.example_input(), "x86_64", c_api_requested=True)
    out = compiled.save(tmp_path / "x86")
    source = tmp_path / "classify.c"
    source.write_text(readme_c_example())
    exe = tmp_path / "classify"
    build = ["gcc", "-std=c11", "-O2", f"-I{out}", str(source), str(out / "libqnorm_model.a"), "-lm", "-o", str(exe)]
    done = subprocess.run(build, check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    k = compiled.quantize(x[:4].numpy())
    want = qat_integers(model, x[:4], compiled.metadata["output"]["format"]["scale"])
    assert np.array_equal(compiled.run_ints(k), want)
    for sample, row in zip(k, want, strict=True):
        ran = subprocess.run([str(exe)], input=sample.tobytes(), capture_output=True, check=False)
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.decode() == " ".join(map(str, row)) + f" -> class {row.argmax()} on x86_64\n"

    # The same file against the aarch64 header: this gcc targets x86_64, the header refuses.
    wrong = subprocess.run(["gcc", "-std=c11", f"-I{aarch64}", "-c", str(source), "-o", str(tmp_path / "w.o")],
                           check=False, capture_output=True, text=True)
    assert wrong.returncode != 0 and "this model was compiled for aarch64" in wrong.stderr


def test_opencl_model_equals_qat_on_the_test_set(cache, mixer, tmp_path, capsys):
    from compilers.tvm import opencl

    if opencl.unavailable() is not None:
        pytest.skip(opencl.unavailable())
    model, x, _ = mixer
    compiled = compile_model(model, model.example_input(), "opencl")
    out = compiled.save(tmp_path / "opencl")
    assert sorted(json.loads((out / "model.json").read_text())["files"]) == ["constants.bin", "model.cl", "plan.json"]
    loaded = load_compiled(out, "opencl")
    want = qat_integers(model, x, loaded.metadata["output"]["format"]["scale"])
    assert np.array_equal(loaded.run_ints(loaded.quantize(x.numpy())), want)  # 360 samples: 6 chunks, one padded
    np.save(tmp_path / "x.npy", x.numpy())
    assert main(["run", str(out), "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npy")]) == 0
    assert np.array_equal(np.load(tmp_path / "y.npy"), want)
    assert "360 sample(s) run on the OpenCL device" in capsys.readouterr().out
