"""`qnorm compile --target cuda`: the whole model as one CUDA source that nvcc builds into
PTX and cubins for sm_80 and sm_90, a launch plan, and the gpu_harness plan that
scripts/gpu_check.sh runs on a GPU (checked here for consistency: no GPU runs it here)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from deploy_helpers import TINY_MIXER, briefly_trained, private_cache

from compilers import toolchains
from compilers.tvm.cuda_model import CudaModel
from compilers.tvm.graph import load_compiled
from qnorm.cli import main
from qnorm.train.checkpoint import save_checkpoint

if toolchains.nvcc_unavailable() is not None:
    pytest.skip(toolchains.nvcc_unavailable(), allow_module_level=True)

REPO = Path(__file__).resolve().parent.parent
SIZES = {"int8": 1, "int16": 2, "int32": 4, "int64": 8, "float32": 4}  # what gpu_harness reads


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    yield from private_cache(tmp_path_factory, "cuda-cache")


@pytest.fixture(scope="module")
def built(cache, tmp_path_factory):
    """A briefly trained tiny mixer, its checkpoint compiled for CUDA by `qnorm compile`."""
    model, x = briefly_trained("mixer", **TINY_MIXER)
    checkpoint = save_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "mixer")
    out = tmp_path_factory.mktemp("compiled") / "cuda"
    assert main(["compile", str(checkpoint), "--target", "cuda", "-o", str(out)]) == 0
    return model, x[:64], out


def test_cuda_build_has_ptx_and_cubins_for_every_kernel(built):
    _, _, out = built
    loaded = load_compiled(out, "cuda")
    assert isinstance(loaded, CudaModel)
    names = {f"model.{arch}.{kind}" for arch in ("sm_80", "sm_90") for kind in ("ptx", "cubin")}
    assert set(loaded.metadata["files"]) == names | {"model.cu", "plan.json", "constants.bin"}
    plan = json.loads((out / "plan.json").read_text())
    kernels = {launch["kernel"] for launch in plan["launches"]}
    for arch in ("sm_80", "sm_90"):
        ptx = (out / f"model.{arch}.ptx").read_text()
        assert f".target {arch}" in ptx
        assert all(f".entry {k}(" in ptx for k in kernels)
        assert (out / f"model.{arch}.cubin").read_bytes()[:4] == b"\x7fELF"
    with pytest.raises(RuntimeError, match="scripts/gpu_check.sh runs it on a GPU"):
        loaded.run_ints(np.zeros((1, 8, 8), np.int8))


def test_harness_plan_holds_every_launch_and_the_qat_outputs(built, tmp_path):
    model, x, out = built
    loaded = load_compiled(out)
    with torch.no_grad():
        expected = model(x).numpy()
    path = loaded.harness_plan(loaded.quantize(x.numpy()), expected, tmp_path / "bundle")
    lines = path.read_text().splitlines()
    assert lines[:3] == ["qnorm-gpu-plan 1", "module model sm_80 sm_90", "run model.64"] and lines[-1] == "end"
    plan = json.loads((out / "plan.json").read_text())
    buffers = {}
    for line in (ln for ln in lines if ln.startswith("buffer ")):
        _, name, dtype, count, data = line.split()
        buffers[name] = (dtype, int(count))
        if data != "-":  # the harness refuses a file of another size
            assert (tmp_path / "bundle" / data).stat().st_size == int(count) * SIZES[dtype]
    assert len(buffers) == len(plan["buffers"])
    launches = [ln.split() for ln in lines if ln.startswith("launch ")]
    assert [ln[1] for ln in launches] == [launch["kernel"] for launch in plan["launches"]]
    for words in launches:
        grid, block, nargs = words[2:5], words[5:8], int(words[8])
        assert len(words) == 9 + nargs and all(int(v) > 0 for v in grid + block)
        assert all(a.split(":")[1] in buffers for a in words[9:] if a.startswith("buf:"))
    _, output, file = next(ln for ln in lines if ln.startswith("expect ")).split()
    want = np.fromfile(tmp_path / "bundle" / file, dtype=np.float32).reshape(64, 10)
    assert output == f"b{plan['output']}" and np.array_equal(want, expected)
    for name in ("model.sm_80.cubin", "model.sm_90.ptx"):  # the harness loads them next to the plan
        assert (tmp_path / "bundle" / name).read_bytes() == (out / name).read_bytes()


def test_gpu_check_script_builds_the_plan_from_a_compiled_model(built, tmp_path):
    _, _, out = built
    script = REPO / "scripts" / "cuda_model_plan.py"
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's qnorm, as the script's own repo
    done = subprocess.run([sys.executable, str(script), str(out), str(tmp_path / "model")], env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "model" / "model.plan").is_file() and "64 samples of the digits test set" in done.stdout
