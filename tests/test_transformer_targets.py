"""The integer transformer (IntLayerNorm, IntSoftmax, IntGELU) and the LLaMA-style model
(IntRMSNorm, IntSoftmax, gated IntSiLU), one block each, compiled for the boards and the
GPUs and compared bit for bit with the QAT model's output integers on the whole digits
test set (360 samples).

Cross compiles and PoCL's first program build are slow, so each target builds one
variant, and each variant goes through both whole-model paths (the C API's static plan
and the GPU device plan):

* GELU transformer: aarch64 (`qnorm compile` of a checkpoint, run under qemu-user and by
  `qnorm run`) and cuda (built: PTX and cubins, and the plan scripts/gpu_check.sh runs);
* LLaMA-style model: riscv64 (under qemu-user) and opencl (on PoCL).
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from deploy_helpers import (
    TRANSFORMER_INT_OPS,
    TRANSFORMER_VARIANTS,
    briefly_trained,
    needs_tools,
    private_cache,
    qat_integers,
)
from torch import nn

from compilers import toolchains
from compilers.tvm.c_api import CApiModel
from compilers.tvm.cuda_model import CudaModel
from compilers.tvm.graph import compile_model, load_compiled
from qnorm.cli import main
from qnorm.train.checkpoint import save_checkpoint

Trained = tuple[nn.Module, torch.Tensor]
ELF_MACHINE = {"aarch64": 0xB7, "riscv64": 0xF3}  # e_machine: EM_AARCH64, EM_RISCV


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    yield from private_cache(tmp_path_factory, "transformer-cache")


@pytest.fixture(scope="module")
def gelu() -> Trained:
    return briefly_trained("transformer", **TRANSFORMER_VARIANTS["gelu"])


@pytest.fixture(scope="module")
def llama() -> Trained:
    return briefly_trained("transformer", **TRANSFORMER_VARIANTS["llama"])


@pytest.fixture(scope="module")
def gelu_aarch64(cache, gelu: Trained, tmp_path_factory) -> Path:
    """The GELU transformer as a checkpoint, compiled for aarch64 by `qnorm compile`."""
    needs_tools("aarch64")
    checkpoint = save_checkpoint(gelu[0], tmp_path_factory.mktemp("ckpt") / "gelu")
    out = tmp_path_factory.mktemp("compiled") / "gelu-aarch64"
    assert (
        main(["compile", str(checkpoint), "--target", "aarch64", "-o", str(out)]) == 0
    )
    return out


def proven_classes(metadata: dict) -> set[str]:
    """The qnorm layer classes the artifact's exactness proof lists as "name (Layer)"."""
    return {
        entry.rsplit("(", 1)[1].rstrip(")")
        for entry in metadata["exactness"]["int_ops"]
    }


def runner_machine(directory: Path) -> int:
    """The ELF e_machine of the artifact's statically linked runner."""
    runner = (directory / "qnorm_run").read_bytes()
    assert runner[:4] == b"\x7fELF"
    return int.from_bytes(runner[18:20], "little")


def test_gelu_transformer_on_aarch64_equals_qat_on_the_test_set(gelu, gelu_aarch64):
    model, x = gelu
    loaded = load_compiled(gelu_aarch64, "aarch64")
    assert isinstance(loaded, CApiModel)
    meta = loaded.metadata
    want = qat_integers(model, x, meta["output"]["format"]["scale"])
    assert np.array_equal(loaded.run_ints(loaded.quantize(x.numpy())), want)
    assert meta["artifact"] == "c-api" and meta["target"]["name"] == "aarch64"
    ops = {entry["op"] for entry in meta["datapath"]["int_ops"].values()}
    assert ops == proven_classes(meta) == TRANSFORMER_INT_OPS["gelu"]
    assert runner_machine(gelu_aarch64) == ELF_MACHINE["aarch64"]


def test_qnorm_run_prints_the_transformer_classes(gelu, gelu_aarch64, tmp_path, capsys):
    model, x = gelu
    loaded = load_compiled(gelu_aarch64)
    want = qat_integers(model, x, loaded.metadata["output"]["format"]["scale"])
    np.save(
        tmp_path / "x.npy", x.numpy()
    )  # float32: quantized as the model's first quantizer does
    argv = [
        "run",
        str(gelu_aarch64),
        "--input",
        str(tmp_path / "x.npy"),
        "--output",
        str(tmp_path / "y.npy"),
    ]
    assert main(argv) == 0
    assert np.array_equal(np.load(tmp_path / "y.npy"), want)
    printed = capsys.readouterr().out
    assert "360 sample(s) run under aarch64 emulation" in printed
    assert "  classes: " + " ".join(map(str, want.argmax(axis=1))) in printed


def test_llama_model_on_riscv64_equals_qat_on_the_test_set(cache, llama, tmp_path):
    needs_tools("riscv64")
    model, x = llama
    compiled = compile_model(model, model.example_input(), "riscv64")
    assert isinstance(compiled, CApiModel)
    loaded = load_compiled(compiled.save(tmp_path / "llama"))
    assert (
        loaded.built_for() == "riscv64"
        and runner_machine(tmp_path / "llama") == ELF_MACHINE["riscv64"]
    )
    want = qat_integers(model, x, loaded.metadata["output"]["format"]["scale"])
    assert np.array_equal(loaded.run_ints(loaded.quantize(x.numpy())), want)
    assert proven_classes(loaded.metadata) == TRANSFORMER_INT_OPS["llama"]


def test_llama_model_on_opencl_equals_qat_on_the_test_set(cache, llama, tmp_path):
    from compilers.tvm import opencl

    if opencl.unavailable() is not None:
        pytest.skip(opencl.unavailable())
    model, x = llama
    compiled = compile_model(model, model.example_input(), "opencl")
    loaded = load_compiled(compiled.save(tmp_path / "opencl"), "opencl")
    want = qat_integers(model, x, loaded.metadata["output"]["format"]["scale"])
    assert np.array_equal(
        loaded.run_ints(loaded.quantize(x.numpy())), want
    )  # 360 samples: 6 chunks, one padded


def test_gelu_transformer_builds_for_cuda_with_its_gpu_check_plan(
    cache, gelu, tmp_path
):
    if toolchains.nvcc_unavailable() is not None:
        pytest.skip(toolchains.nvcc_unavailable())
    model, x = gelu
    compiled = compile_model(model, model.example_input(), "cuda")
    assert isinstance(compiled, CudaModel)
    out = compiled.save(tmp_path / "cuda")
    launches = json.loads((out / "plan.json").read_text())["launches"]
    kernels = {launch["kernel"] for launch in launches}
    for arch in ("sm_80", "sm_90"):
        ptx = (out / f"model.{arch}.ptx").read_text()
        assert f".target {arch}" in ptx and all(f".entry {k}(" in ptx for k in kernels)
        assert (out / f"model.{arch}.cubin").read_bytes()[:4] == b"\x7fELF"

    # what scripts/gpu_check.sh runs on a GPU: every launch, and the QAT outputs of 64 samples
    x = x[:64]
    with torch.no_grad():
        expected = model(x).numpy()
    plan = compiled.harness_plan(
        compiled.quantize(x.numpy()), expected, tmp_path / "bundle"
    )
    lines = plan.read_text().splitlines()
    assert [ln.split()[1] for ln in lines if ln.startswith("launch ")] == [
        launch["kernel"] for launch in launches
    ]
    _, _, file = next(ln for ln in lines if ln.startswith("expect ")).split()
    assert np.array_equal(
        np.fromfile(tmp_path / "bundle" / file, np.float32).reshape(expected.shape),
        expected,
    )
